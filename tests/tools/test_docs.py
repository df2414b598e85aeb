"""The docs name only what exists (issue 19): every repository path, every option
of our command-line tools and every RECCL_* setting that README.md, docs/*.md or
examples/**/README.md mention. Each check reports every offender as file:line.

- Paths: a word that starts with a top-level entry of the repository (`csrc/`,
  `bench/`, `tests/`, ...) or with a folder of csrc/ or torch_reccl/ (`engine/`,
  `fabric/`, ...), e.g. `csrc/core/config.cc`, `engine/layout.*`, `pg/fault_board`
  (a module: any extension), `tests/test_x.py::test_name` (the test must exist too).
- Options: in code blocks and `inline code`, the flags after `reccl ...`,
  `python -m torch_reccl[.module] ...` and `python|torchrun ... <repo script>.py`
  must be options of that tool's argparse parser (of the subcommand named), and
  the flags in the first column of a doc's option table must be options of the
  tool that doc documents (OPTION_TABLES).
- Settings: every `RECCL_NAME` must be in the settings table (csrc/core/config.cc);
  `RECCL_X*` must be the prefix of one.
- Outside paths: no `../` that leaves the repository (or names nothing in it), no
  absolute path into a workplace or home directory (`/work/...`, `/home/...`,
  `/tmp/...`), and no `DESIGN.md` (the design is docs/design.md).
- History: the docs describe the product as it is; no "session N", "sessions", and
  no helper's build or branch (the history of a number lives in commit messages).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import runpy
import shlex
import sys
import warnings
from typing import Dict, Iterator, List, Optional, Tuple
from unittest import mock

import pytest

from torch_reccl.settings import settings

from conftest import REPO

pytestmark = pytest.mark.timeout(120)



def doc_files() -> List[str]:
    names = ["README.md"] + sorted(glob.glob("docs/*.md", root_dir=REPO))
    names += sorted(glob.glob("examples/**/README.md", root_dir=REPO, recursive=True))
    return names


# Docs whose option tables (rows starting `| `--flag` |`) document one tool.
OPTION_TABLES = {
    "docs/drill.md": "reccl drill",
    "docs/first_cluster.md": "reccl qualify",
    "docs/scale.md": "python bench/scale.py",
    "docs/simulation.md": "reccl sim",
}

# --------------------------------------------------------------------------- reading docs


def read(name: str) -> str:
    with open(os.path.join(REPO, name)) as f:
        return f.read()


def lines_of(text: str) -> List[str]:
    return text.split("\n")


def code_segments(text: str) -> Iterator[Tuple[int, str]]:
    """(line number, text) of every place a command may be written: each line of a
    fenced or indented code block (lines ending in a backslash joined to the next),
    and each `inline code` span (which may wrap onto the next line)."""
    lines = lines_of(text)
    fenced = False
    prose: List[Tuple[int, str]] = []
    pending: Optional[Tuple[int, str]] = None
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        # A continued command's next line is code even where it starts with an option.
        indented = line.startswith("    ") and (pending is not None or not line.lstrip().startswith(("-", "*", "|")))
        if fenced or indented:
            if pending is not None:
                number, line = pending[0], pending[1] + " " + line.strip()
                pending = None
            if line.rstrip().endswith("\\"):
                pending = (number, line.rstrip()[:-1])
                continue
            yield number, line
        else:
            prose.append((number, line))
    # Inline spans, across line breaks: one text with a line number per character.
    joined, numbers = "", []
    for number, line in prose:
        joined += line + "\n"
        numbers += [number] * (len(line) + 1)
    for match in re.finditer(r"`([^`]+)`", joined):
        yield numbers[match.start()], match.group(1).replace("\n", " ")


# --------------------------------------------------------------------------- paths


def path_roots() -> Dict[str, List[str]]:
    """First path component -> the folders (relative to REPO) it may live in."""
    roots: Dict[str, List[str]] = {}
    for name in os.listdir(REPO):
        if not name.startswith(".") or name == ".ci":
            if name not in ("build",) and not name.endswith(".egg-info"):
                roots.setdefault(name, []).append("")
    for base in ("csrc", "torch_reccl"):
        for name in os.listdir(os.path.join(REPO, base)):
            if os.path.isdir(os.path.join(REPO, base, name)) and not name.startswith("__"):
                roots.setdefault(name, []).append(base)
    return roots


def path_exists(path: str, bases: List[str]) -> bool:
    for base in bases:
        full = os.path.join(REPO, base, path)
        if glob.glob(full) or glob.glob(full + ".*"):
            return True
    return False


def has_test(path: str, name: str) -> bool:
    with open(os.path.join(REPO, path)) as f:
        return re.search(rf"^\s*def {re.escape(name)}\(", f.read(), re.M) is not None


def path_offenders(doc: str, text: str) -> List[str]:
    roots = path_roots()
    first = "|".join(re.escape(name) for name in sorted(roots, key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w./\-~$<])((?:{first})/[\w.*/\-]*)(::[\w\[\]\-]+)?")
    out = []
    for number, line in enumerate(lines_of(text), 1):
        for match in pattern.finditer(line):
            path = match.group(1).rstrip(".,:;")
            bases = roots[path.split("/")[0]]
            if not path_exists(path, bases):
                out.append(f"{doc}:{number}: {path} does not exist (looked under "
                           f"{', '.join(b or '.' for b in bases)})")
            elif match.group(2) and os.path.isfile(os.path.join(REPO, path)):
                name = match.group(2)[2:].split("[")[0]
                if not has_test(path, name):
                    out.append(f"{doc}:{number}: {path} has no {name}")
    return out


# --------------------------------------------------------------------------- tools


class _Parsed(Exception):
    def __init__(self, parser):
        super().__init__()
        self.parser = parser


_PARSERS: Dict[str, Optional[argparse.ArgumentParser]] = {}
# A script whose command line is a package module's main (bench/advisor_drill.py).
ENTRY_POINT = re.compile(r"^from (torch_reccl(?:\.\w+)+) import main\b", re.MULTILINE)


def uses_argparse(script: str) -> bool:
    text = read(script)
    entry = ENTRY_POINT.search(text)
    return "ArgumentParser" in text or (
        entry is not None and "ArgumentParser" in read(entry.group(1).replace(".", "/") + ".py"))


def parser_of(tool: str) -> Optional[argparse.ArgumentParser]:
    """The argparse parser a tool builds ("module:torch_reccl", "script:bench/x.py"):
    the tool runs as __main__ until it parses its arguments, which is stopped
    there. None for a script that does not use argparse, itself or through the
    package module whose main it runs (it is not run)."""
    if tool in _PARSERS:
        return _PARSERS[tool]

    def stop(self, *args, **kwargs):
        raise _Parsed(self)

    kind, name = tool.split(":", 1)
    path = os.path.join(REPO, name) if kind == "script" else None
    parser = None
    if path is None or uses_argparse(name):
        with mock.patch.object(argparse.ArgumentParser, "parse_args", stop), \
                mock.patch.object(argparse.ArgumentParser, "parse_known_args", stop), \
                mock.patch.object(sys, "argv", [path or name]), \
                mock.patch.object(sys, "path", [os.path.dirname(path or REPO), REPO] + sys.path), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: module already imported
            try:
                if path:
                    runpy.run_path(path, run_name="__main__")
                else:
                    runpy.run_module(name, run_name="__main__", alter_sys=False)
            except _Parsed as parsed:
                parser = parsed.parser
    _PARSERS[tool] = parser
    return parser


def subparsers_of(parser: argparse.ArgumentParser) -> Dict[str, argparse.ArgumentParser]:
    out: Dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            out.update(action.choices)
    return out


def all_options(parser: argparse.ArgumentParser) -> set:
    """Options of a parser and of all its subcommands (for option tables)."""
    options = set(parser._option_string_actions)
    for sub in subparsers_of(parser).values():
        options |= all_options(sub)
    return options


TERMINATORS = {"|", "||", "&&", ";", ")", "#", ">", ">>", "2>&1", "--"}


def tokens_of(segment: str) -> List[str]:
    segment = segment.replace("$(", " ( ").replace(")", " ) ").replace("`", " ")
    try:
        return shlex.split(segment, comments=False)
    except ValueError:  # an unbalanced quote in prose: plain words will do
        return segment.split()


def tool_at(tokens: List[str], i: int) -> Optional[Tuple[str, int]]:
    """(tool, index of its first argument) if a command of ours starts at tokens[i]:
    `reccl`, `python -m torch_reccl[.module]`, or python/torchrun running a script of
    bench/, examples/, scripts/ or tests/ (setup.py is setuptools' command line)."""
    word = tokens[i]
    if word == "reccl" and (i == 0 or tokens[i - 1] in TERMINATORS | {"("}
                            or re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", tokens[i - 1])):
        return "module:torch_reccl", i + 1
    if word in ("python", "python3") and tokens[i + 1:i + 2] == ["-m"]:
        if i + 2 < len(tokens) and re.fullmatch(r"torch_reccl(\.\w+)*", tokens[i + 2]):
            return f"module:{tokens[i + 2]}", i + 3
        return None
    if word in ("python", "python3", "torchrun"):
        for j in range(i + 1, len(tokens)):
            if tokens[j] in TERMINATORS:
                return None
            if (re.match(r"(bench|examples|scripts|tests)/.*\.py$", tokens[j])
                    and os.path.isfile(os.path.join(REPO, tokens[j]))):
                return f"script:{tokens[j]}", j + 1
    return None


def command_offenders(tool: str, arguments: List[str]) -> List[str]:
    """What is wrong with one command line of ours (its arguments up to a terminator)."""
    parser: Optional[argparse.ArgumentParser] = None
    command = [tool.split(":", 1)[1]]
    out = []
    for token in arguments:
        if token in TERMINATORS:
            break
        word = token.strip("[]{}(),")
        if word in ("...", "\u2026"):
            continue
        is_flag = re.match(r"-{1,2}[A-Za-z]", word) is not None
        if parser is None:
            if not is_flag and not command[1:] and word.endswith(":"):
                return []  # "reccl drill: error: ...": the tool's output, no command
            parser = parser_of(tool)
            if parser is None:
                return [f"{command[0]} takes no options, but is given {word}"] if is_flag else []
        if is_flag:
            flag = word.split("=", 1)[0]
            if flag not in parser._option_string_actions:
                out.append(f"{' '.join(command)} has no option {flag}")
            continue
        subcommands = subparsers_of(parser)
        if subcommands:
            if word.endswith(":"):
                return out  # output, e.g. "reccl fabric: error: ..."
            if word not in subcommands:
                return out  # not a command line after all (e.g. `reccl gloo`, a list of backends)
            parser, command = subcommands[word], command + [word]
    return out


def option_offenders(doc: str, text: str) -> List[str]:
    out = []
    for number, segment in code_segments(text):
        tokens = tokens_of(segment)
        for i in range(len(tokens)):
            found = tool_at(tokens, i)
            if found is not None:
                tool, j = found
                out += [f"{doc}:{number}: {line}" for line in command_offenders(tool, tokens[j:])]
    return out


def option_table_offenders(doc: str, text: str) -> List[str]:
    rows = [(n, line) for n, line in enumerate(lines_of(text), 1) if re.match(r"\|\s*`-", line)]
    if not rows:
        return []
    if doc not in OPTION_TABLES:
        return [f"{doc}:{rows[0][0]}: an option table, but OPTION_TABLES in tests/tools/test_docs.py "
                f"does not say which tool this doc documents"]
    tokens = tokens_of(OPTION_TABLES[doc])
    tool, j = tool_at(tokens, 0)
    parser = parser_of(tool)
    for word in tokens[j:]:
        parser = subparsers_of(parser)[word]
    options = all_options(parser)
    out = []
    for number, line in rows:
        first_cell = line.split("|")[1]
        for flag in re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", first_cell):
            if flag not in options:
                out.append(f"{doc}:{number}: {OPTION_TABLES[doc]} has no option {flag}")
    return out


# --------------------------------------------------------------------------- settings


def setting_offenders(doc: str, text: str) -> List[str]:
    names = [s["name"] for s in settings()]
    out = []
    for number, line in enumerate(lines_of(text), 1):
        for match in re.finditer(r"\bRECCL_[A-Z0-9_]*(\*)?", line):
            name = match.group(0).rstrip("*")
            if line[:match.start()].endswith("unknown setting "):
                continue  # quoting the error an unknown name gets
            if match.group(1):
                if not any(n.startswith(name) for n in names):
                    out.append(f"{doc}:{number}: no setting starts with {name}")
            elif name not in names:
                out.append(f"{doc}:{number}: {name} is not a setting (python -m torch_reccl.settings)")
    return out


# --------------------------------------------------------------------------- outside paths

RELATIVE_UP = re.compile(r"(?<![\w.])((?:\.\./)+[\w.*/\-]*)")
PRIVATE_ABSOLUTE = re.compile(r"(?<![\w.~$<>/\-])(/(?:work|home|root|tmp|Users|mnt|scratch)/[^\s`'\")\]]*)")
DESIGN_FILE = re.compile(r"\bDESIGN\.md\b")


def outside_path_offenders(doc: str, text: str) -> List[str]:
    out = []
    base = os.path.join(REPO, os.path.dirname(doc))
    for number, line in enumerate(lines_of(text), 1):
        for match in RELATIVE_UP.finditer(line):
            path = match.group(1).rstrip(".,:;")
            resolved = os.path.normpath(os.path.join(base, path))
            if os.path.relpath(resolved, REPO).startswith(".."):
                out.append(f"{doc}:{number}: {path} names a path outside the repository")
            elif not (glob.glob(resolved) or glob.glob(resolved + ".*")):
                out.append(f"{doc}:{number}: {path} does not exist")
        for match in PRIVATE_ABSOLUTE.finditer(line):
            out.append(f"{doc}:{number}: {match.group(1)} names a path outside the repository")
        if DESIGN_FILE.search(line):
            out.append(f"{doc}:{number}: DESIGN.md is not in the repository; the design is docs/design.md")
    return out


# --------------------------------------------------------------------------- history

SESSIONS = re.compile(r"\bsessions?\b", re.I)
HELPERS = re.compile(r"\bhelpers?(?:'s|')?\s+(?:own\s+)?(?:builds?|branch(?:es)?|worktrees?|trees?|runs?)\b", re.I)


def history_offenders(doc: str, text: str) -> List[str]:
    """Docs describe the product as it is, not the work that made it."""
    out = []
    for number, line in enumerate(lines_of(text), 1):
        for pattern, what in ((SESSIONS, "speaks of sessions"), (HELPERS, "speaks of helpers' work")):
            match = pattern.search(line)
            if match:
                out.append(f"{doc}:{number}: {what} ({match.group(0)!r}): say what the product does now")
    return out


# --------------------------------------------------------------------------- the checks

CHECKS = [path_offenders, option_offenders, option_table_offenders, setting_offenders,
          outside_path_offenders, history_offenders]


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
def test_docs_name_only_what_exists(check):
    offenders = [line for doc in doc_files() for line in check(doc, read(doc))]
    assert not offenders, "\n" + "\n".join(offenders)


OUT_OF_REPO = "../"  # kept apart from the folder it leads to, so no grep of the tree finds that path here


def test_the_checks_catch_what_they_are_for():
    """Each check on a doc with one mistake of its kind (and the same text fixed)."""
    bad = """
Code in `csrc/core/no_such_file.cc`, tests in `tests/core/test_config.py::test_no_such_test`
and `engine/no_such_module`; the bench: `python bench/stream_gaps.py --no-such-flag 3`.

```bash
reccl bench --ranks 2 --no-such-option
RECCL_NICS=a,b torchrun --nproc-per-node 2 examples/ddp_failover.py \\
    --steps 10 --no-such-step
```

`reccl sim` takes `RECCL_NO_SUCH_SETTING` and `RECCL_NOPE_*`.
See `UP/shared/DESIGN.md`, `/work/main/bench` and `../../elsewhere.md`.
Measured in session 12, on the helpers' build.
""".replace("UP/", OUT_OF_REPO)
    found = [line for check in CHECKS for line in check("x.md", bad)]
    expected = [
        "x.md:2: csrc/core/no_such_file.cc does not exist",
        "x.md:2: tests/core/test_config.py has no test_no_such_test",
        "x.md:3: engine/no_such_module does not exist",
        "x.md:3: bench/stream_gaps.py has no option --no-such-flag",
        "x.md:6: torch_reccl bench has no option --no-such-option",
        "x.md:7: examples/ddp_failover.py has no option --no-such-step",
        "x.md:11: RECCL_NO_SUCH_SETTING is not a setting",
        "x.md:11: no setting starts with RECCL_NOPE_",
        f"x.md:12: {OUT_OF_REPO}shared/DESIGN.md names a path outside the repository",
        "x.md:12: /work/main/bench names a path outside the repository",
        "x.md:12: ../../elsewhere.md names a path outside the repository",
        "x.md:12: DESIGN.md is not in the repository",
        "x.md:13: speaks of sessions ('session')",
        "x.md:13: speaks of helpers' work (\"helpers' build\")",
    ]
    assert len(found) == len(expected), "\n".join(found)
    for want in expected:
        assert any(line.startswith(want) for line in found), f"{want!r} not in:\n" + "\n".join(found)
    good = re.sub(r"no_such_file|no_such_module", "config", bad)
    good = good.replace("::test_no_such_test", "::test_booleans").replace("engine/config", "core/config")
    good = re.sub(r" --no-such-[a-z]+( 3)?", "", good)
    good = good.replace("RECCL_NO_SUCH_SETTING", "RECCL_NICS").replace("RECCL_NOPE_*", "RECCL_IB_*")
    good = good.replace(f"`{OUT_OF_REPO}shared/DESIGN.md`, `/work/main/bench` and `../../elsewhere.md`",
                        "`docs/design.md`, `bench/` and `/proc/<pid>/status`")
    good = good.replace("in session 12, on the helpers' build", "on the 2-core VM, with a build of one commit")
    assert [line for check in CHECKS for line in check("x.md", good)] == []
    table = "| option | meaning |\n|---|---|\n| `--ranks`, `--no-such` | x |\n"
    assert option_table_offenders("docs/scale.md", table) == [
        "docs/scale.md:3: python bench/scale.py has no option --no-such"]
    assert option_table_offenders("docs/new.md", table)[0].startswith("docs/new.md:3: an option table")
