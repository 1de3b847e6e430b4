"""The engine's start-up rules and per-request bad input."""

from __future__ import annotations

import pytest

from iterserve.engine.config import ConfigError, EngineConfig, parse_size
from iterserve.engine.sampling_params import InvalidRequestError, SamplingParams
from tests.unit.engine_helpers import fake_engine, run_to_completion


def test_without_chunked_prefill_the_budget_must_cover_max_model_len():
    with pytest.raises(ConfigError) as err:
        EngineConfig(model="fake", chunked_prefill=False, max_model_len=2048,
                     max_num_batched_tokens=1024).resolve()
    message = str(err.value)
    assert "--max-num-batched-tokens" in message and "--max-model-len" in message


def test_chunked_prefill_allows_a_budget_below_max_model_len():
    config = EngineConfig(model="fake", max_model_len=2048, max_num_batched_tokens=256).resolve()
    assert config.max_num_batched_tokens == 256


def test_more_sequences_than_budget_tokens_is_refused_naming_both_options():
    with pytest.raises(ConfigError) as err:
        EngineConfig(model="fake", max_num_seqs=128, max_num_batched_tokens=64).resolve()
    assert "--max-num-seqs" in str(err.value) and "--max-num-batched-tokens" in str(err.value)


def test_defaults_follow_chunking():
    assert EngineConfig(model="fake", max_model_len=1024).resolve().max_num_batched_tokens == 512
    assert EngineConfig(model="fake", max_model_len=1024, chunked_prefill=False).resolve().max_num_batched_tokens == 1024


@pytest.mark.parametrize(
    "options, option_named",
    [
        ({"preemption_mode": "evict"}, "--preemption-mode"),
        ({"block_size": 12}, "--block-size"),
        ({"max_num_seqs": 0}, "--max-num-seqs"),
        ({"scheduling": "fifo"}, "--scheduling"),
        ({"attention_backend": "flash"}, "--attention-backend"),
    ],
)
def test_bad_options_name_the_option(options, option_named):
    with pytest.raises(ConfigError, match=option_named):
        EngineConfig(model="fake", **options).resolve()


def test_a_kv_pool_smaller_than_one_max_length_sequence_is_refused():
    config = EngineConfig(model="fake", max_model_len=1024).resolve()
    with pytest.raises(ConfigError, match="--kv-cache-memory"):
        config.check_kv_capacity(num_blocks=10, num_cpu_blocks=0)


def test_swap_mode_needs_a_swap_pool():
    config = EngineConfig(model="fake", max_model_len=64, preemption_mode="swap").resolve()
    with pytest.raises(ConfigError, match="--swap-space"):
        config.check_kv_capacity(num_blocks=10, num_cpu_blocks=0)


def test_fake_engine_from_config_sizes_its_pool_from_memory():
    from iterserve.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_config(EngineConfig(model="fake", kv_cache_memory="64MiB", max_model_len=512))
    assert engine.block_manager.num_blocks == 64 * 1024**2 // (30 * 2 * 3 * 64 * 4 * 16)


def test_sizes_parse_with_units():
    assert parse_size("512MiB", "x") == 512 * 1024**2
    assert parse_size("2GiB", "x") == 2 * 1024**3
    assert parse_size(1000, "x") == 1000
    with pytest.raises(ConfigError, match="--kv-cache-memory"):
        parse_size("lots", "--kv-cache-memory")


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"best_of_all": 3}, "best_of_all"),
        ({"max_tokens": "ten"}, "max_tokens"),
    ],
)
def test_bad_sampling_fields_name_the_field(fields, param):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams.from_dict(fields)
    assert err.value.param == param and param in str(err.value)


def test_bad_request_fails_alone_and_leaks_nothing():
    engine = fake_engine(max_model_len=64, max_num_batched_tokens=64)
    engine.add_request(prompt_token_ids=[97] * 10, request_id="good",
                       params=SamplingParams(max_tokens=5, ignore_eos=True))
    with pytest.raises(InvalidRequestError, match="max_model_len") as err:
        engine.add_request(prompt_token_ids=[97] * 64, request_id="too-long")
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request(prompt_token_ids=[])
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request(prompt_token_ids=[97], request_id="good")
    assert run_to_completion(engine).keys() == {"good"}
    assert engine.block_manager.usage() == 0.0
    assert not engine._sequences


def test_long_prefill_cap_defaults_to_an_eighth_of_the_budget_and_refuses_negatives():
    assert EngineConfig(model="fake", max_num_batched_tokens=512).resolve().long_prefill_token_threshold == 64
    assert EngineConfig(model="fake", max_num_batched_tokens=64).resolve().long_prefill_token_threshold == 16
    assert EngineConfig(model="fake", chunked_prefill=False, max_model_len=512).resolve().long_prefill_token_threshold == 0
    with pytest.raises(ConfigError, match="--long-prefill-token-threshold"):
        EngineConfig(model="fake", long_prefill_token_threshold=-1).resolve()
