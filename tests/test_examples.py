"""The examples run as documented, so they cannot rot.

examples/ddp_failover.py and fsdp_failover.py run under torchrun (2 CPU ranks,
backend "reccl") with and without a NIC failure: both runs must end with bit-identical parameters, and
rank 0 must have seen both ranks' failovers through the job-wide event view (its
JSONL sink and its printed log).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(script, *args, timeout=150, env_overrides=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(env_overrides or {})
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               os.path.join(REPO, "examples", script) if not os.path.isabs(script) else script, *args]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
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


@pytest.mark.timeout(240)
def test_megatron_launcher_hands_its_group_to_the_script_and_logs_to_the_last_ranks_run(tmp_path):
    """The launcher with a stand-in for Megatron's script (tests/megatron_standin.py):
    argv reaches the script without our --reccl-* options, the script finds the
    group made, and rank 0's failovers land in the W&B run on the last rank."""
    from test_integrations import finished_run_records, history_rows

    standin = os.path.join(REPO, "tests", "megatron_standin.py")
    output = torchrun(os.path.join(REPO, "examples", "megatron", "pretrain_gpt_reccl.py"),
                      "--reccl-backend", "reccl", "--reccl-script", standin, "--reccl-wandb",
                      "--train-iters", "150", "--wandb-project", "reccl-megatron-test",
                      env_overrides={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path),
                                     "WANDB_SILENT": "true", "RECCL_NICS": "127.0.0.1,127.0.0.2"})
    assert re.search(r"\[reccl event\] rank 0 failover on ", output), output
    [run_file_dir] = re.findall(r"wandb run dir (\S+)", output)
    records = finished_run_records(os.path.dirname(run_file_dir))
    failovers = [row["reccl/failovers"] for row in history_rows(records) if "reccl/failovers" in row]
    # rank 0's sender and receiver ends and rank 1's: at least 4 failovers reached rank 1's run
    assert failovers and max(failovers) >= 4, failovers
