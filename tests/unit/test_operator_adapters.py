"""spec.adapters: validation that names the field, what new pods start with (ConfigMap-fed
--lora-modules, so a changed list rolls no pod), the load/unload plan for a running pod, and the
reconcile recording an adapter pass in status.adapters and Events (one writer)."""

from __future__ import annotations

import copy

import pytest

from iterserve.engine.config import ConfigError, EngineConfig
from iterserve.operator import resources as r
from iterserve.operator.adapters import (
    FAILED,
    LOADED,
    UNLOADED,
    AdapterReport,
    PodAdapters,
    plan,
    start_adapters,
    wanted_adapters,
)
from iterserve.operator.engine_config import engine_config_for
from iterserve.operator.reconcile import Reconciler
from iterserve.operator.validation import SpecError, parse_spec
from tests.unit.test_operator_bounded_reads import HostilePod
from tests.unit.test_operator_value_flow import MemoryKube

OWNER = r.Owner("llm", "ns", "uid-1")
BASE = {"model": {"uri": "smollm2-135m"}}


def spec_with(adapters, **more):
    return parse_spec({**BASE, "adapters": adapters, **more})


@pytest.mark.parametrize("adapters, more, field, words", [
    ([{"name": "bad name", "source": "/a"}], {}, "spec.adapters[0].name", "pattern"),
    ([{"name": "-x", "source": "/a"}], {}, "spec.adapters[0].name", "pattern"),
    ([{"name": "x" * 257, "source": "/a"}], {}, "spec.adapters[0].name", "256"),
    ([{"name": "sql", "source": "hf://org/sql"}], {}, "spec.adapters[sql].source", "not a URL"),
    ([{"name": "sql", "source": "/adapters/../etc"}], {}, "spec.adapters[sql].source", "'..'"),
    ([{"name": "sql", "source": "/a b"}], {}, "spec.adapters[0].source", "pattern"),
    ([{"name": "sql", "source": "sql"}], {}, "spec.adapters", "persistentVolumeClaim"),
    ([{"name": "sql", "source": "/a"}, {"name": "sql", "source": "/b"}], {}, "spec.adapters", "unique"),
    ([{"name": "smollm2-135m", "source": "/a"}], {}, "spec.adapters[0].name", "base model"),
    ([{"name": "m", "source": "/a"}], {"engine": {"extraArgs": ["--served-model-name", "m"]}},
     "spec.adapters[0].name", "base model"),
    ([{"name": f"a{i}", "source": "/a"} for i in range(65)], {}, "spec.adapters", "64"),
    ([], {"engine": {"extraArgs": ["--lora-modules", "a=/a"]}}, "spec.engine.extraArgs[0]", "set by the operator"),
])
def test_bad_adapter_lists_are_refused_naming_the_field(adapters, more, field, words):
    with pytest.raises(SpecError) as caught:
        spec_with(adapters, **more)
    assert caught.value.field == field and words in caught.value.message, caught.value


def test_a_relative_source_resolves_inside_the_model_volume():
    spec = spec_with([{"name": "sql", "source": "adapters/sql"}, {"name": "org/chat:v2", "source": "/opt/chat"}],
                     model={"uri": "m.gguf", "persistentVolumeClaim": {"claimName": "weights"}, "mountPath": "/w"})
    assert wanted_adapters(spec) == {"sql": "/w/adapters/sql", "org/chat:v2": "/opt/chat"}


