"""`reccl bench`: the table parses and holds plausible numbers, bad arguments get
clear errors, and in the emulated fabric the NIC-down run really fails over.

The runs use small sizes and few iterations; speed is never asserted (that is
what bench/ is for), only that every number is positive, every checked element
right, and busbw follows from algbw by nccl-tests' factors.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from torch_reccl import cli
from torch_reccl.bench.cli import parse_ops, parse_size
from torch_reccl.bench.rank import bus_factor, shape_for

from conftest import REPO

OPS = ("all_reduce", "all_gather", "reduce_scatter")


def run_bench(*args, timeout=150) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "torch_reccl", "bench", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def table_rows(stdout: str):
    """Data rows of the table: every line that is not a '#' comment, split on blanks."""
    return [line.split() for line in stdout.splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.timeout(150)
def test_table_against_gloo_parses_with_positive_numbers():
    sizes = [64 << 10, 128 << 10, 256 << 10]
    done = run_bench("--min-bytes", "64K", "--max-bytes", "256K", "--ops",
                     "all_reduce,allgather,reduce-scatter", "--compare", "gloo",
                     "--warmup", "1", "--iters", "2", "--progress")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = table_rows(done.stdout)
    assert [(r[0], int(r[1])) for r in rows] == [(op, s) for op in OPS for s in sizes], done.stdout
    for row in rows:
        # op size count type | reccl: time algbw busbw #wrong | gloo: same | ratio
        assert len(row) == 4 + 4 + 4 + 1, row
        op, size, count, dtype = row[0], int(row[1]), int(row[2]), row[3]
        assert dtype == "float32" and count * 4 == size
        for first in (4, 8):
            time_us, algbw, busbw, wrong = map(float, row[first:first + 4])
            assert time_us > 0 and algbw > 0 and busbw > 0, row
            assert wrong == 0, row
            assert algbw == pytest.approx(size / (time_us * 1e-6) / 1e9, rel=0.01, abs=1e-3)
            assert busbw == pytest.approx(algbw * bus_factor(op, 2), rel=0.01, abs=1e-3)
        # The ratio is computed from unrounded busbw; the table prints busbw to 3
        # decimals (half a unit: 0.0005) and the ratio to 2 (0.005): on a slow
        # machine a busbw of 0.010 GB/s alone is 5% uncertain, so bound exactly.
        reccl_busbw, gloo_busbw = float(row[6]), float(row[10])
        lowest = (reccl_busbw - 0.0005) / (gloo_busbw + 0.0005)
        highest = (reccl_busbw + 0.0005) / max(gloo_busbw - 0.0005, 1e-9)
        assert lowest - 0.005 <= float(row[12]) <= highest + 0.005, row
    assert "[" in done.stderr and "18/18" in done.stderr, "no progress bar on stderr"


@pytest.mark.timeout(150)
def test_json_output_with_three_ranks():
    done = run_bench("--ranks", "3", "--rails", "3", "--ops", "reduce_scatter", "--min-bytes", "96K",
                     "--max-bytes", "96K", "--iters", "2", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(done.stdout)
    assert record["ranks"] == 3 and record["variants"] == ["reccl"] and not record["errors"]
    (row,) = record["rows"]
    assert row["op"] == "reduce_scatter" and row["bytes"] == 96 << 10
    m = row["variants"]["reccl"]
    assert m["wrong"] == 0 and m["busbw"] == pytest.approx(m["algbw"] * 2 / 3)
    assert "127.0.0.3" in record["where"]


def test_sizes_and_shapes():
    assert parse_size("1M") == 1 << 20 and parse_size("64k") == 64 << 10
    assert parse_size("1048576") == 1 << 20 and parse_size("2MiB") == 2 << 20
    assert parse_ops("allreduce,all_gather") == ["all_reduce", "all_gather"]
    # all_gather: size is the output; rounded down to ranks x element size
    assert shape_for("all_gather", 1000, 3, "float32") == (249, 996, 83, 249)
    assert shape_for("reduce_scatter", 1 << 20, 2, "float64") == (131072, 1 << 20, 131072, 65536)
    assert bus_factor("all_reduce", 4) == 1.5 and bus_factor("all_gather", 4) == 0.75


@pytest.mark.parametrize("args, message", [
    (["--min-bytes", "1X"], "'1X' is not a size"),
    (["--ops", "all_reduce,broadcast"], "unknown op 'broadcast'; valid ops: all_reduce, all_gather"),
    (["--fabric", "2by2"], "is not HOSTSxRAILS"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
    (["--fault", "h0nic0:down@5s"], "a bench fault has no time"),
    (["--fault", "h0nic0:up"], "valid actions: down, blackhole, slow=P%, lossy=P%"),
    (["--fault", "h0nic0:slow"], "slow needs a percent"),
    (["--fault", "eth0:down"], "unknown target 'eth0'"),
])
def test_bad_arguments_are_refused_by_the_parser(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--min-bytes", "4M", "--max-bytes", "1M"], "--min-bytes (4194304) is larger than --max-bytes"),
    (["--ranks", "1"], "--ranks must be 2..64"),
    (["--factor", "1"], "--factor must be an integer >= 2"),
    (["--compare", "nccl"], "valid baselines: gloo"),
    (["--compare", "reccl"], "is the backend itself"),
    (["--rate-mbit", "100"], "--rate-mbit needs --fabric"),
    (["--tcp-congestion", "reno"], "--tcp-congestion needs --fabric"),
    (["--fabric", "2x2", "--tcp-congestion", "Reno?"], "--tcp-congestion 'Reno?': want an algorithm's name"),
    (["--fabric", "2x2", "--ranks", "3"], "disagrees with --fabric"),
    (["--backend", "gloo", "--nic-down"], "only the reccl backend"),
    (["--backend", "gloo", "--fault", "h0nic0:down"], "only the reccl backend"),
    (["--fault", "h0nic1:slow=10%"], "needs --fabric HOSTSxRAILS"),
    (["--fault", "h0nic2:down"], "rail 2 does not exist; this run has 2 rails"),
    (["--fault", "h3nic0:down"], "host 3 does not exist; this run has 2 hosts"),
])
def test_inconsistent_arguments_are_explained(capsys, args, message):
    assert cli.main(["bench", *args]) == 2
    assert message in capsys.readouterr().err


def test_cuda_without_gpus_is_skipped_with_a_reason(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert cli.main(["bench", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "skipped" in err and "needs CUDA GPUs" in err and "--device cpu" in err


@pytest.mark.timeout(150)
def test_fabric_nic_down_run_fails_over():
    from torch_reccl.fabric import require_root

    require_root()
    done = run_bench("--fabric", "2x2", "--rate-mbit", "1000", "--ops", "all_reduce",
                     "--min-bytes", "1M", "--max-bytes", "2M", "--iters", "2", "--nic-down",
                     "--json", "-")
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(done.stdout)
    assert record["variants"] == ["reccl", "reccl,NIC0-down"] and not record["errors"]
    assert "emulated fabric" in record["where"] and "TCP cubic" in record["where"]
    assert record["failovers"]["reccl"] == 0
    assert record["failovers"]["reccl,NIC0-down"] >= 1
    for row in record["rows"]:
        for m in row["variants"].values():
            assert m["wrong"] == 0 and m["busbw"] > 0


@pytest.mark.timeout(200)
def test_fabric_fault_runs_two_nics_down_and_a_slow_nic():
    """--fault: two NICs of host 0 down (really, in the fabric) in one run, a NIC
    slowed by tbf in another; both exact, the first fails over."""
    from torch_reccl.fabric import require_root

    require_root()
    done = run_bench("--fabric", "2x3", "--rate-mbit", "1000", "--ops", "all_reduce",
                     "--min-bytes", "1M", "--max-bytes", "1M", "--iters", "2",
                     "--fault", "h0nic0:down,h0nic1:down", "--fault", "h0nic1:slow=20%", "--json", "-")
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(done.stdout)
    assert record["variants"] == ["reccl", "reccl,h0nic0:down+h0nic1:down", "reccl,h0nic1:slow=20%"]
    assert not record["errors"], record["errors"]
    assert record["failovers"]["reccl"] == 0
    assert record["failovers"]["reccl,h0nic0:down+h0nic1:down"] >= 2, record["failovers"]
    for row in record["rows"]:
        assert set(row["variants"]) == set(record["variants"])
        for m in row["variants"].values():
            assert m["wrong"] == 0 and m["busbw"] > 0


@pytest.mark.timeout(150)
def test_loopback_nic_down_run_fails_over():
    # On loopback the driver cannot reach the ranks' NICs: rank 0 injects the fault.
    done = run_bench("--ops", "all_reduce", "--min-bytes", "1M", "--max-bytes", "1M",
                     "--iters", "2", "--nic-down", "--json", "-")
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(done.stdout)
    assert record["failovers"]["reccl"] == 0
    assert record["failovers"]["reccl,NIC0-down"] >= 1, record


# --------------------------------------------------------------------------- bench/ scripts

BENCH = os.path.join(REPO, "bench")


def bench_scripts():
    """The runnable scripts of bench/ (reccl_bench_runs.py is their shared helper)."""
    for name in sorted(os.listdir(BENCH)):
        if name.endswith(".py"):
            with open(os.path.join(BENCH, name)) as f:
                if 'if __name__ == "__main__":' in f.read():
                    yield name


@pytest.mark.timeout(120)
def test_every_bench_script_takes_json():
    """Each bench script writes its result records with --json PATH, as `reccl bench` does."""
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    lacking = []
    for name in bench_scripts():
        done = subprocess.run([sys.executable, os.path.join(BENCH, name), "--help"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{name} --help: {done.stderr[-500:]}"
        if "--json" not in done.stdout:
            lacking.append(name)
    assert not lacking, f"no --json option: {lacking}"


@pytest.mark.timeout(120)
def test_stream_gaps_json_record(tmp_path):
    path = tmp_path / "gaps.json"
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, os.path.join(BENCH, "stream_gaps.py"), "--sizes", "4096,65536",
                           "--seconds", "0.5", "--json", str(path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(path.read_text())
    assert record["meta"]["command"].startswith("python bench/stream_gaps.py")
    assert [r["bytes"] for r in record["results"]] == [4096, 65536]
    for r in record["results"]:
        assert r["messages"] > 0 and r["msgs_per_s"] > 0 and r["gb_per_s"] > 0
        assert 0 <= r["gap_ms_p50"] <= r["gap_ms_p99"] <= r["gap_ms_max"]
        assert r["gaps_over_30ms"] <= r["gaps_over_10ms"] <= r["messages"]
