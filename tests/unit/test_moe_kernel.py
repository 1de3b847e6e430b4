"""The mixture-of-experts block: the torch path (the CPU path) against transformers' own Qwen3-MoE
and Qwen2-MoE blocks, and the fused Triton kernel against the torch path, on CPU through the
Triton interpreter."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from iterserve.engine.kernels import moe as moe_kernel  # noqa: E402
from iterserve.engine.model import moe  # noqa: E402


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def random_block(gen: torch.Generator, experts: int, hidden: int, inter: int, top_k: int,
                 dtype=torch.float32) -> moe.MoeWeights:
    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.2).to(dtype)
    return moe.MoeWeights(router=rand(experts, hidden), gate_up=rand(experts, 2 * inter, hidden),
                          down=rand(experts, hidden, inter), top_k=top_k, normalize_top_k=True)


def hf_block(kind: str, norm_topk_prob: bool, seed: int):
    torch.manual_seed(seed)
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
        config = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                                norm_topk_prob=norm_topk_prob)
    else:
        from transformers import Qwen2MoeConfig
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as Block
        config = Qwen2MoeConfig(hidden_size=64, moe_intermediate_size=48, shared_expert_intermediate_size=80,
                                num_experts=6, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob)
    block = Block(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(seed + p.numel()))
    return config, block


def ours_from_hf(config, block) -> moe.MoeWeights:
    shared = None
    if hasattr(block, "shared_expert"):
        s = block.shared_expert
        shared = moe.SharedExpert(gate_up=torch.cat([s.gate_proj.weight, s.up_proj.weight]).detach(),
                                  down=s.down_proj.weight.detach(), gate=block.shared_expert_gate.weight.detach())
    return moe.MoeWeights(router=block.gate.weight.detach(), gate_up=block.experts.gate_up_proj.detach(),
                          down=block.experts.down_proj.detach(), top_k=config.num_experts_per_tok,
                          normalize_top_k=config.norm_topk_prob, shared=shared)


@pytest.mark.parametrize("kind,norm_topk_prob", [("qwen3_moe", True), ("qwen3_moe", False), ("qwen2_moe", False)])
def test_the_torch_moe_block_equals_transformers_block(kind, norm_topk_prob):
    config, block = hf_block(kind, norm_topk_prob, seed=7)
    x = torch.randn(1, 29, config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = block(x)[0]
        got = moe.moe_forward(x[0], ours_from_hf(config, block), silu_and_mul)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_routing_weights_follow_the_float32_softmax_and_renormalise_only_when_asked():
    gen = torch.Generator().manual_seed(0)
    x, router = torch.randn(5, 16, generator=gen), torch.randn(4, 16, generator=gen)
    raw, ids = moe.route(x, router, top_k=2, normalize=False)
    probs = torch.softmax(x @ router.T, dim=-1)
    torch.testing.assert_close(raw, probs.gather(1, ids))
    assert (raw.sum(-1) < 1).all()
    normed, same_ids = moe.route(x, router, top_k=2, normalize=True)
    assert torch.equal(ids, same_ids)
    torch.testing.assert_close(normed.sum(-1), torch.ones(5))


def test_align_puts_every_pair_once_in_blocks_of_one_expert():
    gen = torch.Generator().manual_seed(1)
    experts, block_m = 6, 16
    ids = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(23)])
    ids[ids == 4] = 5  # expert 4 chosen by nobody
    sorted_pairs, block_experts = moe_kernel.align(ids, experts, block_m)
    num_pairs = ids.numel()
    real = sorted_pairs[sorted_pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))
    for b, expert in enumerate(block_experts.tolist()):
        block = sorted_pairs[b * block_m:(b + 1) * block_m]
        block = block[block < num_pairs]
        if expert == experts:
            assert block.numel() == 0
        else:
            assert (ids.reshape(-1)[block] == expert).all()
    assert 4 not in block_experts.tolist()


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [
    (1, 8, 2, 64, 48),  # one decode token
    (37, 8, 2, 64, 48),  # a prefill chunk: several blocks per expert
    (70, 4, 1, 96, 40),  # top-1, hidden and inter not multiples of the tiles
    (5, 16, 4, 32, 16),  # most experts idle
])
def test_the_triton_kernel_equals_the_grouped_torch_path(tokens, experts, top_k, hidden, inter):
    gen = torch.Generator().manual_seed(tokens * experts + top_k)
    block = random_block(gen, experts, hidden, inter, top_k)
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = moe.route(x, block.router, top_k, normalize=True)
    want = moe.experts_grouped(x, block.gate_up, block.down, weights, ids, silu_and_mul)
    got = moe_kernel.fused_experts(x, block.gate_up, block.down, weights, ids, silu_and_mul)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_triton_kernel_in_half_precision_stays_near_the_float32_result():
    gen = torch.Generator().manual_seed(11)
    block = random_block(gen, 8, 64, 48, 2)
    x = torch.randn(19, 64, generator=gen)
    weights, ids = moe.route(x, block.router, 2, normalize=True)
    want = moe.experts_grouped(x, block.gate_up, block.down, weights, ids, silu_and_mul)
    half = block.gate_up.half(), block.down.half()
    got = moe_kernel.fused_experts(x.half(), *half, weights.half(), ids, silu_and_mul)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_the_triton_kernel_with_no_tokens_returns_an_empty_batch():
    block = random_block(torch.Generator().manual_seed(0), 4, 32, 16, 2)
    x = torch.zeros(0, 32)
    got = moe_kernel.fused_experts(x, block.gate_up, block.down, torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int64),
                                   silu_and_mul)
    assert got.shape == (0, 32)
