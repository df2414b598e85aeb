"""The advisor acting end to end in the emulated fabric: degraded, checkpoint, exit, torchrun restart.

Two emulated hosts with two rails (every NIC capped at --rate-mbit) train the drill's
MLP (torch_reccl.drill.trainer) data-parallel over the "reccl" backend, each host
under its own ``torchrun --max-restarts`` (static rendezvous on the management
network), checkpointing every --checkpoint-every steps into a shared directory. After
--fault-step steps host 0's NIC 1 loses its link (a real carrier loss) and stays
down for --repair-s seconds (an emulated long repair, past the end of the runs by
default). The same schedule runs under three rules of torch_reccl.policy.FaultPolicy:

  advised       fail over, run degraded to the next checkpoint, save, exit 75;
                torchrun restarts the job, which resumes from that checkpoint
  restart       exit 75 at once (no checkpoint); the job resumes from the last one
  run_degraded  fail over and run degraded to the end

plus a fault-free run. ``--restart-on same`` (default): torchrun restarts the job on
the same hosts. ``--restart-on spare``: a third host is the spare; torchrun runs
with --max-restarts 0 and this script, as a scheduler would, starts the job again
with the spare in place of host 0 (the job's other host stays). The policy's
costs: --t-detect 0 (the library sees the fault at once; no node has to be found),
--t-reload about what a restart measures here.

In place, the restarted job finds eth1 still down: the library reads each NIC's
flags at start (getifaddrs: IFF_UP and IFF_RUNNING, csrc/core/topology.cc),
registers eth1 as down in its health table, declines to dial or accept over it,
and every connection starts on the NICs that are up (the "start" message lists
each NIC's state as torch_reccl.stats() sees it).

Per run: wall time (first step of the first attempt to the last step), steps
executed and lost (executed beyond the job's steps: work redone after a restart),
time between an exit and the restarted job's first step, the restarts, and whether
the final parameters (SHA-256, every rank) equal the fault-free run's: every batch
is a function of (seed, step, rank) and the checkpoint holds parameters, momentum
and step, so a job that resumes replays exactly the steps it lost.

Needs root (network namespaces). bench/advisor_drill.py runs main(); the fabric tests
(tests/fabric/test_advisor_fabric.py) run run_once.

    python bench/advisor_drill.py [--steps 500] [--fault-step 80] [--checkpoint-every 50]
                                  [--restart-on same|spare] [--repair-s 1e9]
                                  [--rules advised restart run_degraded] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from torch_reccl.cli.launch import FABRIC_STORE_PORT, Job, unique_fabric_name
from torch_reccl.fabric import Fabric

RULES = ("advised", "restart", "run_degraded")
FAULT_HOST, FAULT_RAIL = 0, 1
SPARE_HOST = 2            # --restart-on spare: where the scheduler moves host 0's rank
STALL_TIMEOUT_S = 120.0   # no message from the job for this long: the run failed


class HostsPlacement:
    """Rank r in fabric host ``hosts[r]`` (FabricPlacement puts rank h in host h): a
    job that a scheduler moved onto a spare host keeps its other hosts."""

    kind = "fabric"

    def __init__(self, fabric: Fabric, hosts: list):
        self.fabric = fabric
        self.hosts = hosts
        self.ranks = len(hosts)

    def env(self, rank: int) -> dict:
        nics = ",".join(self.fabric.nic_name(r) for r in range(self.fabric.rails))
        return {"RECCL_NICS": nics, "MASTER_ADDR": self.fabric.mgmt_ip(self.hosts[0]),
                "MASTER_PORT": str(FABRIC_STORE_PORT)}

    def popen(self, rank: int, argv, **kwargs):
        return self.fabric.popen(self.hosts[rank], argv, **kwargs)

    def describe(self) -> str:
        return f"hosts {self.hosts} of emulated fabric {self.fabric.name!r}"


def torchrun_argv(fabric: Fabric, args, rule: str, checkpoint_dir: str, hosts: list) -> list:
    trainer = ["--steps", str(args.steps), "--batch", str(args.batch), "--width", str(args.width),
               "--depth", "3", "--seed", "0", "--timeout", "120",
               "--checkpoint-dir", checkpoint_dir, "--checkpoint-every", str(args.checkpoint_every),
               "--t-detect", str(args.t_detect), "--t-reload", str(args.t_reload),
               "--step-delay", str(args.step_delay)]
    if rule != "fault_free":
        trainer += ["--policy", rule]
    # on a spare, the scheduler restarts the job on other hosts: torchrun itself does not
    max_restarts = 0 if args.restart_on == "spare" else args.max_restarts
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)),
            "--nproc-per-node", "1", "--rdzv-backend", "static",
            "--master-addr", fabric.mgmt_ip(hosts[0]), "--master-port", "29400",
            "--max-restarts", str(max_restarts), "--monitor-interval", "0.2",
            "-m", "torch_reccl.drill.trainer"] + trainer


def run_once(fabric: Fabric, args, rule: str) -> dict:
    """One job under one rule (``fault_free``: no fault, no policy); bounded."""
    fabric.heal()
    checkpoint_dir = tempfile.mkdtemp(prefix="reccl-advisor-drill-")
    env = {"RECCL_HEARTBEAT_MS": "300", "RECCL_CONNECT_TIMEOUT_MS": "1000"}
    result = {"rule": rule, "restart_on": args.restart_on, "starts": [], "exits": [],
              "steps_executed": 0, "final": {}, "hosts": []}
    fault_at = repaired_at = None
    first_step_t = last_step_t = None
    step_s = []
    hosts = [0, 1]
    deadline = time.monotonic() + args.run_timeout_s
    try:
        while True:  # one torchrun job per pass: a second only when the scheduler moves it
            result["hosts"].append(list(hosts))
            exits_before = len(result["exits"])
            argv = torchrun_argv(fabric, args, rule, checkpoint_dir, hosts)
            with Job(HostsPlacement(fabric, hosts), argv, env=env,
                     per_rank_env=lambda r: {"PET_NODE_RANK": str(r)}) as job:
                quiet_since = time.monotonic()
                while not job.all_exited():
                    if time.monotonic() > deadline or time.monotonic() - quiet_since > STALL_TIMEOUT_S:
                        raise RuntimeError(f"{rule}: the job stopped making progress\n{job.logs()}")
                    if fault_at is not None and repaired_at is None and \
                            time.time() - fault_at >= args.repair_s:
                        fabric.nic_up(FAULT_HOST, FAULT_RAIL)
                        repaired_at = time.time()
                    message = job.next_message(0.1)
                    if message is None:
                        continue
                    quiet_since = time.monotonic()
                    rank, body = message
                    kind = body.get("kind")
                    if kind == "start":
                        result["starts"].append({"t": body["t0"], "resumed_from": body["resumed_from"],
                                                 "restart": body["restart"], "nics_up": body["nics"]})
                    elif kind == "step":
                        result["steps_executed"] += 1
                        first_step_t = body["t"] if first_step_t is None else first_step_t
                        last_step_t = body["t"]
                        phase = ("healthy" if fault_at is None else
                                 "repaired" if repaired_at is not None else
                                 f"after the fault, start {len(result['starts'])}")
                        step_s.append((phase, body["step_s"], body.get("faults", 0)))
                        if rule != "fault_free" and fault_at is None and body["step"] >= args.fault_step:
                            fabric.nic_down(FAULT_HOST, FAULT_RAIL)
                            fault_at = time.time()
                    elif kind == "exit":
                        result["exits"].append({"step": body["step"], "action": body["action"],
                                                "t": body["t"], "k": body["k"],
                                                "reason": body["reason"]})
                    elif kind == "done":
                        result["final"][str(rank)] = {"steps": body["steps"],
                                                      "params_sha256": body["params_sha256"]}
                job.wait(30)
                result["exit_codes"] = job.exit_codes()
            moved = args.restart_on == "spare" and len(result["exits"]) > exits_before
            if moved and hosts[0] == FAULT_HOST:
                hosts = [SPARE_HOST, 1]  # the scheduler swaps the host with the faulty NIC out
                continue
            if any(result["exit_codes"]):
                raise RuntimeError(f"{rule}: torchrun exited with {result['exit_codes']}\n"
                                   f"{job.logs()}")
            break
    finally:
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
    result["wall_s"] = last_step_t - first_step_t
    result["steps_lost"] = result["steps_executed"] - args.steps
    result["fault_t"] = None if fault_at is None else fault_at - first_step_t
    result["repair_t"] = None if repaired_at is None else repaired_at - first_step_t
    restarts = result["starts"][1:]
    result["down_s"] = [start["t"] - exit_["t"] for exit_, start in zip(result["exits"], restarts)]
    # median step time per phase (after the fault, start 1: failed over; start 2: the
    # restarted job, without the NIC or on the spare) and the steps where the policy
    # saw a fault active
    phases = {}
    for phase, seconds, _ in step_s[1:]:
        phases.setdefault(phase, []).append(seconds)
    result["median_step_ms"] = {phase: round(1e3 * sorted(v)[len(v) // 2], 1)
                                for phase, v in phases.items()}
    result["steps_with_faults_seen"] = sum(1 for _, _, faults in step_s if faults)
    return result


def summary_lines(results: dict) -> list:
    reference = results.get("fault_free")
    lines = [f"{'rule':<13} {'wall s':>7} {'vs fault-free':>13} {'steps run':>9} {'lost':>5} "
             f"{'restarts':>8} {'down s':>7}  exit (step: action)                final model"]
    for rule, r in results.items():
        extra = "" if reference is None else f"{r['wall_s'] - reference['wall_s']:+.1f} s"
        exits = ", ".join(f"{e['step']}: {e['action']}" for e in r["exits"]) or "-"
        same = r.get("same_model_as_fault_free")
        model = "-" if same is None else ("= fault-free" if same else "DIFFERS")
        lines.append(f"{rule:<13} {r['wall_s']:>7.1f} {extra:>13} {r['steps_executed']:>9} "
                     f"{r['steps_lost']:>5} {len(r['starts']) - 1:>8} "
                     f"{sum(r['down_s']):>7.1f}  {exits:<34} {model}")
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--fault-step", type=int, default=80,
                        help="host 0's NIC 1 goes down once this step is done")
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--repair-s", type=float, default=1e9,
                        help="seconds until the NIC comes back (default: not within the run)")
    parser.add_argument("--rules", nargs="+", choices=RULES, default=list(RULES))
    parser.add_argument("--rate-mbit", type=float, default=200.0)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--step-delay", type=float, default=0.0,
                        help="seconds of emulated compute per step")
    parser.add_argument("--t-detect", type=float, default=0.0,
                        help="FaultPolicy t_detect_s: here the library sees the fault at once and "
                             "no node has to be found (default: %(default)s)")
    parser.add_argument("--t-reload", type=float, default=10.0,
                        help="FaultPolicy t_reload_s: about what a restart costs here, exit to "
                             "the restarted job's first step (default: %(default)s)")
    parser.add_argument("--max-restarts", type=int, default=2)
    parser.add_argument("--restart-on", choices=("same", "spare"), default="same",
                        help="same: torchrun --max-restarts restarts the job on its hosts, the "
                             "faulty NIC still down; spare: torchrun exits and the scheduler (this "
                             "script) starts the job with a spare host in place of host 0")
    parser.add_argument("--run-timeout-s", type=float, default=600.0)
    parser.add_argument("--name", default=None, help="the fabric's name")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)
    if not 0 < args.fault_step < args.steps:
        parser.error(f"--fault-step must lie in 1..{args.steps - 1}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("advisor_drill: needs root (network namespaces)", file=sys.stderr)
        return 2

    fabric = Fabric(hosts=3 if args.restart_on == "spare" else 2, rails=2, rate_mbit=args.rate_mbit,
                    name=args.name or unique_fabric_name("ad"))
    fabric.up()
    results = {}
    try:
        for rule in ("fault_free",) + tuple(args.rules):
            began = time.monotonic()
            results[rule] = run_once(fabric, args, rule)
            print(f"[{rule}] done in {time.monotonic() - began:.0f} s", flush=True)
    finally:
        fabric.down()
    reference = {r["params_sha256"] for r in results["fault_free"]["final"].values()}
    for rule in args.rules:
        digests = {r["params_sha256"] for r in results[rule]["final"].values()}
        results[rule]["same_model_as_fault_free"] = digests == reference and len(reference) == 1
    print("\n".join(summary_lines(results)))
    for rule in args.rules:
        for start in results[rule]["starts"][1:]:
            print(f"  {rule}: restarted job resumed from step {start['resumed_from']}, "
                  f"rank 0's NICs at its start: {start['nics_up']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"results": results, "args": vars(args)}, out, indent=2)
            out.write("\n")
    ok = all(r.get("same_model_as_fault_free", True) for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
