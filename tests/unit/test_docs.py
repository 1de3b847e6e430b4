"""The docs are checked like code: every relative link in README.md and docs/ resolves (file and
heading), every repository path named in inline code exists, every doc page is reachable from the
README, every `iterserve ...` command shown in a fenced code block parses with that subcommand's own argparse parser (built in-process, no servers),
and the CRD reference equals the text generated from operator/models.py."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from iterserve import cli
from iterserve.engine.server import api_docs
from iterserve.operator import crd_docs

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
SHELL_OPERATORS = {"|", "||", "&", "&&", ";", ">", ">>", "<", "2>", "2>&1"}


def rel(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def heading_anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation other than - and _ dropped, spaces to -."""
    text = FENCE.sub("", path.read_text())
    anchors = set()
    for line in text.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def broken_links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text())  # a link inside a code block is code, not a link
    bad = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{rel(path)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest):
            bad.append(f"{rel(path)}: {target} (no heading #{anchor} in {rel(dest)})")
    return bad


def test_every_relative_link_in_the_docs_resolves():
    bad = [line for path in DOCS for line in broken_links(path)]
    assert not bad, "broken links:\n" + "\n".join(bad)


INLINE_CODE = re.compile(r"`([^`\n]+)`")
REPO_DIRS = ("engine/", "operator/", "iterserve/", "bench/", "tests/", "docs/", "charts/", "crds/", "examples/",
             "e2e/", "image/")


def path_exists(text: str) -> bool:
    """A path, or the prefix of files a script writes (`--plot docs/perf/sim/policy` writes policy_*.png)."""
    path = REPO / text
    return path.exists() or (path.parent.is_dir() and any(p.name.startswith(path.name) for p in path.parent.iterdir()))


def missing_paths(path: Path) -> list[str]:
    """Repository paths named in inline code (`bench/peers/compare.py`, `tests/unit/x.py::test_y`)."""
    text = FENCE.sub("", path.read_text())
    bad = []
    for code in INLINE_CODE.findall(text):
        for word in code.split():
            target = word.split("::")[0].rstrip(".,:;)")
            if target.startswith(REPO_DIRS) and not re.search(r"[*<>{}$\[\]]", target) and not path_exists(target):
                bad.append(f"{rel(path)}: `{word}`")
    return bad


def test_a_renamed_script_named_in_the_docs_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Run `bench/peers/compare.py --quick` or `bench/no_such_bench.py --quick`; see `docs/perf/peers.json`.\n")
    assert [line.split(": ", 1)[1] for line in missing_paths(page)] == ["`bench/no_such_bench.py`"]


BENCH_MODULE = re.compile(r"-m (bench(?:\.[a-z0-9_]+)+)")  # lower case: not a placeholder


def missing_bench_modules(text: str) -> list[str]:
    """`python -m bench.GROUP.NAME` in prose, code blocks or recipes, whose module file is not there."""
    return [name for name in BENCH_MODULE.findall(text)
            if not (REPO / (name.replace(".", "/") + ".py")).is_file()]


def test_a_moved_benchmark_module_is_caught():
    text = "python -m bench.engine.throughput --quick\n`python -m bench.throughput --quick`"
    assert missing_bench_modules(text) == ["bench.throughput"]


def test_every_benchmark_module_the_docs_and_makefile_run_exists():
    sources = [*DOCS, REPO / "Makefile", *(REPO / "bench").rglob("*.py")]
    bad = [f"{rel(path)}: {name}" for path in sources for name in missing_bench_modules(path.read_text())]
    # The Makefile's bench loop names modules relative to bench/ in BENCHES.
    make = (REPO / "Makefile").read_text()
    benches = re.search(r"^BENCHES :=((?:.*\\\n)*.*)$", make, re.M).group(1).replace("\\\n", " ").split()
    bad += [f"Makefile BENCHES: {b}" for b in benches if not (REPO / "bench" / (b.replace(".", "/") + ".py")).is_file()]
    assert benches and not bad, "benchmark modules that do not exist:\n" + "\n".join(bad)


BENCH_PATH = re.compile(r"(?<![\w/.])bench/[a-z0-9_/]+\.py\b")


def test_every_benchmark_path_named_in_code_and_docs_exists():
    """Comments, docstrings, messages and docs that point at a benchmark by its path (recorded
    results under docs/perf/ keep what their run printed)."""
    from tests.unit.test_no_history import read_text, tracked_files

    bad = []
    for path in tracked_files():
        text = None if path.startswith("docs/perf/") or path == "tests/unit/test_docs.py" else read_text(path)
        for name in BENCH_PATH.findall(text or ""):
            if not (REPO / name).is_file():
                bad.append(f"{path}: {name}")
    assert not bad, "benchmark paths that do not exist (bench/ is grouped: docs/development.md#benchmarks):\n" + \
        "\n".join(bad)


