"""GPU validation of the zero-code route: an unmodified ``backend="nccl"`` job
that never imports torch_reccl gets our plugin from the environment alone:

    NCCL_NET_PLUGIN=$(python -m torch_reccl --plugin-path) NCCL_NET=ReCCL python job.py

The job below (two ranks, NCCL P2P/SHM off so traffic uses the network) must
report through NCCL's INFO log that it uses the ReCCL network, and its
all_reduce results must be exact. Run:  python tests/gpu/zero_code_nccl.py
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

JOB = r'''
import os, sys, torch, torch.distributed as dist
rank = int(sys.argv[1]); store_path = sys.argv[2]
assert "torch_reccl" not in sys.modules
torch.cuda.set_device(rank)
dist.init_process_group("nccl", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                        device_id=torch.device("cuda", rank))
x = torch.full((1 << 20,), float(rank + 1), device="cuda")
for _ in range(10):
    dist.all_reduce(x)
torch.cuda.synchronize()
assert torch.all(x == 3.0 * 2 ** 9), x[:4]
assert "torch_reccl" not in sys.modules, "the job must not import torch_reccl"
dist.destroy_process_group()
print("RESULT-OK", rank)
'''


def main() -> int:
    import torch

    if torch.cuda.device_count() < 2:
        print("needs 2 GPUs; skipped")
        return 0
    plugin = subprocess.run([sys.executable, "-m", "torch_reccl", "--plugin-path"], check=True,
                            capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = []
        for rank in range(2):
            env = {**os.environ, "NCCL_NET_PLUGIN": plugin, "NCCL_NET": "ReCCL",
                   "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NVLS_ENABLE": "0",
                   "NCCL_HOSTID": f"zero-code-{rank}", "RECCL_NICS": "127.0.0.1,127.0.0.2",
                   "NCCL_SOCKET_IFNAME": "lo", "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
            procs.append(subprocess.Popen([sys.executable, "-c", JOB, str(rank), store], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    summary = []
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        uses = "Using network ReCCL" in out or "NET/ReCCL" in out
        good = proc.returncode == 0 and "RESULT-OK" in out and uses
        summary.append(f"rank {rank}: {'PASS' if good else 'FAIL'} exit {proc.returncode}, "
                       f"result {'RESULT-OK' in out}, uses ReCCL {uses}")
        if not good:
            print(out[-3000:])
    print("\n".join(summary))
    return 0 if all("PASS" in line for line in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
