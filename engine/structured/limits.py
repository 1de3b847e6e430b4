"""Limits on a structured-output spec, checked before xgrammar compiles it.

In: a `StructuredOutput`. Out: nothing, or InvalidRequestError naming the request field, the place
in the spec and the limit. Compiling is CPU work a client chooses the size of, and some shapes cost
far more than their text: xgrammar (0.2.9) turns a JSON schema's `pattern` into grammar rules by
expanding its counted repetitions, so `x{1,1000}` compiles in 0.19 s but `x{1,10000}` in 36 s, and
a schema nested 500 levels deep takes 30 s. Counts that xgrammar handles lazily today (minItems,
maxLength, a regex's `{n,m}`, measured fast up to 10^8) are bounded as well, so that a different
xgrammar version cannot turn them into the same trap.
"""

from __future__ import annotations

import json
import re

from iterserve.engine.sampling_params import InvalidRequestError

MAX_REPEAT = 10_000  # any count: minItems, maxItems, minLength, maxLength, ..., and each {n,m}
MAX_ENUM = 1_000  # values of one enum, or guided_choice's choices (OpenAI allows 1,000 in all)
MAX_SCHEMA_DEPTH = 64  # nested JSON objects and lists in a schema (100 levels compile in 0.23 s)
MAX_PATTERN_EXPANSION = 2_000  # a schema pattern's size once its counted repetitions are expanded

_COUNT_KEYS = frozenset({"minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties",
                         "minContains", "maxContains"})
_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_MAX_DIGITS = 9  # a longer count is over every limit; never hand int() a 100,000-digit string


def check_limits(kind: str, spec: str, field: str) -> None:
    """Raise InvalidRequestError(param=field) if the spec is over a limit; say which and the limit."""
    if kind == "json_schema":
        _check_schema(spec, field)
    elif kind == "choice":
        choices = json.loads(spec)
        if len(choices) > MAX_ENUM:
            raise _refuse(field, f"{len(choices)} choices", f"at most {MAX_ENUM} choices")
    elif kind in ("regex", "grammar"):
        _check_counts(spec, field, "")


def _refuse(field: str, what: str, limit: str) -> InvalidRequestError:
    return InvalidRequestError(f"{field}: {what}; this server allows {limit} in a structured output (a limit "
                               "on the work of compiling it into a grammar): simplify the schema", field)


def _check_schema(spec: str, field: str) -> None:
    try:
        schema = json.loads(spec)
    except RecursionError:
        raise _refuse(field, "the schema is nested too deeply", f"{MAX_SCHEMA_DEPTH} levels") from None
    except ValueError:
        return  # not JSON: xgrammar's own error names the problem
    # Iterative, so a deep schema costs no Python stack; each entry is (value, path, depth).
    todo: list[tuple[object, str, int]] = [(schema, "", 1)]
    while todo:
        value, path, depth = todo.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise _refuse(field, f"the schema is nested deeper than {MAX_SCHEMA_DEPTH} levels (at {path})",
                          f"{MAX_SCHEMA_DEPTH} levels")
        if isinstance(value, list):
            todo.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))
            continue
        if not isinstance(value, dict):
            continue
        for key, item in value.items():
            where = f"{path}.{key}" if path else key
            _check_keyword(key, item, where, field)
            if isinstance(item, (dict, list)):
                todo.append((item, where, depth + 1))


def _check_keyword(key: str, value: object, where: str, field: str) -> None:
    # Only a keyword's own value type counts: a property *named* "maxLength" maps to a schema object.
    if key in _COUNT_KEYS and isinstance(value, int) and not isinstance(value, bool) and value > MAX_REPEAT:
        raise _refuse(field, f"{where} is {value}", f"counts up to {MAX_REPEAT}")
    elif key == "enum" and isinstance(value, list) and len(value) > MAX_ENUM:
        raise _refuse(field, f"{where} has {len(value)} values", f"at most {MAX_ENUM} enum values")
    elif key == "pattern" and isinstance(value, str):
        _check_counts(value, field, where)
        size = pattern_expansion(value)
        if size > MAX_PATTERN_EXPANSION:
            raise _refuse(field, f"{where} expands to about {size} repeated characters",
                          f"patterns that expand to at most {MAX_PATTERN_EXPANSION} (nested counts multiply)")


def _check_counts(text: str, field: str, where: str) -> None:
    """Every {n}, {n,} and {n,m} in a regex or grammar at most MAX_REPEAT."""
    for match in _COUNT.finditer(text):
        for digits in match.groups():
            if digits and (len(digits) > _MAX_DIGITS or int(digits) > MAX_REPEAT):
                place = f"{where}: " if where else ""
                raise _refuse(field, f"{place}the repetition {match.group(0)[:40]} counts past {MAX_REPEAT}",
                              f"counts up to {MAX_REPEAT}")


def pattern_expansion(pattern: str) -> int:
    """The pattern's size with every counted repetition written out: an atom (a character, an escape,
    a class) is 1, a group the sum of its parts, X{n,m} is X's size times max(n, m). One pass, linear
    in the pattern; alternatives are summed (an upper bound)."""
    frames = [[0, 0]]  # per open group: [size of finished parts, size of the last part]
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        frame = frames[-1]
        if c == "(":
            frames.append([0, 0])
            i += 1
            continue
        if c == ")" and len(frames) > 1:
            frames.pop()
            frames[-1][0] += frames[-1][1]
            frames[-1][1] = max(1, frame[0] + frame[1])
            i += 1
            continue
        if c == "{":
            match = _COUNT.match(pattern, i)
            if match is not None:
                counts = [d for d in match.groups() if d]
                bound = max(int(d) if len(d) <= _MAX_DIGITS else 10**_MAX_DIGITS for d in counts)
                frame[1] = max(1, frame[1]) * bound
                i = match.end()
                continue
        frame[0] += frame[1]
        frame[1] = 1
        i = _atom_end(pattern, i)
    while len(frames) > 1:  # unbalanced: xgrammar refuses it; count what was seen
        last = frames.pop()
        frames[-1][1] += last[0] + last[1]
    return frames[0][0] + frames[0][1]


def _atom_end(pattern: str, i: int) -> int:
    """Index after the atom at i: an escape, a character class, or one character."""
    if pattern[i] == "\\":
        return i + 2
    if pattern[i] != "[":
        return i + 1
    j = i + 1
    if j < len(pattern) and pattern[j] == "^":
        j += 1
    if j < len(pattern) and pattern[j] == "]":  # a leading ] is a literal
        j += 1
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1
