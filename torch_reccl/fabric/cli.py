"""``reccl fabric``: build, fault, heal and tear down an emulated fabric.

    reccl fabric up    --name N --hosts H --rails R [--rate-mbit M] [--tcp-congestion NAME]
    reccl fabric down  --name N
    reccl fabric fail  --name N (nic H:R | rail R | blackhole H:R | flap H:R [--period S --count C]
                                 | slow H:R --percent P | lossy H:R --percent P)
    reccl fabric heal  --name N [nic H:R | rail R | blackhole H:R | slow H:R | lossy H:R]
                                                                     (no target: heal all)
    reccl fabric exec  --name N HOST [--timeout S] -- CMD...
    reccl fabric show  --name N [--json]
    reccl fabric list

The fabric outlives each command; its state file (/run/reccl-fabric/N.json)
lets later commands find it.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

FAULT_KINDS = ("nic", "rail", "blackhole", "flap", "slow", "lossy")
HEAL_KINDS = ("nic", "rail", "blackhole", "slow", "lossy")
# --percent: what a slow NIC keeps of the fabric rate / what a lossy NIC drops
DEFAULT_PERCENT = {"slow": 10.0, "lossy": 5.0}


def _host_rail(text: str):
    try:
        h, r = text.split(":")
        return int(h), int(r)
    except ValueError:
        raise ValueError(f"expected HOST:RAIL (e.g. 0:1), got {text!r}") from None


def _rail(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected a rail number (e.g. 1), got {text!r}") from None


def _fabric(name: str):
    from torch_reccl.fabric import Fabric

    return Fabric.attach(name)


def _err(msg: str, code: int = 1) -> int:
    print(f"reccl fabric: error: {msg}", file=sys.stderr)
    return code


def _guard(fn):
    """Turn the library's errors into a message and an exit code."""

    def wrapped(args) -> int:
        from torch_reccl.fabric import FabricError

        try:
            return int(fn(args) or 0)
        except FabricError as e:
            return _err(str(e), 1)
        except ValueError as e:
            return _err(str(e), 2)

    wrapped.__name__ = fn.__name__
    wrapped.__doc__ = fn.__doc__
    return wrapped


def format_show(info: dict) -> str:
    rate = f"{info['rate_mbit']:g} mbit/s per NIC" if info["rate_mbit"] else "no rate cap"
    tcp = info.get("tcp_congestion") or "the namespaces' default"
    lines = [f"fabric {info['name']}: {info['hosts']} hosts x {info['rails']} rails, {rate}, "
             f"TCP congestion control {tcp}"]
    for h in info["host_state"]:
        lines.append(f"host {h['host']}  netns {h['netns']}  mgmt0 {h['mgmt_ip']}")
        for n in h["nics"]:
            flags = [n["operstate"] or "?", "carrier" if n["carrier"] else "NO-CARRIER"]
            if n["blackhole"]:
                flags.append("BLACKHOLE")
            if n.get("slow_pct") is not None:
                flags.append(f"SLOW {n['slow_pct']:g}%")
            if n.get("lossy_pct") is not None:
                flags.append(f"LOSSY {n['lossy_pct']:g}%")
            lines.append(f"  {n['nic']:<5} {n['ip']:<15} {' '.join(flags)}")
    f = info["faults"]
    lines.append("faults: " + ", ".join(
        f"{k} {v}" for k, v in f.items() if v) if any(f.values()) else "faults: none")
    return "\n".join(lines)


@_guard
def cmd_up(args) -> int:
    from torch_reccl.fabric import Fabric
    from torch_reccl.fabric.fabric import tcp_congestion_arg

    fab = Fabric(hosts=args.hosts, rails=args.rails, rate_mbit=args.rate_mbit, name=args.name,
                 tcp_congestion=tcp_congestion_arg(args.tcp_congestion))
    fab.up()
    print(format_show(fab.show()))
    return 0