def test_new_pods_start_with_the_list_from_the_configmap_and_a_changed_list_rolls_nothing():
    one = spec_with([{"name": "sql", "source": "/a/sql"}])
    two = spec_with([{"name": "sql", "source": "/a/sql"}, {"name": "chat", "source": "/a/chat"}])
    args = r.engine_args(one)
    assert args[args.index("--enable-lora"):][:5] == ["--enable-lora", "--lora-modules", "$(ITERSERVE_LORA_MODULES)",
                                                      "--max-loras", "$(ITERSERVE_MAX_LORAS)"]
    assert r.build_configmap(OWNER, two, 16)["data"] == {"max_num_seqs": "16", "lora_modules": "sql=/a/sql chat=/a/chat",
                                                        "max_loras": "2"}
    assert r.build_deployment(OWNER, one) == r.build_deployment(OWNER, two)  # the ConfigMap changes, no pod rolls
    env = {e["name"]: e for e in r.build_deployment(OWNER, one)["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["ITERSERVE_LORA_MODULES"]["valueFrom"]["configMapKeyRef"] == {"name": "llm-engine", "key": "lora_modules"}
    # the first adapter switches LoRA on at start: that one rolls
    assert "--enable-lora" not in r.engine_args(spec_with([]))
    assert r.build_configmap(OWNER, spec_with([]), 16)["data"] == {"max_num_seqs": "16"}
    many = spec_with([{"name": f"a{i}", "source": f"/a/{i}"} for i in range(20)])
    assert r.build_configmap(OWNER, many, 16)["data"]["max_loras"] == str(r.MAX_LORAS_CAP)


def test_the_users_max_loras_wins_and_the_pod_parses_what_the_operator_passes():
    spec = spec_with([{"name": "sql", "source": "/a/sql"}, {"name": "chat", "source": "/a/chat"}],
                     engine={"extraArgs": ["--max-loras", "1"]})
    assert "$(ITERSERVE_MAX_LORAS)" not in r.engine_args(spec)
    config, _ = engine_config_for(spec, 8)  # through serve's own parser, as a pod would
    assert config.max_loras == 1 and config.lora_module_paths() == {"sql": "/a/sql", "chat": "/a/chat"}


def test_lora_modules_items_split_only_where_a_new_name_starts():
    config = EngineConfig(lora_modules=("a=/x b=/y", "c=/my dir/z"))
    assert config.lora_module_paths() == {"a": "/x", "b": "/y", "c": "/my dir/z"}
    assert EngineConfig(lora_modules=("",)).lora_module_paths() == {}  # the ConfigMap's list may be empty
    with pytest.raises(ConfigError, match="twice"):
        EngineConfig(lora_modules=("a=/x a=/y",)).lora_module_paths()


@pytest.mark.parametrize("wanted, served, unload, load", [
    ({"a": "/a"}, {}, (), (("a", "/a"),)),
    ({"a": "/a"}, {"a": "/a"}, (), ()),
    ({}, {"a": "/a", "hand": "/h"}, ("a", "hand"), ()),  # the spec's list is the whole truth
    ({"a": "/a2", "b": "/b"}, {"a": "/a", "c": "/c"}, ("a", "c"), (("a", "/a2"), ("b", "/b"))),  # a moved
    ({"a": "/a"}, {"a": None}, (), ()),  # a server that does not say where: left alone
])
def test_plan_for_one_pod(wanted, served, unload, load):
    steps = plan(wanted, served)
    assert (steps.unload, steps.load) == (unload, load)


def test_report_events_name_pods_and_announce_an_error_once():
    report = AdapterReport((PodAdapters("p1", ("a", "b"), did_load=("b",)),
                            PodAdapters("p2", ("a",), "load b from /b: HTTP 400: no adapter_config.json", did_unload=("c",)),
                            PodAdapters("p3", ("a", "b"), did_load=("b",))))
    events = report.events([])
    assert [(t, reason) for t, reason, _ in events] == [("Normal", LOADED), ("Normal", UNLOADED), ("Warning", FAILED)]
    assert events[0][2] == "Loaded LoRA adapter b on 2 pod(s): p1, p3"
    assert [reason for _, reason, _ in report.events(report.status())] == [LOADED, UNLOADED]  # the error is known
    assert report.status()[1] == {"pod": "p2", "loaded": ["a"], "error": "load b from /b: HTTP 400: no adapter_config.json"}


def test_the_reconcile_records_an_adapter_pass_and_later_passes_keep_it():
    kube = MemoryKube(copy.deepcopy({**BASE, "adapters": [{"name": "a", "source": "/a"}]}))
    reconciler = Reconciler(kube)
    reconciler.reconcile("ns", "llm")
    reconciler.reconcile("ns", "llm")  # the router is ready now: the Service moves to it
    assert kube.objects[("ConfigMap", "llm-engine")]["data"]["lora_modules"] == "a=/a"
    kube.writes.clear()
    report = AdapterReport((PodAdapters("llm-x", ("a",), did_load=("a",)),))
    reconciler.reconcile("ns", "llm", adapters=report)
    assert kube.body["status"]["adapters"] == [{"pod": "llm-x", "loaded": ["a"]}]
    assert kube.writes == [("status", "adapters")] and kube.events[-1] == LOADED
    kube.writes.clear()
    reconciler.reconcile("ns", "llm")  # no pass: what status recorded stands, nothing is written
    assert kube.writes == [] and kube.body["status"]["adapters"] == [{"pod": "llm-x", "loaded": ["a"]}]


def test_new_pods_start_without_an_adapter_that_failed_to_load_and_is_loaded_nowhere():
    spec = spec_with([{"name": n, "source": f"/a/{n}"} for n in ("ok", "bad", "slow")])
    recorded = [{"pod": "p1", "loaded": ["ok", "slow"], "failed": ["bad"]}, {"pod": "p2", "loaded": ["ok"],
                                                                            "failed": ["slow"]}]
    assert [a.name for a in start_adapters(spec, recorded)] == ["ok", "slow"]  # slow loaded on p1: it works
    assert [a.name for a in start_adapters(spec, None)] == ["ok", "bad", "slow"]  # nothing known yet: all

    kube = MemoryKube(copy.deepcopy({**BASE, "adapters": [{"name": "ok", "source": "/a/ok"},
                                                           {"name": "bad", "source": "/a/bad"}]}))
    reconciler = Reconciler(kube)
    reconciler.reconcile("ns", "llm")
    deployment = kube.objects[("Deployment", "llm")]["spec"]
    report = AdapterReport((PodAdapters("llm-x", ("ok",), "load bad from /a/bad: HTTP 400: ...", failed=("bad",)),))
    reconciler.reconcile("ns", "llm", adapters=report)
    assert kube.objects[("ConfigMap", "llm-engine")]["data"]["lora_modules"] == "ok=/a/ok"
    assert kube.body["status"]["adapters"][0]["failed"] == ["bad"]
    assert kube.objects[("Deployment", "llm")]["spec"] == deployment  # no roll
    fixed = AdapterReport((PodAdapters("llm-x", ("bad", "ok"), did_load=("bad",)),))
    reconciler.reconcile("ns", "llm", adapters=fixed)  # the source was fixed: new pods get it again
    assert kube.objects[("ConfigMap", "llm-engine")]["data"]["lora_modules"] == "ok=/a/ok bad=/a/bad"


@pytest.fixture(params=["huge", "trickle"])
def hostile_pod(request):
    server = HostilePod(request.param)
    yield server
    server.close()


def test_a_hostile_pods_model_list_is_bounded_and_only_that_pod_records_it(hostile_pod):
    import asyncio
    import time

    from iterserve.operator.adapters import AdapterAdmin, sync_pods

    pod = hostile_pod
    started = time.monotonic()
    report = asyncio.run(sync_pods(AdapterAdmin("token", timeout=1.0), {"bad": pod.url, "gone": "http://127.0.0.1:9"},
                                   {"a": "/a"}, deadline_s=5.0))
    assert time.monotonic() - started < 3
    errors = {p.pod: p.error for p in report.pods}
    assert "1048576-byte cap" in errors["bad"] or "timeout" in errors["bad"], errors
    assert errors["gone"].startswith("GET http://127.0.0.1:9/v1/models: ") and len(report.pods) == 2
    assert all(p.loaded == () and p.did_load == () for p in report.pods)
