"""The examples run as documented, so they cannot rot.

examples/ddp_failover.py and fsdp_failover.py run under torchrun (2 CPU ranks,
backend "reccl") with and without a NIC failure: both runs must end with bit-identical parameters, and
rank 0 must have seen both ranks' failovers through the job-wide event view (its
JSONL sink and its printed log).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from torch_reccl.bench import megatron_fault

from conftest import HELPERS, REPO
from wandb_run import finished_run_records, history_rows


def torchrun(script, *args, timeout=150, env_overrides=None, cwd=REPO):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(env_overrides or {})
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               os.path.join(REPO, "examples", script) if not os.path.isabs(script) else script, *args]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{script} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout


def checksum(output):
    found = re.findall(r"parameters sha256 ([0-9a-f]+)", output)
    assert len(found) == 1, output
    return found[0]


@pytest.mark.timeout(360)
@pytest.mark.parametrize("script, steps, fault_step", [("ddp_failover.py", 200, 50),
                                                       ("fsdp_failover.py", 60, 20)])
def test_training_example_is_bit_identical_and_shows_every_rank(tmp_path, script, steps, fault_step):
    jsonl = tmp_path / "events.jsonl"
    faulted = torchrun(script, "--steps", str(steps), "--fault-step", str(fault_step),
                       "--heal-after-s", "0.5", "--events-jsonl", str(jsonl))
    clean = torchrun(script, "--steps", str(steps), "--fault-step", "-1")
    assert checksum(faulted) == checksum(clean)
    assert "[reccl event]" not in clean

    events = [json.loads(line) for line in jsonl.read_text().splitlines()]
    failovers = {(e["rank"], e["detail"].split(":")[0]) for e in events if e["kind"] == "failover"}
    # rank 0's NIC died: both ends of its connections to rank 1 moved, on both ranks
    assert {(0, "sender"), (0, "receiver"), (1, "sender"), (1, "receiver")} <= failovers, events
    assert any(e["kind"] == "nic_down" and e["rank"] == 0 for e in events)
    assert not any(e["kind"] == "nic_down" and e["rank"] == 1 for e in events)  # a drill is process-local
    assert re.search(r"\[reccl event\] rank 1 failover on \S+", faulted), faulted


LAUNCHER = os.path.join(REPO, "examples", "megatron", "pretrain_gpt_reccl.py")
MEGATRON_CHECKOUT = os.path.join(HELPERS, "megatron_checkout")


@pytest.mark.timeout(240)
def test_megatron_launcher_hands_its_group_to_the_script_and_logs_to_the_last_ranks_run(tmp_path):
    """The launcher from a stand-in Megatron-LM checkout (tests/helpers/megatron_checkout), as
    its README says: the script imports the checkout's megatron package, argv reaches
    it without our --reccl-* options, it finds the group made (default backend
    "reccl"), --exit-signal-handler's flags are gathered through Megatron's
    dist_signal_handler (whose get_device raises for "reccl" unless the launcher
    adapts it) and stop every rank at the same step, and rank 0's failovers (host 0's
    NIC 0 down before iteration 51 by the launcher's fault schedule) land in the W&B
    run on the last rank."""
    output = torchrun(LAUNCHER, "--reccl-script", "pretrain_gpt.py", "--reccl-wandb",
                      "--reccl-fault-schedule", "h0nic0:down@step 50",
                      "--train-iters", "150", "--wandb-project", "reccl-megatron-test",
                      "--exit-signal-handler", cwd=MEGATRON_CHECKOUT,
                      env_overrides={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path),
                                     "WANDB_SILENT": "true", "RECCL_NICS": "127.0.0.1,127.0.0.2"})
    assert re.search(r"\[reccl event\] rank 0 failover on ", output), output
    # torchrun's single node is host 0: the fault fires in both its processes
    fired = re.findall(r"\[reccl fault\] before iteration (\d+): .*? on rank (\d)", output)
    assert sorted(fired) == [("51", "0"), ("51", "1")], output
    assert sorted(re.findall(r"rank (\d): exit signal at step (\d+)", output)) == [("0", "75"), ("1", "75")], output
    [run_file_dir] = re.findall(r"wandb run dir (\S+)", output)
    records = finished_run_records(os.path.dirname(run_file_dir))
    failovers = [row["reccl/failovers"] for row in history_rows(records) if "reccl/failovers" in row]
    # rank 0's sender and receiver ends and rank 1's: at least 4 failovers reached rank 1's run
    assert failovers and max(failovers) >= 4, failovers


def load_launcher():
    spec = importlib.util.spec_from_file_location("pretrain_gpt_reccl", LAUNCHER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("backend, cuda, local_rank, expected", [
    ("reccl", False, None, "cpu"), ("reccl", False, 3, "cpu"),
    ("reccl", True, None, "cuda"), ("reccl", True, 3, "cuda:3"),
    ("cuda:nccl,cpu:reccl", True, 1, "cuda:1"),
    ("nccl", True, 3, "megatron's"), ("gloo", False, None, "megatron's")])
def test_megatron_signal_handler_device_for_reccl(monkeypatch, backend, cuda, local_rank, expected):
    """Megatron's get_device() raises for any backend but nccl and gloo; the
    launcher's wrapper answers for reccl and leaves the others to Megatron."""
    import torch

    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    get_device = load_launcher().reccl_aware_get_device(lambda local_rank=None: "megatron's")
    assert str(get_device(local_rank)) == expected


