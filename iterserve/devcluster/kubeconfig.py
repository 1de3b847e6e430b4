"""Writes kubeconfig files (admin client certificate or a bearer token) with embedded data,
so a kubeconfig keeps working when copied elsewhere."""

from __future__ import annotations

import base64
from pathlib import Path

import yaml


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def cluster_entry(server: str, ca_file: Path) -> dict:
    return {"server": server, "certificate-authority-data": _b64(ca_file)}


def client_cert_user(cert_file: Path, key_file: Path) -> dict:
    return {"client-certificate-data": _b64(cert_file), "client-key-data": _b64(key_file)}


def token_user(token: str) -> dict:
    return {"token": token}


def write_kubeconfig(path: Path, cluster: dict, user: dict, name: str) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": cluster}],
        "users": [{"name": name, "user": user}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name, "namespace": "default"}}],
        "current-context": name,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path


def current_cluster(kubeconfig: Path) -> dict:
    """The cluster entry of the current context, with a relative CA path made absolute."""
    config = yaml.safe_load(Path(kubeconfig).read_text())
    context = next(c for c in config["contexts"] if c["name"] == config["current-context"])
    cluster = dict(next(c for c in config["clusters"] if c["name"] == context["context"]["cluster"])["cluster"])
    if "certificate-authority" in cluster:
        cluster["certificate-authority"] = str((Path(kubeconfig).parent / cluster["certificate-authority"]).resolve())
    return cluster
