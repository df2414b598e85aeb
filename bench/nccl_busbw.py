"""busbw of NCCL collectives between two GPUs forced through the network layer.

Both ranks run on one machine but look like two hosts (NCCL_HOSTID, P2P and SHM
off), so every byte crosses the net transport: NCCL's own socket transport
(defaults, and tuned) or the ReCCL plugin (fault-free, and with rank 0's primary
NIC down via inject_fault; host buffers, and GPU buffers staged by NVL). All
variants run in the same invocation. Also prints rank 0's threads and open sockets
(by thread name) at the end of each variant, its communicators still up.

    python bench/nccl_busbw.py [--sizes-mib 1 4 16 64 256 1024] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from torch_reccl.bench.rank import run_collective  # noqa: E402
from torch_reccl.cli.launch import spawn_bounded  # noqa: E402

COMMON = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NVLS_ENABLE": "0",
          "NCCL_SOCKET_IFNAME": "lo", "NCCL_DEBUG": "WARN"}
LOOPBACK_NICS = "127.0.0.1,127.0.0.2"
LOOPBACK_NICS_4 = "127.0.0.1,127.0.0.2,127.0.0.3,127.0.0.4"
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
    }


def census() -> dict:
    """This process's threads (by name, digits dropped: "reccl-io3" counts as "reccl-io")
    and open sockets, taken while its communicators are still up."""
    import procstat  # beside this file

    names: dict = {}
    for stat in procstat.threads().values():
        name = stat.name.rstrip("0123456789") or "?"
        names[name] = names.get(name, 0) + 1
    return {"threads": sum(names.values()), "sockets": procstat.fds()[1], "thread_names": names}


def worker(rank, env, nic_down, sizes_mib, iters, out_path, store_path, preload):
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
    for name in ("all_reduce", "all_gather", "reduce_scatter"):
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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument("--only", nargs="+", help="run only these variants")
    parser.add_argument("--preload", action="store_true",
                        help="import torch_reccl._C before NCCL loads it as a plugin")
    args = parser.parse_args()
    if torch.cuda.device_count() < 1:
        print("needs a GPU (the two ranks share one when there is only one)")
        return 1
    import torch_reccl

    table = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, (env, nic_down) in variants(torch_reccl.plugin_path()).items():
            if args.only and label not in args.only:
                continue
            out = os.path.join(tmp, f"{label}.json")
            store = os.path.join(tmp, f"{label}.store")
            try:
                spawn_bounded(worker, ({**COMMON, **env}, nic_down, args.sizes_mib, args.iters, out,
                                       store, args.preload), nprocs=2, timeout_s=540)
                with open(out) as f:
                    table[label] = json.load(f)
            except Exception as error:  # one broken variant must not hide the others
                print(f"variant {label} failed: {error}", file=sys.stderr)
                table[label] = {}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)
    labels = list(table)
    print(f"busbw GB/s (2 ranks on {torch.cuda.device_count()} GPU(s), network path forced)")
    print(f"{'collective/MiB':22s}" + "".join(f"{label:>19s}" for label in labels))
    keys = next(([k for k in t if k != "census"] for t in table.values() if t), [])
    for key in keys:
        print(f"{key:22s}" + "".join(f"{table[label][key]:19.2f}" if key in table[label] else f"{'failed':>19s}"
                                     for label in labels))
    print("rank 0 after the last collective, communicators up: threads / open sockets")
    census = ["%d / %d" % (t["census"]["threads"], t["census"]["sockets"]) if t else "failed" for t in table.values()]
    print(f"{'':22s}" + "".join(f"{cell:>19s}" for cell in census))
    for label, t in table.items():
        if t:
            print(f"  {label}: {t['census']['thread_names']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
