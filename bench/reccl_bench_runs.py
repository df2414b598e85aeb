"""Helpers shared by the bench scripts: `reccl bench` run as a subprocess with extra
RECCL_* settings and its JSON record read back (the drivers that compare
settings), a torch_reccl module loaded by path, and the --json write."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(argv: List[str], extra_env: dict, path: str, timeout: float) -> dict:
    """`reccl bench <argv> --no-progress --json path` with `extra_env`; its record."""
    env = {**os.environ, **extra_env,
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch_reccl", "bench", *argv, "--no-progress", "--json", path]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, timeout=timeout)
    with open(path) as f:
        return json.load(f)


def load_standalone(module: str):
    """torch_reccl/<module>.py by path. Importing it as torch_reccl.<module> would import
    the torch_reccl package (and load the extension) in a launcher or a Gloo rank."""
    import importlib.util

    name = f"reccl_{module}_standalone"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "torch_reccl", f"{module}.py"))
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[name] = loaded
        spec.loader.exec_module(loaded)
    return sys.modules[name]


def write_json(path, result) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
