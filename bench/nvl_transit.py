"""NVL's staging copies on one machine with two NVLink-joined GPUs.

For each size: the NVLink peer-copy rate (torch's GPU 0 -> GPU 1 copy, the
reference peak), and the stager's GPU -> host and host -> GPU rates directly
over GPU 0's PCIe link and through a transit buffer on GPU 1 (NVLink leg on
GPU 0's stream, PCIe leg on GPU 1's, pieces overlapped). The ratio
transit/direct is the cost of the detour; transit memory is what the stager
holds afterwards (capped by --max-transit-mib).

    python bench/nvl_transit.py [--sizes-mib 1 4 16 64 256] [--max-transit-mib 32] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rate(fn, size: int, iters: int) -> float:
    fn()  # warm: streams, peer access, transit buffer
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    return size * iters / (time.perf_counter() - start) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--max-transit-mib", type=int, default=32)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json")
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        print("needs 2 GPUs")
        return 1
    from torch_reccl import _native

    C = _native.native()
    stager = C.DeviceStager(max_transit_bytes=args.max_transit_mib << 20)
    stager.prepare(0, max(args.sizes_mib) << 20, [1])
    rows = []
    for mib in args.sizes_mib:
        size = mib << 20
        src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda:0")
        peer = torch.empty(size, dtype=torch.uint8, device="cuda:1")
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(size, dtype=torch.uint8, device="cuda:0")
        row = {"mib": mib}
        row["nvlink_peer"] = rate(lambda: peer.copy_(src, non_blocking=True), size, args.iters)
        for transit, label in ((-1, "direct"), (1, "transit")):
            row[f"to_host_{label}"] = rate(
                lambda: stager.to_host(host.data_ptr(), src.data_ptr(), 0, size, transit), size, args.iters)
            row[f"to_device_{label}"] = rate(
                lambda: stager.to_device(dst.data_ptr(), 0, host.data_ptr(), size, transit), size, args.iters)
        if not torch.equal(dst, src):
            print(f"{mib} MiB: the staged round trip changed the data")
            return 1
        row["transit_mib"] = stager.transit_bytes / (1 << 20)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("GB/s; transit/direct ratio; transit memory held (MiB)")
    print(f"{'MiB':>5s} {'NVLink':>8s} {'D2H dir':>8s} {'D2H NVL':>8s} {'ratio':>6s} "
          f"{'H2D dir':>8s} {'H2D NVL':>8s} {'ratio':>6s} {'transit':>8s}")
    for r in rows:
        print(f"{r['mib']:5d} {r['nvlink_peer']:8.1f} {r['to_host_direct']:8.1f} {r['to_host_transit']:8.1f} "
              f"{r['to_host_transit'] / r['to_host_direct']:6.2f} {r['to_device_direct']:8.1f} "
              f"{r['to_device_transit']:8.1f} {r['to_device_transit'] / r['to_device_direct']:6.2f} "
              f"{r['transit_mib']:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
