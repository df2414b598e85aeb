"""Does a copy wait for the application's CUDA calls? (the reason NVL uses own contexts)

Thread A plays the application: its stream is busy for 3 s (a collective in
flight) and A makes a pageable host-to-device copy behind it, so A sits inside
the CUDA driver for those 3 s. Thread B plays NCCL's proxy thread: 0.5 s later it
copies 12 MiB GPU -> pinned host memory, either with torch on a side stream (the
application's primary context) or with reccl's NVL stager (its own context),
out of a buffer from cudaMalloc or from CUDA's virtual memory API (torch's
expandable segments). The table shows how long B's copy took; "waited" means it
finished only when A's did (docs/nvl.md, "Own CUDA contexts").

    python bench/cuda_context_lock.py        # 2 GPUs not needed; one is enough
    python bench/cuda_context_lock.py --json lock.json
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

from reccl_bench_runs import write_json

CASES = [
    ("torch copy, primary context", "torch", False),
    ("reccl stager, cudaMalloc buffer", "stager", False),
    ("reccl stager, virtual-memory buffer", "stager", True),
]
BUSY_S, B_DELAY_S = 3.0, 0.5


def case(kind: str) -> None:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from torch_reccl import _native

    torch.cuda.set_device(0)
    n = 3 << 20
    pageable, landing = torch.randn(n), torch.empty(n, device="cuda")
    source, pinned = torch.randn(n, device="cuda"), torch.empty(n, pin_memory=True)
    side = torch.cuda.Stream()
    stager = None
    if kind == "stager":
        stager = _native.native().DeviceStager(max_transit_bytes=1 << 20)
        stager.prepare(0, source.numel() * 4, [])
    torch.cuda.synchronize()
    done = {}

    def application():
        landing.copy_(pageable)  # waits in the driver for the busy stream
        done["application"] = time.perf_counter()

    def proxy():
        time.sleep(B_DELAY_S)
        start = time.perf_counter()
        if stager is not None:
            stager.to_host(pinned.data_ptr(), source.data_ptr(), 0, source.numel() * 4, -1)
        else:
            with torch.cuda.stream(side):
                pinned.copy_(source, non_blocking=True)
            side.synchronize()
        done["copy"] = time.perf_counter()
        done["copy_s"] = done["copy"] - start

    torch.cuda._sleep(int(1.98e9 * BUSY_S))  # GPU cycles: ~BUSY_S at H200's 1.98 GHz
    threads = [threading.Thread(target=application), threading.Thread(target=proxy)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    exact = torch.equal(pinned, source.cpu())
    # B waited for A when B finished only as A did, long after it started
    waited = done["copy_s"] > 0.5 and abs(done["copy"] - done["application"]) < 0.1
    print(f"{done['copy_s']:.4f} {waited} {exact}", flush=True)  # os._exit follows


def measure(label: str, kind: str, virtual_memory: bool) -> dict:
    """One case in a fresh process (its own CUDA state): B's copy time and the verdict."""
    record = {"copy": label, "seconds": None, "waited": None, "exact": None, "error": None}
    env = dict(os.environ)
    env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True" if virtual_memory else ""
    try:
        out = subprocess.run([sys.executable, __file__, "--case", kind], env=env, capture_output=True,
                             text=True, timeout=60)
    except subprocess.TimeoutExpired:
        record["error"] = "timed out"
        return record
    fields = out.stdout.split()[-3:]
    if out.returncode != 0 or len(fields) != 3:
        record["error"] = f"failed: {out.stderr[-300:]}"
        return record
    record.update(seconds=float(fields[0]), waited=fields[1] == "True", exact=fields[2] == "True")
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="also write every case's record here")
    parser.add_argument("--case", choices=["torch", "stager"], help=argparse.SUPPRESS)  # one child
    args = parser.parse_args(argv)
    if args.case:
        case(args.case)
        os._exit(0)
    print(f"B's 12 MiB copy, issued {B_DELAY_S} s into A's {BUSY_S} s wait in the driver")
    print(f"{'copy':40s} {'seconds':>8s}  verdict")
    records = []
    for label, kind, virtual_memory in CASES:
        r = measure(label, kind, virtual_memory)
        records.append(r)
        if r["error"]:
            print(f"{label:40s} {'-':>8s}  {r['error']}")
            continue
        verdict = "waited for A" if r["waited"] else "did not wait"
        print(f"{label:40s} {r['seconds']:8.4f}  {verdict}{'' if r['exact'] else ', WRONG BYTES'}")
    write_json(args.json, {"meta": {"busy_s": BUSY_S, "b_delay_s": B_DELAY_S}, "results": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
