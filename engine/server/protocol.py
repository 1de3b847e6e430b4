"""OpenAI request and response schemas.

Requests are strict: an unknown field or a wrong type is refused (400, naming the field) rather
than silently ignored, so a client never believes a setting took effect when it did not.
Fields that OpenAI defines but iterserve does not implement are accepted only at their neutral
value, and refused otherwise with a message saying so. The exception is IGNORED_FIELDS: fields
stock clients send that cannot change the generated text (`user`, `metadata`, `store`,
`service_tier`...); they are accepted, not acted on, and named in the response's
X-Iterserve-Ignored-Fields header and a log line.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from iterserve.engine.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_PENALTY,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TOKEN_ID,
    MIN_REPETITION_PENALTY,
    MIN_SEED,
)

MAX_MESSAGES = 1024  # per chat request
MAX_N = 16  # choices per prompt
MAX_PROMPTS = 64  # prompts per completions request
# Accepted and ignored (named in the X-Iterserve-Ignored-Fields response header): they never change
# the generated text. `stream_options` is honoured (include_usage), so it is not listed.
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                  "safety_identifier")
IGNORED_FIELDS_HEADER = "X-Iterserve-Ignored-Fields"


def _valid_unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("is not valid Unicode (it holds a lone surrogate such as \\ud800)") from None
    return value


# Every string a request carries: JSON allows "\ud800", which no tokenizer can encode.
Text = Annotated[str, AfterValidator(_valid_unicode)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM's: every chunk carries its choice's usage so far.")


class JsonSchemaFormat(_Request):
    name: Text = Field(max_length=64, description="The schema's name (OpenAI requires one; not used).")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="The JSON schema the output must "
                                           "match; absent: any JSON object.")
    strict: bool | None = Field(None, description="Accepted; the output always matches the schema exactly.")
    description: Text | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


StopString = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
StopStrings = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None


class _SamplingFields(_Request):
    """Fields both endpoints share; the names and ranges are OpenAI's."""

    model: Text | None = Field(None, description="The served model's id (GET /v1/models); defaults to it.")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE,
                               description="Below 1e-5 the choice is greedy (the most likely token).")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N, description=f"Choices per prompt (at most {MAX_N}); they share the prompt's "
                                                   "cached KV blocks (prefix caching). Streamed, each chunk names its choice's index.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopStrings = None
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = Field(
        None, description="Token id (as a string, as OpenAI sends it) -> bias in [-100, 100] added to its logit.")
    # Accepted and ignored (IGNORED_FIELDS).
    user: Text | None = Field(None, max_length=256, description="Ignored (accepted for clients that send it).")
    metadata: dict[str, Any] | None = Field(None, description="Ignored (accepted for clients that send it).")
    store: bool | None = Field(None, description="Ignored: nothing is stored.")
    service_tier: Text | None = Field(None, max_length=64, description="Ignored: there is one tier.")
    prompt_cache_key: Text | None = Field(None, max_length=1024, description="Ignored (see cache_salt).")
    safety_identifier: Text | None = Field(None, max_length=256, description="Ignored.")
    # vLLM's extensions, which load generators and benchmarks rely on.
    top_k: int = Field(-1, ge=-1, le=MAX_TOKEN_ID,
                       description="-1: off (0 is refused); above the vocabulary size: the whole vocabulary.")
    ignore_eos: bool = False
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_PENALTY,
                                      description="HF's: seen tokens' logits divided (>0) or multiplied (<0) by it.")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0, description="No EOS or stop token before this many tokens.")
    # Prefix caching per request: vLLM's cache_salt (only requests with the same salt share cached KV
    # blocks) and an opt-out (the request neither reuses cached blocks nor offers its own).
    cache_salt: str | None = None
    # Prefill/decode disaggregation (engine/kv_transfer/params.py; vLLM's field): {"do_remote_decode": true}
    # on a prefill call, the prefill answer's object plus "do_remote_prefill": true on a decode call.
    kv_transfer_params: dict[str, Any] | None = Field(
        None, description='P/D disaggregation (vLLM\'s): {"do_remote_decode": true} asks a prefill engine to lease '
                          'the prompt\'s KV and return its kv_transfer_params; that object plus "do_remote_prefill": '
                          'true asks a decode engine to pull it. One prompt, n 1.')
    skip_prefix_cache: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    # Structured outputs (grammar-constrained decoding, engine/structured): OpenAI's response_format,
    # or one of vLLM's guided_* fields.
    response_format: ResponseFormat | None = Field(
        None, description='{"type": "json_object"} or {"type": "json_schema", "json_schema": {"name": ..., '
                          '"schema": {...}}}: the output is JSON matching it (compact, no free whitespace).')
    guided_json: dict[str, Any] | Text | None = Field(None, description="vLLM's: a JSON schema the output matches.")
    guided_regex: Text | None = Field(None, description="vLLM's: a regular expression the output matches.")
    guided_choice: Annotated[list[Text], Field(min_length=1, max_length=1024)] | None = Field(
        None, description="vLLM's: the output is exactly one of these strings.")
    guided_grammar: Text | None = Field(None, description="vLLM's: an EBNF grammar (GBNF, root rule `root`) "
                                                          "the output matches.")

    def ignored_fields(self) -> list[str]:
        """The IGNORED_FIELDS this request set (to a value other than null)."""
        return [name for name in IGNORED_FIELDS
                if name in self.model_fields_set and getattr(self, name, None) is not None]

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit() or int(key) > MAX_TOKEN_ID:
                raise ValueError(f"keys must be token ids (decimal strings), got {key!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"biases must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}")
        return value


TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(_SamplingFields):
    prompt: Text | TokenIds | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)] | Annotated[
        list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)
    ] = Field(description=f"A string, a list of token ids, or a batch of up to {MAX_PROMPTS} of either "
                          "(choice i*n+j is prompt i's j-th choice, streamed or not).")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="Only equal to n (or left out).")
    max_tokens: int | None = Field(None, ge=0, description="0 only with echo: the prompt (and its logprobs), "
                                                            "nothing generated (as vLLM; lm-evaluation-harness).")
    echo: bool = Field(False, description="Return the prompt before the completion (and, with logprobs, the "
                                          "prompt tokens' logprobs: the first token's is null).")
    logprobs: int | None = Field(None, ge=0, description="The chosen token's logprob plus this many most likely "
                                                         "tokens' per position (at most the server's --max-logprobs).")
    suffix: Text | None = Field(None, description="Fill-in-the-middle: only for models with FIM tokens "
                                                  "(<fim_prefix>, <fim_suffix>, <fim_middle>); else refused.")


class TextPart(_Request):
    type: Literal["text"]
    text: Text


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)] | None = Field(
        None, description="Required except on an assistant message that carries tool_calls.")
    name: Text | None = Field(None, max_length=256)
    tool_calls: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = Field(
        None, description="An earlier assistant turn's tool calls (OpenAI's shape).")
    tool_call_id: Text | None = Field(None, max_length=256, description="On a tool message: the call it answers.")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, description="With logprobs: this many most likely tokens per "
                                                             "position (at most the server's --max-logprobs).")
    parallel_tool_calls: bool | None = Field(None, description="With tools: false allows one call per answer "
                                                               "(without tools it is ignored).")
    tools: list[dict[str, Any]] | None = Field(None, description="Function tools (OpenAI's shape).")
    tool_choice: Text | dict[str, Any] | None = Field(
        None, description='"none", "auto" (the default with tools: only for chat templates that define tools; '
                          'calls parsed hermes-style), "required" or {"type": "function", "function": {"name": '
                          '...}} (forced through the structured-output grammar, any template).')


