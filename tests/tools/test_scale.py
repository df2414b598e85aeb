"""Scale, CI (issue 14): a 16-rank CPU job with a Megatron-like group set on the dev machine.

Runs bench/scale.py's launcher (torch_reccl.bench.scaling.runner.run_job, imported, not copied) twice in this module:
once with backend "reccl", once with "gloo", each as 16 rank processes on
127.0.0.1 whose store is a real c10d TCPStore server hosted here behind the
launcher's counting proxy. Each job: init_process_group, the group set (world,
tensor-parallel pairs (2k, 2k+1), the two strided data-parallel groups, and 4
more world-sized groups: 15 groups, 7 per rank), one small all_reduce on every
group, 1 s to settle, a 3 s idle window, then 4-byte and 4 MiB all_reduces on
the world group. docs/scale.md says how each number is measured.

What is asserted:

* gloo: the job finishes and the proxy sees zero store requests in the idle
  window. This is the fairness check: torch and the harness themselves send
  nothing while a job idles, so the reccl assertion below asks nothing Gloo
  does not already do.
* reccl: the job finishes within its bounds and every collective it ran gave
  the exact result (integer-valued float32 inputs; compared bit for bit in the
  ranks against a locally computed reference).
* reccl: zero store requests (and zero client->server reads) in the idle window,
  after every group was used once.
* reccl: threads per rank, all of them (the transport's I/O loops, engine and
  control threads, Python's and torch's own threads), are at most

      16 + 2 x NICs + B

  where NICs = the number of RECCL_NICS (2 here) and B = the threads torch and
  Python keep in a gloo-only rank of the same job: the largest count, over the
  gloo ranks at their idle window, of threads not named ``gloo*``/``pt_gloo*``
  (gloo's own per-group threads; B is 1, the main thread, with torch 2.13 CPU).
  TCP paths have no threads of their own (their sockets are served by the
  process's event loops), so nothing in the count grows with connections.

The busbw tests (-k busbw; issue 15) need none of the 16-rank jobs: the rank's
bit-for-bit check of all_reduce/all_gather/reduce_scatter against a stand-in
collective (right, unwritten and one-element-wrong outputs), the op counts per
size, and one real 4-rank job per backend with 1 MiB of each op (each job bounded
at 60 s), whose table must have a positive busbw row per op for both backends
and zero wrong results.

SCALE_TEST_RANKS (default 16, even) changes the job size, e.g. to see the
assertions on a size a given engine finishes (not a RECCL_* name: the engine
rejects unknown RECCL_* variables). RECCL_* engine settings in the environment
reach the ranks (RECCL_NICS defaults to two loopback NICs).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from torch_reccl.bench.scaling import (  # bench/scale.py's package
    busbw as scale_busbw,
    ceiling as wire_ceiling,
    report as scale_report,
    runner as scale_runner,
)

from conftest import REPO

RANKS = int(os.environ.get("SCALE_TEST_RANKS", "16"))
IDLE_S = 3.0
SETTLE_S = 1.0
PHASE_TIMEOUT_S = 90.0               # any one phase
TOTAL_TIMEOUT_S = {"gloo": 60.0, "reccl": 150.0}   # a whole job (today's reccl needs the most)
JOB_OPTS = dict(idle_s=IDLE_S, settle_s=SETTLE_S, phase_timeout=PHASE_TIMEOUT_S, op_timeout=60.0,
                warmup=2, small_iters=5, busbw_iters=1,
                busbw=(("all_reduce", 4 << 20),))  # few ops: exactness, not speed
THREAD_BUDGET = 16                   # threads per rank, whatever N and G ...
THREADS_PER_NIC = 2                  # ... plus this many per NIC (the I/O loops among them)
GLOO_THREAD_PREFIXES = ("gloo", "pt_gloo")

pytestmark = pytest.mark.timeout(240)  # CI: one job is bounded by TOTAL_TIMEOUT_S, plus start-up


def run(backend: str, tmp_path_factory) -> dict:
    log_dir = str(tmp_path_factory.mktemp(f"scale-{backend}"))
    result = scale_runner.run_job(backend, RANKS, env=scale_runner.rank_env(backend), log_dir=log_dir,
                           total_timeout=TOTAL_TIMEOUT_S[backend], **JOB_OPTS)
    with open(os.path.join(log_dir, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    build = result.get("extension", {})
    print(f"\n{backend} x {RANKS}: {result['status']} in {result['total_s']:.1f} s, phases "
          + ", ".join(f"{k} {v:.1f}s" for k, v in result["phase_s"].items()) + f"; record: {log_dir}"
          + (f"; extension {build.get('path')} {build.get('sha256')} ({build.get('mtime')})" if build else ""))
    return result


@pytest.fixture(scope="module")
def gloo_job(tmp_path_factory):
    return run("gloo", tmp_path_factory)


@pytest.fixture(scope="module")
def reccl_job(tmp_path_factory):
    return run("reccl", tmp_path_factory)


def reached(result: dict, what: str) -> None:
    """Fails (with why) unless the job got as far as the idle window."""
    if "idle" not in result:
        pytest.fail(f"{result['backend']} x {result['ranks']} never reached {what}: {result['status']}\n"
                    f"{result.get('detail', '')}")


def describe_idle(result: dict) -> str:
    idle = result["idle"]
    lines = [f"{idle['store_requests']} store requests ({idle['store_reads']} reads, {idle['store_bytes']} bytes, "
             f"{idle['store_connections_opened']} connections opened) in {idle['window_s']:.2f} s idle, "
             f"{result['ranks']} ranks, {result['groups_total']} groups",
             "by type: " + json.dumps(idle["store_by_type"]),
             "by key (digits as #): " + json.dumps(dict(list(idle["store_by_key"].items())[:20]))]
    lines += ["first requests seen:"] + [f"  {s}" for s in idle["store_samples"][:20]]
    return "\n".join(lines)


def torch_baseline_threads(gloo: dict) -> int:
    """B: the most threads a gloo rank of the job has that are not gloo's own."""
    return max(sum(count for name, count in names.items() if not name.startswith(GLOO_THREAD_PREFIXES))
               for names in gloo["thread_names_per_rank"])


