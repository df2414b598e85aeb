"""Gloo against reccl under torchft: the same job (2 replica groups of one rank, one
per host, torchft's Manager) through the same faults on replica 1: its host loses
NIC 0 for good (``nic``), its process is killed and started again (``kill``).
Prints, per backend and fault, the quorum changes, the job's steps each replica was
not in, the failed steps, the survivor's longest stall, the time until every
replica trains again and whether the final parameters are equal
(torch_reccl/bench/torchft_compare.py; docs/torchft.md).

    python bench/torchft_fault.py [--mode auto|fabric|inject] [--backends gloo,reccl]
                                  [--faults nic,kill] [--steps 300] [--fault-step 40]
                                  [--timeout 15] [--setting RECCL_NAME=VALUE] [--repeat 1]
                                  [--json PATH]

``--mode fabric`` (root, pyroute2): each replica in a host of the emulated fabric,
the NIC fault a veth that loses carrier (Gloo runs on NIC 0, reccl on NICs 0 and
1). ``--mode inject``: on this machine over loopback NICs, the NIC fault
``torch_reccl.inject_fault`` inside replica 1, which Gloo never sees. ``auto``:
fabric where it can be built.
"""
from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time

from torch_reccl.bench import torchft_compare


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("auto",) + torchft_compare.MODES, default="auto")
    parser.add_argument("--backends", default="gloo,reccl", help="comma-separated: gloo, reccl")
    parser.add_argument("--faults", default="nic,kill", help="comma-separated: nic, kill")
    parser.add_argument("--steps", type=int, default=300, help="steps the job trains")
    parser.add_argument("--fault-step", type=int, default=40, help="the fault comes after this step")
    parser.add_argument("--step-s", type=float, default=0.05, help="each step takes at least this long")
    parser.add_argument("--timeout", type=float, default=15.0, help="torchft's and the process group's timeout (s)")
    parser.add_argument("--setting", action="append", default=[], metavar="RECCL_NAME=VALUE",
                        help="a RECCL_* setting for every replica (repeatable), e.g. RECCL_PEER_GONE_TIMEOUT_MS=3000")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each backend and fault")
    parser.add_argument("--name", default=None, help="the fabric's name (default: from the pid)")
    parser.add_argument("--json", default=None, help="write every run's record here")
    args = parser.parse_args(argv)
    for option, valid in (("backends", torchft_compare.BACKENDS), ("faults", torchft_compare.FAULTS)):
        chosen = [v.strip() for v in getattr(args, option).split(",") if v.strip()]
        wrong = [v for v in chosen if v not in valid]
        if wrong or not chosen:
            parser.error(f"--{option} {getattr(args, option)!r}: valid values are {', '.join(valid)}")
        setattr(args, option, chosen)
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: expected 1 or more")
    for setting in args.setting:
        name, _, value = setting.partition("=")
        if not name.startswith("RECCL_") or not value:
            parser.error(f"--setting {setting!r}: expected RECCL_NAME=VALUE")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    mode = args.mode
    if mode == "auto":
        from torch_reccl.fabric.fabric import is_root

        mode = "fabric" if is_root() else "inject"
        print(f"torchft_fault: mode {mode} ({'root' if mode == 'fabric' else 'not root: loopback NICs'})",
              flush=True)
    outcomes = []
    for fault in args.faults:
        for backend in [b for b in args.backends for _ in range(args.repeat)]:
            outcome = torchft_compare.run(backend, fault, mode=mode, steps=args.steps,
                                          fault_step=args.fault_step, step_s=args.step_s,
                                          timeout_s=args.timeout, name=args.name,
                                          env=dict(setting.split("=", 1) for setting in args.setting),
                                          log=lambda line: print(line, flush=True))
            outcomes.append(outcome)
            print(json.dumps(outcome.to_dict()), flush=True)
    print(torchft_compare.table(outcomes))
    if args.json:
        record = {"meta": {"command": "python bench/torchft_fault.py " + shlex.join(sys.argv[1:] if argv is None
                                                                                   else argv),
                           "mode": mode, "host": platform.node(), "when": time.strftime("%Y-%m-%d %H:%M:%S %Z")},
                  "results": [o.to_dict() for o in outcomes]}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