def test_every_repository_path_the_docs_name_exists():
    bad = [line for path in DOCS for line in missing_paths(path)]
    assert not bad, "paths named in the docs that do not exist:\n" + "\n".join(bad)


def test_the_readme_reads_in_minutes_with_cluster_install_on_its_first_screen():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move detail into docs/ (at most ~200)"
    headings = [n for n, line in enumerate(lines) if line.startswith("## ")]
    install = [n for n in headings if "install on a cluster" in lines[n].lower()]
    assert install and install[0] < 40, "the README's first screen must hold '## Install on a cluster'"


def test_every_doc_page_is_linked_from_the_readme():
    linked = {(REPO / t.partition("#")[0]).resolve() for t in LINK.findall((REPO / "README.md").read_text())}
    missing = [rel(p) for p in (REPO / "docs").glob("*.md") if p.resolve() not in linked]
    assert not missing, f"doc pages the README does not link: {missing}"


def shown_commands(text: str) -> list[str]:
    """The `iterserve` command lines of a page's code blocks, continuations joined."""
    commands = []
    for block in FENCE.findall(text):
        joined = re.sub(r"\s*\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = re.sub(r"^\s*(\$ )?(\.venv/bin/)?", "", line)
            if line.startswith("iterserve "):
                commands.append(line)
    return commands


def command_argv(line: str) -> list[str]:
    """The words of one shell line up to its first operator (pipe, redirect, &&) or comment."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    argv = []
    for word in lexer:
        if word in SHELL_OPERATORS:
            break
        argv.append(word)
    return argv[1:]  # without "iterserve"


def exact_flags_only(parser: argparse.ArgumentParser) -> None:
    """argparse accepts a unique prefix of a flag (`--max-num-seq`); the docs must show whole flags,
    so a renamed flag whose old name is a prefix of the new one is still caught."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                exact_flags_only(sub)


def full_parser() -> argparse.ArgumentParser:
    """`iterserve`'s parser with every subcommand configured, as `cli.main` builds it per call."""
    parser, subparsers = cli.build_parser()
    for name, (module_name, help_text) in cli.SUBCOMMANDS.items():
        module = cli._load(module_name)
        assert module is not None, f"subcommand {name}: {module_name} does not import"
        module.configure(subparsers.add_parser(name, help=help_text, description=help_text))
    exact_flags_only(parser)
    return parser


def parse_error(parser: argparse.ArgumentParser, argv: list[str], capsys) -> str | None:
    try:
        parser.parse_args(argv)
    except SystemExit as exc:
        err = capsys.readouterr().err.strip().splitlines()
        return None if exc.code == 0 else (err[-1] if err else f"exit {exc.code}")
    return None


def test_command_lines_are_read_as_a_shell_reads_them():
    assert command_argv("iterserve serve --port 9000 > log.txt  # a comment") == ["serve", "--port", "9000"]
    assert command_argv("iterserve crd | kubectl apply -f -") == ["crd"]
    assert shown_commands("```\n$ .venv/bin/iterserve router \\\n   --port 8000\n```\n") == [
        "iterserve router --port 8000"]


def test_a_misspelt_flag_in_a_shown_command_is_caught(capsys):
    parser = full_parser()
    assert parse_error(parser, ["serve", "--max-num-seqs", "8"], capsys) is None
    assert parse_error(parser, ["serve", "--max-num-seq", "8"], capsys) is not None
    assert parse_error(parser, ["router", "--port", "8000", "--max-queues", "4"], capsys) is not None


def test_every_iterserve_command_in_the_docs_parses(capsys):
    parser = full_parser()
    bad = []
    for path in DOCS:
        for line in shown_commands(path.read_text()):
            error = parse_error(parser, command_argv(line), capsys)
            if error:
                bad.append(f"{rel(path)}: {line}\n    {error}")
    assert not bad, "commands in the docs that iterserve would refuse:\n" + "\n".join(bad)


@pytest.mark.parametrize("page, generator, source", [
    ("crd-reference.md", crd_docs, "operator/models.py"),
    ("api-reference.md", api_docs, "engine/server/protocol.py"),
])
def test_the_generated_references_equal_what_their_models_generate(page, generator, source):
    if (REPO / "docs" / page).read_text() != generator.reference_markdown():
        pytest.fail(f"docs/{page} differs from {source}: run `make docs` "
                    f"(python -m {generator.__name__} > docs/{page})")
