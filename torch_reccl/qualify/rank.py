"""One rank of ``reccl qualify``: the four checks in order, then rank 0's verdict,
summary, ``--json`` and ``--report``; every rank exits with the verdict's code
(0: every check that ran passed; 1: one failed, or the run could not go on)."""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict, Optional

from torch_reccl.qualify import report, steps
from torch_reccl.qualify.job import Job, QualifyError, now_iso


def run(args) -> int:
    started = time.monotonic()
    job = Job(args.step_timeout)
    say = steps.Progress(job, args.progress_markers)
    from torch_reccl.qualify.collectives import EventLog

    events = EventLog()
    record: Dict[str, Any] = {"tool": "reccl qualify", "date": now_iso(), "command": args.command_line,
                              "world": job.world, "checks": {}, "step_s": {}}
    step_s = record["step_s"]
    mark = [started]

    def took(name: str) -> None:
        now = time.monotonic()
        step_s[name] = round(now - mark[0], 1)
        mark[0] = now

    checks = record["checks"]
    took("rendezvous")
    code = 1
    try:
        plan = steps.run_inventory(job, args, say)
        if args.sizes_mib is None:
            args.sizes_mib = steps.DEFAULT_SIZES_MIB[plan["device"]]
        if args.failover_mib is None:
            args.failover_mib = steps.DEFAULT_FAILOVER_MIB[plan["device"]]
        record.update({"device": plan["device"], "rails": plan["rails"], "host_of": plan["host_of"],
                       "hosts": [{"index": h, "hostname": inv["hostname"], "ranks": job.hosts[h]}
                                 for h, inv in enumerate(plan["inventory"]["hosts"])]})
        checks["inventory"] = plan["inventory"]
        took("inventory")
        if "reach" not in args.checks:
            checks["reach"] = steps.skipped("not asked for (--checks)")
        elif not plan["hosts_listed"]:
            checks["reach"] = steps.skipped("a host could not list its NICs (inventory)")
        elif len(job.hosts) < 2:
            checks["reach"] = steps.skipped("one host: no pair to connect")
        else:
            checks["reach"] = steps.run_reach(job, args, plan, events, say)
            took("reach")
        ok_so_far = job.publish("reach/ok", all(c["status"] != "failed" for c in checks.values())
                                if job.is_root else None, args.step_timeout + steps.STORE_SLACK_S)
        gate = None if ok_so_far else "an earlier check failed"
        run_checks(job, args, plan, events, say, checks, gate, took)
        if job.is_root:
            code = 0 if all(c["status"] != "failed" for c in checks.values()) else 1
    except QualifyError as error:
        record["error"] = str(error)
        print(f"reccl qualify: rank {job.rank}: error: {error}", file=sys.stderr)
    except Exception as error:  # noqa: BLE001 - a check that broke: the report says so, the code is 1
        import traceback

        traceback.print_exc()
        record["error"] = f"{type(error).__name__}: {error}"
    finally:
        events.close()
    if job.is_root:
        record["elapsed_s"] = round(time.monotonic() - started, 1)
        record["ok"] = code == 0 and "error" not in record
        record["failures"] = report.failures(record)
        print(report.summary(record), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=1)
        if args.report:
            with open(args.report, "w") as f:
                f.write(report.markdown(record))
    try:
        code = job.publish("verdict", code if job.is_root else None, args.step_timeout + steps.STORE_SLACK_S)
    except QualifyError as error:
        print(f"reccl qualify: rank {job.rank}: {error}", file=sys.stderr)
        code = 1
    _finish(code)
    return code


def run_checks(job: Job, args, plan: Dict[str, Any], events, say, checks: Dict[str, Any],
               gate: Optional[str], took) -> None:
    """Performance and failover: on the device the plan chose, unless ``gate`` says why not."""
    wanted = [c for c in ("perf", "failover") if c in args.checks]
    for name in ("perf", "failover"):
        if name not in wanted:
            checks[name] = steps.skipped("not asked for (--checks)")
        elif gate:
            checks[name] = steps.skipped(gate)
    if gate or not wanted:
        return
    if plan["device"] == "cuda":
        got = steps.run_gpu(job, args, plan, say)
        took("gpu variants")
        if job.is_root:
            checks.update(got)
        return
    groups = steps.CpuGroups(job, plan, args.collective_timeout)
    took("process groups")
    if "perf" in wanted:
        got = steps.run_cpu_perf(job, args, groups, say)
        took("perf")
        if job.is_root:
            checks["perf"] = got
    if "failover" in wanted:
        if plan["rails"] < 2:
            checks["failover"] = steps.skipped("one NIC per host: nothing to fail over to")
        else:
            got = steps.run_cpu_failover(job, args, plan, groups, events, say)
            took("failover")
            if job.is_root:
                checks["failover"] = got


def _finish(code: int) -> None:
    """Ends the process group, if one was made; a group broken by a failed check may not
    end cleanly, so that wait is bounded by the process exiting anyway."""
    import torch.distributed as dist

    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the verdict is out; nothing left to protect
            os._exit(code)
