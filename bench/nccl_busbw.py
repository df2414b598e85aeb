"""busbw of NCCL collectives between two GPUs forced through the network layer.

Both ranks run on one machine but look like two hosts (NCCL_HOSTID, P2P and SHM
off), so every byte crosses the net transport: NCCL's own socket transport
(defaults, and tuned) or the ReCCL plugin (fault-free, and with rank 0's primary
NIC down via inject_fault; host buffers, and GPU buffers staged by NVL), beside the
path's ceiling: plain sockets moving the same bytes with the same GPU<->host copies
(socket-ceiling, torch_reccl/bench/gpu_ceiling.py). All variants run in the same
invocation. Also prints rank 0's threads and open sockets
(by thread name) at the end of each variant, its communicators still up.

    python bench/nccl_busbw.py [--sizes-mib 1 4 16 64 256 1024] [--ops all_reduce ...]
                               [--only VARIANT ...] [--rounds R] [--json PATH]

With --rounds R every chosen variant runs R times, the variants taking turns
(A B, B A, A B ...), so that a slow spell of the machine hits all of them alike; the
summary gives each variant's median and, for every other variant, its ratio to
the first one round by round (min / median / max).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from torch_reccl.bench import procstat  # noqa: E402
from torch_reccl.bench.gpu_ceiling import ceiling_busbw  # noqa: E402
from torch_reccl.bench.rank import OPS, run_collective  # noqa: E402
from torch_reccl.cli.launch import spawn_bounded  # noqa: E402

COMMON = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NVLS_ENABLE": "0",
          "NCCL_SOCKET_IFNAME": "lo", "NCCL_DEBUG": "WARN"}
LOOPBACK_NICS = "127.0.0.1,127.0.0.2"
LOOPBACK_NICS_4 = "127.0.0.1,127.0.0.2,127.0.0.3,127.0.0.4"
# Not NCCL: plain sockets over the 4 loopback NICs with the same GPU<->host copies
# (torch_reccl/bench/gpu_ceiling.py), the path's ceiling on this machine.
CEILING = "socket-ceiling"
CEILING_SOCKS_PER_NIC = 2
# Loopback NICs have no PCI path: say which GPU each sits next to, and let NCCL
# hand GPU buffers to the plugin at any distance.
NVL = {"RECCL_NVL": "on", "RECCL_NIC_GPUS": "0,1", "NCCL_NET_GDR_LEVEL": "SYS",
       "NCCL_NET_GDR_READ": "1"}


def variants(plugin: str):
    reccl = {"NCCL_NET_PLUGIN": plugin, "NCCL_NET": "ReCCL", "RECCL_NICS": LOOPBACK_NICS}
    reccl4 = {**reccl, "RECCL_NICS": LOOPBACK_NICS_4}
    return {
        "nccl-socket": ({"NCCL_NET": "Socket"}, False),
        "nccl-socket-tuned": ({"NCCL_NET": "Socket", "NCCL_SOCKET_NTHREADS": "4",
                               "NCCL_NSOCKS_PERTHREAD": "4", "NCCL_MIN_NCHANNELS": "8",
                               "NCCL_MAX_NCHANNELS": "8"}, False),
        "reccl": (reccl, False),
        "reccl-8ch": ({**reccl, "NCCL_MIN_NCHANNELS": "8", "NCCL_MAX_NCHANNELS": "8"}, False),
        "reccl-nic-down": ({**reccl, "NCCL_MIN_NCHANNELS": "8", "NCCL_MAX_NCHANNELS": "8"}, True),
        # four NICs, one down: spreading stripes over the three survivors; off, the
        # failed-over connections pile onto their one backup NIC
        "reccl-4nic-8ch": ({**reccl4, "NCCL_MIN_NCHANNELS": "8", "NCCL_MAX_NCHANNELS": "8"}, False),
        # the same without spreading and grey-failure detection: what they cost fault-free
        "reccl-4nic-8ch-plain": ({**reccl4, "RECCL_SPREAD": "off", "RECCL_GREY": "0",
                                  "NCCL_MIN_NCHANNELS": "8", "NCCL_MAX_NCHANNELS": "8"}, False),
        "reccl-4nic-down": ({**reccl4, "NCCL_MIN_NCHANNELS": "8", "NCCL_MAX_NCHANNELS": "8"}, True),
        "reccl-4nic-down-nospread": ({**reccl4, "RECCL_SPREAD": "off", "NCCL_MIN_NCHANNELS": "8",
                                      "NCCL_MAX_NCHANNELS": "8"}, True),
        # NVL: GPU buffers staged by the plugin; NIC 0 sits next to GPU 0, NIC 1 next to GPU 1
        "reccl-nvl-8ch": ({**reccl, **NVL, "NCCL_MIN_NCHANNELS": "8", "NCCL_MAX_NCHANNELS": "8"}, False),
        "reccl-nvl-nic-down": ({**reccl, **NVL, "NCCL_MIN_NCHANNELS": "8", "NCCL_MAX_NCHANNELS": "8"}, True),
        CEILING: ({}, False),
    }


def census() -> dict:
    """This process's threads (by name, digits dropped: "reccl-io3" counts as "reccl-io")
    and open sockets, taken while its communicators are still up."""
    names: dict = {}
    for stat in procstat.threads().values():
        name = stat.name.rstrip("0123456789") or "?"
        names[name] = names.get(name, 0) + 1
    return {"threads": sum(names.values()), "sockets": procstat.fds()[1], "thread_names": names}


def worker(rank, env, nic_down, ops, sizes_mib, iters, out_path, store_path, preload):
    os.environ.update(env)
    os.environ["NCCL_HOSTID"] = f"bench-host-{rank}"
    import torch_reccl

    if preload:
        torch_reccl.nics()

    device = rank % torch.cuda.device_count()  # one GPU: both ranks share it (own NCCL_HOSTID)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            device_id=torch.device("cuda", device))
    warm = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(warm)  # connections exist before any fault
    if nic_down and rank == 0:
        torch_reccl.inject_fault(torch_reccl.nics()[0]["name"], "down")
    dist.all_reduce(warm)  # every rank: the collectives must stay in step
    results = {}
    for name in ops:
        for mib in sizes_mib:
            numel = (mib << 20) // 4
            x = torch.ones(numel, device="cuda")
            out = torch.empty(numel * 2 if name == "all_gather" else numel // 2, device="cuda")

            run_collective(name, out, x)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                run_collective(name, out, x)
            end.record()
            torch.cuda.synchronize()
            seconds = start.elapsed_time(end) / 1e3 / iters
            # nccl-tests conventions, n = 2: allreduce busbw = algbw, (all)gather/scatter = algbw / 2
            data = (mib << 20) * (2 if name == "all_gather" else 1)
            factor = 1.0 if name == "all_reduce" else 0.5
            results[f"{name}/{mib}"] = data / seconds * factor / 1e9
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({**results, "census": census()}, f)
    # No rank may tear down its communicator while the other's last receives are
    # still in flight: a rank's kernel can finish before its own sends have landed.
    dist.barrier()
    torch.cuda.synchronize()
    dist.destroy_process_group()


def ceiling_worker(rank, ops, sizes_mib, iters, out_path, store_path):
    torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.FileStore(store_path, 2)
    results = ceiling_busbw(rank, LOOPBACK_NICS_4.split(","), CEILING_SOCKS_PER_NIC, store, ops, sizes_mib,
                            iters)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({**results, "census": census()}, f)


def run_variant(label, env, nic_down, args, tmp, round_index) -> dict:
    """One set of two ranks; rank 0's results ({} when the variant failed)."""
    out = os.path.join(tmp, f"{label}.{round_index}.json")
    store = os.path.join(tmp, f"{label}.{round_index}.store")
    try:
        if label == CEILING:
            spawn_bounded(ceiling_worker, (args.ops, args.sizes_mib, args.iters, out, store), nprocs=2,
                          timeout_s=540)
        else:
            spawn_bounded(worker, ({**COMMON, **env}, nic_down, args.ops, args.sizes_mib, args.iters, out,
                                   store, args.preload), nprocs=2, timeout_s=540)
        with open(out) as f:
            return json.load(f)
    except Exception as error:  # one broken variant must not hide the others
        print(f"variant {label} (round {round_index + 1}) failed: {error}", file=sys.stderr)
        return {}


