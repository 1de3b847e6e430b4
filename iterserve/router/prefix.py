"""Prefix affinity: which replica recently served a prompt's prefix, by block-aligned hashes.

A prompt's first N tokens are cut into blocks of the engines' block size and named by the
engine's own chained block hashes (engine/prefix_cache.py: block i's name covers blocks 0..i),
so a key names a whole prefix. The router records every full block's key against the replica it
sent the request to and, for the next request, looks up its longest recorded prefix.

The router has no tokenizer: a prompt given as token ids is blocked on the ids (the same names
the replica's prefix cache uses); text (a string prompt, or chat messages) on its UTF-8 bytes,
CHARS_PER_TOKEN bytes to a token, which lines up with the engine's blocks only approximately but
keeps the same prefix on the same replica. A request's cache_salt enters the first block.
"""

from __future__ import annotations

import json
from collections import OrderedDict

from iterserve.engine.prefix_cache import prefix_block_hashes

CHARS_PER_TOKEN = 4


def block_hashes(tokens: list[int] | bytes, block_size: int, max_tokens: int, extra: tuple = ()) -> list[int]:
    """The chained keys of the full blocks among the first max_tokens tokens (or bytes)."""
    return prefix_block_hashes(tokens[:max_tokens], block_size, extra)


def prompt_keys(body: bytes, block_size: int, max_tokens: int) -> list[int]:
    """The prefix keys of an OpenAI completions or chat request body ([] if it has no prompt)."""
    try:
        request = json.loads(body)
    except ValueError:
        return []
    if not isinstance(request, dict):
        return []
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    salt = request.get("cache_salt")
    extra = (salt,) if isinstance(salt, str) and salt else ()
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return block_hashes(prompt, block_size, max_tokens, extra)
    if isinstance(prompt, str):
        text = prompt.encode()
    elif isinstance(request.get("messages"), list):
        text = json.dumps(request["messages"], separators=(",", ":"), sort_keys=True).encode()
    else:
        return []
    return block_hashes(text, block_size * CHARS_PER_TOKEN, max_tokens * CHARS_PER_TOKEN, extra)


class PrefixTable:
    """Prefix key -> the replica that last served it; least recently used keys go first."""

    def __init__(self, capacity: int = 100_000):
        self.capacity = capacity
        self._owner: OrderedDict[int, str] = OrderedDict()

    def lookup(self, keys: list[int]) -> str | None:
        for key in reversed(keys):
            url = self._owner.get(key)
            if url is not None:
                return url
        return None

    def longest(self, keys: list[int]) -> tuple[str | None, int]:
        """(the replica that served the longest recorded prefix of keys, how many blocks long)."""
        for depth in range(len(keys), 0, -1):
            url = self._owner.get(keys[depth - 1])
            if url is not None:
                return url, depth
        return None, 0

    def record(self, keys: list[int], url: str) -> None:
        for key in keys:
            self._owner[key] = url
            self._owner.move_to_end(key)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget(self, url: str) -> None:
        for key in [k for k, v in self._owner.items() if v == url]:
            del self._owner[key]
