"""Spreading through the NCCL net plugin: busbw with NICs down or slow, spreading off and on.

Two emulated hosts with 4 rails (every NIC capped, default 1000 Mbit/s). Host 0
drives the plugin's v11 table as NCCL's proxy does (tests/helpers/spread_peer.py): one
connection per channel, one channel per NIC, every channel an equal share of
each step in 512 KiB messages with 8 in flight, all polled from one thread, the
step ending when the slowest channel ends; host 1 receives and checks every
byte. Phases: fault-free; host 0's eth0 slowed to 10% (tbf; link up, no
errors), with --slow-warmup untimed steps first, so grey-failure detection has
the load it judges by; eth0 (healed from slow) down; eth0 and eth1 down. The
whole run happens three times: RECCL_SPREAD=off (the failed or degraded NICs'
connections move to one backup NIC each), on, and on with RECCL_GREY=0 (no
grey-failure detection: the slow NIC stays in use); each busbw is printed as a
ratio to the fault-free busbw of the same run. Bounds: (N-k)/N of fault-free
with k of N NICs down or slow. Needs root.

    python bench/plugin_spread.py [--rate-mbit 1000] [--step-mb 64] [--steps 8] [--json out.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELPERS = os.path.join(REPO, "tests", "helpers")
PEER = os.path.join(HELPERS, "spread_peer.py")
NICS = [f"eth{i}" for i in range(4)]
PHASES = {"free": [], "slow1": [], "down1": [0], "down2": [0, 1]}  # phase: rails down
SLOW_RAIL, SLOW_PERCENT = 0, 10.0
RUNS = {"off": {"RECCL_SPREAD": "off"}, "on": {"RECCL_SPREAD": "on"},
        "on-nogrey": {"RECCL_SPREAD": "on", "RECCL_GREY": "0"}}


def run(settings: dict, args) -> dict:
    from torch_reccl.fabric import Fabric

    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "RECCL_NICS": ",".join(NICS), "RECCL_TRANSPORT": "tcp",
               **settings, "RECCL_HEARTBEAT_MS": str(args.heartbeat_ms),
               "PYTHONPATH": os.pathsep.join(filter(None, [HELPERS, REPO, os.environ.get("PYTHONPATH")]))}
        common = ["--driver", "plugin", "--dir", tmp, "--phases", ",".join(PHASES),
                  "--step-bytes", str(args.step_mb << 20), "--message-bytes", str(args.message_kb << 10),
                  "--window", str(args.window), "--warmup", str(args.warmup),
                  "--phase-warmup", f"slow1={args.slow_warmup}",
                  "--steps", str(args.steps), "--deadline", str(args.timeout)]
        slowed_at = None
        with Fabric(hosts=2, rails=4, rate_mbit=args.rate_mbit, name="bs") as fab:
            logs = [open(os.path.join(tmp, f"log-{role}"), "w") for role in ("recv", "send")]
            procs = [fab.popen(host, [sys.executable, PEER, "--role", role, *common], env=env,
                               stdout=subprocess.DEVNULL, stderr=log)
                     for (host, role), log in zip(((1, "recv"), (0, "send")), logs)]
            deadline = time.monotonic() + args.timeout + 30
            for phase, rails in PHASES.items():
                while not os.path.exists(os.path.join(tmp, f"want-{phase}")):
                    if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                        raise RuntimeError(f"peers stopped before {phase}: " + tail(tmp))
                    time.sleep(0.01)
                if phase == "slow1":
                    fab.slow(0, SLOW_RAIL, SLOW_PERCENT)
                    slowed_at = time.time()
                elif rails:
                    fab.slow(0, SLOW_RAIL, on=False)
                for rail in rails:
                    fab.nic_down(0, rail)
                if rails:
                    time.sleep(args.settle)  # failover done, rails dialed
                open(os.path.join(tmp, f"go-{phase}"), "w").close()
            for proc in procs:
                proc.wait(timeout=max(1, deadline - time.monotonic()))
        results = {"slowed_at": slowed_at}
        for role in ("send", "recv"):
            with open(os.path.join(tmp, f"result-{role}.json")) as f:
                results[role] = json.load(f)
            if results[role]["error"]:
                raise RuntimeError(f"{role}: {results[role]['error']}\n" + tail(tmp))
        if results["recv"]["bad_count"]:
            raise RuntimeError(f"corrupted messages: {results['recv']['bad']}")
        return results


def tail(tmp: str) -> str:
    out = []
    for role in ("send", "recv"):
        path = os.path.join(tmp, f"log-{role}")
        if os.path.exists(path):
            with open(path) as f:
                out.append(f"--- {role}\n{f.read()[-2000:]}")
    return "\n".join(out)


def summarize(results: dict) -> dict:
    phases = {p["phase"]: p for p in results["send"]["phases"]}
    free = phases["free"]["busbw_gbps"]
    out = {}
    for name, phase in phases.items():
        total = sum(phase["nic_bytes_sent"].get(n, 0) for n in NICS) or 1
        out[name] = {"busbw_gbps": phase["busbw_gbps"], "ratio": phase["busbw_gbps"] / free,
                     "step_s": phase["step_s"],
                     "nic_share": {n: phase["nic_bytes_sent"].get(n, 0) / total for n in NICS},
                     "spreading": [sorted(e["nics"]) for e in phase["spreading"]]}
    # Grey-failure verdicts on the sending host (the slowed NIC is host 0's).
    degraded = [e for e in results["send"]["events"] if e["kind"] == "degraded"]
    out["degraded_nics"] = sorted({e["nic"] for e in degraded})
    out["detected_s"] = (min(e["time"] for e in degraded) - results["slowed_at"]
                         if degraded and results["slowed_at"] else None)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate-mbit", type=float, default=1000)
    parser.add_argument("--step-mb", type=int, default=64, help="bytes per step over all channels")
    parser.add_argument("--message-kb", type=int, default=512)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--slow-warmup", type=int, default=6,
                        help="untimed steps after eth0 is slowed (detection needs ~2.5 s of load)")
    parser.add_argument("--settle", type=float, default=1.5)
    parser.add_argument("--heartbeat-ms", type=int, default=1000)
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root (network namespaces)", file=sys.stderr)
        return 2
    record = {"command": " ".join(sys.argv), "date": datetime.datetime.utcnow().isoformat() + "Z",
              "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores",
              "rate_mbit": args.rate_mbit, "load_average_before": os.getloadavg(), "runs": {}}
    for name, settings in RUNS.items():
        record["runs"][name] = summarize(run(settings, args))
    print(f"plugin busbw (GB/s), 2 hosts x 4 rails at {args.rate_mbit:g} Mbit/s, "
          f"{args.step_mb} MiB steps in {args.message_kb} KiB messages, one channel per NIC")
    print(f"{'phase':>7} {'bound':>6} " + " ".join(f"{name:>10} {'ratio':>6}" for name in RUNS))
    bounds = {"free": 1.0, "slow1": 0.75, "down1": 0.75, "down2": 0.5}
    for phase in PHASES:
        print(f"{phase:>7} {bounds[phase]:>6.2f} " +
              " ".join(f"{record['runs'][name][phase]['busbw_gbps']:>10.3f} "
                       f"{record['runs'][name][phase]['ratio']:>6.2f}" for name in RUNS))
    for phase in ("slow1", "down1", "down2"):
        share = record["runs"]["on"][phase]["nic_share"]
        print(f"spread on, {phase}: bytes per NIC " +
              " ".join(f"{n} {share[n]:.2f}" for n in NICS))
    for name in RUNS:
        detected = record["runs"][name]["detected_s"]
        print(f"{name}: degraded NICs (events on host 0): {record['runs'][name]['degraded_nics'] or 'none'}"
              + (f", first {detected:.2f} s after eth0 was slowed" if detected is not None else ""))
    record["load_average_after"] = os.getloadavg()
    print(f"line rate {4 * args.rate_mbit / 8e3:.3f} GB/s; load average before "
          f"{record['load_average_before'][0]:.1f}, after {record['load_average_after'][0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
