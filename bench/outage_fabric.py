"""Long total outages in the emulated fabric, with default timers: the CPU engine
(training) and the NCCL plugin (a message stream) ride them out.

training: two emulated hosts with two rails (2 Gbit/s per NIC) train the small
MLP of torch_reccl/bench/fabric_train.py over the "reccl" backend, 40 steps; at step 20 a
real outage starts for --seconds: `host` = every NIC of host 1 loses its link,
`pair` = host 0 loses rail 0 and host 1 rail 1 at once (no common healthy
rail). Reports whether training finished, the longest stall (`recovered`
events), how many `stalled` events each rank saw, and whether the final
parameters equal the fault-free run's.

plugin: the NCCL net plugin's send and receive comms (torch_reccl/bench/nccl_net.py
drives the plugin tables as NCCL's proxy does: isend/irecv, test() polled)
stream 150 messages from host 0 to host 1; after the first ones, every NIC of
host 1 loses its link for --seconds. Reports whether every request completed
with exact bytes (no error returned to NCCL) and the stall events.

The group's timeout (`init_process_group(timeout=)`) is set above the outage:
it bounds every collective. Needs root.

    python bench/outage_fabric.py [--seconds 60] [--what training plugin] [--outage host pair] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 40


def default_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECCL_")}
    env["RECCL_NICS"] = "eth0,eth1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    return env


def downs(outage: str) -> list:
    return [(1, 0), (1, 1)] if outage == "host" else [(0, 0), (1, 1)]


def training(fab, seconds: float, outage, port: int, timeout_s: float) -> dict:
    """One run; outage None = fault-free."""
    argv = ["--world", "2", "--master", fab.mgmt_ip(0), "--port", str(port), "--steps", str(STEPS),
            "--timeout", str(timeout_s)]
    if outage:
        argv += ["--pause", "20"]
    worker = [sys.executable, "-m", "torch_reccl.bench.outage_train"]
    procs = [fab.popen(h, [*worker, "--rank", str(h)] + argv, env=default_env(),
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for h in range(2)]
    began = time.monotonic()
    try:
        if outage:
            line = procs[0].stdout.readline()
            if not line.startswith("PAUSE"):
                raise RuntimeError(f"expected PAUSE, got {line!r}")
            for host, rail in downs(outage):
                fab.nic_down(host, rail, wait=False)
            procs[0].stdin.write("go\n")
            procs[0].stdin.flush()
            time.sleep(seconds)
            fab.heal()
        out = []
        for rank, proc in enumerate(procs):
            stdout, stderr = proc.communicate(timeout=timeout_s + seconds + 120)
            lines = stdout.strip().splitlines()
            if proc.returncode != 0 or len(lines) < 2:
                out.append({"rank": rank, "error": (stderr.strip().splitlines() or ["?"])[-1][:300]})
                continue
            result = json.loads(lines[-2])
            result.update(json.loads(lines[-1]))
            out.append(result)
        return {"ranks": out, "wall_s": time.monotonic() - began}
    finally:
        fab.heal()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def plugin(fab, seconds: float) -> dict:
    env = default_env()
    with tempfile.TemporaryDirectory() as tmp:
        harness = [sys.executable, "-m", "torch_reccl.bench.nccl_net"]
        procs = [fab.popen(host, [*harness, "--role", role, "--dir", tmp,
                                  "--deadline", str(seconds + 120)], env=env,
                           stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, f"log-{role}"), "w"))
                 for host, role in ((1, "recv"), (0, "send"))]
        try:
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(tmp, "progress-send")) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.5)
            for host, rail in downs("host"):
                fab.nic_down(host, rail, wait=False)
            time.sleep(seconds)
            fab.heal()
            for proc in procs:
                proc.wait(timeout=seconds + 180)
        finally:
            fab.heal()
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        results = {}
        for role in ("send", "recv"):
            path = os.path.join(tmp, f"result-{role}.json")
            results[role] = json.load(open(path)) if os.path.exists(path) else {"error": "no result"}
        return results


def stall_line(events) -> str:
    stalled = [e for e in events if e["kind"] == "stalled"]
    recovered = [e["duration_s"] for e in events if e["kind"] == "recovered" and e.get("connection")]
    failed = [e for e in events if e["kind"] == "connection_failed"]
    return (f"{len(stalled)} stalled events over {len({e['connection'] for e in stalled})} connections, "
            f"longest stall {max(recovered):.1f} s" if recovered else f"{len(stalled)} stalled, no recovered") + \
        (f", {len(failed)} connection_failed" if failed else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--what", nargs="+", choices=("training", "plugin"), default=["training", "plugin"])
    parser.add_argument("--outage", nargs="+", choices=("host", "pair"), default=["host", "pair"])
    parser.add_argument("--json", metavar="PATH", help="also write every run's record here")
    args = parser.parse_args()
    record = {"seconds": args.seconds, "steps": STEPS}
    from torch_reccl.fabric import Fabric

    fab = Fabric(hosts=2, rails=2, rate_mbit=2000, name="obn").up()
    try:
        port = 29900 + os.getpid() % 50
        if "training" in args.what:
            timeout_s = max(60.0, args.seconds * 2)
            reference = training(fab, 0, None, port, timeout_s)
            ref_params = {r.get("params") for r in reference["ranks"]}
            record["fault_free"] = reference
            print(f"fault-free: {STEPS} steps, {reference['wall_s']:.1f} s")
            for outage in args.outage:
                port += 1
                run = training(fab, args.seconds, outage, port, timeout_s)
                record[f"training_{outage}"] = run
                what = ("host 1 loses every NIC" if outage == "host"
                        else "host 0 loses rail 0, host 1 rail 1")
                print(f"training, {what} for {args.seconds:g} s: wall {run['wall_s']:.1f} s")
                for r in run["ranks"]:
                    if "error" in r:
                        print(f"  rank {r['rank']}: DIED: {r['error']}")
                        continue
                    same = r["params"] in ref_params and len(ref_params) == 1
                    print(f"  rank {r['rank']}: {len(r['losses'])} steps, parameters "
                          f"{'bit-identical' if same else 'DIFFER'}; {stall_line(r['events'])}")
        if "plugin" in args.what:
            results = plugin(fab, args.seconds)
            record["plugin_host"] = results
            print(f"NCCL plugin stream, host 1 loses every NIC for {args.seconds:g} s:")
            for role, r in results.items():
                good = f", {r['good']} of 150 messages bit-exact" if "good" in r else ""
                print(f"  {role}: error {r.get('error')}{good}; {stall_line(r.get('events', []))}")
    finally:
        fab.down()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
