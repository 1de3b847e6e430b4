"""Certificates and keys for a loopback-only control plane: a CA, the API server's serving
certificate, the admin client certificate, the service-account signing key pair, and the
front-proxy CA and client certificate with which the API server's aggregation layer proxies to
extension API servers (e.g. an external metrics adapter)."""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = dt.timedelta(days=365)


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    parts = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        parts.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(parts)


def _write_key(key, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _write_cert(cert: x509.Certificate, path: Path) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
    )


def _leaf(ca_key, ca_cert, subject: x509.Name, usage, sans=None) -> tuple:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = _builder(subject, ca_cert.subject, key.public_key())
    builder = builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


FRONT_PROXY_CLIENT = "front-proxy-client"


def _ca(common_name: str):
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(common_name)
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return ca_key, ca_cert


def write_pki(folder: Path) -> None:
    """Writes ca.crt, apiserver.{crt,key}, admin.{crt,key}, sa.{key,pub}, front-proxy-ca.crt and
    front-proxy-client.{crt,key} into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _ca("iterserve-dev-cluster-ca")
    _write_key(ca_key, folder / "ca.key")
    _write_cert(ca_cert, folder / "ca.crt")

    sans = [
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.DNSName("localhost"),
        x509.DNSName("kubernetes"),
        x509.DNSName("kubernetes.default"),
        x509.DNSName("kubernetes.default.svc"),
    ]
    key, cert = _leaf(ca_key, ca_cert, _name("kube-apiserver"), ExtendedKeyUsageOID.SERVER_AUTH, sans)
    _write_key(key, folder / "apiserver.key")
    _write_cert(cert, folder / "apiserver.crt")

    # system:masters bypasses RBAC: the admin used by the components, tests and people.
    key, cert = _leaf(ca_key, ca_cert, _name("iterserve-admin", "system:masters"), ExtendedKeyUsageOID.CLIENT_AUTH)
    _write_key(key, folder / "admin.key")
    _write_cert(cert, folder / "admin.crt")

    # Its own CA, as kubeadm does: extension API servers trust the user headers of any client
    # certificate this CA signed, so none of the cluster CA's client certificates may pass as it.
    proxy_ca_key, proxy_ca_cert = _ca("iterserve-dev-cluster-front-proxy-ca")
    _write_cert(proxy_ca_cert, folder / "front-proxy-ca.crt")
    key, cert = _leaf(proxy_ca_key, proxy_ca_cert, _name(FRONT_PROXY_CLIENT), ExtendedKeyUsageOID.CLIENT_AUTH)
    _write_key(key, folder / "front-proxy-client.key")
    _write_cert(cert, folder / "front-proxy-client.crt")

    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_key(sa_key, folder / "sa.key")
    (folder / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
