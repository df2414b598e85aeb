"""`reccl drill`: the fault schedule grammar, and real drills.

The drills train for real (2 ranks, the reccl backend on CPU) and check what a
user is promised: the run finishes, failovers were seen, the final parameters
are bit-identical to a fault-free run of the same steps, the PNG is written,
and the fabric is gone afterwards, also when the drill is killed by SIGTERM.
The fabric drills need root; the inject_fault drill runs anywhere.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from torch_reccl import cli
from torch_reccl.drill.schedule import ScheduleError, check_topology, fault_spans, parse_fault, parse_schedule

from conftest import REPO


def drill(*args, timeout=100) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "torch_reccl", "drill", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def fabric_leftovers(name: str) -> list:
    left = [n for n in (os.listdir("/run/netns") if os.path.isdir("/run/netns") else [])
            if n.startswith(f"reccl-{name}-")]
    if os.path.exists(f"/run/reccl-fabric/{name}.json"):
        left.append(f"/run/reccl-fabric/{name}.json")
    return left


def event_summary(events: list, limit: int = 24) -> str:
    """One short line per event (time, rank, kind, reason, NIC, detail), the first
    `limit`: a failure message that a truncated CI log still shows whole."""
    lines = [f"{e['t']:7.3f} r{e['rank']} {e['kind']}/{e['reason']} {e['nic']} {e['detail'][:80]}"
             for e in events[:limit]]
    if len(events) > limit:
        lines.append(f"... {len(events) - limit} more")
    return "\n".join(lines)


def summary_lines(stdout: str) -> str:
    """The drill summary's step-time, failover and event-count lines."""
    return "\n".join(line for line in stdout.splitlines()
                     if line.strip().startswith(("step time", "failovers", "events", "throughput")))


# --------------------------------------------------------------------------- schedule


def test_schedule_targets_actions_and_times():
    faults = parse_schedule("rail1:down@20s, rail1:up@40s")
    assert [(f.rail, f.host, f.action, f.at_s, f.at_step) for f in faults] == [
        (1, None, "down", 20.0, None), (1, None, "up", 40.0, None)]
    (flap,) = parse_schedule("h3nic0:FLAP@step 50")
    assert (flap.host, flap.rail, flap.action, flap.at_step, flap.text) == (3, 0, "flap", 50, "h3nic0:flap@step 50")
    (hole,) = parse_schedule("nic1:blackhole@1500ms")
    assert (hole.host, hole.rail, hole.at_s, hole.target) == (0, 1, 1.5, "h0nic1")
    assert parse_fault("rail0:heal@step7").at_step == 7
    assert parse_fault("rail0:down@.5s").at_s == 0.5
    assert [f.text for f in parse_schedule(["rail0:down@1s", "rail0:up@2s"])] == ["rail0:down@1s", "rail0:up@2s"]
    assert parse_schedule("none") == [] and parse_schedule([]) == []
    assert hole.due(1.5, 0) and not hole.due(1.49, 10**6)
    assert flap.due(0.0, 50) and not flap.due(1e9, 49)


def test_schedule_slow_and_lossy_nics():
    slow, lossy, heal = parse_schedule("h0nic1:slow=10%@5s, H0NIC1:Lossy=2.5%@step 3,h0nic1:heal@9s")
    assert (slow.host, slow.rail, slow.action, slow.percent, slow.at_s) == (0, 1, "slow", 10.0, 5.0)
    assert slow.text == "h0nic1:slow=10%@5s"
    assert (lossy.action, lossy.percent, lossy.at_step, lossy.text) == (
        "lossy", 2.5, 3, "h0nic1:lossy=2.5%@step 3")
    assert heal.percent is None
    assert parse_fault("rail0:slow=.5%@1s").percent == 0.5
    spans = fault_spans([(slow, 5.0), (heal, 9.0)], end_s=20.0)
    assert spans == [(5.0, 9.0, "h0nic1 slow")]
    spans = fault_spans([(parse_fault("rail1:lossy=5%@1s"), 1.0), (parse_fault("rail1:heal@4s"), 4.0)],
                        end_s=20.0)
    assert spans == [(1.0, 4.0, "rail1 lossy")]


