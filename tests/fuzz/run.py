"""Builds and runs the libFuzzer harnesses of tests/fuzz (docs/fuzzing.md).

    python tests/fuzz/run.py build  [--out DIR]
    python tests/fuzz/run.py run    [--out DIR] [--seconds N] [--jobs N] [--only a,b]
                                    [--report FILE] [--no-merge]
    python tests/fuzz/run.py minimize [--out DIR]
    python tests/fuzz/run.py seed   [--out DIR]

build: every harness with clang++-14 -fsanitize=fuzzer,address,undefined into DIR
(default build/fuzz), libFuzzer and the C++ runtime linked in, so DIR can be copied
to and run on another x86_64 Linux host without clang. run: every harness at once
(at most --jobs at a time) for --seconds each, on a scratch copy of its corpus; then
the inputs that add coverage are merged into tests/fuzz/corpus/<harness>/ (unless
--no-merge) and executions, coverage (libFuzzer's cov: and ft:) and corpus size go
to the --report JSON. A crash leaves its input in DIR/artifacts/<harness>/ and the
run exits 1. minimize: rewrites each corpus to the smallest set with the same
coverage. seed: writes the encoders' seed inputs (seeds.cc, built with g++).
Needs clang-14 and its libFuzzer (Debian: apt-get install clang-14
libclang-rt-14-dev) for build, run and minimize; only g++ for seed.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fuzz_targets  # noqa: E402
from fuzz_targets import CORPUS, LIBFUZZER, LIBFUZZER_LINK, REPO, TARGETS, corpus_dir  # noqa: E402

DEFAULT_OUT = os.path.join(REPO, "build", "fuzz")
INSTALL = "apt-get install -y clang-14 libclang-rt-14-dev (Debian/Ubuntu)"
DONE = re.compile(r"^#(\d+)\s+DONE\s+cov: (\d+) ft: (\d+) corp: (\d+)/(\d+)(\w*)b")
STAT = re.compile(r"^stat::(\w+):\s+(\d+)")


def clang() -> str:
    for name in ("clang++-14", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    sys.exit(f"tests/fuzz needs clang++ with libFuzzer: {INSTALL}")


def binary(out: str, name: str) -> str:
    path = os.path.join(out, f"fuzz_{name}")
    if not os.access(path, os.X_OK):
        sys.exit(f"{path} is not built: python tests/fuzz/run.py build --out {out}")
    return path


def corpus_size(folder: str) -> Dict[str, int]:
    files = [os.path.join(folder, f) for f in os.listdir(folder)] if os.path.isdir(folder) else []
    files = [f for f in files if os.path.isfile(f)]
    return {"files": len(files), "bytes": sum(os.path.getsize(f) for f in files)}


def command_build(args) -> int:
    compiler = clang()
    started = time.monotonic()
    try:
        built = fuzz_targets.build(list(TARGETS), args.out, compiler, LIBFUZZER, LIBFUZZER_LINK,
                                   jobs=os.cpu_count() or 2)
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 1
    for name, path in built.items():
        print(f"{name:14s} {path}")
    print(f"built {len(built)} harnesses with {compiler} in {time.monotonic() - started:.0f} s")
    return 0


SLOW_UNIT_S = 10  # libFuzzer's -report_slow_units default: a rerun past it is a hang


def fuzz_one(name: str, out: str, seconds: int, merge: bool) -> dict:
    exe = binary(out, name)
    scratch = os.path.join(out, "work", name)
    artifacts = os.path.join(out, "artifacts", name) + os.sep
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(corpus_dir(name), scratch)
    os.makedirs(artifacts, exist_ok=True)
    log_path = os.path.join(out, "logs", f"{name}.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    command = [exe, scratch, f"-max_total_time={seconds}", "-timeout=10", "-rss_limit_mb=2048",
               "-max_len=4096", "-print_final_stats=1", f"-artifact_prefix={artifacts}"]
    started = time.monotonic()
    with open(log_path, "w") as log:
        rc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=seconds + 120).returncode
    elapsed = time.monotonic() - started
    result = {"seconds": round(elapsed, 1), "rc": rc, "log": log_path}
    with open(log_path, errors="replace") as log:
        for line in log:
            done = DONE.match(line)
            if done:
                result.update(executions=int(done.group(1)), cov=int(done.group(2)), ft=int(done.group(3)))
            stat = STAT.match(line)
            if stat:
                result[stat.group(1)] = int(stat.group(2))
    # libFuzzer keeps an input that once ran past -report_slow_units (10 s) as
    # slow-unit-*: on a loaded machine that is often the scheduler, not the input.
    # Each is run again alone; one still slow is a hang, the others are listed.
    found = sorted(os.listdir(artifacts))
    result["crashes"] = [f for f in found if not f.startswith("slow-unit-")]
    result["slow_units"] = {}
    for slow in (f for f in found if f.startswith("slow-unit-")):
        again = time.monotonic()
        try:
            subprocess.run([exe, os.path.join(artifacts, slow)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=SLOW_UNIT_S, check=True)
            result["slow_units"][slow] = round(time.monotonic() - again, 3)
        except (subprocess.TimeoutExpired, subprocess.CalledProcessError):
            result["crashes"].append(slow)
    if merge:
        subprocess.run([exe, "-merge=1", corpus_dir(name), scratch], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=600, check=True)
    result["corpus"] = corpus_size(corpus_dir(name))
    return result


def command_run(args) -> int:
    names = args.only.split(",") if args.only else list(TARGETS)
    unknown = sorted(set(names) - set(TARGETS))
    if unknown:
        sys.exit(f"unknown harnesses {unknown}; valid: {', '.join(TARGETS)}")
    for name in names:
        binary(args.out, name)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = dict(zip(names, pool.map(lambda n: fuzz_one(n, args.out, args.seconds, args.merge), names)))
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "cpus": os.cpu_count(), "seconds_each": args.seconds,
        "command": " ".join(sys.argv), "harnesses": results,
    }
    print(f"{'harness':14s} {'executions':>12s} {'exec/s':>8s} {'cov':>6s} {'ft':>7s} {'corpus':>12s}  crashes")
    for name, r in results.items():
        corpus = f"{r['corpus']['files']}/{r['corpus']['bytes']}b"
        print(f"{name:14s} {r.get('executions', 0):12d} {r.get('average_exec_per_sec', 0):8d} "
              f"{r.get('cov', 0):6d} {r.get('ft', 0):7d} {corpus:>12s}  {len(r['crashes'])}")
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=2)
        print(f"report: {args.report}")
    failed = [n for n, r in results.items() if r["crashes"] or "executions" not in r]
    if failed:
        print(f"crashes or no final stats in {failed}: see {args.out}/artifacts and {args.out}/logs",
              file=sys.stderr)
        return 1
    return 0


def command_minimize(args) -> int:
    for name in TARGETS:
        exe = binary(args.out, name)
        before = corpus_size(corpus_dir(name))
        fresh = os.path.join(args.out, "minimized", name)
        shutil.rmtree(fresh, ignore_errors=True)
        os.makedirs(fresh)
        subprocess.run([exe, "-merge=1", fresh, corpus_dir(name)], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=600, check=True)
        kept = set(os.listdir(fresh))  # libFuzzer names them by the SHA-1 of their bytes
        present = set()
        for f in os.listdir(corpus_dir(name)):
            path = os.path.join(corpus_dir(name), f)
            with open(path, "rb") as data:
                digest = hashlib.sha1(data.read()).hexdigest()
            if digest in kept or f.startswith(("seed-", "regression-")):  # these stay whatever they add
                present.add(digest)
            else:
                os.remove(path)
        for digest in kept - present:
            shutil.copy(os.path.join(fresh, digest), os.path.join(corpus_dir(name), digest))
        after = corpus_size(corpus_dir(name))
        print(f"{name:14s} {before['files']:5d} -> {after['files']:5d} files, "
              f"{before['bytes']} -> {after['bytes']} bytes")
    return 0


def command_seed(args) -> int:
    compiler = shutil.which("g++") or sys.exit("seed needs g++")
    sources = sorted({s for sources in TARGETS.values() for s in sources})
    seeds = os.path.join(args.out, "seeds")
    os.makedirs(seeds, exist_ok=True)
    exe = os.path.join(seeds, "write_seeds")
    subprocess.run([compiler, *fuzz_targets.COMMON, os.path.join(fuzz_targets.HERE, "seeds.cc"),
                    *[os.path.join(REPO, "csrc", s) for s in sources], "-o", exe], check=True, timeout=600)
    subprocess.run([exe, CORPUS], check=True, timeout=60)
    for name in TARGETS:
        print(f"{name:14s} {corpus_size(corpus_dir(name))}")
    return 0


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("build", "run", "minimize", "seed"):
        p = sub.add_parser(name)
        p.add_argument("--out", default=DEFAULT_OUT, help="build folder (default build/fuzz)")
        if name == "run":
            p.add_argument("--seconds", type=int, default=60, help="fuzzing time per harness")
            p.add_argument("--jobs", type=int, default=len(TARGETS), help="harnesses fuzzed at once")
            p.add_argument("--only", help="comma-separated harness names (default: all)")
            p.add_argument("--report", help="write the per-harness results to this JSON file")
            p.add_argument("--no-merge", dest="merge", action="store_false",
                           help="leave tests/fuzz/corpus as it is")
    args = parser.parse_args(argv)
    return {"build": command_build, "run": command_run, "minimize": command_minimize,
            "seed": command_seed}[args.command](args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
