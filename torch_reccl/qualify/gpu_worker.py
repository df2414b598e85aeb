"""One rank of one GPU variant of ``reccl qualify`` (a process of its own: NCCL picks
its network once per process).

    python -m torch_reccl.qualify.gpu_worker --spec SPEC.json

The spec (written by the rank that starts this process) names the variant --
``plugin`` (NCCL_NET=ReCCL through torch_reccl's libnccl-net-reccl.so) or
``baseline`` (NCCL's own IB or Socket network) -- the store prefix the variant's
ranks meet under, the busbw sizes, and for the plugin whether to run the failover
streams. The environment carries the rest (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT, NCCL_*). The result goes to the spec's ``out`` as JSON:
busbw rows, the failover results by rail, which transport the plugin ran over and
the bytes it moved per NIC, or the error that stopped it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import Any, Dict


def plugin_state() -> Dict[str, Any]:
    """The plugin's transport ('' when NCCL never initialised it) and bytes per NIC."""
    import torch_reccl
    from torch_reccl._native import native

    nics = torch_reccl.stats()["nics"]
    return {"transport": native().nccl_plugin_transport(),
            "nics": {name: {"bytes_sent": n["bytes_sent"], "bytes_received": n["bytes_received"]}
                     for name, n in nics.items()}}


def run(spec: Dict[str, Any], result: Dict[str, Any]) -> None:
    """Fills ``result`` as it goes: on an exception it says how far the run got (stage)."""
    import torch
    import torch.distributed as dist

    from torch_reccl.qualify.collectives import EventLog, busbw, fault_stream

    variant = spec["variant"]
    world = int(os.environ["WORLD_SIZE"])
    rank = result["rank"]
    events = EventLog() if variant == "plugin" else None
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise RuntimeError(f"this torch ({torch.__version__}) sees no CUDA GPU")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    result["stage"] = "nccl"  # from here on, a failure may be NCCL's (its network, its plugin)
    timeout = datetime.timedelta(seconds=spec["collective_timeout_s"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False,
                          timeout=timeout)
    dist.init_process_group("nccl", store=dist.PrefixStore(spec["prefix"], store), rank=rank,
                            world_size=world, timeout=timeout, device_id=device)
    group = dist.group.WORLD
    warm = torch.ones(1 << 20, device=device)
    dist.all_reduce(warm)
    torch.cuda.synchronize(device)
    if variant == "plugin":
        state = plugin_state()
        result["plugin"] = state
        if not state["transport"]:
            raise RuntimeError(
                f"NCCL ran a collective without initialising the reccl net plugin "
                f"(NCCL_NET_PLUGIN={os.environ.get('NCCL_NET_PLUGIN')}, NCCL_NET={os.environ.get('NCCL_NET')})")
    result["stage"] = "collectives"
    if spec["sizes"]:
        result["busbw"] = busbw(dist, group, device, spec["sizes"], spec["budget_s"])
    if spec.get("failover"):
        f = spec["failover"]
        names = list(plugin_state()["nics"])[:f["rails"]]
        if len(names) < f["rails"]:
            names = f["names"]
        result["failover_names"] = names
        result["failover"] = []
        for rail in range(f["rails"]):
            host = rail % f["hosts"]
            result["failover"].append(fault_stream(
                dist, group, device, f["bytes"], names[rail], f["host_of"][rank] == host, events,
                f["base_s"], f["hold_s"], f["settle_s"]))
        result["plugin"] = plugin_state()
    # no rank tears its communicator down while another's last receives are in flight
    dist.barrier()
    torch.cuda.synchronize(device)
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_reccl.qualify.gpu_worker")
    parser.add_argument("--spec", required=True, help="the JSON spec the qualify rank wrote")
    args = parser.parse_args(argv)
    with open(args.spec) as f:
        spec = json.load(f)
    result: Dict[str, Any] = {"rank": int(os.environ.get("RANK", "-1")), "variant": spec["variant"],
                              "error": None, "stage": "start"}
    try:
        run(spec, result)
    except Exception as error:  # noqa: BLE001 - the parent reports it, with this process's log
        result["error"] = f"{type(error).__name__}: {error}"
        if spec["variant"] == "plugin":
            try:
                result["plugin"] = plugin_state()
            except Exception:  # noqa: BLE001 - the error above is what matters
                pass
    with open(spec["out"] + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(spec["out"] + ".tmp", spec["out"])
    return 0 if result["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main())
