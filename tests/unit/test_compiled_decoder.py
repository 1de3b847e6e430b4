"""engine/model/compiled.py on a tiny random Llama: the compiled forward (fp32 and with int8
weight-only linears, both of their row-count branches) gives the eager forward's logits on mixed
batches of prefill chunks and decodes, and every layer shares the same graphs."""

from __future__ import annotations

import pytest
import torch

from iterserve.engine.attention import AttentionMetadata, get_backend
from iterserve.engine.model.compiled import CompiledForward, compile_model
from iterserve.engine.model.llama import LlamaModel
from iterserve.engine.model.loader import load_model
from tests.unit import tiny_llama as tiny


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return tiny.write_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", tiny.hf_weights(seed=5))


def _steps(model: LlamaModel) -> list[torch.Tensor]:
    """Three steps over a fresh cache: a 20-token prefill next to a 6-token one (26 rows: the int8
    linears' dense branch), then the second part of the first prompt with a decode (9 rows), then
    two decodes (2 rows: the weight-only kernel)."""
    block_size = 4
    kv = [(torch.zeros(32, block_size, tiny.KV_HEADS, tiny.HEAD_DIM),
           torch.zeros(32, block_size, tiny.KV_HEADS, tiny.HEAD_DIM)) for _ in range(tiny.LAYERS)]
    tables = [list(range(0, 9)), list(range(20, 23))]
    a, b = list(range(40, 68)), [200, 201, 7, 7, 7, 9, 12]
    steps = [([20, 6], [20, 6], a[:20] + b[:6], list(range(20)) + list(range(6))),
             ([8, 1], [28, 7], a[20:28] + b[6:7], list(range(20, 28)) + [6]),
             ([1, 1], [29, 8], [5, 9], [28, 7])]
    out = []
    for query_lens, seq_lens, ids, positions in steps:
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
        out.append(model.compute_logits(model(torch.tensor(ids), torch.tensor(positions), kv, meta)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["none", "int8"])
@torch.inference_mode()
def test_compiled_forward_matches_eager(gguf, quantization):
    loaded = load_model(gguf, show_progress=False)
    model = LlamaModel.from_weights(loaded.config, loaded.weights, get_backend("torch"), torch.device("cpu"),
                                    torch.float32, max_positions=tiny.CONTEXT, quantization=quantization)
    eager = _steps(model)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compile_model(model, warm_up=False)
    assert isinstance(model.compiled, CompiledForward)
    got = _steps(model)
    for want, have in zip(eager, got, strict=True):
        torch.testing.assert_close(have, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(have.argmax(-1), want.argmax(-1))
    # Graphs per shape class, shared by every layer: 3 functions x at most 2 classes here (26 and 9
    # rows dynamic, 2 rows the int8 kernel's branch), never one per layer.
    assert 3 <= torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 6
    # Once compiled, running the same steps again compiles nothing new.
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    _steps(model)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before
