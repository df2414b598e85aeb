"""Runs `reccl bench` as a subprocess with extra RECCL_* settings and reads back
its JSON record; shared by the benchmark drivers that compare settings."""
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


def write_json(path, result) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
