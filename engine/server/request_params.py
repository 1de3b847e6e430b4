"""An OpenAI request's fields turned into what the engine runs: SamplingParams (checked against the
model's context length and vocabulary), the structured output (compiled here, so an invalid schema
is a 400), the logprobs cap, and the accepted-but-ignored fields named back to the client."""

from __future__ import annotations

import logging

from fastapi import Request

from iterserve.engine.model.generation_config import defaults_of
from iterserve.engine.sampling_params import InvalidRequestError, SamplingParams
from iterserve.engine.server.async_engine import AsyncEngine
from iterserve.engine.server.errors import invalid, unavailable
from iterserve.engine.server.protocol import IGNORED_FIELDS_HEADER, _SamplingFields
from iterserve.engine.server.state import ServerState
from iterserve.engine.structured import StructuredOutput
from iterserve.engine.structured.compile_pool import CompileBusy

logger = logging.getLogger(__name__)
STRUCTURED_FIELDS = "response_format, guided_json, guided_regex, guided_choice, guided_grammar"


def ignored_headers(body: _SamplingFields, request: Request) -> dict[str, str]:
    """Name the accepted-but-ignored fields the request set: a response header and a log line."""
    ignored = body.ignored_fields()
    if not ignored:
        return {}
    logger.info("%s: ignored fields %s (accepted, they do not change the output)", request.url.path,
                ", ".join(ignored))
    return {IGNORED_FIELDS_HEADER: ",".join(ignored)}


def check_logprobs(value: int | None, state: ServerState, field: str) -> None:
    limit = state.options.max_logprobs
    if value is not None and value > limit:
        raise invalid(f"{field}: at most {limit} (the server's --max-logprobs), got {value}", field)


def _asked_structured(body: _SamplingFields) -> list[StructuredOutput]:
    asked = []
    form = body.response_format
    if form is not None and form.type != "text":
        if form.type == "json_object":
            asked.append(StructuredOutput("json_object", "", "response_format"))
        elif form.json_schema is None:
            raise invalid('response_format: type "json_schema" needs a json_schema object '
                          '({"name": ..., "schema": {...}})', "response_format")
        elif form.json_schema.schema_ is None:
            asked.append(StructuredOutput("json_object", "", "response_format"))
        else:
            asked.append(StructuredOutput.json_schema(form.json_schema.schema_, "response_format"))
    if body.guided_json is not None:
        asked.append(StructuredOutput.json_schema(body.guided_json, "guided_json"))
    if body.guided_regex is not None:
        asked.append(StructuredOutput("regex", body.guided_regex, "guided_regex"))
    if body.guided_choice is not None:
        asked.append(StructuredOutput.choice(body.guided_choice))
    if body.guided_grammar is not None:
        asked.append(StructuredOutput("grammar", body.guided_grammar, "guided_grammar"))
    return asked


async def structured_output(body: _SamplingFields, engine: AsyncEngine,
                            forced_call: StructuredOutput | None = None) -> StructuredOutput | None:
    """The request's structured output (a forced tool call, response_format or one guided_* field),
    compiled here on the grammar pool (engine/structured/compile_pool.py) so an invalid or too costly
    schema is a 400, with the compiled grammar pinned on it: the engine thread never compiles."""
    asked = ([forced_call] if forced_call is not None else []) + _asked_structured(body)
    if not asked:
        return None
    if len(asked) > 1:
        raise invalid(f"{asked[1].field}: only one structured output per request, and {asked[0].field} is "
                      f"already set; send one of {STRUCTURED_FIELDS}", asked[1].field)
    structured = asked[0]
    grammars = engine.engine.executor.grammars
    if grammars is None:
        raise invalid(f"{structured.field}: structured outputs need a real model's vocabulary; this server "
                      "runs the fake model (--fake-model)", structured.field)
    try:
        return await grammars.pool.compile(structured)
    except InvalidRequestError as error:
        raise invalid(str(error), error.param) from None
    except CompileBusy as error:
        raise unavailable(str(error), "structured_output_busy") from None


def _check_length(prompt_len: int, max_tokens: int | None, max_model_len: int, prompt_field: str) -> None:
    if prompt_len >= max_model_len:
        raise invalid(f"{prompt_field}: the prompt has {prompt_len} tokens, but this model's maximum context "
                      f"length is {max_model_len} tokens; shorten it", prompt_field, "context_length_exceeded")
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise invalid(f"max_tokens: this model's maximum context length is {max_model_len} tokens, but "
                      f"{prompt_len} prompt tokens + max_tokens {max_tokens} exceed it; lower max_tokens to "
                      f"at most {max_model_len - prompt_len}", "max_tokens", "context_length_exceeded")


def _logit_bias(body: _SamplingFields, engine: AsyncEngine) -> dict[int, float] | None:
    logit_bias = {int(token): bias for token, bias in body.logit_bias.items()} if body.logit_bias else None
    vocab = getattr(engine.engine.tokenizer, "vocab_size", None)
    if logit_bias and vocab is not None and max(logit_bias) >= vocab:
        raise invalid(f"logit_bias: token id {max(logit_bias)} is outside the vocabulary [0, {vocab})", "logit_bias")
    return logit_bias


def sampling_params(body: _SamplingFields, max_tokens: int | None, prompt_len: int, engine: AsyncEngine,
                    prompt_field: str, default_max_tokens: int, logprobs: int | None = None,
                    prompt_logprobs: int | None = None,
                    structured: StructuredOutput | None = None) -> SamplingParams:
    _check_length(prompt_len, max_tokens, engine.engine.config.max_model_len, prompt_field)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    # A field the request leaves out takes the model's generation_config.json default (as vLLM does).
    model = defaults_of(engine.engine.tokenizer)

    def pick(name: str):
        value = getattr(body, name)
        return value if name in body.model_fields_set else model.default_for(name, value)

    try:
        return SamplingParams(
            temperature=pick("temperature"), top_p=pick("top_p"), top_k=pick("top_k"), seed=body.seed,
            max_tokens=max_tokens or min(default_max_tokens, model.default_for("max_tokens", default_max_tokens)),
            stop=stop, stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos, cache_salt=body.cache_salt, skip_prefix_cache=body.skip_prefix_cache,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=pick("repetition_penalty"), min_p=pick("min_p"), min_tokens=body.min_tokens,
            logit_bias=_logit_bias(body, engine), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            structured=structured,
        )
    except InvalidRequestError as error:
        raise invalid(str(error), error.param) from None
