"""LoRA adapters across replicas, with real processes: `iterserve router` in front of a real-model
engine serving adapter ad0 and a fake-model engine serving only the base model's name. A request
for ad0 goes to the engine that has it (counted as adapter_affinity), base requests to both, an
unknown name gets the router's own 404; the operator's adapter pass (operator/adapters.py) loads
and unloads adapters on the real engine through its admin API, and the router follows."""

from __future__ import annotations

import asyncio
from contextlib import ExitStack

import httpx
import pytest

from iterserve.devcluster.waiting import wait_for
from iterserve.engine import metrics as names
from iterserve.operator.adapters import AdapterAdmin, sync_pods
from tests.integration.test_router import metric, router
from tests.lora_fixture import write_adapter
from tests.server_fixture import running_server

pytestmark = pytest.mark.slow
TOKEN = "lora-routing-admin-token"
BASE = "smollm2-135m"
ROUTERS_404 = "no replica serves it"  # in the router's own 404 (an engine words its own differently)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-routing")
    for i, targets in enumerate([("q_proj", "v_proj"), ("o_proj",), ("k_proj",)]):
        write_adapter(root / f"ad{i}", 4, targets, seed=i)
    with ExitStack() as stack:
        real = stack.enter_context(running_server(
            ["--max-model-len", "128", "--max-num-seqs", "4", "--max-loras", "2", "--max-lora-rank", "8",
             "--kv-cache-memory", "64MiB", "--lora-modules", f"ad0={root / 'ad0'}", "--dtype", "float32"],
            env={"ITERSERVE_ADMIN_TOKEN": TOKEN}, log_path=root / "real.log", ready_timeout=300))
        fake = stack.enter_context(running_server(["--fake-model", "--served-model-name", BASE],
                                                  log_path=root / "fake.log"))
        url, log = stack.enter_context(router([real.url, fake.url], root))
        # both model lists known: the router answers an unknown name itself
        wait_for(lambda: ROUTERS_404 in complete(url, "nope").text, 30, 0.2, what="the router to read both model lists")
        yield root, real, fake, url


def complete(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120,
                      json={"model": model, "prompt": "The best way to learn is", "max_tokens": 2, "temperature": 0})


def served(url: str) -> float:
    return sum(s.value for f in _families(url) for s in f.samples if s.name == names.REQUESTS_TOTAL)


def adapter_requests(url: str, adapter: str) -> float:
    return metric(url, names.LORA_REQUESTS_TOTAL, lora_name=adapter) or 0.0


def _families(url: str):
    from prometheus_client.parser import text_string_to_metric_families

    return list(text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text))


def test_adapter_requests_go_to_the_replica_serving_it_and_unknown_names_get_the_routers_404(fleet):
    _, real, fake, url = fleet
    picks_before = metric(url, names.ROUTER_PICKS_TOTAL, reason="adapter_affinity") or 0.0
    real_before, fake_before = served(real.url), served(fake.url)
    for _ in range(6):
        answer = complete(url, "ad0")
        assert answer.status_code == 200, answer.text
    assert adapter_requests(real.url, "ad0") >= 6
    assert served(fake.url) == fake_before  # the fake engine never saw one: it would have answered 404
    assert metric(url, names.ROUTER_PICKS_TOTAL, reason="adapter_affinity") == picks_before + 6

    for _ in range(4):  # the base model: any replica (equal loads rotate)
        assert complete(url, BASE).status_code == 200
    assert served(fake.url) >= fake_before + 1 and served(real.url) >= real_before + 6 + 1

    unknown = complete(url, "no-such-adapter")
    assert unknown.status_code == 404
    error = unknown.json()["error"]
    assert error["code"] == "model_not_found" and "'no-such-adapter'" in error["message"]
    assert "'ad0'" in error["message"] and ROUTERS_404 in error["message"]  # the router's, not an engine's


def test_the_operators_adapter_pass_loads_and_unloads_live_and_the_router_follows(fleet):
    root, real, _, url = fleet
    admin, pods = AdapterAdmin(TOKEN), {"real-0": real.url}
    wanted = {"ad0": str(root / "ad0"), "ad1": str(root / "ad1")}
    [first] = asyncio.run(sync_pods(admin, pods, wanted)).pods
    assert (first.loaded, first.did_load, first.did_unload, first.error) == (("ad0", "ad1"), ("ad1",), (), None)
    wait_for(lambda: complete(url, "ad1").status_code == 200, 15, 0.2, what="the router to learn ad1")
    [again] = asyncio.run(sync_pods(admin, pods, wanted)).pods  # level-triggered: nothing more to do
    assert (again.did_load, again.did_unload, again.error) == ((), (), None)

    # ad0 leaves the list, a bad directory joins it: ad0 is unloaded, the bad one's error recorded
    wanted = {"ad1": str(root / "ad1"), "bad": str(root / "nowhere")}
    [second] = asyncio.run(sync_pods(admin, pods, wanted)).pods
    assert second.loaded == ("ad1",) and second.did_unload == ("ad0",) and second.did_load == ()
    assert "load bad" in second.error and "adapter_config.json" in second.error and second.failed == ("bad",)
    wait_for(lambda: ROUTERS_404 in complete(url, "ad0").text, 15, 0.2, what="ad0 gone from the router's lists")

    [refused] = asyncio.run(sync_pods(AdapterAdmin("wrong-token"), pods, {"ad2": str(root / "ad2")})).pods
    assert "HTTP 401" in refused.error and refused.loaded == ("ad1",)  # nothing changed without the token
