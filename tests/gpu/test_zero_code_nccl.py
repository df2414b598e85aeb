"""GPU check of the zero-code route: an unmodified ``backend="nccl"`` job that never
imports torch_reccl gets our plugin from the environment alone:

    NCCL_NET_PLUGIN=$(python -m torch_reccl --plugin-path) NCCL_NET=ReCCL python job.py

The job below runs as two ranks that look like two hosts (``two_host_env``; with
one GPU they share it). NCCL's INFO log must say it uses the ReCCL network and
the all_reduce results must be exact.

Run with the other GPU checks: ``python -m pytest -m gpu tests/gpu`` (docs/gpu_tests.md).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from conftest import needs_gpus, two_host_env

pytestmark = needs_gpus(1)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB_TIMEOUT_S = 240

JOB = r'''
import os, sys, torch, torch.distributed as dist
rank = int(sys.argv[1]); store_path = sys.argv[2]
assert "torch_reccl" not in sys.modules
device = rank % torch.cuda.device_count()  # one GPU: both ranks share it (own NCCL_HOSTID)
torch.cuda.set_device(device)
dist.init_process_group("nccl", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                        device_id=torch.device("cuda", device))
x = torch.full((1 << 20,), float(rank + 1), device="cuda")
for _ in range(10):
    dist.all_reduce(x)
torch.cuda.synchronize()
assert torch.all(x == 3.0 * 2 ** 9), x[:4]
assert "torch_reccl" not in sys.modules, "the job must not import torch_reccl"
dist.destroy_process_group()
print("RESULT-OK", rank)
'''


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_unmodified_nccl_job_uses_the_plugin_from_the_environment(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    plugin = subprocess.run([sys.executable, "-m", "torch_reccl", "--plugin-path"], check=True,
                            capture_output=True, text=True, env=env, timeout=60).stdout.strip()
    assert os.path.isfile(plugin), plugin
    logs = [tmp_path / f"rank{rank}.log" for rank in range(2)]
    procs = []
    for rank in range(2):
        rank_env = {**env, **two_host_env(rank, "zero-code"), "NCCL_NET_PLUGIN": plugin,
                    "NCCL_NET": "ReCCL", "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
        with open(logs[rank], "w") as log:  # a file, not a pipe: NCCL's INFO log can fill a pipe
            procs.append(subprocess.Popen([sys.executable, "-c", JOB, str(rank), str(tmp_path / "store")],
                                          env=rank_env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + JOB_TIMEOUT_S
    try:
        while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        hung = [rank for rank, proc in enumerate(procs) if proc.poll() is None]
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    problems = []
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        out = log.read_text()
        uses = "Using network ReCCL" in out or "NET/ReCCL" in out
        if rank in hung or proc.returncode != 0 or f"RESULT-OK {rank}" not in out or not uses:
            problems.append(f"rank {rank}: {'hung' if rank in hung else f'exit {proc.returncode}'}, "
                            f"result ok {f'RESULT-OK {rank}' in out}, uses ReCCL {uses}\n{out[-3000:]}")
    assert not problems, "\n".join(problems)
