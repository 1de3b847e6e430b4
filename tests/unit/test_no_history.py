"""The project speaks of itself as it is: no tracked file (outside CHANGELOG.md) numbers development
rounds ("session", "issue" or "wave" and a number), names a result file by the run that made it
(`peers_session8_rerun.json`), dates a run in prose, or cites a path on one developer's machine.
Git keeps the story; a reader of the code or docs needs what is true now.

The patterns are narrow on purpose: "session" is a legitimate word (aiohttp's ClientSession, an HTTP
session, pytest's session scope, start_new_session), so only a number after it, or the phrases that
speak of other developers' rounds, count.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Files that may speak of history: the changelog (releases), and this test (it names the patterns).
EXEMPT = {"CHANGELOG.md", "tests/unit/test_no_history.py"}

CONTENT_PATTERNS = [
    # a number after session/issue/wave, with a space, '#', '_' or '-' or nothing between
    r"(?<![a-z])sessions?[ _-]?[0-9]",
    r"(?<![a-z])issues?[ _-]?#?[0-9]",
    r"(?<![a-z])waves?[ _-]?[0-9]",
    # development rounds spoken of without a number
    r"\b(other|this|previous|last|next|earlier|later|each|every|parallel) (engineers?'? )?sessions?\b(?! scope)"
    r"(?!'s control plane)",
    # paths of the machine the project was developed on
    r"/work/(main|coord|shared)\b",
    r"/tmp/prompts",
]
# Dates of runs in prose: only in prose files; a result's JSON may record when it was made.
PROSE_PATTERNS = [r"\b20[0-9]{2}-[01][0-9]-[0-3][0-9]\b"]
PROSE_SUFFIXES = (".md", ".txt", ".rst")
# Result files named by run, not by what they measure.
NAME_PATTERN = re.compile(r"session|rerun|midway|(?<![a-z])s[0-9]+_|_s[0-9]+(?![0-9a-z])", re.I)

# Lines a pytest fixture or process API legitimately uses; the narrow patterns above already skip them,
# and this list keeps the test honest about which ones were seen.
ALLOWED_LINE = re.compile(r"scope=\"session\"|start_new_session|ClientSession", re.I)


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p and p not in EXEMPT]


def history_hits(path: str, text: str) -> list[str]:
    patterns = CONTENT_PATTERNS + (PROSE_PATTERNS if path.endswith(PROSE_SUFFIXES) else [])
    combined = re.compile("|".join(f"(?:{p})" for p in patterns), re.I)
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        if combined.search(line) and not ALLOWED_LINE.search(line):
            hits.append(f"{path}:{n}: {line.strip()[:160]}")
    return hits


def read_text(path: str) -> str | None:
    try:
        data = (REPO / path).read_bytes()
    except (FileNotFoundError, IsADirectoryError):  # deleted in the work tree, or a submodule
        return None
    if b"\0" in data[:8192]:  # binary (PNG, wheels): no prose to check
        return None
    return data.decode("utf-8", errors="replace")


def test_the_patterns_catch_history_and_spare_ordinary_uses_of_the_words():
    # Built from pieces, so that this file itself passes the plain `git grep` of the same words.
    n = " 8"
    caught = [f"# issue{n}: the P/D path", f"measured in session{n}", f"see wave{n}", "(issue #14)",
              "other sessions' work on the same cores", "peers_session8 figures",
              "/work/coord/briefs/contract17.txt"]
    spared = ["async with aiohttp.ClientSession() as http:", "@pytest.fixture(scope=\"session\")",
              "start_new_session=True", "an HTTP session cookie", f"tissue{n} samples",
              "one control plane for the whole test session"]
    for line in caught:
        assert history_hits("x.py", line), line
    for line in spared:
        assert not history_hits("x.py", line), line
    assert history_hits("x.md", "measured on 2026-12-01 before the others started")
    assert not history_hits("x.json", '"date": "2026-12-01"')
    for name in ["docs/perf/peers_session8.json", "docs/perf/peers_rerun.png",
                 "docs/perf/step_profile_s7_after_t1.json", "docs/perf/peers_session7_midway.json"]:
        assert NAME_PATTERN.search(name), name
    for name in ["docs/perf/peers.json", "bench/simulator/speed.py", "docs/perf/sim/fit_s.json"]:
        assert not NAME_PATTERN.search(Path(name).name), name


def test_no_tracked_file_narrates_development_history():
    hits = []
    for path in tracked_files():
        text = read_text(path)
        if text is not None:
            hits += history_hits(path, text)
    if hits:
        pytest.fail("history inside the project (say what is, not how it came to be; git keeps the "
                    f"story). {len(hits)} lines:\n" + "\n".join(hits[:200]))


def test_no_tracked_file_is_named_by_the_run_that_made_it():
    bad = [p for p in tracked_files() if NAME_PATTERN.search(Path(p).name)]
    assert not bad, ("files named by a run, not by what they hold (keep one current result per "
                     "benchmark, named by what it measures):\n" + "\n".join(bad))