@_guard
def cmd_down(args) -> int:
    from torch_reccl.fabric import Fabric

    # works without a state file too: removes everything carrying the name
    Fabric.cleanup(args.name)
    print(f"fabric {args.name} down")
    return 0


@_guard
def cmd_fail(args) -> int:
    fab = _fabric(args.name)
    kind, target = args.kind, args.target
    if kind == "rail":
        rail = _rail(target)
        fab.rail_down(rail)
        print(f"fabric {fab.name}: rail {rail} down")
    elif kind == "nic":
        h, r = _host_rail(target)
        fab.nic_down(h, r)
        print(f"fabric {fab.name}: host {h} {fab.nic_name(r)} down")
    elif kind == "blackhole":
        h, r = _host_rail(target)
        fab.blackhole(h, r, True)
        print(f"fabric {fab.name}: host {h} {fab.nic_name(r)} blackholed")
    elif kind in ("slow", "lossy"):
        h, r = _host_rail(target)
        pct = DEFAULT_PERCENT[kind] if args.percent is None else args.percent
        if kind == "slow":
            fab.slow(h, r, pct)
            print(f"fabric {fab.name}: host {h} {fab.nic_name(r)} slowed to {pct:g}% "
                  f"of {fab.rate_mbit:g} mbit/s")
        else:
            fab.lossy(h, r, pct)
            print(f"fabric {fab.name}: host {h} {fab.nic_name(r)} drops {pct:g}% of its frames")
    else:  # flap: runs in the foreground until done (Ctrl-C stops it, link up)
        h, r = _host_rail(target)
        handle = fab.flap(h, r, period_s=args.period, count=args.count)
        limit = args.period * args.count + 10.0
        try:
            done = handle.join(limit)
        except KeyboardInterrupt:
            done = handle.stop()
        if not done and not handle.stop():
            return _err(f"flapping host {h} rail {r} did not stop within {limit:.0f}s")
        if handle.error is not None:
            return _err(f"flapping host {h} rail {r} failed: {handle.error}")
        print(f"fabric {fab.name}: host {h} {fab.nic_name(r)} flapped "
              f"{handle.flaps_done} times, link up")
    return 0


@_guard
def cmd_heal(args) -> int:
    fab = _fabric(args.name)
    kind, target = args.kind, args.target
    if kind is None:
        if target is not None:
            raise ValueError(f"heal: give a kind ({', '.join(HEAL_KINDS)}) before {target!r}")
        fab.heal()
        print(f"fabric {fab.name}: healed (all links up, no blackholes, full rate, no loss)")
        return 0
    if target is None:
        raise ValueError(f"heal {kind}: missing target "
                         f"({'RAIL' if kind == 'rail' else 'HOST:RAIL'})")
    if kind == "rail":
        rail = _rail(target)
        fab.rail_up(rail)
        print(f"fabric {fab.name}: rail {rail} up")
    elif kind == "nic":
        h, r = _host_rail(target)
        fab.nic_up(h, r)
        print(f"fabric {fab.name}: host {h} {fab.nic_name(r)} up")
    elif kind == "slow":
        h, r = _host_rail(target)
        fab.slow(h, r, on=False)
        print(f"fabric {fab.name}: host {h} {fab.nic_name(r)} back at full rate")
    elif kind == "lossy":
        h, r = _host_rail(target)
        fab.lossy(h, r, on=False)
        print(f"fabric {fab.name}: host {h} {fab.nic_name(r)} loses no frames")
    else:
        h, r = _host_rail(target)
        fab.blackhole(h, r, False)
        print(f"fabric {fab.name}: host {h} {fab.nic_name(r)} blackhole removed")
    return 0