# --------------------------------------------------------------------------- tests


def test_gloo_idle_sends_no_store_requests(gloo_job, record_property):
    """The harness is fair: a Gloo job of the same shape is silent on the store while idle."""
    reached(gloo_job, "the idle window")
    record_property("gloo_idle_store_requests", gloo_job["idle"]["store_requests"])
    print(describe_idle(gloo_job))
    assert gloo_job["status"] == "ok", f"{gloo_job['status']}: {gloo_job.get('detail')}"
    assert gloo_job["errors"] == [], gloo_job["errors"]
    assert gloo_job["idle"]["store_requests"] == 0 and gloo_job["idle"]["store_reads"] == 0, \
        describe_idle(gloo_job)


def test_reccl_exact_results(reccl_job):
    """Every rank finishes every phase, and every collective result is bit-exact."""
    assert reccl_job["status"] == "ok", f"{reccl_job['status']}: {reccl_job.get('detail')}"
    assert reccl_job["errors"] == [], "\n".join(reccl_job["errors"][:20])


def test_reccl_idle_sends_no_store_requests(reccl_job, record_property):
    """Nothing in the store while nothing changes (issue 14: control plane event-driven)."""
    reached(reccl_job, "the idle window")
    idle = reccl_job["idle"]
    record_property("reccl_idle_store_requests", idle["store_requests"])
    record_property("reccl_idle_store_reads", idle["store_reads"])
    print(describe_idle(reccl_job))
    assert idle["store_requests"] == 0 and idle["store_reads"] == 0, describe_idle(reccl_job)


