"""`reccl soak`: its fault schedule, its command line, and its checked job.

The schedule must be a pure function of its seed and arguments (a failing soak is
replayed from its seed), never put two faults on one NIC at once, let host
outages and splits have the fabric to themselves, and heal everything before the
end. The worker is run for real on loopback NICs (any user): two ranks, every op
checked, then a replay of the same training steps that must end bit-identical.
So is the plugin stream, its two ends over the plugin library on loopback NICs:
every message arrives intact, and a receiver that expects other bytes or another
size reports each message as wrong. The soak itself needs the emulated fabric
(root): docs/soak.md.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from torch_reccl.cli.launch import Job, LoopbackPlacement
from torch_reccl.soak.plugin_stream import ROLES
from torch_reccl.soak.runner import (
    PLUGIN_LABELS,
    Sample,
    SoakResult,
    SoakSettings,
    StreamResult,
    _absorb,
    _drain_stream,
    _stream_failures,
    inventory_growth,
    proc_inventory,
    resource_verdicts,
    stall,
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


def test_the_streams_reports_are_filed_progress_is_the_receivers_and_wrong_or_error_fails():
    stream = StreamResult()
    tick = {"kind": "tick", "bytes": 4096, "in_flight": 8, "longest_gap_s": 0.2,
            "longest_gap_end": 1000.5, "messages": 3, "wrong": 0, "t": 1001.0}
    assert stream.absorb("recv", {"kind": "start", "t": 1000.0})
    assert not stream.absorb("send", {**tick, "messages": 5})  # sending is not arriving
    assert stream.absorb("recv", tick)
    assert not stream.absorb("recv", {**tick, "t": 1002.0})  # nothing new arrived
    assert stream.absorb("recv", {**tick, "messages": 4, "bytes": 8192, "longest_gap_s": 1.5,
                                  "longest_gap_end": 1001.8, "t": 1003.0})
    assert stream.problems() == []
    summary = stream.summary(t0=990.0)
    assert summary["messages"] == 4 and summary["bytes"] == 8192 and summary["sent"] == 5
    assert summary["wrong"] == 0 and summary["errors"] == 0
    assert summary["longest_gap_s"] == 1.5 and summary["longest_gap_end_s"] == pytest.approx(11.8)
    stream.absorb("recv", {"kind": "wrong", "index": 7, "what": "bytes", "size": 4096, "first_byte": 9,
                           "got": 1, "expected": 2})
    stream.absorb("recv", {**tick, "wrong": 3})
    assert stream.summary()["wrong"] == 3
    (problem,) = stream.problems()
    assert problem.startswith("plugin stream: wrong message (3 in all)") and "'index': 7" in problem
    stream.absorb("send", {"kind": "error", "what": "test(send 12) returned ncclResult 6"})
    assert stream.problems()[-1] == \
        "plugin stream: the send end failed: test(send 12) returned ncclResult 6"
    assert stream.absorb("recv", {**tick, "kind": "done", "messages": 4, "bytes": 8192, "wrong": 5})
    assert stream.done["recv"]["role"] == "recv" and stream.summary()["wrong"] == 5
    json.dumps(stream.to_json(990.0))


def test_a_stall_is_judged_against_the_bound_plus_the_outages_in_its_window():
    spans = [(100.0, 120.0), (200.0, 205.0)]
    assert stall(29.0, 50.0, spans, 30.0) is None
    assert stall(31.0, 50.0, spans, 30.0) == {"t": 50.0, "stalled_s": 31.0, "allowed_s": 30.0}
    # 20 s of outage in the window: 50 s allowed
    assert stall(45.0, 130.0, spans, 30.0) is None
    assert stall(51.0, 130.0, spans, 30.0)["allowed_s"] == pytest.approx(50.0)
    # part of an outage: 30 + 3
    assert stall(34.0, 203.0, spans, 30.0)["allowed_s"] == pytest.approx(33.0)


def test_the_plugin_streams_resources_are_judged_as_a_ranks():
    settings = SoakSettings(duration_s=300.0, warmup_s=30.0, settle_s=20.0)
    result = SoakResult(world=1, plugin=StreamResult())
    assert result.processes() == [0, *PLUGIN_LABELS]
    for t in range(0, 300, 2):
        result.samples.append(Sample(float(t), 0, 100_000, 40, 9, 30))
        result.samples.append(Sample(float(t), "plugin-send", 80_000, 20, 5, 3))
        result.samples.append(Sample(float(t), "plugin-recv", 80_000 + (t > 250) * 10_000,
                                     20 + (t > 250), 5, 3 + (t > 250)))
    problems, summary = resource_verdicts(result, settings, faults_end_s=280.0)
    assert sorted(summary, key=str) == [0, "plugin-recv", "plugin-send"]
    assert {p.split(":")[0] for p in problems} == {"plugin-recv"}, problems
    assert any("RSS grew" in p for p in problems) and any("sockets not returned" in p for p in problems)
    # an end that never sampled (it died, or the stream never started) is named
    result.samples = [s for s in result.samples if s.rank != "plugin-send"]
    problems, _ = resource_verdicts(result, settings, faults_end_s=280.0)
    assert "plugin-send: no resource sample in the fault-free warm-up (it died early?)" in problems


def soak_args(*argv):
    from torch_reccl.cli import build_parser

    return build_parser().parse_args(["soak", *argv])


def test_no_plugin_leaves_the_stream_out_and_a_missing_library_is_said_before_anything_runs(
        monkeypatch, capsys):
    from torch_reccl.soak import cli

    assert cli.settings_of(soak_args()).plugin is True
    assert cli.settings_of(soak_args("--no-plugin")).plugin is False
    assert cli.plugin_problem() is None  # this checkout has the library

    def not_built():
        raise ImportError("/x/libnccl-net-reccl.so is not built; run: pip install --no-build-isolation -e .")

    monkeypatch.setattr("torch_reccl._native.plugin_path", not_built)
    assert "is not built" in cli.plugin_problem()
    assert cli.run(soak_args("--duration", "3m", "--name", "zz")) == 2
    err = capsys.readouterr().err
    assert "the plugin stream needs the NCCL net plugin library: /x/libnccl-net-reccl.so is not built" \
        in err and "--no-plugin runs the soak without it" in err
    assert cli.stream_line(None) == "plugin stream: not run (--no-plugin)"
    line = cli.stream_line({"messages": 10, "bytes": 3 << 20, "wrong": 0, "errors": 0,
                            "longest_gap_s": 1.25, "longest_gap_end_s": 42.0})
    assert line == ("plugin stream (host 0 -> host 1): 10 messages, 3 MiB, wrong 0, errors 0, "
                    "longest gap 1.25 s (ended at 42.0 s)")


def run_stream(tmp_path, duration: float, send=(), recv=()):
    """Both ends of the plugin stream on loopback NICs, as the soak starts them
    on its hosts: (what they reported, their exit codes)."""
    argv = [sys.executable, "-m", "torch_reccl.soak.plugin_stream", "--handle", str(tmp_path / "handle"),
            "--duration", str(duration), "--seed", "3", "--start-timeout", "60", "--finish-timeout", "60"]
    extra = {"send": list(send), "recv": list(recv)}
    stream = StreamResult()
    with Job(LoopbackPlacement(2, 2), argv, env={"RECCL_TRANSPORT": "tcp", "RECCL_NSOCKS": "1"},
             log_dir=str(tmp_path), names=list(PLUGIN_LABELS),
             per_rank_args=lambda index: ["--role", ROLES[index], *extra[ROLES[index]]]) as job:
        assert job.wait(duration + 120.0), f"the ends did not exit\n{job.logs()}"
        _drain_stream(job, stream)
        return stream, job.exit_codes(), _stream_failures(job, stream)


def test_the_plugin_stream_carries_every_message_intact_over_loopback(tmp_path):
    stream, codes, problems = run_stream(tmp_path, 5.0)
    assert codes == [0, 0] and problems == [], problems
    assert set(stream.started) == set(stream.done) == set(ROLES)
    summary = stream.summary()
    sent, received = stream.done["send"], stream.done["recv"]
    assert summary["messages"] == sent["messages"] == received["messages"] > 10
    assert sent["bytes"] == received["bytes"] == summary["bytes"] > 10 << 20
    assert summary["wrong"] == 0 and summary["errors"] == 0
    assert 0 < summary["longest_gap_s"] < 2.0
    ticks = [t for t in stream.ticks if t["role"] == "recv"]
    assert len(ticks) >= 3 and [t["messages"] for t in ticks] == sorted(t["messages"] for t in ticks)
    assert "plugin-recv.log" in os.listdir(tmp_path)


@pytest.mark.parametrize("what,send,recv", [
    ("bytes", ["--min-bytes", "64K", "--max-bytes", "64K"],
     ["--min-bytes", "64K", "--max-bytes", "64K", "--seed", "4"]),
    ("size", ["--min-bytes", "1000", "--max-bytes", "1000"], ["--min-bytes", "2000", "--max-bytes", "2000"]),
])
def test_a_receiver_expecting_other_bytes_or_another_size_reports_every_message_wrong(
        tmp_path, what, send, recv):
    """The receiver checks against another seed (same sizes, other bytes), or
    expects 2000 bytes where 1000 come: every message is wrong, none counted."""
    stream, codes, problems = run_stream(tmp_path, 2.0, send, recv)
    assert codes == [0, 1], codes  # the sender cannot tell; the receiver can
    received = stream.done["recv"]
    assert received["messages"] == 0 and received["wrong"] == stream.done["send"]["messages"] > 0
    assert len(stream.wrong) == min(10, received["wrong"])
    assert {w["what"] for w in stream.wrong} == {what}
    if what == "size":
        assert stream.wrong[0]["size"] == 1000 and stream.wrong[0]["expected_size"] == 2000
    assert problems and problems[0].startswith("plugin stream: wrong message")


def test_the_scheduling_probe_records_lateness_and_its_percentiles_bound_the_samples(tmp_path):
    """The probe beside a soak: a real run writes a histogram on SIGTERM, and the
    summary's percentiles are the upper edges of the buckets that hold them."""
    from torch_reccl.soak.probe import BUCKET_S, LatenessHistogram, summarize

    out = tmp_path / "lateness.json"
    probe = subprocess.Popen([sys.executable, "-m", "torch_reccl.soak.probe", "--out", str(out),
                              "--max-s", "30"], cwd=REPO,
                             env={**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")})
    time.sleep(1.0)
    probe.terminate()
    assert probe.wait(10) == 0
    real = summarize(json.loads(out.read_text()))
    assert real["count"] > 50 and 0 <= real["p50_ms"] <= real["p99_ms"] <= real["max_ms"] + BUCKET_S * 1e3

    histogram = LatenessHistogram()
    for late_ms in [0.05] * 98 + [4.0, 250.0]:  # the last beyond the buckets: counted, and the max
        histogram.add(late_ms / 1e3)
    summary = summarize(histogram.to_json())
    assert summary["count"] == 100
    assert summary["p50_ms"] == pytest.approx(0.1)
    assert summary["p99_ms"] == pytest.approx(4.1)
    assert summary["max_ms"] == pytest.approx(250.0)
    assert summarize(None)["count"] == 0
