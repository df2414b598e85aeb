"""Spreading through the NCCL net plugin: busbw with NICs down or slow, against a fault-free phase that fills the NICs.

Two emulated hosts with 4 rails (every NIC capped by tbf, default 1000 Mbit/s).
Host 0 drives the plugin's v11 table as NCCL's proxy does
(torch_reccl/bench/spread_peer.py): one connection per channel, channel c on NIC c
mod 4 (--channels 8: two per NIC), every step an equal --channel-mb per channel
in --message-kb messages, all in flight at once (--window), polled from one
thread, the step ending when the slowest channel ends; host 1 receives and
checks every byte. Phases (--phases): fault-free; `down1` host 0's eth0 down;
`down2` eth0 and eth1 down; optionally `slow1` eth0 slowed to 10% (tbf; link up,
no errors) with --slow-warmup untimed steps first, so grey-failure detection has
the load it judges by. Before the fault-free phase --setup-warmup untimed steps
(connections fully grown); after each change --warmup settling steps; then
--steps timed steps.

Each run (--runs) is one pass through the phases with its own settings: `on`
(the defaults: spreading and grey detection on), `plain` (RECCL_SPREAD=off
RECCL_GREY=0: failover to one backup NIC only, no grey detection; its fault-free
phase is the cost check of spreading and detection), `off` (RECCL_SPREAD=off),
`on-nogrey` (RECCL_GREY=0).

With k of N NICs down lock-step traffic keeps at best (N-k)/N of a fault-free
phase that fills the NICs, so each phase is reported against the run's
fault-free busbw and against that bound; the fault-free phase is reported as a
share of the line rate (each fault phase also as a share of the surviving NICs'
line rate), and ratios are quoted only when it reaches --min-fill
(else the bench says so and exits 1: a fault-free phase that leaves the NICs
idle makes every ratio look better than it is). Needs root.

    python bench/plugin_spread.py [--channels 4] [--runs on,plain] [--per-step] [--json out.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER = [sys.executable, "-m", "torch_reccl.bench.spread_peer"]
NICS = [f"eth{i}" for i in range(4)]
PHASE_RAILS = {"free": [], "slow1": [], "down1": [0], "down2": [0, 1]}  # phase: rails down
PHASE_NAMES = {"free": "fault-free", "slow1": "eth0 at 10%", "down1": "eth0 down",
               "down2": "eth0, eth1 down"}
SLOW_RAIL, SLOW_PERCENT = 0, 10.0
RUNS = {"on": {}, "plain": {"RECCL_SPREAD": "off", "RECCL_GREY": "0"},
        "off": {"RECCL_SPREAD": "off"}, "on-nogrey": {"RECCL_GREY": "0"}}


def bound(phase: str) -> float:
    """(N-k)/N: what lock-step traffic keeps of fault-free with k of N NICs down or slow."""
    lost = len(PHASE_RAILS[phase]) + (phase == "slow1")
    return (len(NICS) - lost) / len(NICS)


def run(settings: dict, phases: list, args) -> dict:
    from torch_reccl.fabric import Fabric

    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "RECCL_NICS": ",".join(NICS), "RECCL_TRANSPORT": "tcp",
               "RECCL_SPREAD": "on", "RECCL_GREY": "1", **settings,
               "RECCL_HEARTBEAT_MS": str(args.heartbeat_ms),
               "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
        common = ["--driver", "plugin", "--dir", tmp, "--phases", ",".join(phases),
                  "--channels", str(args.channels), "--nics", str(len(NICS)),
                  "--step-bytes", str(args.channels * args.channel_mb << 20),
                  "--message-bytes", str(args.message_kb << 10),
                  "--window", str(args.window), "--warmup", str(args.warmup),
                  "--steps", str(args.steps), "--deadline", str(args.timeout)]
        first_steps = [f"free={args.setup_warmup}"] + (
            [f"slow1={args.slow_warmup}"] if "slow1" in phases else [])
        common += ["--phase-warmup", ",".join(first_steps)]
        if args.per_step:
            common.append("--per-step")
        slowed_at = None
        with Fabric(hosts=2, rails=len(NICS), rate_mbit=args.rate_mbit, name=args.fabric,
                    tcp_congestion=args.tcp_congestion) as fab:
            logs = [open(os.path.join(tmp, f"log-{role}"), "w") for role in ("recv", "send")]
            procs = [fab.popen(host, [*PEER, "--role", role, *common], env=env,
                               stdout=subprocess.DEVNULL, stderr=log)
                     for (host, role), log in zip(((1, "recv"), (0, "send")), logs)]
            deadline = time.monotonic() + args.timeout + 30
            for phase in phases:
                while not os.path.exists(os.path.join(tmp, f"want-{phase}")):
                    if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                        raise RuntimeError(f"peers stopped before {phase}: " + tail(tmp))
                    time.sleep(0.01)
                if phase == "slow1":
                    fab.slow(0, SLOW_RAIL, SLOW_PERCENT)
                    slowed_at = time.time()
                elif PHASE_RAILS[phase] and slowed_at is not None:
                    fab.slow(0, SLOW_RAIL, on=False)
                for rail in PHASE_RAILS[phase]:
                    fab.nic_down(0, rail)
                if PHASE_RAILS[phase]:
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


def imbalance(phase: dict, rails_down: list) -> dict:
    """Per timed step: the busiest surviving NIC's bytes over the survivors' mean
    (1.0: every survivor carried the same), and the spread of the channels' end
    times (first to last channel done, as a share of the step)."""
    survivors = [n for i, n in enumerate(NICS) if i not in rails_down]
    loads, gaps = [], []
    for nic_bytes in phase["step_nic_bytes"]:
        sent = [nic_bytes.get(n, 0) for n in survivors]
        loads.append(max(sent) / (sum(sent) / len(sent)))
    for ends in phase["channel_s"]:
        gaps.append((max(ends) - min(ends)) / max(ends))
    return {"busiest_nic_over_mean": statistics.mean(loads) if loads else None,
            "channel_end_spread": statistics.mean(gaps) if gaps else None}


def summarize(results: dict, args) -> dict:
    phases = {p["phase"]: p for p in results["send"]["phases"]}
    free = phases["free"]["busbw_gbps"]
    line_rate = len(NICS) * args.rate_mbit / 8e3  # GB/s
    out = {"fill": free / line_rate, "phases": {}}
    for name, phase in phases.items():
        total = sum(phase["nic_bytes_sent"].get(n, 0) for n in NICS) or 1
        ratio = phase["busbw_gbps"] / free
        out["phases"][name] = {
            "busbw_gbps": phase["busbw_gbps"], "of_line_rate": phase["busbw_gbps"] / line_rate,
            "of_survivors_line_rate": phase["busbw_gbps"] / (line_rate * bound(name)),
            "ratio": ratio, "bound": bound(name), "of_bound": ratio / bound(name),
            "step_s": phase["step_s"], "tcp": phase["tcp"],
            "timed_from": phase["timed_from"], "timed_to": phase["timed_to"],
            "nic_share": {n: phase["nic_bytes_sent"].get(n, 0) / total for n in NICS},
            "spreading": [sorted(e["nics"]) for e in phase["spreading"]]}
        if args.per_step:
            out["phases"][name].update(imbalance(phase, PHASE_RAILS[name]),
                                       channel_s=phase["channel_s"],
                                       step_nic_bytes=phase["step_nic_bytes"],
                                       step_tcp_timeouts=phase["step_tcp_timeouts"])
    # Grey-failure verdicts on the sending host (the slowed NIC is host 0's).
    degraded = [e for e in results["send"]["events"] if e["kind"] == "degraded"]
    out["degraded_nics"] = sorted({e["nic"] for e in degraded})
    out["receiver_tcp"] = results["recv"].get("tcp", {})
    out["events"] = {role: [{k: e.get(k) for k in ("time", "kind", "nic", "connection", "reason", "detail")}
                            for e in results[role]["events"]] for role in ("send", "recv")}
    out["detected_s"] = (min(e["time"] for e in degraded) - results["slowed_at"]
                         if degraded and results["slowed_at"] else None)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate-mbit", type=float, default=1000)
    parser.add_argument("--channels", type=int, default=4, help="4: one per NIC; 8: two per NIC")
    parser.add_argument("--channel-mb", type=int, default=4, help="MiB per channel and step")
    parser.add_argument("--message-kb", type=int, default=1024)
    parser.add_argument("--window", type=int, default=0,
                        help="messages in flight per channel (default: all of a step's)")
    parser.add_argument("--phases", default="free,down1,down2",
                        help="free first, then any of slow1, down1, down2")
    parser.add_argument("--runs", default="on,plain", help=f"any of {', '.join(RUNS)}")
    parser.add_argument("--warmup", type=int, default=2, help="settling steps after each change")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per phase")
    parser.add_argument("--setup-warmup", type=int, default=80,
                        help="untimed steps before the fault-free phase (~3 s at 4 channels), as "
                             "nccl-tests' warm-up iterations: just after set-up, data sockets "
                             "still joining and TCP finding its windows make the first steps "
                             "up to 4x slower now and then")
    parser.add_argument("--slow-warmup", type=int, default=60,
                        help="untimed steps after eth0 is slowed (detection needs ~2.5 s of load)")
    parser.add_argument("--settle", type=float, default=1.5)
    parser.add_argument("--heartbeat-ms", type=int, default=1000)
    parser.add_argument("--min-fill", type=float, default=0.88,
                        help="share of the line rate fault-free must reach before ratios are quoted")
    parser.add_argument("--per-step", action="store_true",
                        help="record bytes per NIC and channel end times of every step: how even "
                             "the survivors' load was")
    parser.add_argument("--fabric", default="psb", help="name of the emulated fabric (unique per user)")
    parser.add_argument("--tcp-congestion", default="cubic", metavar="NAME",
                        help="the hosts' TCP congestion control ('inherit': this machine's default)")
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    phases = args.phases.split(",")
    runs = args.runs.split(",")
    if phases[0] != "free" or any(p not in PHASE_RAILS for p in phases) or len(set(phases)) < len(phases):
        parser.error(f"--phases {args.phases!r}: want free first, then any of slow1, down1, down2")
    if not runs or any(r not in RUNS for r in runs):
        parser.error(f"--runs {args.runs!r}: want a comma-separated list of {', '.join(RUNS)}")
    per_channel = args.channel_mb << 20
    if args.message_kb <= 0 or per_channel % (args.message_kb << 10):
        parser.error(f"--message-kb {args.message_kb}: must divide --channel-mb {args.channel_mb} MiB")
    args.window = args.window or per_channel // (args.message_kb << 10)
    from torch_reccl.fabric.fabric import tcp_congestion_arg

    try:
        args.tcp_congestion = tcp_congestion_arg(args.tcp_congestion)
    except ValueError as error:
        parser.error(str(error))
    if os.geteuid() != 0:
        print("needs root (network namespaces)", file=sys.stderr)
        return 2
    record = {"command": " ".join(sys.argv), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores",
              "rate_mbit": args.rate_mbit, "tcp_congestion": args.tcp_congestion or "inherited",
              "load_average_before": os.getloadavg(), "runs": {}}
    for name in runs:
        record["runs"][name] = summarize(run(RUNS[name], phases, args), args)
    record["load_average_after"] = os.getloadavg()
    line_rate = len(NICS) * args.rate_mbit / 8e3
    print(f"plugin busbw, 2 hosts x {len(NICS)} rails at {args.rate_mbit:g} Mbit/s (line rate "
          f"{line_rate:.3f} GB/s), {args.channels} channels, {args.channel_mb} MiB per channel "
          f"and step in {args.message_kb} KiB messages, {args.window} in flight; "
          f"{args.setup_warmup} untimed steps first, then {args.warmup} settling + {args.steps} "
          f"timed steps per phase; TCP congestion control {record['tcp_congestion']}")
    filled = True
    for name in runs:
        result = record["runs"][name]
        fills = result["fill"] >= args.min_fill
        filled = filled and fills
        print(f"\nrun {name} ({' '.join(f'{k}={v}' for k, v in RUNS[name].items()) or 'defaults'}): "
              f"fault-free at {result['fill']:.1%} of line rate"
              + ("" if fills else f", below {args.min_fill:.0%}: the NICs are not filled, "
                 "ratios not quoted"))
        print(f"{'phase':>16} {'GB/s':>7} {'of line':>8} {'of survivors':>12} {'ratio':>6} {'bound':>6} {'of bound':>8}"
              + (f" {'busiest NIC/mean':>16} {'end spread':>10}" if args.per_step else ""))
        for phase in phases:
            p = result["phases"][phase]
            ratios = (f"{p['ratio']:>6.3f} {p['bound']:>6.2f} {p['of_bound']:>8.3f}" if fills
                      else f"{'-':>6} {p['bound']:>6.2f} {'-':>8}")
            extra = (f" {p['busiest_nic_over_mean']:>16.3f} {p['channel_end_spread']:>10.3f}"
                     if args.per_step else "")
            print(f"{PHASE_NAMES[phase]:>16} {p['busbw_gbps']:>7.3f} {p['of_line_rate']:>8.1%} "
                  f"{p['of_survivors_line_rate']:>12.1%} "
                  f"{ratios}{extra}")
        for phase in phases[1:]:
            share = result["phases"][phase]["nic_share"]
            print(f"  {PHASE_NAMES[phase]}: bytes per NIC " + " ".join(f"{n} {share[n]:.3f}" for n in NICS))
        for phase in phases:
            tcp = result["phases"][phase]["tcp"]
            print(f"  {PHASE_NAMES[phase]}: host 0 TCP " + " ".join(f"{k} {v}" for k, v in sorted(tcp.items())))
        print("  whole run: host 1 TCP " + " ".join(f"{k} {v}" for k, v in sorted(result["receiver_tcp"].items())))
        if "slow1" in phases:
            detected = result["detected_s"]
            print(f"  degraded NICs (events on host 0): {result['degraded_nics'] or 'none'}"
                  + (f", first {detected:.2f} s after eth0 was slowed" if detected is not None else ""))
    if "on" in runs and "plain" in runs:
        on, plain = (record["runs"][r]["phases"]["free"]["busbw_gbps"] for r in ("on", "plain"))
        record["fault_free_on_over_plain"] = on / plain
        print(f"\nfault-free cost of spreading and grey detection: on / plain = {on / plain:.3f}")
    print(f"load average before {record['load_average_before'][0]:.2f}, "
          f"after {record['load_average_after'][0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0 if filled else 1


if __name__ == "__main__":
    sys.exit(main())