# --------------------------------------------------------------------------- fault schedule


def test_megatron_fault_schedule_is_the_drills_by_iteration():
    launcher = load_launcher()
    faults = launcher.parse_iteration_schedule("h0nic0:down@step 20, h0nic0:up@step 40,rail1:flap@step 5")
    assert [(f.text, f.host, f.rail, f.action, f.at_step) for f in faults] == [
        ("h0nic0:down@step 20", 0, 0, "down", 20), ("h0nic0:up@step 40", 0, 0, "up", 40),
        ("rail1:flap@step 5", None, 1, "flap", 5)]
    assert launcher.parse_iteration_schedule(None) == [] and launcher.parse_iteration_schedule("none") == []
    from torch_reccl.drill.schedule import ScheduleError

    for bad, says in [("h0nic0:down@20s", "by iteration; use @step N"),
                      ("h0nic0:slow=10%@step 3", "needs the emulated fabric"),
                      ("h0eth0:down@step 3", "unknown target"), ("h0nic0:down@step", "not a time or step")]:
        with pytest.raises(ScheduleError, match=re.escape(says)):
            launcher.parse_iteration_schedule(bad)


def test_megatron_iteration_hook_fires_on_its_host_before_the_iteration_and_times_each_step():
    """The wrapper around Megatron's train_step: a fault with @step N fires before the
    train_step called with iteration=N (Megatron's logged iteration N+1), only in a
    process of the fault's host (a rail fault: every host); each call is timed."""
    launcher = load_launcher()
    faults = launcher.parse_iteration_schedule("h1nic0:down@step 2,h0nic1:blackhole@step 2,"
                                               "rail1:heal@step 3,h1nic0:up@step 4")
    ticks = iter(range(100))
    applied, calls = [], []

    def fake_train_step(model, iteration=None):
        calls.append((iteration, list(applied)))
        return {"lm loss": iteration}

    hook = launcher.IterationHook(faults, host=1, nic_names=["127.0.0.1", "127.0.0.2"],
                                  apply=lambda nic, action: applied.append((nic, action)) or f"{action} {nic}",
                                  clock=lambda: float(next(ticks)), announce=lambda line: None)
    module = type("training", (), {"train_step": staticmethod(fake_train_step)})
    hook.install(module)
    hook.install(module)  # once only
    results = [module.train_step("model", iteration=i) for i in range(6)]
    assert [r["lm loss"] for r in results] == list(range(6))
    assert [len(seen) for _, seen in calls] == [0, 0, 1, 2, 3, 3]  # fired before iterations 2, 3, 4
    assert applied == [("127.0.0.1", "down"), ("127.0.0.2", "heal"), ("127.0.0.1", "up")]
    assert [f["before_iteration"] for f in hook.fired] == [3, 4, 5]
    assert hook.step_s == {i: 1.0 for i in range(1, 7)}  # logged numbering, one tick each
    # Without iteration= (older Megatron), calls are counted.
    counting = launcher.IterationHook(faults, host=1, nic_names=["a", "b"], apply=lambda nic, action: action,
                                      announce=lambda line: None)
    step = counting.wrap(lambda: None)
    for _ in range(3):
        step()
    assert [f["fault"] for f in counting.fired] == ["h1nic0:down@step 2"] and sorted(counting.step_s) == [1, 2, 3]


