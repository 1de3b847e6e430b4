"""The chart's CRD is the generated crds/inferenceservice.yaml itself, not a copy that can drift."""

from __future__ import annotations

import os
import tarfile

import pytest
import yaml

from tests.unit.chart_tools import CHART, ROOT, helm, of_kind, render

GENERATED = ROOT / "crds" / "inferenceservice.yaml"
IN_CHART = CHART / "crds" / "inferenceservice.yaml"


def test_chart_crd_is_the_generated_file():
    assert GENERATED.is_file(), "crds/inferenceservice.yaml is missing: run `make crds`"
    assert IN_CHART.read_bytes() == GENERATED.read_bytes(), (
        "charts/iterserve/crds/inferenceservice.yaml differs from crds/inferenceservice.yaml; "
        "restore the link: ln -sf ../../../crds/inferenceservice.yaml charts/iterserve/crds/inferenceservice.yaml")
    # A relative link, so that it resolves in every checkout.
    assert IN_CHART.is_symlink() and not os.path.isabs(os.readlink(IN_CHART))


@pytest.mark.cluster  # needs helm from `make cluster-tools`
def test_chart_template_includes_the_crd():
    [crd] = of_kind(render(include_crds=True), "CustomResourceDefinition")
    assert crd == yaml.safe_load(GENERATED.read_text())


@pytest.mark.cluster  # needs helm from `make cluster-tools`
def test_chart_package_carries_the_crd_content(tmp_path):
    helm("package", str(CHART), "--destination", str(tmp_path))
    [archive] = tmp_path.glob("iterserve-*.tgz")
    with tarfile.open(archive) as tar:
        member = tar.getmember("iterserve/crds/inferenceservice.yaml")
        assert member.isfile(), "helm package stored the link, not the file"
        assert tar.extractfile(member).read() == GENERATED.read_bytes()