@_guard
def cmd_exec(args) -> int:
    fab = _fabric(args.name)
    cmd = list(args.cmd)
    timeout = args.timeout
    # `exec --name N HOST --timeout S -- CMD`: options after HOST land in cmd
    while cmd and cmd[0].startswith("--timeout"):
        opt = cmd.pop(0)
        val = opt.split("=", 1)[1] if "=" in opt else (cmd.pop(0) if cmd else "")
        try:
            timeout = float(val)
        except ValueError:
            raise ValueError(f"exec: --timeout needs seconds, got {val!r}") from None
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ValueError("exec: missing command (reccl fabric exec --name N HOST -- CMD...)")
    try:
        p = fab.popen(args.host, cmd)
    except FileNotFoundError as e:
        return _err(f"exec: cannot run {cmd[0]!r}: {e}", 127)
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(5)
        return _err(f"exec: {cmd[0]!r} still running after {timeout:g}s, killed", 124)
    except KeyboardInterrupt:
        try:
            return p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
            return 130


@_guard
def cmd_show(args) -> int:
    info = _fabric(args.name).show()
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        print(format_show(info))
    return 0


@_guard
def cmd_list(args) -> int:
    from torch_reccl.fabric import list_fabrics

    for n in list_fabrics():
        print(n)
    return 0


def _fabric_help(parser):
    def run(args) -> int:
        parser.print_help(sys.stderr)
        return 2

    return run


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "fabric", help="emulated rail-optimized fabric (network namespaces; root)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(func=_fabric_help(p))
    sp = p.add_subparsers(dest="fabric_command", metavar="ACTION")

    def named(action, help_):
        q = sp.add_parser(action, help=help_)
        q.add_argument("--name", required=True,
                       help="fabric name: 1-4 chars from [a-z0-9]")
        return q

    q = named("up", "build a fabric")
    q.add_argument("--hosts", type=int, required=True, help="number of hosts (netns)")
    q.add_argument("--rails", type=int, required=True, help="NICs per host = rail switches")
    q.add_argument("--rate-mbit", type=float, default=None,
                   help="cap every NIC at this rate, both directions (default: no cap)")
    q.add_argument("--tcp-congestion", default="cubic", metavar="NAME",
                   help="TCP congestion control of every host (default cubic, whatever this "
                        "machine uses; 'inherit' keeps the namespaces' default)")
    q.set_defaults(func=cmd_up)

    q = named("down", "tear a fabric down (everything carrying its name)")
    q.set_defaults(func=cmd_down)

    q = named("fail", "inject a fault")
    q.add_argument("kind", choices=FAULT_KINDS, help="fault kind")
    q.add_argument("target", help="HOST:RAIL for nic/blackhole/flap/slow/lossy, RAIL for rail")
    q.add_argument("--period", type=float, default=0.2,
                   help="flap: seconds per down+up cycle (default 0.2)")
    q.add_argument("--count", type=int, default=10, help="flap: cycles (default 10)")
    q.add_argument("--percent", type=float, default=None,
                   help="slow: percent of the fabric rate the NIC keeps (default 10); "
                        "lossy: percent of frames dropped each way (default 5)")
    q.set_defaults(func=cmd_fail)

    q = named("heal", "undo one fault, or all of them")
    q.add_argument("kind", nargs="?", choices=HEAL_KINDS, help="fault kind (default: all)")
    q.add_argument("target", nargs="?",
                   help="HOST:RAIL for nic/blackhole/slow/lossy, RAIL for rail")
    q.set_defaults(func=cmd_heal)

    q = named("exec", "run a command inside a host's namespace")
    q.add_argument("host", type=int, help="host index")
    q.add_argument("--timeout", type=float, default=None,
                   help="kill the command after this many seconds (default: none)")
    q.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    q.set_defaults(func=cmd_exec)

    q = named("show", "show hosts, NICs, link state and faults")
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q.set_defaults(func=cmd_show)

    q = sp.add_parser("list", help="list fabrics that have a state file")
    q.set_defaults(func=cmd_list)
    return p


def main(argv=None) -> int:
    """``python -m torch_reccl.fabric.cli ...`` (same as ``reccl fabric ...``)."""
    parser = argparse.ArgumentParser(prog="reccl")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