def test_reccl_threads_per_rank_bounded(reccl_job, gloo_job, record_property):
    """Threads per rank, transport threads included, stay within 16 + 2 x NICs + B."""
    reached(reccl_job, "the idle window")
    reached(gloo_job, "the idle window (for the baseline)")
    nics = reccl_job["nics"]
    baseline = torch_baseline_threads(gloo_job)
    bound = THREAD_BUDGET + THREADS_PER_NIC * nics + baseline
    worst = max(reccl_job["threads_non_transport_per_rank"])
    total = reccl_job["threads_max"]
    record_property("reccl_threads_per_rank_max", total)
    record_property("reccl_non_transport_threads_per_rank_max", worst)
    record_property("gloo_threads_per_rank_max", gloo_job["threads_max"])
    print(f"threads per rank: reccl {total} (not transport: {worst}), gloo {gloo_job['threads_max']}; "
          f"bound {THREAD_BUDGET} + {THREADS_PER_NIC} x {nics} NICs + B={baseline} = {bound}; "
          f"reccl rank {reccl_job['thread_names_worst_rank']['rank']}: "
          f"{json.dumps(reccl_job['thread_names_worst_rank']['names'])}")
    assert total <= bound, (
        f"{total} threads in a reccl rank ({worst} not transport; bound {THREAD_BUDGET} + {THREADS_PER_NIC} x "
        f"{nics} NICs + B={baseline} = {bound}); by name in rank "
        f"{reccl_job['thread_names_worst_rank']['rank']}: {json.dumps(reccl_job['thread_names_worst_rank']['names'])}")


# --------------------------------------------------------------------------- busbw over sizes and ops (issue 15)

BUSBW_RANKS = 4
BUSBW_OPS = ("all_reduce", "all_gather", "reduce_scatter")
BUSBW_JOB_S = 60.0  # one 4-rank job, bounded as a whole


