"""`reccl soak`: its fault schedule, its command line, and its checked job.

The schedule must be a pure function of its seed and arguments (a failing soak is
replayed from its seed), never put two faults on one NIC at once, let host
outages and splits have the fabric to themselves, and heal everything before the
end. The worker is run for real on loopback NICs (any user): two ranks, every op
checked, then a replay of the same training steps that must end bit-identical.
The soak itself needs the emulated fabric (root): docs/soak.md.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from torch_reccl.cli.launch import Job, LoopbackPlacement
from torch_reccl.soak.runner import (
    Sample,
    SoakResult,
    SoakSettings,
    _absorb,
    inventory_growth,
    proc_inventory,
    resource_verdicts,
)
from torch_reccl.soak.schedule import (
    DEFAULT_MIX,
    EXCLUSIVE,
    KINDS,
    SoakScheduleError,
    make_schedule,
    outages,
    overlap_s,
    parse_mix,
)

from conftest import REPO


def soak(*args, timeout=60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "torch_reccl", "soak", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def claims(fault, hosts):
    return set(fault.nics_down(hosts) or [(fault.host, fault.rail)])


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another():
    one = make_schedule(7, 4, 2, 30.0, 3600.0, DEFAULT_MIX)
    again = make_schedule(7, 4, 2, 30.0, 3600.0, DEFAULT_MIX)
    other = make_schedule(8, 4, 2, 30.0, 3600.0, DEFAULT_MIX)
    assert [f.to_json() for f in one] == [f.to_json() for f in again]
    assert [f.to_json() for f in one] != [f.to_json() for f in other]


@pytest.mark.parametrize("hosts,rails", [(4, 2), (2, 2), (8, 4), (3, 1)])
def test_faults_never_share_a_nic_exclusive_ones_are_alone_and_all_heal_in_time(hosts, rails):
    faults = make_schedule(3, hosts, rails, 30.0, 2000.0, DEFAULT_MIX)
    assert len(faults) > 100
    kinds = {f.kind for f in faults}
    assert {"nic_down", "flap", "blackhole", "host_down"} <= kinds
    if rails >= 2:
        assert "split" in kinds
    for f in faults:
        assert 30.0 <= f.start_s < f.end_s <= 2000.0, f
    for i, a in enumerate(faults):
        for b in faults[i + 1:]:
            if b.start_s >= a.end_s:
                continue
            if b.start_s < a.end_s and a.start_s < b.end_s:
                assert a.kind not in EXCLUSIVE and b.kind not in EXCLUSIVE, (a, b)
                assert not claims(a, hosts) & claims(b, hosts), (a, b)
    # a split leaves its two hosts no rail in common; a host outage takes every NIC
    for f in faults:
        if f.kind == "split":
            lost_a, lost_b = (set(r) for r in f.rails_lost)
            assert lost_a | lost_b == set(range(rails)) and not lost_a & lost_b
        if f.kind == "host_down":
            assert len(f.nics_down(hosts)) == rails


def test_the_documented_two_hour_schedule_has_a_thousand_faults_of_every_kind():
    """`reccl soak --duration 2h --seed 2` (docs/soak.md): warm-up 30 s, settle 60 s."""
    faults = make_schedule(2, 4, 2, 30.0, 7200.0 - 60.0, DEFAULT_MIX)
    assert len(faults) >= 1000
    assert {f.kind for f in faults} == set(KINDS)


def test_outages_are_the_times_some_pair_of_hosts_has_no_common_rail():
    faults = make_schedule(2, 4, 2, 0.0, 600.0, {"host_down": 1})
    spans = outages(faults, 4, 2)
    assert [(f.start_s, f.end_s) for f in faults] == spans
    single = make_schedule(2, 4, 2, 0.0, 600.0, {"flap": 1})
    assert sum(b - a for a, b in outages(single, 4, 2)) < sum(b - a for a, b in spans)
    assert overlap_s([(0.0, 10.0), (20.0, 30.0)], 5.0, 25.0) == pytest.approx(10.0)


def test_bad_mixes_and_fabrics_are_refused_naming_what_is_valid():
    with pytest.raises(SoakScheduleError, match="KIND=WEIGHT with KIND one of nic_down"):
        parse_mix("nic_dwn=3")
    with pytest.raises(SoakScheduleError, match="every weight is 0"):
        parse_mix("nic_down=0")
    with pytest.raises(SoakScheduleError, match="at least 2 hosts"):
        make_schedule(0, 1, 2, 0.0, 10.0, DEFAULT_MIX)
    with pytest.raises(SoakScheduleError, match="slow needs --rate-mbit"):
        make_schedule(0, 4, 2, 0.0, 10.0, {"slow": 1}, rate_capped=False)
    assert parse_mix("nic_down=2,flap=1") == {"nic_down": 2.0, "flap": 1.0}


def test_cli_dry_run_prints_the_schedule_and_bad_arguments_exit_2():
    out = soak("--dry-run", "--duration", "5m", "--seed", "4")
    assert out.returncode == 0, out.stderr
    again = soak("--dry-run", "--duration", "5m", "--seed", "4")
    assert out.stdout == again.stdout and out.stdout.count("\n") > 20
    assert "faults over" in out.stderr
    bad = soak("--dry-run", "--duration", "40s")
    assert bad.returncode == 2 and "leaves no time for faults" in bad.stderr
    bad = soak("--dry-run", "--hosts", "9")
    assert bad.returncode == 2 and "--hosts must be in 2..8" in bad.stderr
    bad = soak("--dry-run", "--max-bytes", "1G")
    assert bad.returncode == 2 and "--max-bytes must be at most 256M" in bad.stderr
    bad = soak("--dry-run", "--mix", "bogus=1")
    assert bad.returncode == 2 and "KIND one of" in bad.stderr


def test_resource_verdicts_catch_a_leak_and_pass_a_flat_run():
    settings = SoakSettings(duration_s=300.0, warmup_s=30.0, settle_s=20.0)
    flat, leaky = SoakResult(world=1), SoakResult(world=1)
    for t in range(0, 300, 2):
        spike = 50_000 if t % 10 == 0 else 0  # a large message in flight at some samples
        in_flight = 1 if t % 6 == 0 else 0     # a dial's thread and socket
        flat.samples.append(Sample(float(t), 0, 100_000 + spike, 40 + in_flight, 9 + in_flight,
                                   30 + in_flight))
        leaky.samples.append(Sample(float(t), 0, 100_000 + 1000 * t, 40 + (t > 250), 9, 30))
    problems, summary = resource_verdicts(flat, settings, faults_end_s=280.0)
    assert problems == [] and summary[0]["rss_growth"] == 0.0
    assert summary[0]["threads"] == [9, 9]
    problems, _ = resource_verdicts(leaky, settings, faults_end_s=280.0)
    assert any("RSS grew" in p for p in problems)
    assert any("fds not returned" in p for p in problems)
    problems, _ = resource_verdicts(SoakResult(world=1), settings, faults_end_s=280.0)
    assert problems and "no resource sample" in problems[0]


def test_a_count_not_returned_is_named_by_thread_and_socket():
    import socket
    import threading

    before = proc_inventory(os.getpid())
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    dialed = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, name="soak-probe")
    worker.start()
    try:
        after = proc_inventory(os.getpid())
        port = listener.getsockname()[1]
        assert f"127.0.0.1:{port}->0.0.0.0:0 LISTEN" in after["sockets"]
        assert any(f"->127.0.0.1:{port} ESTABLISHED" in s for s in after["sockets"])
        grown = inventory_growth(before, after)
        assert f"+1 socket LISTEN on 127.0.0.1:{port}" in grown
        assert "+2 socket ESTABLISHED to 127.0.0.1" in grown
        assert any(g.startswith("+1 thread ") for g in grown)
        assert inventory_growth(after, after) == []
    finally:
        stop.set()
        worker.join()
        for s in (dialed, accepted, listener):
            s.close()
    assert proc_inventory(2 ** 22 + 1) is None


def inventoried_run(warm: list, end: dict, threads: int, sockets: int,
                    rank: int = 1) -> SoakResult:
    """4 ranks sampled every 2 s for 300 s; ``rank``'s thread and socket (and fd)
    counts rise by ``threads`` and ``sockets`` after 250 s and it holds ``end`` in
    the settle; the quiet samples of the warm-up (15-30 s) cycle through ``warm``."""
    result = SoakResult(world=4)
    for r in range(4):
        for t in range(0, 300, 2):
            late = r == rank and t > 250
            result.samples.append(Sample(float(t), r, 100_000, 40 + late * sockets,
                                         9 + late * threads, 30 + late * sockets))
            if 15 <= t < 30:
                result.inventory.setdefault(r, []).append((float(t), warm[t // 2 % len(warm)]))
            elif t > 290:
                result.inventory.setdefault(r, []).append((float(t), end if r == rank else warm[0]))
    return result


def test_growth_by_the_worker_pool_and_the_boards_store_connection_is_explained_the_rest_named():
    settings = SoakSettings(duration_s=300.0, warmup_s=30.0, settle_s=20.0)
    setup = {"198.19.0.1", "198.19.0.2"}
    quiet = {"threads": {"python": 2, "reccl-worker": 2, "reccl-io": 2},
             "sockets": {"198.18.0.2:5000->198.18.0.1:40000 ESTABLISHED": 8}}
    busy = {**quiet, "threads": {**quiet["threads"], "reccl-worker": 3}}
    # the pool as large as it was at its busiest in the warm-up, and the board's
    # store connection: 1 thread and 1 socket more, both explained
    end = {"threads": busy["threads"],
           "sockets": {**quiet["sockets"], "198.19.0.2:41000->198.19.0.1:29500 ESTABLISHED": 1}}
    problems, summary = resource_verdicts(inventoried_run([quiet, busy], end, 1, 1), settings,
                                          280.0, setup)
    assert problems == [] and summary[1]["explained"] == {"threads": 1, "sockets": 1, "fds": 1}
    # the same counts without the names to explain them
    problems, _ = resource_verdicts(inventoried_run([quiet], quiet, 1, 1), settings, 280.0, setup)
    assert {p.split(":")[1].split(" not")[0].strip() for p in problems} == \
        {"fds", "threads", "sockets"}, problems
    # a second store connection on a rank that hosts no store, and a dial's socket kept
    leaky = {**end, "sockets": {**end["sockets"],
                                "198.19.0.2:41001->198.19.0.1:29500 ESTABLISHED": 1,
                                "198.18.1.2:42000->198.18.1.3:6000 ESTABLISHED": 1}}
    problems, _ = resource_verdicts(inventoried_run([quiet, busy], leaky, 1, 3), settings,
                                    280.0, setup)
    named = [p for p in problems if "sockets not returned" in p]
    assert named and "+1 socket ESTABLISHED to 198.19.0.1" in named[0] \
        and "+1 socket ESTABLISHED to 198.18.1.3" in named[0], problems
    # the store's host may hold the other end of every rank's board connection
    at_store = {**end, "sockets": {**end["sockets"], **{
        f"198.19.0.1:29500->198.19.0.{h}:4100{h} ESTABLISHED": 1 for h in (1, 2)}}}
    problems, _ = resource_verdicts(inventoried_run([quiet, busy], at_store, 1, 3, rank=0),
                                    settings, 280.0, setup)
    assert problems == [], problems
    # a pool that ends larger than it ever was in the warm-up is not explained
    grown_pool = {**end, "threads": {**quiet["threads"], "reccl-worker": 4}}
    problems, _ = resource_verdicts(inventoried_run([quiet, busy], grown_pool, 2, 1), settings,
                                    280.0, setup)
    assert any("+2 thread reccl-worker" in p for p in problems), problems


def test_the_checked_job_runs_every_op_on_loopback_and_replays_bit_identically(tmp_path):
    """Two ranks, 12 s of checked ops after the sweep of every op; then the replay."""
    base = [sys.executable, "-m", "torch_reccl.soak.worker", "--seed", "5", "--max-bytes", str(1 << 20)]
    env = {"RECCL_CHANNELS": "2"}
    done = {}
    for label, extra in (("soak", ["--duration", "12"]), ("replay", None)):
        if label == "replay":
            extra = ["--replay", str(done["soak"][0]["steps"])]
        result = SoakResult(world=2)
        with Job(LoopbackPlacement(2, 2), base + extra, env=env, log_dir=str(tmp_path)) as job:
            deadline = time.monotonic() + 240.0
            while len(result.done) < 2 and not job.failed_ranks():
                assert time.monotonic() < deadline, f"not done within 240 s\n{job.logs()}"
                got = job.next_message(1.0)
                if got is not None:
                    _absorb(result, *got)
            assert not job.failed_ranks(), job.logs()
            assert job.wait(60.0)
        assert result.wrong == [], result.wrong
        done[label] = result.done
    soaked, replayed = done["soak"], done["replay"]
    assert soaked[0]["iterations"] > 20 and soaked[0]["wrong"] == 0
    assert {d["params_sha256"] for d in soaked.values()} == \
        {d["params_sha256"] for d in replayed.values()}
    log = open(os.path.join(tmp_path, "rank0.log")).read()
    swept = {line.split(": ")[1].split(" on ")[0] for line in log.splitlines()
             if line.startswith("op iteration -")}
    from torch_reccl.soak.worker import OPS
    assert swept == set(OPS)
    json.dumps(soaked)  # the driver's JSON takes what the ranks report
