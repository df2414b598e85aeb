"""One rank of a small training run over the "reccl" backend (run inside an
emulated host's netns: python -m torch_reccl.bench.fabric_train --rank R ..., by
tests/helpers/training_fabric.py for the fabric tests, and through
torch_reccl.bench.outage_train by tests/fabric/test_outage_fabric.py and
bench/outage_fabric.py).

Trains a small MLP with fixed seeds: every step sums the flat gradient over
the ranks (large enough for the channel algorithms over every channel), by one
all_reduce or with --sync shards by reduce_scatter then all_gather, and applies
SGD. At the
steps given by --pause, rank 0 prints "PAUSE <step>" and waits for the driver to
apply a fault and answer: "go", or "go avoid" / "go clear" to first wait (bounded)
until the control plane proposes a plan that avoids some channel / no channel, so
the test never races the control plane's period against fast steps. At the end
every rank prints one JSON line: the final parameters' SHA-256, the loss curve and
the rebalance events it saw.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import sys
import time


def sum_by_shards(flat, world, torch, dist):
    """The sum of `flat` over every rank by reduce_scatter then all_gather (zero-padded to equal shards)."""
    shard = -(-flat.numel() // world)
    padded = torch.zeros(shard * world)
    padded[:flat.numel()] = flat
    mine = torch.empty(shard)
    dist.reduce_scatter_tensor(mine, padded)
    dist.all_gather_into_tensor(padded, mine)
    return padded[:flat.numel()]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--master", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--pause", type=int, action="append", default=[])
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--channels", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=60,
                        help="the process group's timeout (s): the bound on every collective")
    parser.add_argument("--sync", choices=("all_reduce", "shards"), default="all_reduce",
                        help="how the gradient is summed: one all_reduce, or (as ZeRO and FSDP "
                             "do) reduce_scatter_tensor into shards, then all_gather_into_tensor")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    import torch_reccl
    from torch_reccl.backend import Options, backend_info

    # One intra-op thread: the test compares runs bit for bit, and with two,
    # rank 0's own forward pass (no communication involved) sometimes rounded
    # differently from run to run on a loaded 2-core box, same parameters, same
    # inputs (a loss off in the 7th digit at step 0, one of two values, with any
    # RECCL_NSOCKS; 30 of 30 runs agreed with one thread).
    torch.set_num_threads(1)
    rebalances = []
    torch_reccl.on_event(lambda e: rebalances.append({"op": e.op, "plan": e.plan, "detail": e.detail}),
                         kinds=["rebalance"])
    store = dist.TCPStore(args.master, args.port, args.world, is_master=args.rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("reccl", store=store, rank=args.rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=args.timeout),
                            pg_options=Options(channels=args.channels))
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(64, args.width), torch.nn.Tanh(),
                                torch.nn.Linear(args.width, args.width), torch.nn.Tanh(),
                                torch.nn.Linear(args.width, 8))
    for p in model.parameters():
        dist.broadcast(p.data, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(99 + args.rank)
    losses = []

    def wait_for_local_state(want: str) -> None:
        # The group agrees on its plan in-band at each collective; what must
        # happen first is this rank seeing the fault (a blackhole only after
        # heartbeats) or its failback, so the next steps switch plans.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            on_backup = backend_info()["channels_on_backup"]
            if (want == "avoid") == bool(on_backup):
                return
            time.sleep(0.02)
        print(f"rank 0: channels on backup did not become {want} within 20 s: {backend_info()}",
              file=sys.stderr, flush=True)

    started = time.monotonic()
    for step in range(args.steps):
        if args.rank == 0 and step in args.pause:
            print(f"PAUSE {step}", flush=True)
            answer = sys.stdin.readline().split()
            if len(answer) > 1:
                wait_for_local_state(answer[1])
        x = torch.randn(32, 64, generator=gen)
        y = torch.randn(32, 8, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        if args.sync == "all_reduce":
            dist.all_reduce(flat)
        else:
            flat = sum_by_shards(flat, args.world, torch, dist)
        flat /= args.world
        offset = 0
        for p in model.parameters():
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        opt.step()
        loss_t = loss.detach().reshape(1)
        dist.all_reduce(loss_t)
        losses.append(float(loss_t) / args.world)

    train_s = time.monotonic() - started
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    info = backend_info()
    dist.barrier()
    torch_reccl.flush_events()
    time.sleep(0.2)  # a batch the delivery thread drained just before is delivered too
    dist.destroy_process_group()
    print(json.dumps({"rank": args.rank, "params": digest.hexdigest(), "losses": losses,
                      "rebalances": rebalances, "channels": info["channels"],
                      "ops_done": info["ops_done"], "send_peers": info["send_peers"],
                      "train_s": round(train_s, 3)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