def _fake_collective(busbw, rank: int, size: int, corrupt=None):
    """A stand-in for run_collective that computes what ``size`` ranks would get, from this
    rank's input alone (the pattern is known); ``corrupt(out)`` then spoils the output."""
    import torch

    total = float(size * (size - 1) // 2)

    def run(op, out, inp):
        if op == "all_reduce":
            inp.sub_(rank).mul_(size).add_(total)
        elif op == "all_gather":
            chunk = inp.numel()
            base = busbw._pattern(out.numel()).float()
            out.copy_(base + torch.arange(out.numel()).div(chunk, rounding_mode="floor").float())
        else:
            chunk = out.numel()
            out.copy_((inp[rank * chunk:(rank + 1) * chunk] - rank) * size + total)
        if corrupt is not None:
            corrupt(op, out if op != "all_reduce" else inp)
    return run


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", BUSBW_OPS)
def test_busbw_check_catches_wrong_results(op, monkeypatch):
    """The rank's bit-for-bit check, without processes: a right result passes, an output the
    op did not write and one wrong element (the last) are caught, with its index."""
    rank, size, nominal = 1, BUSBW_RANKS, 3 << 20  # 3 MiB: several check chunks, and 4 segments
    monkeypatch.setattr(scale_busbw, "run_collective", _fake_collective(scale_busbw, rank, size))
    errors = []
    got = scale_busbw.measure_busbw(op, nominal, 1, 2, rank, size, errors)
    assert errors == [] and got["mean_s"] > 0 and got["bytes"] == nominal
    assert (got["in_count"], got["out_count"]) == {
        "all_reduce": (nominal // 4, nominal // 4), "all_gather": (nominal // 4 // size, nominal // 4),
        "reduce_scatter": (nominal // 4, nominal // 4 // size)}[op]

    monkeypatch.setattr(scale_busbw, "run_collective", lambda op, out, inp: None)  # writes nothing
    errors = []
    scale_busbw.measure_busbw(op, nominal, 1, 2, rank, size, errors)
    assert len(errors) == 2, errors  # the warm-up op and the one after the timed loop

    def last_wrong(op, out):
        out[-1] += 1
    monkeypatch.setattr(scale_busbw, "run_collective", _fake_collective(scale_busbw, rank, size, last_wrong))
    errors = []
    got = scale_busbw.measure_busbw(op, nominal, 0, 1, rank, size, errors)
    assert len(errors) == 1 and f"output element {got['out_count'] - 1} " in errors[0], errors


def test_busbw_counts_shrink_with_size():
    """16 MiB keeps the old counts (warmup/2 untimed, --busbw-iters timed); larger sizes run fewer ops,
    smaller ones more, within bounds; the plan is ops outer, sizes inner."""
    assert scale_busbw.busbw_counts(16 << 20, 5, 10) == (5, 5)
    assert scale_busbw.busbw_counts(256 << 20, 5, 10) == (1, 2)
    assert scale_busbw.busbw_counts(1 << 20, 5, 10) == (5, 20)
    assert scale_busbw.busbw_counts(256 << 20, 1, 2) == (1, 1)
    plan = scale_busbw.busbw_plan(["all_gather", "all_reduce"], [1 << 20, 64 << 20], 5, 10)
    assert [(p["op"], p["size_bytes"]) for p in plan] == [
        ("all_gather", 1 << 20), ("all_gather", 64 << 20), ("all_reduce", 1 << 20), ("all_reduce", 64 << 20)]
    assert scale_busbw.bus_factor("all_reduce", 4) == 1.5 and scale_busbw.bus_factor("all_gather", 4) == 0.75


@pytest.mark.timeout(150)
def test_busbw_sizes_and_ops_table(tmp_path):
    """A real 4-rank job per backend with --busbw-sizes-mib 1 --busbw-ops all_reduce all_gather
    reduce_scatter: every (op, size) has a row with positive busbw for reccl and gloo, the same
    ops counts for both, and zero wrong results."""
    busbw = [(op, 1 << 20) for op in BUSBW_OPS]
    runs = []
    for backend in ("reccl", "gloo"):
        result = scale_runner.run_job(backend, BUSBW_RANKS, idle_s=0.5, settle_s=0.2, phase_timeout=45.0,
                                      op_timeout=40.0, warmup=2, small_iters=3, busbw_iters=1, busbw=busbw,
                                      env=scale_runner.rank_env(backend), log_dir=str(tmp_path / backend),
                                      total_timeout=BUSBW_JOB_S)
        print(f"{backend} x {BUSBW_RANKS}: {result['status']} in {result['total_s']:.1f} s, phases "
              + ", ".join(f"{k} {v:.1f}s" for k, v in result["phase_s"].items()))
        assert result["status"] == "ok", f"{backend}: {result['status']}: {result.get('detail')}"
        assert result["errors"] == [], "\n".join(result["errors"][:20])
        assert [(b["op"], b["bytes"]) for b in result["busbw"]] == busbw
        assert all(b["busbw_GBps"] > 0 and b["iters"] >= 1 for b in result["busbw"])
        runs.append(result)
    assert runs[0]["busbw_plan"] == runs[1]["busbw_plan"]
    table = scale_report.format_table(runs, scale_report.machine_info(), 0.5)
    print(table)
    for op in BUSBW_OPS:
        row = next(line for line in table.splitlines() if f"| 1 MiB {op} busbw (GB/s) |" in line)
        reccl, gloo, ratio = (cell.strip() for cell in row.split("|")[3:6])
        assert float(reccl) > 0 and float(gloo) > 0 and float(ratio) > 0, row
    wrong = next(line for line in table.splitlines() if "| wrong results |" in line)
    assert [cell.strip() for cell in wrong.split("|")[3:5]] == ["0", "0"], wrong


@pytest.mark.timeout(60)
def test_ring_ceiling_moves_bytes_on_every_rank():
    """bench/wire_ceiling.py: every rank of a 4-rank plain-socket ring receives at a
    positive rate, and format_ceilings puts busbw against it per backend."""
    ceiling = wire_ceiling.ring_ceiling(4, socks=2, seconds=0.3, timeout=20)
    assert len(ceiling["GBps_per_rank"]) == 4 and ceiling["min_GBps"] > 0, ceiling
    with pytest.raises(ValueError, match="ranks must be >= 2"):
        wire_ceiling.ring_ceiling(1)
    runs = [{"backend": "reccl", "ranks": 4, "busbw": [{"op": "all_reduce", "size_bytes": 1 << 24,
                                                        "busbw_GBps": ceiling["min_GBps"] / 2}]}]
    table = scale_report.format_ceilings(runs, {4: ceiling})
    row = next(line for line in table.splitlines() if line.startswith("| 4 |"))
    assert [cell.strip() for cell in row.split("|")[3:6]] == ["16 MiB all_reduce", "0.50", "—"], row


@pytest.mark.timeout(60)
def test_memory_ceiling_copies_in_every_process():
    """bench/memory_ceiling.py: two processes each copy at a positive rate, the
    traffic is twice the copy rate, and bad arguments are refused by name."""
    path = os.path.join(REPO, "bench", "memory_ceiling.py")
    out = subprocess.run([sys.executable, path, "--procs", "2", "--mib", "4", "--seconds", "0.2",
                          "--json", "/dev/stdout"], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout[out.stdout.index("{"):])
    run = record["runs"][0]
    assert run["procs"] == 2 and len(run["per_proc_copy_GBps"]) == 2
    assert all(rate > 0 for rate in run["per_proc_copy_GBps"]), run
    assert run["traffic_GBps"] == pytest.approx(2 * run["copy_GBps"])
    bad = subprocess.run([sys.executable, path, "--procs", "0"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "--procs" in bad.stderr, bad.stderr


@pytest.mark.timeout(60)
def test_fresh_fd_table_starts_the_command_with_64_fds_and_passes_its_exit_code(tmp_path):
    """bench/fresh_fd_table.py: the command runs with the kernel's initial 64-entry
    fd table even when the caller holds a high fd, its exit code comes back, and a
    missing command or none is refused by name."""
    path = os.path.join(REPO, "bench", "fresh_fd_table.py")
    probe = ("import sys; sizes = [l.split()[1] for l in open('/proc/self/status') "
             "if l.startswith('FDSize')]; print(sizes[0]); sys.exit(7)")
    high = os.dup2(0, 300)  # the caller's table is then at least 512 entries
    record = tmp_path / "fresh.json"
    try:
        out = subprocess.run([sys.executable, path, "--json", str(record), "--", sys.executable, "-c", probe],
                             capture_output=True, text=True, timeout=30, close_fds=False)
        plain = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                               timeout=30, close_fds=False)
    finally:
        os.close(high)
    assert out.returncode == 7 and out.stdout.strip() == "64", (out.stdout, out.stderr)
    written = json.loads(record.read_text())
    assert written["fd_table_at_start"] == 64 and written["exit_code"] == 7
    assert written["command"][:2] == [sys.executable, "-c"]
    assert int(plain.stdout.strip()) > 64  # without it the table would start larger
    missing = subprocess.run([sys.executable, path, "no-such-command-reccl"], capture_output=True,
                             text=True, timeout=30)
    assert missing.returncode == 127 and "no-such-command-reccl" in missing.stderr
    none = subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=30)
    assert none.returncode == 2 and "usage" in none.stderr


@pytest.mark.timeout(120)
def test_same_host_ring_sums_exactly_in_every_mode(tmp_path):
    """bench/same_host_ring.py: with 3 processes (odd: segments rotate the whole
    ring) the process_vm_readv ring, read whole or piece by piece (a piece that
    does not divide the segment), the direct reduce-scatter and the
    shared-mapping ring leave every rank with the exact sum of its final
    segment, the record has all four, and bad arguments are refused by name."""
    path = os.path.join(REPO, "bench", "same_host_ring.py")
    out = tmp_path / "ring.json"
    done = subprocess.run([sys.executable, path, "--procs", "3", "--mib", "1", "--reps", "2", "--piece-kib", "40",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    runs = json.loads(out.read_text())["runs"]
    assert sorted(r["mode"] for r in runs) == ["direct", "fused", "read", "shared"]
    assert all(r["procs"] == 3 and r["wrong"] == 0 and r["busbw_GBps"] > 0 for r in runs), runs
    assert all(f"{m}/read" in done.stdout for m in ("fused", "direct", "shared")), done.stdout
    bad = subprocess.run([sys.executable, path, "--procs", "1"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "--procs" in bad.stderr, bad.stderr


def test_shared_allreduce_sums_exactly_with_a_tail_piece(tmp_path):
    """bench/shared_allreduce.py: 3 processes (the share does not divide a piece)
    all_reduce a buffer that is not a whole number of pieces (the last piece is
    short) through both slot sets; every rank ends with the exact sum, the
    record carries what the bench tables read, and bad arguments are refused
    by name."""
    path = os.path.join(REPO, "bench", "shared_allreduce.py")
    out = tmp_path / "shm.json"
    done = subprocess.run([sys.executable, path, "--procs", "3", "--mib", "1.3", "--piece-mib", "0.5",
                           "--warmup", "1", "--iters", "3", "--json", str(out)],
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    (run,) = json.loads(out.read_text())["runs"]
    assert run["op"] == "all_reduce" and run["procs"] == 3 and run["wrong"] == 0, run
    assert run["count"] == int(1.3 * (1 << 20)) // 4 and run["bytes"] == run["count"] * 4, run
    assert run["piece_bytes"] == (1 << 19) and run["busbw"] > 0 and run["time_us"] > 0, run
    bad = subprocess.run([sys.executable, path, "--procs", "1"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "--procs" in bad.stderr, bad.stderr


@pytest.mark.timeout(200)
def test_allreduce_algos_puts_the_shared_memory_reference_beside_both_libraries(tmp_path):
    """bench/allreduce_algos.py --shm: a 2-rank run of ring, halving, Gloo and the
    library-free shared-memory all_reduce has a busbw for each in its one row,
    the ratios to Gloo and of reccl's best to the reference, and no wrong
    element; --shm with another op is refused by name."""
    path = os.path.join(REPO, "bench", "allreduce_algos.py")
    out = tmp_path / "algos.json"
    done = subprocess.run([sys.executable, path, "--ranks", "2", "--sizes-mib", "1", "--warmup", "1", "--iters", "2",
                           "--timeout", "60", "--shm", "--json", str(out)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    (record,) = json.loads(out.read_text())["runs"]
    (row,) = record["rows"]
    assert sorted(row["variants"]) == ["gloo", "halving", "ring", "shm"], row
    assert all(m["busbw"] > 0 and m["wrong"] == 0 for m in row["variants"].values()), row
    assert row["ratios"]["shm/gloo"] > 0 and row["ratios"]["best reccl/shm"] > 0, row
    assert "best reccl/shm" in done.stdout
    bad = subprocess.run([sys.executable, path, "--shm", "--ops", "all_gather"], capture_output=True, text=True,
                         timeout=30)
    assert bad.returncode == 2 and "--shm" in bad.stderr, bad.stderr


@pytest.mark.timeout(120)
def test_thread_cpu_reports_both_backends(tmp_path):
    """bench/thread_cpu.py: a 2-rank job per backend, a positive busbw for each and
    rank 0's threads by name; bad arguments are refused by name."""
    path = os.path.join(REPO, "bench", "thread_cpu.py")
    out = subprocess.run([sys.executable, path, "--ranks", "2", "--mib", "1", "--iters", "5",
                          "--timeout", "90", "--json", str(tmp_path / "t.json")],
                         capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = json.loads((tmp_path / "t.json").read_text())["runs"]
    assert [r["backend"] for r in runs] == ["reccl", "gloo"]
    assert all(r["busbw_GBps"] > 0 and r["rank0_cpu_ms_per_op"] for r in runs), runs
    assert any(name.startswith("reccl-") for name in runs[0]["rank0_cpu_ms_per_op"]), runs[0]
    bad = subprocess.run([sys.executable, path, "--ranks", "1"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "--ranks" in bad.stderr, bad.stderr
