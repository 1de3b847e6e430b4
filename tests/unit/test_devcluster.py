"""Parts of the local control plane that need no binaries: certificates and the clear error
when `make cluster-tools` has not been run."""

from __future__ import annotations

import ipaddress

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from iterserve.cli import main
from iterserve.devcluster.pki import write_pki


def test_dev_cluster_without_binaries_names_the_make_target(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ITERSERVE_CLUSTER_BIN", str(tmp_path / "no-bin"))
    assert main(["dev-cluster", "up", "--dir", str(tmp_path / "c")]) == 1
    err = capsys.readouterr().err
    assert "make cluster-tools" in err and "etcd" in err
    assert not (tmp_path / "c" / "cluster.json").exists()


def test_dev_cluster_refuses_a_non_empty_folder_it_did_not_create(tmp_path, capsys):
    home = tmp_path / "home"
    (home / "etcd").mkdir(parents=True)
    (home / "etcd" / "precious").write_text("keep me")
    (home / "kubeconfig").write_text("mine")
    assert main(["dev-cluster", "up", "--dir", str(home)]) == 1
    assert "not empty and was not created by `iterserve dev-cluster up`" in capsys.readouterr().err
    assert sorted(p.name for p in home.iterdir()) == ["etcd", "kubeconfig"]
    assert (home / "etcd" / "precious").read_text() == "keep me" and (home / "kubeconfig").read_text() == "mine"


def test_dev_cluster_takes_a_new_or_empty_folder_and_its_own_again(tmp_path):
    from iterserve.devcluster.cluster import MARKER_FILE, claim_folder

    claim_folder(tmp_path / "new" / "c")
    (tmp_path / "empty").mkdir()
    claim_folder(tmp_path / "empty")
    for folder in (tmp_path / "new" / "c", tmp_path / "empty"):
        assert (folder / MARKER_FILE).exists()
        (folder / "logs").mkdir()
        claim_folder(folder)  # a folder it made, with its outputs in it, is used again


def test_pki_chains_to_the_ca_with_loopback_serving_name_and_admin_group(tmp_path):
    write_pki(tmp_path)
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    serving = x509.load_pem_x509_certificate((tmp_path / "apiserver.crt").read_bytes())
    admin = x509.load_pem_x509_certificate((tmp_path / "admin.crt").read_bytes())
    for cert in (serving, admin):
        cert.verify_directly_issued_by(ca)
    sans = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in sans.get_values_for_type(x509.IPAddress)
    usage = serving.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in usage
    groups = [a.value for a in admin.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)]
    assert groups == ["system:masters"]
    assert (tmp_path / "sa.key").stat().st_mode & 0o077 == 0


def test_pki_front_proxy_client_has_its_own_ca(tmp_path):
    write_pki(tmp_path)
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    proxy_ca = x509.load_pem_x509_certificate((tmp_path / "front-proxy-ca.crt").read_bytes())
    client = x509.load_pem_x509_certificate((tmp_path / "front-proxy-client.crt").read_bytes())
    client.verify_directly_issued_by(proxy_ca)
    assert proxy_ca.subject != ca.subject
    assert client.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "front-proxy-client"
    usage = client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]