def test_megatron_summary_separates_fault_free_steps_from_the_spike():
    launcher = load_launcher()
    faults = launcher.parse_iteration_schedule("h0nic0:down@step 20,h0nic0:up@step 40")
    step_s = {i: 0.010 for i in range(1, 61)}
    step_s[1] = 5.0                       # warm-up: not fault-free time
    step_s[23] = 0.500                    # the failover, 2 iterations after the fault fired
    step_s.update({i: 0.020 for i in range(27, 36)})  # on the backup NIC
    step_s[41] = 0.100                    # the failback
    events = [{"kind": "failover", "rank": 0}, {"kind": "failover", "rank": 1},
              {"kind": "failback", "rank": 0}, {"kind": "nic_down", "rank": 0}, {"kind": "slowdown", "rank": 0}]
    report = launcher.summarize(step_s, faults, events)
    assert report["iterations"] == 60
    assert report["fault_free_median_step_s"] == 0.010
    # fault-free: 3..15 and 47..60 (the span 21..41 widened by 5 iterations, warm-up 1..2 out)
    assert report["fault_free_iterations"] == 13 + 14
    assert report["degraded_median_step_s"] == 0.020  # 27..35: in the span, 6+ iterations off each fault
    assert [(f["before_iteration"], f["max_step_s"], f["max_at_iteration"]) for f in report["faults"]] == [
        (21, 0.5, 23), (41, 0.1, 41)]
    assert report["faults"][0]["vs_fault_free"] == pytest.approx(50.0)
    assert report["events"]["failover"] == 2 and report["events"]["failback"] == 1
    assert report["events_by_rank"]["failover"] == {"0": 1, "1": 1}
    lines = launcher.summary_lines(report)
    assert "fault-free median step 10.00 ms" in lines[0] and "500.00 ms at iteration 23, 50.00x" in lines[1]


@pytest.mark.timeout(300)
def test_megatron_launcher_fault_schedule_keeps_every_loss_and_exits_cleanly(tmp_path):
    """bench/megatron_fault.py's runner (torch_reccl/bench/megatron_fault.py) on the
    stand-in checkout, 2 ranks started without torchrun (rank 0 hosts the store, as on
    the GPU machine): fault-free, then
    rank 0's NIC 0 down before iteration 21 and up before 41 (inject_fault). The
    loss logged at every iteration and the final parameters are identical, the
    launcher's report has every step and both ranks' failovers and failbacks, and
    every rank exits 0 without a backtrace or a "Broken pipe" although the script
    leaves without destroying its process group."""
    pair = megatron_fault.run_pair(MEGATRON_CHECKOUT, str(tmp_path), "dp2", 60, "h0nic0:down@step 20,h0nic0:up@step 40",
                          timeout_s=120, gpus=1, megatron_args=[], log=lambda line: None)
    assert megatron_fault.verdict(pair, 60) == [], megatron_fault.verdict(pair, 60)
    clean, faulted = pair["runs"]["fault_free"], pair["runs"]["fault"]
    digests = [re.findall(r"rank (\d): parameters sha256 (\w+)", "".join(run["logs"])) for run in (clean, faulted)]
    assert len(digests[0]) == 2 and sorted(digests[0]) == sorted(digests[1])
    report = faulted["report"]
    assert sorted(map(int, report["step_s"])) == list(range(1, 61))
    # the collector, rank 0, is host 0: it fired both; rank 1 none
    assert [(f["fault"], f["before_iteration"]) for f in report["fired"]] == [
        ("h0nic0:down@step 20", 21), ("h0nic0:up@step 40", 41)]
    assert "[reccl fault]" in faulted["logs"][0] and "[reccl fault]" not in faulted["logs"][1]
    for run in (clean, faulted):
        for log in run["logs"]:
            assert "Traceback" not in log and "Broken pipe" not in log, log


