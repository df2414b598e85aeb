#!/usr/bin/env python3
"""PyTorch's own distributed test suite against reccl and Gloo, compared.

    python bench/torch_dist_suite.py                          # world sizes 2, 3, 4, every test
    python bench/torch_dist_suite.py --world-sizes 2 --subset fast
    python bench/torch_dist_suite.py -k all_reduce -k barrier --json out.json
    python bench/torch_dist_suite.py --world-sizes 4 --shard 0/4 --json s0.json   # a quarter

What runs: ``torch/testing/_internal/distributed/distributed_test.py`` from the
installed torch (``DistributedTest._DistTestBase``), the way upstream's
``test/distributed/test_distributed_spawn.py`` runs it (that file is not in the
wheel, so this module builds the same TestCase: ``TestDistBackend`` +
``_DistTestBase``, processes spawned per test). Environment per run, as upstream:
``BACKEND``, ``WORLD_SIZE``, ``TEMP_DIR`` (a fresh directory), ``INIT_METHOD``
(``file://`` in it). reccl claims the ``backend_feature`` entries a CPU backend
honestly can: "ddp", "subgroup" and "plugin" (a registered third-party backend).

Three modes, each a separate worker process per world size:

* ``gloo``: ``BACKEND=gloo``.
* ``reccl``: ``BACKEND=reccl``.
* ``reccl-as-gloo``: for the tests the suite gates on the literal name "gloo"
  (skipped under ``reccl``, passed under ``gloo``). ``BACKEND=gloo``, so every gate
  (the decorators, evaluated at import, and the ``BACKEND == "gloo"`` checks at run
  time) sees "gloo". In every process (the worker and the ranks it spawns) this
  module wraps ``torch.distributed.distributed_c10d._new_process_group_helper``,
  which ``init_process_group`` and ``new_group`` call for every group: asked for
  "gloo", it makes the group with "reccl" instead, the same group a reccl job
  gets. torch itself sees reccl (``dist.get_backend`` says "reccl"), so a test
  that torch refuses for non-Gloo backends fails here, naming torch's refusal;
  every other failure here is a reccl gap. (torch's internal helper group of the
  DETAIL-debug wrapper, made with ``ProcessGroupGloo`` directly, stays Gloo.)

Bounds: each test has ``--test-timeout`` seconds (torch's MultiProcessTestCase
kills its ranks past it, ``DISTRIBUTED_TESTS_DEFAULT_TIMEOUT``); a worker that makes
no progress for that long plus a minute is killed (its process group), the test it
was in is recorded as "hang" and the worker restarts after it. Nothing waits
unbounded.

Output: per world size, passed/failed/skipped/hang per mode, then the tests that
pass on one backend but not the other with the first line of each failure or
skip reason, and the name-gated tests under ``reccl-as-gloo``. ``--json`` writes
every test's status and first line.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from typing import Dict, List, Optional

GLOO_NAME_ENV = "TORCH_DIST_SUITE_AS_GLOO"  # not RECCL_*: reccl checks those names
WORKER_ENV = "TORCH_DIST_SUITE_WORKER"
START_METHOD_ENV = "TORCH_DIST_SUITE_START_METHOD"
MODES = ("gloo", "reccl", "reccl-as-gloo")
# The fast subset (a few minutes on 2 cores): collectives, p2p, groups, DDP basics.
FAST_SUBSET = [f"^test_{name}$" for name in (
    "all_reduce_sum", "all_reduce_group_sum", "all_reduce_coalesced_sum", "sparse_all_reduce_sum",
    "broadcast", "reduce_sum", "all_gather", "gather", "scatter", "all_to_all",
    "send_recv", "send_recv_any_source", "isend",
    "barrier", "barrier_group", "new_subgroups", "get_backend",
    "DistributedDataParallelCPU", "ddp_logging_data_cpu")]


# --------------------------------------------------------------------------- worker side

def _install_reccl_as_gloo() -> None:
    """Makes every group asked for as "gloo" a reccl group."""
    import torch.distributed.distributed_c10d as c10d

    real = c10d._new_process_group_helper

    def new_process_group_helper(group_size, group_rank, global_ranks_in_group, backend, store,
                                 group_name, *args, **kwargs):
        if str(backend) != c10d.Backend.GLOO:
            return real(group_size, group_rank, global_ranks_in_group, backend, store, group_name,
                        *args, **kwargs)
        return real(group_size, group_rank, global_ranks_in_group, c10d.Backend("reccl"), store,
                    group_name, *args, **kwargs)

    c10d._new_process_group_helper = new_process_group_helper


def _prepare_worker_imports() -> None:
    """Runs at import in the worker and in every rank it spawns (before the suite's import)."""
    from torch.testing._internal.common_distributed import TIMEOUT_OVERRIDE, DistTestCases

    # A few tests have longer bounds of their own; --test-timeout bounds them too.
    bound = int(os.environ.get("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "300"))
    for name, seconds in TIMEOUT_OVERRIDE.items():
        TIMEOUT_OVERRIDE[name] = min(seconds, bound)

    import torch_reccl  # noqa: F401 - registers "reccl"

    for feature in ("ddp", "subgroup", "plugin"):
        DistTestCases.backend_feature[feature].add("reccl")
    if os.environ.get(GLOO_NAME_ENV) == "1":
        _install_reccl_as_gloo()


if os.environ.get(WORKER_ENV) == "1":
    _prepare_worker_imports()
    import torch
    from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

    class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
        """What upstream's test_distributed_spawn.py defines for gloo/nccl/ucc."""

        def setUp(self):
            super().setUp()
            if os.environ.get(START_METHOD_ENV) == "fork":
                self._start_processes(torch.multiprocessing.get_context("fork").Process)
            else:
                self._spawn_processes()
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()


def _first_line(text: str) -> str:
    """The most telling line of a failure: a rank's exception, else the error's own."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    exc = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit)|AssertionError)\b.*")
    for i, line in enumerate(lines):
        if "exited with error code" in line or "exception:" in line:
            for later in lines[i + 1:]:
                if exc.match(later):
                    return later[:300]
    for line in reversed(lines):
        if exc.match(line):
            return line[:300]
    return (lines[-1] if lines else "")[:300]


class _JsonlResult(unittest.TextTestResult):
    """Appends one JSON line per test (and one when it starts) to a file."""

    def __init__(self, out, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.out = out

    def _write(self, record) -> None:
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()

    def startTest(self, test):
        self._write({"start": test._testMethodName})
        super().startTest(test)

    def addSuccess(self, test):
        super().addSuccess(test)
        self._write({"test": test._testMethodName, "status": "passed", "detail": ""})

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._write({"test": test._testMethodName, "status": "failed",
                     "detail": _first_line(self._exc_info_to_string(err, test))})

    def addError(self, test, err):
        super().addError(test, err)
        self._write({"test": test._testMethodName, "status": "failed",
                     "detail": _first_line(self._exc_info_to_string(err, test))})

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._write({"test": test._testMethodName, "status": "skipped",
                     "detail": str(reason).splitlines()[0][:300] if reason else ""})

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._write({"test": test._testMethodName, "status": "passed", "detail": "expected failure"})

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._write({"test": test._testMethodName, "status": "failed", "detail": "unexpected success"})


def _all_test_names() -> List[str]:
    return sorted(unittest.TestLoader().getTestCaseNames(TestDistBackendWithSpawn))


def _worker_main(args) -> int:
    names = args.tests or _all_test_names()
    if args.list:
        for name in names:
            skipped = getattr(getattr(TestDistBackendWithSpawn, name), "__unittest_skip__", False)
            print(f"{name}\t{'skip' if skipped else 'run'}")
        return 0
    suite = unittest.TestSuite(TestDistBackendWithSpawn(name) for name in names)
    with open(args.results, "a") as out:
        runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=0,
                                         resultclass=lambda *a, **k: _JsonlResult(out, *a, **k))
        runner.run(suite)
    return 0


# --------------------------------------------------------------------------- driver side

def _mode_env(mode: str, world_size: int, temp_dir: str, test_timeout: int,
              start_method: str = "spawn") -> Dict[str, str]:
    env = dict(os.environ)
    env.update({
        WORKER_ENV: "1",
        START_METHOD_ENV: start_method,
        "BACKEND": "reccl" if mode == "reccl" else "gloo",
        "WORLD_SIZE": str(world_size),
        "TEMP_DIR": temp_dir,
        "INIT_METHOD": f"file://{os.path.join(temp_dir, 'init_file')}",
        "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(test_timeout),
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
    })
    env.pop(GLOO_NAME_ENV, None)
    if mode == "reccl-as-gloo":
        env[GLOO_NAME_ENV] = "1"
    if mode != "gloo":
        env.setdefault("RECCL_NICS", "127.0.0.1,127.0.0.2")
    return env


def _worker_cmd(extra: List[str]) -> List[str]:
    return [sys.executable, os.path.abspath(__file__), "--worker"] + extra


def _listing(mode: str, world_size: int) -> Dict[str, bool]:
    """Every test of the suite: whether its decorators skip it in `mode`."""
    with tempfile.TemporaryDirectory(prefix="reccl-suite-") as temp_dir:
        out = subprocess.run(_worker_cmd(["--list"]), env=_mode_env(mode, world_size, temp_dir, 60),
                             capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [line.split("\t") for line in out.splitlines() if line.startswith("test_")]
    return {name: kind == "skip" for name, kind in rows}


def list_tests(patterns: List[str], gated_only: bool, world_size: int) -> List[str]:
    """The suite's tests matching any of `patterns` (all without); with
    `gated_only`, those the decorators skip for reccl but not for gloo."""
    gloo = _listing("gloo", world_size)
    names = sorted(gloo)
    if gated_only:
        reccl = _listing("reccl", world_size)
        names = [n for n in names if reccl.get(n) and not gloo[n]]
    if patterns:
        names = [n for n in names if any(re.search(p, n) for p in patterns)]
    return names


def run_mode(mode: str, world_size: int, tests: List[str], test_timeout: int,
             start_method: str = "spawn", log=sys.stderr) -> Dict[str, dict]:
    """Runs `tests` in one mode; restarts the worker after a test it hung in."""
    results: Dict[str, dict] = {}
    remaining = list(tests)
    stall_limit = test_timeout + 60
    while remaining:
        temp_dir = tempfile.mkdtemp(prefix=f"reccl-suite-{mode}-{world_size}-")
        results_path = os.path.join(temp_dir, "results.jsonl")
        for sub in ("barrier", "test_dir"):
            os.makedirs(os.path.join(temp_dir, sub), exist_ok=True)
        env = _mode_env(mode, world_size, temp_dir, test_timeout, start_method)
        stdout_path = os.path.join(temp_dir, "worker.log")
        with open(stdout_path, "w") as worker_log:
            proc = subprocess.Popen(_worker_cmd(["--results", results_path] + remaining), env=env,
                                    stdout=worker_log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        current: Optional[str] = None
        seen = 0
        last_progress = time.monotonic()
        while True:
            finished = proc.poll() is not None
            records = []
            if os.path.exists(results_path):
                with open(results_path) as f:
                    records = [json.loads(line) for line in f if line.strip()]
            for record in records[seen:]:
                last_progress = time.monotonic()
                if "start" in record:
                    current = record["start"]
                else:
                    results[record["test"]] = record
                    current = None
                    print(f"  [{mode} ws={world_size}] {record['test']}: {record['status']}"
                          + (f" ({record['detail'][:120]})" if record["status"] == "failed" else ""),
                          file=log, flush=True)
            seen = len(records)
            if finished:
                break
            if time.monotonic() - last_progress > stall_limit:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                break
            time.sleep(0.5)
        # Whatever the worker did not finish: the test it was in hung or crashed it.
        if current is not None and current not in results:
            with open(stdout_path) as f:
                tail = f.read()[-2000:]
            why = "hang" if proc.returncode in (-signal.SIGKILL,) else "crash"
            results[current] = {"test": current, "status": "hang" if why == "hang" else "failed",
                                "detail": f"worker {why} (exit {proc.returncode}): "
                                          f"{_first_line(tail)}"}
            print(f"  [{mode} ws={world_size}] {current}: {why}", file=log, flush=True)
        remaining = [t for t in remaining if t not in results]
        if remaining and current is None:
            # The worker exited between tests without running the rest.
            for t in remaining:
                results[t] = {"test": t, "status": "failed",
                              "detail": f"worker exited {proc.returncode} before running it"}
            remaining = []
        shutil.rmtree(temp_dir, ignore_errors=True)
    return results


def _counts(results: Dict[str, dict]) -> Dict[str, int]:
    counts = {"passed": 0, "failed": 0, "skipped": 0, "hang": 0}
    for r in results.values():
        counts[r["status"]] += 1
    return counts


def compare(world_size: int, by_mode: Dict[str, Dict[str, dict]]) -> dict:
    gloo, reccl = by_mode["gloo"], by_mode["reccl"]
    gated = by_mode.get("reccl-as-gloo", {})
    only_gloo = sorted(t for t, r in gloo.items() if r["status"] == "passed"
                       and reccl.get(t, {}).get("status") != "passed")
    only_reccl = sorted(t for t, r in reccl.items() if r["status"] == "passed"
                        and gloo.get(t, {}).get("status") != "passed")
    name_gated = [t for t in only_gloo if reccl.get(t, {}).get("status") == "skipped"]
    reccl_failures = [t for t in only_gloo if t not in name_gated]
    gated_failures = [t for t in name_gated if gated.get(t, {}).get("status") != "passed"]
    return {
        "world_size": world_size,
        "counts": {mode: _counts(results) for mode, results in by_mode.items()},
        "passed_on_gloo_only": only_gloo,
        "passed_on_reccl_only": only_reccl,
        "name_gated": name_gated,
        "reccl_failures_not_gated": reccl_failures,
        "name_gated_failing_as_gloo": gated_failures,
    }


def report(summary: dict, by_mode: Dict[str, Dict[str, dict]], out=sys.stdout) -> None:
    ws = summary["world_size"]
    print(f"\n== world size {ws}", file=out)
    print("| mode | passed | failed | skipped | hang |", file=out)
    print("|---|---|---|---|---|", file=out)
    for mode, c in summary["counts"].items():
        print(f"| {mode} | {c['passed']} | {c['failed']} | {c['skipped']} | {c['hang']} |", file=out)

    def line(mode, t):
        r = by_mode.get(mode, {}).get(t)
        return f"{r['status']}: {r['detail']}" if r else "not run"

    print(f"\npassing on gloo, not on reccl, not name-gated ({len(summary['reccl_failures_not_gated'])}):",
          file=out)
    for t in summary["reccl_failures_not_gated"]:
        print(f"  {t}  [reccl {line('reccl', t)}]", file=out)
    print(f"passing on reccl, not on gloo ({len(summary['passed_on_reccl_only'])}):", file=out)
    for t in summary["passed_on_reccl_only"]:
        print(f"  {t}  [gloo {line('gloo', t)}]", file=out)
    print(f"name-gated (skipped on reccl, passing on gloo): {len(summary['name_gated'])}; "
          f"under reccl-as-gloo not passing ({len(summary['name_gated_failing_as_gloo'])}):", file=out)
    for t in summary["name_gated_failing_as_gloo"]:
        print(f"  {t}  [reccl-as-gloo {line('reccl-as-gloo', t)}]", file=out)


def _shard(text: str):
    match = re.fullmatch(r"(\d+)/(\d+)", text)
    if not match or not 0 <= int(match.group(1)) < int(match.group(2)):
        raise argparse.ArgumentTypeError(f"--shard {text!r}: give I/N with 0 <= I < N, e.g. 0/4")
    return int(match.group(1)), int(match.group(2))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("-k", dest="patterns", action="append", default=[],
                        help="regex on test names (repeatable; any matches)")
    parser.add_argument("--subset", choices=["all", "fast", "gated"], default="all",
                        help="fast: FAST_SUBSET; gated: the tests whose decorators skip them "
                             "for reccl but not for gloo")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="reccl-as-gloo runs the tests that pass on gloo and skip on reccl")
    parser.add_argument("--test-timeout", type=int, default=120, help="seconds per test")
    parser.add_argument("--shard", type=_shard, default=(0, 1), metavar="I/N",
                        help="run every N-th test from the I-th (0 <= I < N) of the sorted list: "
                             "N invocations with I = 0..N-1 together run the whole selection")
    parser.add_argument("--start-method", choices=["spawn", "fork"], default="spawn",
                        help="how each test starts its ranks: spawn (upstream's way; every rank "
                             "imports torch and the suite, ~5 s of CPU each) or fork (the ranks "
                             "inherit the imported suite; for CPU-only runs, many times faster)")
    parser.add_argument("--json", help="write every result here (rewritten after each mode)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--list", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--results", help=argparse.SUPPRESS)
    parser.add_argument("tests", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker_main(args)

    patterns = args.patterns + (FAST_SUBSET if args.subset == "fast" else [])
    started = time.time()
    summaries, all_results = [], {}
    shard, shards = args.shard

    def save() -> None:
        if args.json:  # after every mode: a run cut short keeps what it finished
            with open(args.json, "w") as f:
                json.dump({"summaries": summaries, "results": all_results, "shard": f"{shard}/{shards}",
                           "start_method": args.start_method},
                          f, indent=1)

    for ws in args.world_sizes:
        tests = list_tests(patterns, args.subset == "gated", ws)[shard::shards]
        print(f"world size {ws}: {len(tests)} tests of the installed torch's suite (shard {shard}/{shards}); "
              f"per-test timeout {args.test_timeout}s", file=sys.stderr, flush=True)
        by_mode = all_results[str(ws)] = {"gloo": {}, "reccl": {}, "reccl-as-gloo": {}}
        for mode in ("gloo", "reccl"):
            if mode in args.modes:
                by_mode[mode] = run_mode(mode, ws, tests, args.test_timeout, args.start_method)
                save()
        gated = [t for t, r in by_mode["gloo"].items() if r["status"] == "passed"
                 and by_mode["reccl"].get(t, {}).get("status") == "skipped"]
        if gated and "reccl-as-gloo" in args.modes:
            by_mode["reccl-as-gloo"] = run_mode("reccl-as-gloo", ws, gated, args.test_timeout,
                                                args.start_method)
        summary = compare(ws, by_mode)
        report(summary, by_mode)
        summaries.append(summary)
        save()
    print(f"\nwall time {time.time() - started:.0f} s", file=sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
