"""``reccl qualify --local N``: N ranks on this machine, each its own emulated host.

Each rank gets torchrun's variables, the loopback NICs 127.0.0.1.. (``--rails``) or
the RECCL_NICS the caller set, and its own ``RECCL_HOST_ID`` and ``NCCL_HOSTID``,
with the shortcuts between processes of one machine off (reccl's same-host reads;
NCCL's peer-to-peer, shared-memory and NVLink-multicast transports), so every byte
crosses the network layer as between hosts, and ranks share the GPUs round-robin.
No root needed. The run is bounded by ``--timeout``; rank 0's progress lines are
shown as they come, its summary at the end.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import List

from torch_reccl.cli.launch import Job, LaunchError, LoopbackPlacement, cuda_net_env, terminated_by_signal
from torch_reccl.qualify import report

TICK_S = 0.2
FINISH_S = 30.0   # once every rank has exited: their output read to its end


def rank_argv(args, json_path: str) -> List[str]:
    """The command each rank runs: this one without --local/--rails, with rank 0's
    progress as messages and its record at ``json_path``."""
    argv = [sys.executable, "-m", "torch_reccl.qualify", "--progress-markers", "--json", json_path,
            "--command-line", args.command_line, "--checks", ",".join(args.checks), "--device", args.device,
            "--perf-budget", str(args.perf_budget), "--reach-timeout", str(args.reach_timeout),
            "--failover-base", str(args.failover_base), "--failover-hold", str(args.failover_hold),
            "--failover-settle", str(args.failover_settle), "--collective-timeout", str(args.collective_timeout),
            "--step-timeout", str(args.step_timeout)]
    if args.sizes_mib:
        argv += ["--sizes-mib", *(str(m) for m in args.sizes_mib)]
    if args.failover_mib:
        argv += ["--failover-mib", str(args.failover_mib)]
    if args.report:
        argv += ["--report", os.path.abspath(args.report)]
    return argv


def run_local(args) -> int:
    if args.local < 2:
        print("reccl qualify: error: --local needs at least 2 ranks (hosts) to have pairs to check",
              file=sys.stderr)
        return 2
    placement = LoopbackPlacement(args.local, args.rails)
    user_nics = os.environ.get("RECCL_NICS")
    # NCCL's own shortcuts between processes of one machine off; each variant sets NCCL_NET
    env = {k: v for k, v in cuda_net_env("reccl").items() if k != "NCCL_NET"}
    env["RECCL_SAME_HOST_READS"] = "0"

    def per_rank_env(rank: int):
        own = {"RECCL_HOST_ID": f"qualify-host-{rank}", "NCCL_HOSTID": f"qualify-host-{rank}"}
        if user_nics:
            own["RECCL_NICS"] = user_nics
        return own

    nics = user_nics or ",".join(f"127.0.0.{r + 1}" for r in range(args.rails))
    print(f"reccl qualify: {args.local} ranks on this machine, each its own host, NICs {nics}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="reccl-qualify-") as tmp:
        json_path = os.path.abspath(args.json) if args.json else os.path.join(tmp, "record.json")
        if os.path.exists(json_path):
            os.remove(json_path)  # a stale record must not pass for this run's
        deadline = time.monotonic() + args.timeout
        error = None
        with terminated_by_signal():
            try:
                with Job(placement, rank_argv(args, json_path), env=env, per_rank_env=per_rank_env) as job:
                    while not job.all_exited():
                        got = job.next_message(TICK_S)
                        if got is not None and got[1].get("kind") == "progress":
                            print(f"reccl qualify: {got[1]['text']}", file=sys.stderr, flush=True)
                        if time.monotonic() > deadline:
                            error = f"the run took longer than --timeout {args.timeout:g} s; stopped"
                            break
                    if error is None:
                        job.wait(FINISH_S)
                    codes = job.exit_codes()
                    logs = job.logs()
            except KeyboardInterrupt:
                print("\nreccl qualify: interrupted", file=sys.stderr)
                return 130
            except LaunchError as launch_error:
                print(f"reccl qualify: error: {launch_error}", file=sys.stderr)
                return 1
        try:
            with open(json_path) as f:
                record = json.load(f)
        except (OSError, ValueError):
            print(f"reccl qualify: error: {error or 'rank 0 wrote no record'}; exit codes {codes}\n{logs}",
                  file=sys.stderr)
            return 1
    print(report.summary(record))
    if error:
        print(f"reccl qualify: error: {error}", file=sys.stderr)
        return 1
    return 0 if record.get("ok") else 1