@pytest.mark.timeout(300)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")
def test_megatron_fault_run_with_a_real_veth_down_keeps_every_loss(tmp_path):
    """The same runner with --link veth: both ranks in a 2-host emulated fabric, the
    launcher only reports progress (--reccl-fault-driver) and the bench itself takes
    host 0's eth0 veth down once 20 iterations are done and up after 40. Every loss
    and the final parameters equal the fault-free run's, the faults were real link
    events (the driver's record) and both ranks failed over and back. The stand-in's
    iterations take 50 ms each, so the failback (asynchronous: the healed NIC is
    re-dialled with a backoff of up to 2 s) fits in the 55 iterations after the heal."""
    from torch_reccl.fabric import Fabric

    fabric = Fabric(hosts=2, rails=2, name="mgt").up()
    try:
        link = megatron_fault.VethLink(fabric, str(tmp_path))
        pair = megatron_fault.run_pair(MEGATRON_CHECKOUT, str(tmp_path), "dp2", 80,
                              "h0nic0:down@step 15,h0nic0:up@step 25", timeout_s=150, gpus=1,
                              megatron_args=["--iteration-ms", "50"], log=lambda line: None, link=link)
    finally:
        fabric.down()
    assert megatron_fault.verdict(pair, 80) == [], megatron_fault.verdict(pair, 80)
    clean, faulted = pair["runs"]["fault_free"], pair["runs"]["fault"]
    digests = [re.findall(r"rank (\d): parameters sha256 (\w+)", "".join(run["logs"])) for run in (clean, faulted)]
    assert len(digests[0]) == 2 and sorted(digests[0]) == sorted(digests[1])
    assert clean["link_faults"] == []
    made = faulted["link_faults"]
    assert [m["fault"] for m in made] == ["h0nic0:down@step 15", "h0nic0:up@step 25"], made
    assert [m["iterations_done"] >= step for m, step in zip(made, (15, 25))] == [True, True], made
    assert "eth0 of host 0" in made[0]["what"] and made[0]["what"].endswith("down"), made
    assert faulted["report"]["events_by_rank"]["failover"].keys() == {"0", "1"}, faulted["report"]["events"]
    for run in (clean, faulted):
        for log in run["logs"]:
            assert "Traceback" not in log and "Broken pipe" not in log, log