# -- responses -------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = Field(
        None, exclude_if=lambda value: value is None,
        description="Prefill calls (do_remote_decode) only: the lease on the prompt's KV blocks.")


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kv_transfer_params: dict[str, Any] | None = Field(
        None, exclude_if=lambda value: value is None,
        description="Prefill calls (do_remote_decode) only: the lease on the prompt's KV blocks.")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "iterserve"
    max_model_len: int | None = None
    root: str | None = Field(None, description="A LoRA adapter's directory (vLLM's field); the model's own id otherwise.")
    parent: str | None = Field(None, description="A LoRA adapter's base model; null for the base model.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


ERROR_RESPONSES = {status: {"model": ErrorResponse} for status in (400, 404, 413, 429, 500, 503)}  # in the OpenAPI


# -- admin -----------------------------------------------------------------------------------
class AdminConfigPatch(_Request):
    max_num_seqs: int = Field(ge=1, description="Cap on running sequences, applied at the next step.")


class AdminConfig(BaseModel):
    model: str
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    max_waiting_requests: int
    draining: bool


# A LoRA adapter's name (the characters vLLM accepts); the operator's spec.adapters checks the same.
LORA_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$"
LORA_NAME_MAX_LENGTH = 256


class LoadLoraAdapterRequest(_Request):
    """vLLM's POST /v1/load_lora_adapter body."""
    lora_name: Text = Field(min_length=1, max_length=LORA_NAME_MAX_LENGTH, pattern=LORA_NAME_PATTERN,
                            description="The name requests send as `model`.")
    lora_path: Text = Field(min_length=1, max_length=4096, description="The adapter's directory (PEFT format) on "
                            "this server's filesystem.")


class UnloadLoraAdapterRequest(_Request):
    """vLLM's POST /v1/unload_lora_adapter body."""
    lora_name: Text = Field(min_length=1, max_length=256)
    lora_int_id: int | None = Field(None, description="Accepted for vLLM compatibility; not used.")


class DrainStatus(BaseModel):
    draining: bool
    in_flight: int


# GET /admin/steps: the engine's newest step records (engine/step_log.py), for the operator's
# online step profile. Both bounds hold however many records the ring has.
MAX_STEP_RECORDS_PER_CALL = 1024
MAX_STEP_RECORDS_BYTES = 1024 * 1024  # of the records' JSON; a record is ~450 bytes, so rarely reached
MAX_STEP_SEQ = 2**63 - 1


class AdminStepsQuery(BaseModel):
    """GET /admin/steps's query parameters: page through the ring oldest first, `after` the last
    seq read (the answer's `next_after`)."""

    model_config = ConfigDict(extra="forbid")

    after: int = Field(0, ge=0, le=MAX_STEP_SEQ, description=(
        "Records with a larger seq than this (0: from the oldest the engine still holds)."))
    limit: int = Field(256, ge=1, le=MAX_STEP_RECORDS_PER_CALL, description=(
        f"At most this many records (fewer when their JSON passes {MAX_STEP_RECORDS_BYTES} bytes)."))


class StepRecord(BaseModel):
    """One engine step, as the step log (`--step-log`) writes it too: what it did and where its time went."""

    seq: int = Field(description="Consecutive from 1 over the engine's life: a gap means records fell out of the ring.")
    step: int = Field(description="The engine's step counter (idle steps are counted, not recorded).")
    time: float = Field(description="When the step ended, on the engine's monotonic clock (the answer's `now` is on it too).")
    duration_s: float = Field(description="The step's wall time.")
    cpu_s: float = Field(description="The engine thread's CPU time in the step: its wall time on a core of its own.")
    load_1m: float = Field(description="The node's one-minute load average (read at most once a second).")
    schedule_s: float = Field(description="Scheduling's share of duration_s.")
    model_s: float = Field(description="The model run's share of duration_s.")
    postprocess_s: float = Field(description="Sampling's and output making's share of duration_s.")
    prefill_tokens: int = Field(description="Prompt tokens computed.")
    decode_tokens: int = Field(description="Decode tokens computed (speculative ones included).")
    num_seqs: int = Field(description="Sequences scheduled.")
    context_tokens: int = Field(description="Tokens the scheduled chunks attend to, summed (each chunk's start plus itself).")
    max_context_tokens: int = Field(description="The largest of those.")
    prefill_attention_pairs: int = Field(description="Query-key pairs of the prompt chunks' attention.")
    running: int = Field(description="Sequences running after the step.")
    waiting: int = Field(description="Requests waiting after the step.")
    kv_blocks_used: int = Field(description="KV blocks sequences hold.")
    kv_blocks_cached: int = Field(description="Cached KV blocks no sequence holds.")
    preemptions: int = Field(description="Sequences preempted by the step.")


class StepRecordsPage(BaseModel):
    """GET /admin/steps's answer."""

    records: list[StepRecord] = Field(description="Oldest first, each seq larger than `after`.")
    next_after: int = Field(description="The `after` of the next call: the last record's seq (`after` when none).")
    first_seq: int = Field(description="The oldest seq the engine still holds (0: none yet).")
    last_seq: int = Field(description="The newest seq (smaller than `after`: the engine restarted; read from 0).")
    missed: int = Field(description="Records after `after` that left the ring before this call.")
    now: float = Field(description="The engine's monotonic clock now, to place each record's `time`.")
    capacity: int = Field(description="Records the engine keeps.")