@pytest.mark.parametrize("text, message", [
    ("h0nic1:slow@5s", "slow needs a percent, the share of the fabric rate the NIC keeps: e.g. slow=10%"),
    ("h0nic1:lossy@5s", "lossy needs a percent, the share of frames it drops: e.g. lossy=10%"),
    ("h0nic1:slow=10@5s", "'10' is not a percent; use e.g. slow=10%"),
    ("h0nic1:slow=fast%@5s", "'fast%' is not a percent"),
    ("h0nic1:slow=0%@5s", "slow=0% is out of range; P must be in (0, 100)"),
    ("h0nic1:lossy=100%@5s", "lossy=100% is out of range; P must be in (0, 100)"),
    ("h0nic1:lossy=-5%@5s", "is not a percent"),
    ("h0nic1:down=5%@5s", "down takes no value (only slow=P%, lossy=P% do)"),
    ("h0nic1:slower=5%@5s", "unknown action 'slower'; valid actions: down, up, flap, blackhole, "
                            "slow=P%, lossy=P%, heal"),
])
def test_schedule_slow_and_lossy_errors(text, message):
    with pytest.raises(ScheduleError) as info:
        parse_schedule(text)
    assert message in str(info.value)


def test_cli_refuses_slow_nics_it_cannot_make(capsys):
    assert cli.main(["drill", "--mode", "inject", "--fault", "h0nic1:lossy=5%@1s"]) == 2
    assert "no inject_fault equivalent; they need the emulated fabric" in capsys.readouterr().err
    assert cli.main(["drill", "--mode", "inject", "--rate-mbit", "0",
                     "--fault", "h0nic1:slow=10%@1s"]) == 2
    assert "no inject_fault equivalent" in capsys.readouterr().err


def test_cli_refuses_a_slow_nic_without_a_rate_cap(capsys):
    from torch_reccl.fabric import require_root

    require_root()
    assert cli.main(["drill", "--mode", "fabric", "--rate-mbit", "0",
                     "--fault", "h0nic1:slow=10%@1s"]) == 2
    assert "a slow NIC needs a rate-capped fabric to cut; give --rate-mbit > 0" in \
        capsys.readouterr().err


@pytest.mark.parametrize("text, message", [
    ("rail1:down", "has no '@WHEN' (e.g. rail1:down@20s)"),
    ("rail1@20s", "has no ':ACTION'"),
    ("switch1:down@2s", "unknown target 'switch1'; valid targets: railR"),
    ("rail1:explode@2s", "unknown action 'explode'; valid actions: down, up, flap, blackhole, "
                         "slow=P%, lossy=P%, heal"),
    ("rail1:down@20", "time '20' needs a unit: 20s, 20ms or step 20"),
    ("rail1:down@soon", "'soon' is not a time or step"),
    ("rail1:down@-3s", "is not a time or step"),
    ("rail1:down@1s,,rail1:up@2s", "empty item in the fault schedule"),
    ("h1nic:down@1s", "unknown target 'h1nic'"),
])
def test_schedule_errors_say_what_is_wrong(text, message):
    with pytest.raises(ScheduleError) as info:
        parse_schedule(text)
    assert message in str(info.value)


def test_schedule_must_fit_the_topology():
    check_topology(parse_schedule("rail1:down@1s,h1nic1:up@2s"), hosts=2, rails=2)
    with pytest.raises(ScheduleError, match=r"rail 2 does not exist; this run has 2 rails \(0..1\)"):
        check_topology(parse_schedule("rail2:down@1s"), hosts=2, rails=2)
    with pytest.raises(ScheduleError, match=r"host 2 does not exist; this run has 2 hosts \(0..1\)"):
        check_topology(parse_schedule("h2nic0:down@1s"), hosts=2, rails=2)


