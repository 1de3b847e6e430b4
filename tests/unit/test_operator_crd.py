"""The generated CRD: in sync with the checked-in file, structural, with the promised parts."""

from pathlib import Path

import yaml

from iterserve.operator.crd import crd_manifest, crd_yaml, structural

ROOT = Path(__file__).resolve().parents[2]
CHECKED_IN = ROOT / "crds" / "inferenceservice.yaml"


def test_checked_in_crd_matches_the_models():
    assert CHECKED_IN.read_text() == crd_yaml(), (
        "crds/inferenceservice.yaml drifted from operator/models.py: run `make crds` and commit it")


def _walk(node, path="$"):
    yield path, node
    for key in ("properties", "additionalProperties"):
        children = node.get(key)
        if isinstance(children, dict) and key == "properties":
            for name, child in children.items():
                yield from _walk(child, f"{path}.{name}")
        elif isinstance(children, dict):
            yield from _walk(children, f"{path}[*]")
    if "items" in node:
        yield from _walk(node["items"], f"{path}[]")


def test_schema_is_structural():
    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert "$ref" not in yaml.safe_dump(schema) and "$defs" not in yaml.safe_dump(schema)
    for path, node in _walk(schema):
        free = node.get("x-kubernetes-preserve-unknown-fields") or node.get("x-kubernetes-int-or-string")
        assert "type" in node or free, f"{path} has no type"
        assert not ("properties" in node and "additionalProperties" in node), path
        assert "title" not in node, path
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string"), f"{path}: anyOf is only allowed for int-or-string"
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            if bound in node:
                assert node[bound] is True and isinstance(node[bound.replace("exclusiveM", "m")], (int, float))


def test_names_subresources_and_columns():
    spec = crd_manifest()["spec"]
    assert spec["group"] == "iterserve.dev" and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "InferenceService" and spec["names"]["shortNames"] == ["infsvc"]
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1"
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}
    assert "status" in version["subresources"]
    columns = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert columns == ["Model", "Replicas", "Ready", "Waiting", "KV", "Age"]


def test_cel_rules_name_their_fields():
    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    rules = [rule for _, node in _walk(schema) for rule in node.get("x-kubernetes-validations", [])]
    messages = " ".join(r["message"] for r in rules)
    for field in ("spec.autoscaling.minReplicas", "spec.autoscaling.kvRetune.recoveryThreshold",
                  "spec.engine.maxNumBatchedTokens", "spec.autoscaling.kvRetune.floor"):
        assert field in messages
    autoscaling = schema["properties"]["spec"]["properties"]["autoscaling"]
    assert autoscaling["properties"]["mode"]["enum"] == ["Builtin", "External", "Off"]
    assert autoscaling["properties"]["kvRetune"]["properties"]["threshold"]["default"] == 0.95


def test_optional_fields_become_plain_optional_properties():
    node = structural({"anyOf": [{"$ref": "#/$defs/X"}, {"type": "null"}], "description": "d", "default": None},
                      {"X": {"type": "object", "title": "X", "additionalProperties": False,
                             "properties": {"n": {"type": "integer", "exclusiveMinimum": 0}}}})
    assert node == {"type": "object", "description": "d",
                    "properties": {"n": {"type": "integer", "minimum": 0, "exclusiveMinimum": True}}}


def test_iterserve_crd_command_prints_the_checked_in_file(capsys, tmp_path):
    from iterserve.cli import main

    assert main(["crd"]) == 0
    assert capsys.readouterr().out == CHECKED_IN.read_text()
    assert main(["crd", "-o", str(tmp_path / "crd.yaml")]) == 0
    assert (tmp_path / "crd.yaml").read_text() == CHECKED_IN.read_text()
