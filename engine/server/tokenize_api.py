"""POST /tokenize and POST /detokenize, shaped as vLLM serves them.

/tokenize takes a `prompt` (encoded with special tokens by default, as a completion prompt is) or
chat `messages` (rendered with the model's chat template, as /v1/chat/completions renders them) and
answers `{count, max_model_len, tokens, token_strs}`; /detokenize takes `tokens` and answers
`{prompt}`. Both run the tokenizer in a worker thread; a text that cannot fit in max_model_len
tokens (prompt_length.py) is refused before it is tokenized.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, model_validator

from iterserve.engine.server.errors import invalid
from iterserve.engine.server.prompt_length import check_prompt_chars
from iterserve.engine.server.protocol import (
    MAX_MESSAGES,
    ChatMessage,
    ErrorResponse,
    Text,
    TokenId,
    _Request,
)
from iterserve.engine.server.state import ServerState

router = APIRouter()
_ERRORS = {status: {"model": ErrorResponse} for status in (400, 503)}


class TokenizeRequest(_Request):
    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool | None = Field(
        None, description="Default: true for a prompt, false for messages (the template adds them).")
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: Text | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


@router.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    state: ServerState = request.app.state.server
    engine = state.engine_for(body.model)
    tokenizer = engine.engine.tokenizer
    max_model_len = engine.engine.config.max_model_len
    chars = len(body.prompt) if body.prompt is not None else sum(len(m.text() or "") for m in body.messages)
    check_prompt_chars(chars, tokenizer, max_model_len, "prompt" if body.prompt is not None else "messages")

    def run() -> list[int]:
        if body.prompt is not None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            return tokenizer.encode(body.prompt, add_special_tokens=special)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
        except Exception as error:  # noqa: BLE001 - a template that rejects the conversation
            raise invalid(f"messages: the model's chat template rejected them: {error}", "messages") from None
        check_prompt_chars(len(text), tokenizer, max_model_len, "messages")  # with the template's own text
        return tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))

    tokens = await asyncio.to_thread(run)
    token_strs = [tokenizer.token(t) or "" for t in tokens] if body.return_token_strs and hasattr(
        tokenizer, "token") else None
    return TokenizeResponse(count=len(tokens), max_model_len=engine.engine.config.max_model_len, tokens=tokens,
                            token_strs=token_strs)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    state: ServerState = request.app.state.server
    engine = state.engine_for(body.model)
    tokenizer = engine.engine.tokenizer
    vocab = getattr(tokenizer, "vocab_size", None)
    if vocab is not None and any(t >= vocab for t in body.tokens):
        raise invalid(f"tokens: token ids must be in [0, {vocab})", "tokens")
    text = await asyncio.to_thread(tokenizer.decode, body.tokens)
    return DetokenizeResponse(prompt=text)