def test_fault_spans_pair_starts_with_their_ends():
    applied = [(f, t) for f, t in zip(parse_schedule(
        "rail1:down@1s,h0nic0:blackhole@2s,rail1:up@3s,rail0:heal@4s,h1nic0:flap@5s,h0nic1:down@6s"),
        (1, 2, 3, 4, 5, 6))]
    spans = fault_spans(applied, end_s=10.0, flap_s=2.0)
    assert spans == [(1, 3, "rail1 down"), (2, 4, "h0nic0 blackhole"), (5, 7.0, "h1nic0 flap"),
                     (6, 10.0, "h0nic1 down")]


@pytest.mark.parametrize("args, message", [
    (["--fault", "rail2:down@1s"], "rail 2 does not exist; this run has 2 rails"),
    (["--fault", "rail1:down@1s", "--rails", "1"], "rail 1 does not exist"),
    (["--fault", "rail0:down@1s", "--rails", "1"], "leaves no backup NIC"),
    (["--fault", "bogus"], "has no '@WHEN'"),
    (["--hosts", "1"], "needs --hosts >= 2"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--flap-count", "0"], "--flap-count >= 1"),
    (["--compare", "nccl"], "--compare nccl is the baseline of --device cuda; with --device cpu compare gloo"),
    (["--device", "cuda", "--compare", "gloo"],
     "--compare gloo is the baseline of --device cpu; with --device cuda compare nccl"),
])
def test_cli_refuses_bad_schedules_before_starting_anything(capsys, args, message):
    assert cli.main(["drill", *args]) == 2
    err = capsys.readouterr().err
    assert "reccl drill: error:" in err and message in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch sees a CUDA GPU: --device cuda is valid here")
def test_cli_refuses_cuda_without_a_gpu(capsys):
    assert cli.main(["drill", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert (f"--device cuda needs CUDA GPUs, and this torch ({torch.__version__}) sees none; "
            f"use --device cpu") in err, err


def test_cli_refuses_bad_durations(capsys):
    with pytest.raises(SystemExit):
        cli.main(["drill", "--duration", "soon"])
    assert "'soon' is not a duration; use e.g. 30s" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["drill", "--steps", "10", "--duration", "5s"])
    assert "not allowed with argument" in capsys.readouterr().err


# --------------------------------------------------------------------------- drills


def synthetic_run(label, losses, fault=True):
    """A RunResult as the runner builds one: 10 steps/s at 200 samples/s, and with
    `fault` rail 1 down from 4 s to 8 s, halving throughput, with a failover and a
    failback."""
    from torch_reccl.drill.runner import AppliedFault, RunResult

    run = RunResult(label, t0=0.0, world=2)
    for i, loss in enumerate(losses):
        t = (i + 1) * 0.1
        rate = 100.0 if fault and 4.0 <= t <= 8.0 else 200.0
        run.steps.append({"step": i + 1, "t": t, "loss": loss, "step_s": 0.1, "samples_per_s": rate})
    if fault:
        down, up = parse_schedule("rail1:down@4s,rail1:up@8s")
        run.applied = [AppliedFault(down, 4.0, 40, "rail switch down"),
                       AppliedFault(up, 8.0, 80, "rail switch up")]
        run.events = [{"kind": "failover", "t": 4.02, "rank": 0}, {"kind": "failback", "t": 8.5, "rank": 0}]
    return run


LOSSES = [2.3 * 0.98 ** i for i in range(120)]


def panels(figure):
    rate, loss = figure.axes
    assert rate.get_xlabel() == "time since training began (s)"
    assert rate.get_ylabel() == "throughput (samples/s)"
    assert loss.get_xlabel() == "training step"
    assert loss.get_ylabel() == "training loss (mean over ranks)"
    return rate, loss


def test_plot_shows_loss_by_step_over_the_reference_and_throughput_by_time(tmp_path):
    pytest.importorskip("matplotlib")
    from torch_reccl.drill.plot import drill_figure, plot_drill

    run, reference = synthetic_run("drill", LOSSES), synthetic_run("reference", LOSSES, fault=False)
    rate, loss = panels(drill_figure(run, "title", reference, flap_s=3.0))
    lines = {line.get_label(): line for line in loss.get_lines()}
    base, markers = lines["fault-free reference"], lines["this run (markers)"]
    assert list(base.get_xdata()) == list(markers.get_xdata()) == list(range(1, 121))
    assert list(base.get_ydata()) == list(markers.get_ydata()) == LOSSES
    assert base.get_linestyle() == "-" and markers.get_linestyle() == "None" and markers.get_marker() == "o"
    assert [text.get_text() for text in loss.texts] == ["max |\u0394loss| = 0 over 120 steps (identical)"]
    # the faults at the steps they came after; the rail's downtime shaded in steps too
    assert sorted(line.get_xdata()[0] for line in loss.get_lines() if line.get_linestyle() == "--") == [40, 80]
    # throughput by time: the dip while the rail was down is in the plotted data
    per_step = next(line for line in rate.get_lines() if line.get_label() == "per step")
    dip = {r for t, r in zip(per_step.get_xdata(), per_step.get_ydata()) if 4.0 <= t <= 8.0}
    assert list(per_step.get_xdata()) == [s["t"] for s in run.steps] and dip == {100.0}
    assert {line.get_label() for line in rate.get_lines()} >= {"failover (1)", "failback (1)"}

    path = tmp_path / "drill.png"
    assert plot_drill(run, str(path), "title", reference, flap_s=3.0) == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_states_how_far_a_run_is_from_its_reference_or_that_it_has_none():
    pytest.importorskip("matplotlib")
    from torch_reccl.drill.plot import drill_figure

    off = LOSSES[:50] + [LOSSES[50] + 0.25] + LOSSES[51:]
    _, loss = panels(drill_figure(synthetic_run("drill", off), "t", synthetic_run("ref", LOSSES, fault=False)))
    assert [text.get_text() for text in loss.texts] == ["max |\u0394loss| = 0.25 over 120 steps"]
    _, loss = panels(drill_figure(synthetic_run("drill", LOSSES), "t"))
    assert [text.get_text() for text in loss.texts] == ["no fault-free reference (--verify runs one)"]
    assert [line.get_label() for line in loss.get_lines() if line.get_marker() == "o"] == ["this run"]


def check_record(record: dict, steps, faults: int, verified: bool = True) -> None:
    run = record["run"]
    assert run["finished"] and run["error"] is None
    steps = steps or len(run["steps"])
    assert len(run["steps"]) == steps and run["steps"][-1]["step"] == steps
    assert len(run["applied"]) == faults and not run["not_applied"]
    kinds = [e["kind"] for e in run["events"]]
    assert "failover" in kinds and "failback" in kinds, kinds
    first_fault = run["applied"][0]["t"]
    assert all(e["t"] >= first_fault - 0.05 for e in run["events"] if e["kind"] == "failover")
    assert record["ok"]
    if not verified:
        assert record["verify"] is None and record["reference"] is None
        return
    assert record["verify"]["identical"] and record["verify"]["losses_identical"]
    assert len(record["reference"]["steps"]) == steps
    assert not any(e["kind"] == "failover" for e in record["reference"]["events"])


@pytest.mark.timeout(120)
def test_rail_down_and_up_in_the_fabric(tmp_path):
    from torch_reccl.fabric import require_root

    require_root()
    plot, out = tmp_path / "drill.png", tmp_path / "drill.json"
    # by time, so the rail is back for 3 s whatever the machine's speed (failback re-dials
    # with a backoff of up to 2 s)
    done = drill("--hosts", "2", "--rails", "2", "--rate-mbit", "1000", "--duration", "6s",
                 "--fault", "rail1:down@1.5s,rail1:up@3s", "--verify", "--name", "tdr1",
                 "--plot", str(plot), "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(out.read_text())
    assert record["mode"] == "fabric"
    check_record(record, steps=None, faults=2)
    assert record["run"]["steps"][-1]["t"] >= 6.0
    assert "rail switch rctdr1-r1 down" in record["run"]["applied"][0]["what"]
    nic_downs = {e["rank"] for e in record["run"]["events"] if e["kind"] == "nic_down"}
    assert nic_downs == {0, 1}, "every host saw its eth1 lose carrier"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 20_000
    assert "bit-identical to the fault-free run: YES" in done.stdout
    assert "verdict: OK" in done.stdout
    assert fabric_leftovers("tdr1") == []


@pytest.mark.timeout(150)
def test_slow_nic_in_the_fabric_is_degraded_and_training_stays_exact(tmp_path, monkeypatch):
    """A drill's slow= fault end to end: host 0's eth1 cut to 10% by tbf under the
    drill's training load is named degraded (reason slow) and traffic fails over
    off it, while every step's loss and the final parameters match the fault-free
    run. The heartbeat at 8 s, as in test_grey_fabric: this checks the detector,
    not the race with a TCP collapse (docs/grey_failures.md)."""
    from torch_reccl.fabric import require_root

    require_root()
    monkeypatch.setenv("RECCL_HEARTBEAT_MS", "8000")
    out = tmp_path / "drill.json"
    done = drill("--hosts", "2", "--rails", "2", "--rate-mbit", "1000", "--duration", "14s",
                 "--fault", "h0nic1:slow=10%@2s,h0nic1:heal@12s", "--verify", "--name", "tdsl",
                 "--plot", str(tmp_path / "drill.png"), "--json", str(out), timeout=140)
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(out.read_text())
    run = record["run"]
    assert run["finished"] and run["error"] is None and record["ok"]
    assert len(run["applied"]) == 2 and not run["not_applied"]
    assert "slowed to 10% of 1000 mbit/s" in run["applied"][0]["what"]
    slow_at = run["applied"][0]["t"]
    seen = event_summary(run["events"]) + "\n" + summary_lines(done.stdout)
    degraded = [e for e in run["events"] if e["kind"] == "degraded"]
    assert degraded, f"no degraded event:\n{seen}"
    assert all(e["reason"] == "slow" and e["t"] >= slow_at for e in degraded), seen
    assert any(e["kind"] == "failover" and e["reason"] == "slow" for e in run["events"]), seen
    assert record["verify"]["identical"] and record["verify"]["losses_identical"]
    assert "verdict: OK" in done.stdout
    assert fabric_leftovers("tdsl") == []


@pytest.mark.timeout(120)
def test_without_root_falls_back_to_inject_fault_on_loopback(tmp_path, monkeypatch, capsys):
    out = tmp_path / "drill.json"
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # as a user would run it
    code = cli.main(["drill", "--steps", "100", "--fault", "h1nic0:down@step 15",
                     "--fault", "h1nic0:up@step 35", "--no-plot", "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    assert "not root (network namespaces need root): no emulated fabric; falling back to " \
           "torch_reccl.inject_fault on loopback NICs" in captured.err
    record = json.loads(out.read_text())
    assert record["mode"] == "inject" and "loopback" in record["where"]
    check_record(record, steps=100, faults=2, verified=False)  # the fabric drill verifies
    assert [a["step"] for a in record["run"]["applied"]] == [15, 35]
    assert "inject_fault('lo:127.0.0.1', 'down') in rank 1" in record["run"]["applied"][0]["what"]
    assert "injected in-process with torch_reccl.inject_fault" in captured.err


@pytest.mark.timeout(90)
def test_sigterm_tears_the_fabric_down():
    from torch_reccl.fabric import require_root

    require_root()
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "torch_reccl", "drill", "--duration", "60s",
                             "--name", "tdr2", "--no-plot", "--rate-mbit", "1000"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    started = threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line)
            if "starting 2 ranks" in line:
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert started.wait(60), "".join(lines)
        time.sleep(3)  # the ranks are up and training inside the namespaces
        assert os.path.exists("/run/netns/reccl-tdr2-h0")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=45)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    reader.join(5)
    assert proc.returncode == 130, "".join(lines)
    assert "interrupted; tearing down" in "".join(lines)
    assert fabric_leftovers("tdr2") == []
