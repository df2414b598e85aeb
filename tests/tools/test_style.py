"""The tree is clean under the project's own style configurations: ruff for
Python (pyproject.toml, [tool.ruff]) and clang-format for C++ (.clang-format).
`bash scripts/test.sh` installs both at the pinned versions (the test extras), so
every contributor formats as CI checks; elsewhere these skip with the install line."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

INSTALL = "pip install -e '.[test]' (or bash scripts/test.sh) installs it"


def _tool(name: str) -> str:
    path = shutil.which(name) or os.path.join(os.path.dirname(sys.executable), name)
    if not os.path.exists(path):
        pytest.skip(f"needs {name}: {INSTALL}")
    return path


def test_python_is_clean_under_ruff():
    cp = subprocess.run([_tool("ruff"), "check", "--no-cache", REPO], capture_output=True, text=True,
                        timeout=300, cwd=REPO)
    assert cp.returncode == 0, f"ruff check found problems (ruff check --fix fixes most):\n{cp.stdout}{cp.stderr}"


def test_cpp_is_clean_under_clang_format():
    files = sorted(glob.glob(os.path.join(REPO, "csrc", "**", "*.cc"), recursive=True)
                   + glob.glob(os.path.join(REPO, "csrc", "**", "*.h"), recursive=True))
    assert len(files) > 100, f"found only {len(files)} C++ files under csrc/"
    cp = subprocess.run([_tool("clang-format"), "--dry-run", "--Werror", *files], capture_output=True,
                        text=True, timeout=300, cwd=REPO)
    offenders = sorted({line.split(":")[0] for line in cp.stderr.splitlines() if ": error:" in line})
    assert cp.returncode == 0, (f"{len(offenders)} files differ from .clang-format "
                                f"(clang-format -i FILE fixes them): {offenders[:20]}")
