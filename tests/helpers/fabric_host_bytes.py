"""One rank of tests/fabric/test_halving_fabric.py's cross-host byte count: several
ranks share each emulated host (netns), so traffic between them never reaches
the host's NICs, and each host's lowest rank reads what its NICs sent
(/sys/class/net/<nic>/statistics/tx_bytes, this namespace's own /sys) around
one all_reduce, reduce_scatter and all_gather of --mib MiB each. The inputs
are small integers (exact in any order), so every result is checked against
the local sum. Prints one JSON line: {op: bytes the host's NICs sent} (the
leader) or {} (the others), and the number of wrong elements.
"""
from __future__ import annotations

import argparse
import datetime
import json


def tx_bytes(nics):
    total = 0
    for nic in nics:
        with open(f"/sys/class/net/{nic}/statistics/tx_bytes") as f:
            total += int(f.read())
    return total


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--per-host", type=int, required=True)
    parser.add_argument("--master", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mib", type=int, default=8)
    parser.add_argument("--nics", default="eth0,eth1")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    import torch_reccl  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)  # 8 ranks on the CI's 2 cores

    store = dist.TCPStore(args.master, args.port, args.world, is_master=args.rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("reccl", store=store, rank=args.rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=60))
    leader = args.rank % args.per_host == 0
    nics = args.nics.split(",")
    n = (args.mib << 20) // 4
    world = args.world

    def value(rank):
        return (torch.arange(n, dtype=torch.float32) % 97) + rank

    share = n // world
    mine = slice(args.rank * share, (args.rank + 1) * share)
    total = sum(value(r) for r in range(world))

    def run(op):
        """(result, expected) of one collective."""
        if op == "all_reduce":
            out = value(args.rank)
            dist.all_reduce(out)
            return out, total
        if op == "reduce_scatter":
            out = torch.empty(share)
            dist.reduce_scatter_tensor(out, value(args.rank))
            return out, total[mine]
        out = torch.empty(share * world)
        dist.all_gather_into_tensor(out, value(args.rank)[mine])
        return out, torch.cat([value(r)[r * share:(r + 1) * share] for r in range(world)])

    sent = {}
    wrong = 0
    run("all_reduce")  # connections made and same-host handshakes done before counting
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        dist.barrier()
        before = tx_bytes(nics) if leader else 0
        got, want = run(op)
        dist.barrier()
        if leader:
            sent[op] = tx_bytes(nics) - before
        wrong += int((got != want).sum())
    dist.destroy_process_group()
    print(json.dumps({"sent": sent, "wrong": wrong}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
