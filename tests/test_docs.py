"""README.md and every doc under docs/ stand alone and name only what exists.

What must hold, for each document: no reference to anything outside the repository (a `../shared`
path, an absolute path of the machine it was written on, a link that leaves the checkout); every
relative link resolves to a file in the repository; every repository path it names exists (a glob
names at least one file); every `controllerctl` command and every flag it shows exists in the CLI's
own parser, and every flag it shows a `benchmarks/*.py` script with is in that script's `--help`. docs/production.md has further checks of its own (tests/deploy/test_production_doc.py).
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: Top-level folders of this repository a document may name a path under.
TOP = ("controller", "policies", "sim", "proto", "deploy", "docs", "tests", "benchmarks", "scripts")


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def code_spans(text: str) -> list[str]:
    """Inline code (may wrap a line) and the lines of fenced blocks, continuation lines joined."""
    fenced = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    rest = re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S)
    spans = [s.replace("\n", " ") for s in re.findall(r"`([^`]+)`", rest)]
    for block in fenced:
        spans += block.replace("\\\n", " ").splitlines()
    return spans


def controllerctl_commands(text: str) -> list[list[str]]:
    """The words after `controllerctl` of every command the text shows (comments and `&&` tails cut)."""
    out = []
    for span in code_spans(text):
        if "controllerctl " not in span:
            continue
        out.append(shlex.split(span.split("controllerctl ", 1)[1].split("#")[0].split("&&")[0]))
    return out


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def _flags(p: argparse.ArgumentParser) -> set[str]:
    return {o for a in p._actions for o in a.option_strings}


def check_controllerctl_command(words: list[str]) -> None:
    """Fails naming the command or option of ``words`` that `controllerctl` does not have."""
    from controller.cli import build_parser

    parser = build_parser()
    top = _flags(parser)
    i = 0
    while i < len(words) and words[i].startswith("-"):  # global options before the command
        assert words[i] in top, f"controllerctl {words[i]}: no such global option"
        i += 2
    p, path = parser, []
    while i < len(words) and words[i] in _subparsers(p):
        p = _subparsers(p)[words[i]]
        path.append(words[i])
        i += 1
    assert path or i >= len(words), f"controllerctl {' '.join(words)}: no such command"  # or options alone
    for w in words[i:]:
        if w.startswith("--"):
            assert w.split("=")[0] in _flags(p), f"controllerctl {' '.join(path)}: no option {w}"


def repository_paths(text: str) -> set[str]:
    """Every `top/...` path the text names: a file (with an extension), a glob or a folder (with a slash).
    Words like `sim/engine` in a ratio are neither."""
    top = "|".join(TOP)
    found = re.findall(rf"(?<![\w./-])((?:{top})/[\w./*-]*[\w*]/?)", text)
    return {p.rstrip("/") for p in found if p.endswith("/") or re.search(r"[.*][^/]*$", p.split("/")[-1])}


def _commands() -> list[tuple[str, list[str]]]:
    return [(_id(d), w) for d in DOCS for w in controllerctl_commands(d.read_text(encoding="utf-8"))]


@pytest.mark.parametrize("doc", DOCS, ids=_id)
def test_nothing_outside_the_repository_is_referenced(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    for n, line in enumerate(text.splitlines(), 1):
        assert "../shared" not in line and "/work/" not in line, f"{_id(doc)}:{n}: {line.strip()}"
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same document
        resolved = (doc.parent / target.split("#")[0]).resolve()
        assert resolved.is_relative_to(ROOT), f"{_id(doc)}: link {target} leaves the repository"
        assert resolved.exists(), f"{_id(doc)}: link {target} names nothing"


@pytest.mark.parametrize("doc", DOCS, ids=_id)
def test_every_repository_path_a_doc_names_exists(doc: Path) -> None:
    for rel in sorted(repository_paths(doc.read_text(encoding="utf-8"))):
        assert any(ROOT.glob(rel)) or (ROOT / rel).exists(), f"{_id(doc)} names {rel}, which does not exist"


@pytest.mark.parametrize(
    ("doc", "words"), _commands(), ids=lambda v: v if isinstance(v, str) else " ".join(v)
)
def test_every_controllerctl_command_and_flag_a_doc_shows_exists(doc: str, words: list[str]) -> None:
    check_controllerctl_command(words)


def benchmark_flags(text: str) -> list[tuple[str, str]]:
    """(script, --flag) for every flag a code span passes to a `benchmarks/*.py` script."""
    out = []
    for span in code_spans(text):
        for script, rest in re.findall(r"(benchmarks/\w+\.py)((?:\s+[^|;&]*)?)", span):
            out += [(script, f) for f in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest)]
    return out


@functools.cache
def _help(script: str) -> str:
    r = subprocess.run(
        [sys.executable, script, "--help"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, f"{script} --help exited {r.returncode}: {r.stderr[-300:]}"
    return r.stdout


def _benchmark_flags() -> list[tuple[str, str, str]]:
    found = {(_id(d), s, f) for d in DOCS for s, f in benchmark_flags(d.read_text(encoding="utf-8"))}
    return sorted(found)


@pytest.mark.parametrize(("doc", "script", "flag"), _benchmark_flags(), ids=lambda v: v)
def test_every_benchmark_flag_a_doc_shows_exists(doc: str, script: str, flag: str) -> None:
    assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", _help(script)), (
        f"{doc}: {script} has no {flag}"
    )


def test_the_checks_find_what_they_look_for() -> None:
    text = "run `controllerctl sim compare --scenario drift`\n```\ncontrollerctl policy set x \\\n  --engine e\n```\n"
    assert controllerctl_commands(text) == [
        ["sim", "compare", "--scenario", "drift"],
        ["policy", "set", "x", "--engine", "e"],
    ]
    with pytest.raises(AssertionError, match="no option --nope"):
        check_controllerctl_command(["sim", "compare", "--nope"])
    with pytest.raises(AssertionError, match="no such command"):
        check_controllerctl_command(["frobnicate"])
    assert repository_paths(
        "docs/results/*.json, sim/kernel.py:12, controller/vllm/ (not v1/core.py, sim/engine)"
    ) == {
        "docs/results/*.json",
        "sim/kernel.py",
        "controller/vllm",
    }
    assert len(_commands()) > 30
    assert benchmark_flags(
        "`python benchmarks/sim_speed.py --json F` then `benchmarks/x.py [--a 1] | --b`"
    ) == [
        ("benchmarks/sim_speed.py", "--json"),
        ("benchmarks/x.py", "--a"),
    ]
    assert len(_benchmark_flags()) > 20


def _policy_blocks() -> list[tuple[str, str]]:
    """Every fenced YAML block of the docs that is a whole policy document (``kind: Policy``)."""
    out = []
    for d in DOCS:
        for block in re.findall(r"```yaml\n(.*?)```", d.read_text(encoding="utf-8"), re.S):
            if re.search(r"^kind: Policy\s*$", block, re.M):
                out.append((_id(d), block))
    return out


@pytest.mark.parametrize(("doc", "block"), _policy_blocks(), ids=lambda v: v if v.endswith(".md") else "")
def test_every_policy_a_doc_shows_validates(doc: str, block: str) -> None:
    # docs/policies.md's own example gave `params: {discount: 0.9}` to goodput_model, which has none.
    from controller.validation import parse_policy_checked

    parse_policy_checked(block, source=doc)


def test_every_algorithm_parameter_is_in_the_policies_table() -> None:
    from policies.algorithms import REGISTRY

    text = (ROOT / "docs" / "policies.md").read_text(encoding="utf-8")
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \(.*$", text, re.M)}
    assert _policy_blocks(), "no policy example found"
    for name, learner in REGISTRY.items():
        assert name in rows, f"docs/policies.md: no row for algorithm {name}"
        for param in getattr(learner, "PARAMS", {}):
            assert f"`{param}`" in rows[name], f"docs/policies.md: {name}'s row lacks `{param}`"


#: A pointer to notes that live beside the repository, not in it (their paths and file names).
_OUTSIDE = re.compile(r"\.\./shared|/work/|shared/research|research/[\w.-]+\.md|anchors(\.md| §)")


def test_no_tracked_file_points_outside_the_repository() -> None:
    # Profiles, code comments and test comments too, not only the docs: a profile's `sources:` once
    # cited "anchors.md §6a", a file no clone has.
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    found = []
    for name in listed.decode().split("\0"):
        path = ROOT / name
        if not name or name == "tests/test_docs.py" or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # images and other binary files
            continue
        found += [
            f"{name}:{n}: {line.strip()}"
            for n, line in enumerate(text.splitlines(), 1)
            if _OUTSIDE.search(line)
        ]
    assert found == []
