"""The Python tree keeps its roles, read from the import statements of every module:

- bench/ holds runnable scripts. No test, tests/helpers module, package module or
  example imports one (as the package ``bench`` or by a script's name) or loads one
  into its process by path: what the tests share with the benchmarks is in the
  package (torch_reccl.bench), and a test that needs a bench script whole runs it as
  a subprocess.
- Test modules import no test module: what tests share is in tests/conftest.py or
  tests/helpers/.
- The package imports nothing of tests/ (conftest, tests/helpers) or bench/: it ships
  alone. bench/ uses nothing of tests/ either (no import, no path into it): a
  harness the benchmarks run is the package's.

Pure Python: it needs no build.
"""
from __future__ import annotations

import ast
import os
from typing import Iterator, List, Set, Tuple

from conftest import HELPERS, REPO

BENCH = os.path.join(REPO, "bench")
LOADERS = {"spec_from_file_location", "run_path", "SourceFileLoader"}


def python_files(*folders: str) -> Iterator[str]:
    for folder in folders:
        for root, dirs, names in os.walk(os.path.join(REPO, folder)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in sorted(names):
                if name.endswith(".py"):
                    yield os.path.join(root, name)


def stems(folder: str) -> Set[str]:
    return {name[:-3] for name in os.listdir(folder) if name.endswith(".py")}


def imports(path: str) -> List[Tuple[int, str]]:
    """(line, top-level module) of every absolute import of the file."""
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def bench_loads(path: str) -> List[int]:
    """Lines that load a file by path (importlib, runpy) with bench/ in the call."""
    with open(path, encoding="utf-8") as handle:
        source = handle.read()
    lines = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in LOADERS and "bench" in (ast.get_source_segment(source, node) or ""):
                lines.append(node.lineno)
    return lines


def paths_into_tests(path: str) -> List[int]:
    """Lines of calls given a path into tests/: os.path.join(..., "tests", ...) or a
    "tests/..." argument."""
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), path)
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        joins = isinstance(node.func, ast.Attribute) and node.func.attr == "join"
        for arg in node.args:
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and (
                    arg.value.startswith("tests/") or (joins and arg.value == "tests")):
                lines.append(node.lineno)
    return lines


def offenders(files: Iterator[str], forbidden: Set[str], what: str) -> List[str]:
    return [f"{os.path.relpath(path, REPO)}:{line} imports {module} ({what})"
            for path in files for line, module in imports(path) if module in forbidden]


def test_the_finder_sees_imports_and_loads(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("import bench.scaling\nfrom grey_fabric import run\nfrom . import near\n"
                    "import importlib.util as u\nu.spec_from_file_location('m', 'bench/x.py')\n"
                    "import os\nos.path.join('/r', 'tests', 'helpers')\n")
    assert imports(str(path)) == [(1, "bench"), (2, "grey_fabric"), (4, "importlib"), (6, "os")]
    assert bench_loads(str(path)) == [5]
    assert paths_into_tests(str(path)) == [7]


def test_nothing_imports_or_loads_a_bench_script():
    scripts = stems(BENCH) | {"bench"}
    users = list(python_files("tests", "torch_reccl", "examples"))
    found = offenders(iter(users), scripts, "a bench/ script")
    found += [f"{os.path.relpath(path, REPO)}:{line} loads a bench/ file into its process"
              for path in users for line in bench_loads(path)]
    assert not found, "\n".join(found)


def test_no_test_module_imports_another():
    tests = [p for p in python_files("tests") if os.path.basename(p).startswith("test_")]
    found = [f"{os.path.relpath(path, REPO)}:{line} imports {module}"
             for path in python_files("tests") for line, module in imports(path)
             if module.startswith("test_")]
    assert tests and not found, "\n".join(found)


def test_the_package_imports_nothing_of_tests_or_bench():
    forbidden = stems(HELPERS) | {"conftest", "tests", "bench"} | stems(BENCH)
    found = offenders(python_files("torch_reccl"), forbidden, "tests/ or bench/")
    assert not found, "\n".join(found)


def test_bench_uses_nothing_of_tests():
    found = offenders(python_files("bench"), stems(HELPERS) | {"conftest", "tests"}, "tests/")
    found += [f"{os.path.relpath(path, REPO)}:{line} names a path into tests/"
              for path in python_files("bench") for line in paths_into_tests(path)]
    assert not found, "\n".join(found)
