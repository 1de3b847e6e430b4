"""LoRA adapters through `iterserve serve` on the embedded model: adapters from --lora-modules and
loaded/unloaded at run time behind the admin token, listed by /v1/models with their parent, chosen
by a request's `model`; run-time load and unload under load fail no request; an unloaded adapter's
new requests get 404; more adapters than slots are served by reusing slots; vLLM's
lora_requests_info gauge and the per-adapter counters."""

from __future__ import annotations

import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.lora_fixture import write_adapter
from tests.server_fixture import running_server

pytestmark = pytest.mark.slow
TOKEN = "lora-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    for i, (rank, targets) in enumerate([(8, ("q_proj", "v_proj")), (3, ("o_proj", "down_proj")),
                                         (5, ("gate_proj", "up_proj", "k_proj")), (1, ("q_proj",))]):
        write_adapter(root / f"ad{i}", rank, targets, seed=i)
    args = ["--max-model-len", "256", "--max-num-seqs", "8", "--max-loras", "2", "--max-lora-rank", "8",
            "--lora-modules", f"ad0={root / 'ad0'}", "--dtype", "float32"]
    with running_server(args, env={"ITERSERVE_ADMIN_TOKEN": TOKEN}, log_path=root / "server.log",
                        ready_timeout=300) as srv:
        srv.root = root
        yield srv


def complete(url: str, model: str, max_tokens: int = 6) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "The best way to learn is",
                                                      "max_tokens": max_tokens, "temperature": 0}, timeout=120)


def test_adapters_are_listed_chosen_by_model_and_unknown_names_get_404(server):
    models = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [("smollm2-135m", None), ("ad0", "smollm2-135m")]
    base, adapted = complete(server.url, "smollm2-135m"), complete(server.url, "ad0")
    assert base.status_code == adapted.status_code == 200
    assert base.json()["choices"][0]["text"] != adapted.json()["choices"][0]["text"]
    missing = complete(server.url, "no-such-adapter")
    assert missing.status_code == 404 and "'no-such-adapter'" in missing.json()["error"]["message"]


def test_load_and_unload_need_the_admin_token_and_run_under_load_without_failing_a_request(server):
    url, root = server.url, server.root
    body = {"lora_name": "ad1", "lora_path": str(root / "ad1")}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=body).status_code == 401
    statuses: list[tuple[str, int]] = []
    stop = threading.Event()

    def load(model):
        while not stop.is_set():
            statuses.append((model, complete(url, model, max_tokens=4).status_code))

    threads = [threading.Thread(target=load, args=(m,)) for m in ("smollm2-135m", "ad0", "ad0")]
    for t in threads:
        t.start()
    try:
        loaded = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=ADMIN, timeout=60)
        assert loaded.status_code == 200 and "ad1" in loaded.text
        assert complete(url, "ad1").status_code == 200
        again = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=ADMIN, timeout=60)
        assert again.status_code == 400  # already loaded
        # a third and fourth adapter with two slots: slots are reused
        for name in ("ad2", "ad3"):
            assert httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(root / name)},
                              headers=ADMIN, timeout=60).status_code == 200
            assert complete(url, name).status_code == 200
        unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "ad0"}, headers=ADMIN)
        assert unloaded.status_code == 200
    finally:
        stop.set()
        for t in threads:
            t.join()
    failures = [(m, s) for m, s in statuses if s != 200 and not (m == "ad0" and s == 404)]
    assert not failures and len(statuses) >= 3
    assert complete(url, "ad0").status_code == 404  # unloaded: new requests get 404
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "ad0"}, headers=ADMIN).status_code == 404
    bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(root / "nowhere")},
                     headers=ADMIN)
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    models = {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]}
    assert models == {"smollm2-135m", "ad1", "ad2", "ad3"}


def test_vllm_lora_info_gauge_and_per_adapter_counters(server):
    assert complete(server.url, "ad1").status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}
    info = families["vllm:lora_requests_info"].samples
    assert len(info) == 1 and set(info[0].labels) == {"max_lora", "waiting_lora_adapters", "running_lora_adapters"}
    assert info[0].labels["max_lora"] == "2" and info[0].value > 1e9  # the sample's Unix time, as vLLM sets it
    counts = {s.labels["lora_name"]: s.value for s in families["iterserve_lora_requests"].samples
              if s.name.endswith("_total")}
    assert counts.get("ad1", 0) >= 2
