"""Helpers shared by the bench scripts: `reccl bench` run as a subprocess with extra
RECCL_* settings and its JSON record read back (the drivers that compare
settings), forked rank processes with no library (the same-host references),
a torch_reccl module loaded by path, and the --json write."""
from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import platform
import queue
import subprocess
import sys
import time
from typing import List, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(argv: List[str], extra_env: dict, path: str, timeout: float) -> dict:
    """`reccl bench <argv> --no-progress --json path` with `extra_env`; its record."""
    env = {**os.environ, **extra_env,
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch_reccl", "bench", *argv, "--no-progress", "--json", path]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, timeout=timeout)
    with open(path) as f:
        return json.load(f)


def run_forked_ranks(what: str, procs: int, target, args: Sequence, patience_s: float,
                     timeout_s: float) -> Tuple[float, int]:
    """Runs target(rank, *args, results) in `procs` forked processes. Each rank puts
    one (rank, seconds, wrong, error or None) on `results`. Returns the slowest
    rank's seconds and the wrong elements of all; raises naming `what` when a rank
    reports an error, when a rank exits without a result and `patience_s` (the
    ranks' own longest wait, after which the others have given up too) passes,
    or when the results are not all in after `timeout_s`."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    workers = [ctx.Process(target=target, args=(rank, *args, results)) for rank in range(procs)]
    for w in workers:
        w.start()
    got, gone_since, deadline = [], None, time.monotonic() + timeout_s
    try:
        while len(got) < procs:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: {procs - len(got)} of {procs} ranks gave no result in {timeout_s:.0f} s")
            try:
                got.append(results.get(timeout=1.0))
                continue
            except queue.Empty:
                pass
            if any(w.exitcode not in (None, 0) for w in workers) or all(w.exitcode is not None for w in workers):
                gone_since = gone_since or time.monotonic()
                if time.monotonic() - gone_since > patience_s:
                    codes = {rank: w.exitcode for rank, w in enumerate(workers)}
                    raise RuntimeError(f"{what}: ranks exited without a result (exit codes {codes})")
    finally:
        for w in workers:
            w.join(10)
            if w.is_alive():
                w.kill()
    errors = [f"rank {rank}: {error}" for rank, _, _, error in got if error]
    if errors:
        raise RuntimeError(f"{what} failed: " + "; ".join(errors))
    return max(seconds for _, seconds, _, _ in got), sum(wrong for _, _, wrong, _ in got)


def load_standalone(module: str):
    """torch_reccl.<module> ("bench.rank") by path. Importing it as torch_reccl.<module> would
    import the torch_reccl package (and load the extension) in a launcher or a Gloo rank."""
    import importlib.util

    name = f"reccl_{module.replace('.', '_')}_standalone"
    if name not in sys.modules:
        path = os.path.join(REPO, "torch_reccl", *module.split(".")) + ".py"
        spec = importlib.util.spec_from_file_location(name, path)
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[name] = loaded
        spec.loader.exec_module(loaded)
    return sys.modules[name]


def write_json(path, result) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def write_runs(path, args, runs: list) -> None:
    """The --json record of a run over this machine: its host, cores and kernel,
    the date, the arguments and the runs."""
    write_json(path, {"machine": {"host": platform.node(), "cores": os.cpu_count(), "kernel": platform.release()},
                      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      "args": vars(args), "runs": runs})