@pytest.mark.timeout(300)
def test_megatron_launcher_policy_saves_through_megatrons_exit_path_and_resumes(tmp_path):
    """--reccl-policy advised under torchrun --max-restarts 1, stand-in checkout: host
    0's NIC 0 down before iteration 13 and the iterations three times slower from
    there (the slowdown the policy measures). The policy runs degraded to the next
    checkpoint, iteration 20, where Megatron's --exit-signal-handler path saves
    (--save) on the same iteration on every rank; the launcher exits 75, torchrun
    restarts the job, which loads the checkpoint (--load) and finishes: the final
    parameters equal a fault-free run's. (Megatron-LM's own save_checkpoint and
    load_checkpoint are the stand-in's here; not run against Megatron-LM.)"""
    def run(save_dir, *extra):
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   OMP_NUM_THREADS="1", RECCL_NICS="127.0.0.1,127.0.0.2")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "2", "--max-restarts", "1", LAUNCHER,
                   "--reccl-script", "pretrain_gpt.py", *extra, "--train-iters", "40",
                   "--exit-signal-handler", "--no-self-sigterm", "--iteration-ms", "10",
                   "--save", save_dir, "--load", save_dir, "--save-interval", "10"]
        done = subprocess.run(command, cwd=MEGATRON_CHECKOUT, env=env, capture_output=True,
                              text=True, timeout=240)
        assert done.returncode == 0, f"{done.returncode}:\n{done.stdout}\n{done.stderr}"
        return done.stdout + done.stderr

    clean = run(str(tmp_path / "clean"))
    jsonl = tmp_path / "events.jsonl"
    output = run(str(tmp_path / "job"), "--reccl-events-jsonl", str(jsonl),
                 "--reccl-fault-schedule", "h0nic0:down@step 12",
                 "--reccl-policy", "advised", "--reccl-t-detect", "10", "--reccl-t-reload", "0.1",
                 "--slow-from", "12", "--slow-iteration-ms", "60")
    exits = re.findall(r"rank (\d): exiting for rescheduling at step (\d+) \((\w+);", output)
    assert sorted(exits) == [("0", "20", "checkpoint_and_exit"), ("1", "20", "checkpoint_and_exit")], output
    assert sorted(re.findall(r"rank (\d): exit signal at step (\d+)", output)) == [
        ("0", "19"), ("1", "19")], output
    assert sorted(re.findall(r"rank (\d): loaded checkpoint at iteration (\d+)", output)) == [
        ("0", "20"), ("1", "20")], output
    advice = [r for r in map(json.loads, jsonl.read_text().splitlines()) if r["kind"] == "advice"]
    exit_record = next(r for r in advice if r["action"] == "checkpoint_and_exit")
    assert exit_record["step"] == 20 and exit_record["k_measured"] and exit_record["k"] > 1.5
    assert exit_record["checkpoint_interval_steps"] == 10 and exit_record["t_detect_s"] == 10
    # both attempts print their parameters (the first at iteration 20); the ranks' lines may
    # run into each other, so match the 64 hex digits alone
    [final] = set(re.findall(r"parameters sha256 ([0-9a-f]{64})", clean))
    assert re.findall(r"parameters sha256 ([0-9a-f]{64})", output).count(final) == 2, output


@pytest.mark.timeout(300)
def test_torchft_example_keeps_its_quorum_through_a_nic_and_heals_a_killed_replica():
    """examples/torchft_reccl.py as documented: replica 1's NIC lost at step 40 (its
    connections fail over, no quorum change), replica 1 killed at step 100 and healed
    from replica 0; both end with the same parameters."""
    pytest.importorskip("torchft", reason="needs torchft (pip install torchft, or the test extras)")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, os.path.join(REPO, "examples", "torchft_reccl.py")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "[example] final parameters equal on both replicas" in done.stdout, done.stdout[-3000:]
    found = re.findall(r"\[replica (\d)\] done: step 300, quorum ids seen \[([\d, ]+)\], failed steps "
                       r"\[([\d, ]*)\], reccl failovers (\d+)", done.stdout)
    finals = {r: ([int(q) for q in quorums.split(",")], [int(f) for f in failed.split(",") if f.strip()],
                  int(failovers)) for r, quorums, failed, failovers in found}
    assert set(finals) == {"0", "1"}, done.stdout[-3000:]
    quorums, failed, failovers = finals["0"]
    assert not [f for f in failed if f < 100], finals  # the lost NIC failed no step: failover, not torchft
    assert failovers >= 1, finals                      # replica 1's lost NIC moved replica 0's ends too
    assert len(quorums) >= 2, finals                   # replica 1 left the quorum and came back
