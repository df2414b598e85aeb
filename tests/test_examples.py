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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
MEGATRON_CHECKOUT = os.path.join(REPO, "tests", "megatron_checkout")


@pytest.mark.timeout(240)
def test_megatron_launcher_hands_its_group_to_the_script_and_logs_to_the_last_ranks_run(tmp_path):
    """The launcher from a stand-in Megatron-LM checkout (tests/megatron_checkout), as
    its README says: the script imports the checkout's megatron package, argv reaches
    it without our --reccl-* options, it finds the group made (default backend
    "reccl"), --exit-signal-handler's flags are gathered through Megatron's
    dist_signal_handler (whose get_device raises for "reccl" unless the launcher
    adapts it) and stop every rank at the same step, and rank 0's failovers land in
    the W&B run on the last rank."""
    from test_integrations import finished_run_records, history_rows

    output = torchrun(LAUNCHER, "--reccl-script", "pretrain_gpt.py", "--reccl-wandb",
                      "--train-iters", "150", "--wandb-project", "reccl-megatron-test",
                      "--exit-signal-handler", cwd=MEGATRON_CHECKOUT,
                      env_overrides={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path),
                                     "WANDB_SILENT": "true", "RECCL_NICS": "127.0.0.1,127.0.0.2"})
    assert re.search(r"\[reccl event\] rank 0 failover on ", output), output
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