def measured_keys(tables) -> list:
    """The "collective/MiB" keys of the first variant that did not fail."""
    return next(([k for k in t if k != "census"] for t in tables if t), [])


def print_table(title: str, table: dict) -> None:
    labels = list(table)
    print(title)
    print(f"{'collective/MiB':22s}" + "".join(f"{label:>19s}" for label in labels))
    keys = measured_keys(table.values())
    for key in keys:
        print(f"{key:22s}" + "".join(f"{table[label][key]:19.2f}" if key in table[label] else f"{'failed':>19s}"
                                     for label in labels))


def print_rounds(rounds: list) -> None:
    """Each variant's median over the rounds, and each variant against the first
    one, round by round (both ran back to back)."""
    labels = list(rounds[0])
    keys = measured_keys(t for r in rounds for t in r.values())
    median = {label: {k: statistics.median(r[label][k] for r in rounds if k in r[label]) for k in keys
                      if any(k in r[label] for r in rounds)} for label in labels}
    print_table(f"median busbw GB/s over {len(rounds)} rounds", median)
    for label in labels[1:]:
        print(f"{label} / {labels[0]}, round by round: min / median / max")
        for key in keys:
            ratios = [r[label][key] / r[labels[0]][key] for r in rounds
                      if key in r[label] and key in r[labels[0]]]
            if ratios:
                print(f"  {key:20s} {min(ratios):.3f} / {statistics.median(ratios):.3f} / {max(ratios):.3f}"
                      f"   ({' '.join(f'{x:.3f}' for x in ratios)})")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the chosen variants this many times, taking turns")
    parser.add_argument("--json")
    parser.add_argument("--only", nargs="+", help="run only these variants, in this order")
    parser.add_argument("--preload", action="store_true",
                        help="import torch_reccl._C before NCCL loads it as a plugin")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1; got {args.rounds}")
    if torch.cuda.device_count() < 1:
        print("needs a GPU (the two ranks share one when there is only one)")
        return 1
    import torch_reccl

    every = variants(torch_reccl.plugin_path())
    unknown = [label for label in args.only or [] if label not in every]
    if unknown:
        parser.error(f"--only: no variant {', '.join(unknown)}; valid: {', '.join(every)}")
    chosen = {label: every[label] for label in (args.only or every)}
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            # every other round in reverse, so no variant always runs right after another
            order = list(chosen) if round_index % 2 == 0 else list(reversed(chosen))
            ran = {label: run_variant(label, *chosen[label], args, tmp, round_index) for label in order}
            rounds.append({label: ran[label] for label in chosen})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rounds[0] if args.rounds == 1 else rounds, f, indent=1)
    title = f"busbw GB/s (2 ranks on {torch.cuda.device_count()} GPU(s), network path forced)"
    for round_index, table in enumerate(rounds):
        print_table(title if args.rounds == 1 else f"{title}, round {round_index + 1}", table)
    if args.rounds > 1:
        print_rounds(rounds)
    table = rounds[-1]
    print("rank 0 after the last collective, communicators up: threads / open sockets")
    census = ["%d / %d" % (t["census"]["threads"], t["census"]["sockets"]) if t else "failed" for t in table.values()]
    print(f"{'':22s}" + "".join(f"{cell:>19s}" for cell in census))
    for label, t in table.items():
        if t:
            print(f"  {label}: {t['census']['thread_names']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
