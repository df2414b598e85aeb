"""GPU check: Megatron-LM's pretrain_gpt.py through a NIC failure, loss for loss.

Megatron-LM itself (a checkout's folder: pretrain_gpt.py, megatron/, gpt_builders.py,
model_provider.py, named by MEGATRON_LM_DIR; not part of this repository) trains a
tiny GPT through examples/megatron/pretrain_gpt_reccl.py, 2 ranks data-parallel,
each its own "host" to NCCL (own NCCL_HOSTID, P2P, SHM and NVLink multicast off,
CUDA_VISIBLE_DEVICES=0 and LOCAL_RANK=0 in both: they share one GPU), so every byte
between them crosses the net plugin over the loopback NICs 127.0.0.1 and 127.0.0.2.
Two runs of ITERATIONS iterations: fault-free, and with the launcher's fault schedule
taking rank 0's NIC 0 down (inject_fault) before iteration FAULT_AT + 1 and up before
HEAL_AT + 1 (40 iterations before the end: failback is asynchronous, the sender
re-dials the healed primary). The "lm loss" Megatron logs at every iteration (--log-interval 1) must
be identical, the fault run's events (every rank's, in the launcher's --reccl-report)
must hold failovers and failbacks, the fault-free run's none, and every rank must
exit 0 with no "Broken pipe" in its log. The runner and the checks are
torch_reccl/bench/megatron_fault.py's (bench/megatron_fault.py runs its full version:
300 iterations, DP 2 and TP 2).

Skipped, with the reason, without a CUDA GPU or without MEGATRON_LM_DIR. (Not a
RECCL_* name: torch_reccl refuses any RECCL_* variable that is not one of its settings.)
"""
from __future__ import annotations

import os

import pytest

from torch_reccl.bench import megatron_fault

from conftest import needs_gpus

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
ITERATIONS, FAULT_AT, HEAL_AT = 80, 20, 40
RUN_TIMEOUT_S = 300
MEGATRON_DIR = os.environ.get("MEGATRON_LM_DIR", "")


def megatron_problem():
    if not MEGATRON_DIR:
        return ("needs a Megatron-LM checkout: set MEGATRON_LM_DIR to its folder "
                "(pretrain_gpt.py, megatron/, gpt_builders.py, model_provider.py)")
    if not os.path.isfile(os.path.join(MEGATRON_DIR, "pretrain_gpt.py")):
        return f"MEGATRON_LM_DIR={MEGATRON_DIR} has no pretrain_gpt.py (a Megatron-LM checkout's root)"
    return None


pytestmark = needs_gpus(1) + [pytest.mark.skipif(megatron_problem() is not None,
                                                 reason=megatron_problem() or "")]


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
def test_megatron_loss_is_identical_through_a_nic_failure(tmp_path):
    pair = megatron_fault.run_pair(os.path.abspath(MEGATRON_DIR), str(tmp_path), "dp2", ITERATIONS,
                          f"h0nic0:down@step {FAULT_AT},h0nic0:up@step {HEAL_AT}", RUN_TIMEOUT_S, gpus=1)
    print(megatron_fault.table([pair]))
    problems = megatron_fault.verdict(pair, ITERATIONS)
    assert not problems, "\n".join(problems)
    fired = pair["runs"]["fault"]["report"]["fired"]
    assert [f["before_iteration"] for f in fired] == [FAULT_AT + 1, HEAL_AT + 1], fired


RESUME_TIMEOUT_S = 240


@pytest.mark.timeout(5 * RESUME_TIMEOUT_S + 60)
def test_a_resumed_megatron_run_logs_the_uninterrupted_losses(tmp_path):
    """A job stopped and resumed from its checkpoint is the same job: 60 iterations saved
    every 20 (--ckpt-format torch), uninterrupted; stopped at iteration 40 by Megatron's
    --exit-interval and resumed; stopped by the launcher's --reccl-policy restart right
    after rank 0's NIC is lost for good before iteration 26 (exit 75) and resumed from
    iteration 20 without the fault. Every logged loss and grad norm equals the
    uninterrupted run's (the second iteration after a start logs the mean of the first
    two, as Megatron does after any start), and the iteration-60 parameters are the
    uninterrupted run's bit for bit (bench/megatron_fault.py --resume)."""
    result = megatron_fault.run_resume(os.path.abspath(MEGATRON_DIR), str(tmp_path), RESUME_TIMEOUT_S, gpus=1)
    problems = megatron_fault.resume_verdict(result)
    assert not problems, "\n".join(problems)
