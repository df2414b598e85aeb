"""The four checks of ``reccl qualify`` as every rank runs them, in order, and the
record rank 0 keeps of them (written as ``--json``, shown as the summary and the
``--report``).

Each check ends with a status: ``passed``, ``failed`` (its ``problems`` say why,
naming the host, rail or NIC) or ``skipped`` (``reason``: an earlier check failed,
one NIC leaves nothing to fail over to, ``--checks`` left it out). Performance
and failover run only when inventory and reachability passed: on a cluster whose
rails do not all connect their numbers would measure the fault, not the fabric.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from torch_reccl.qualify import inventory, reach
from torch_reccl.qualify.collectives import OPS, EventLog, fault_stream, measure
from torch_reccl.qualify.job import Job, QualifyError

CHECKS = ("inventory", "reach", "perf", "failover")
DEFAULT_SIZES_MIB = {"cpu": [1.0, 16.0], "cuda": [16.0, 64.0, 256.0]}
DEFAULT_FAILOVER_MIB = {"cpu": 4.0, "cuda": 64.0}
STORE_SLACK_S = 30.0        # beyond a step's own bound, for the slowest rank to arrive
GPU_WORKER_SLACK_S = 120.0  # a GPU variant's process: NCCL's set-up, beyond its collectives
MIB = 1 << 20


def skipped(reason: str, **fields) -> Dict[str, Any]:
    return {"status": "skipped", "reason": reason, "problems": [], **fields}


def verdict(problems: List[str], **fields) -> Dict[str, Any]:
    return {"status": "failed" if problems else "passed", "problems": problems, **fields}


class Progress:
    """Rank 0's step lines: on stderr, or as messages to ``reccl qualify --local``."""

    def __init__(self, job: Job, markers: bool):
        self.job = job
        self.markers = markers

    def __call__(self, text: str) -> None:
        if not self.job.is_root:
            return
        if self.markers:
            from torch_reccl.cli.launch import report

            report("progress", text=text)
        else:
            print(f"reccl qualify: {text}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- 1 inventory


def run_inventory(job: Job, args, say: Progress) -> Dict[str, Any]:
    """Every rank reports; rank 0 groups ranks into hosts, compares the hosts and
    publishes the plan every rank follows: {host_of, rails, device, inventory}."""
    say("inventory: listing NICs, RDMA devices and GPUs on every host")
    import torch

    mine = {"host_key": job.host_key, "inventory": inventory.collect(),
            "cuda": bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0}
    gathered = job.gather("inventory", mine, args.step_timeout)
    plan = None
    if job.is_root:
        missing = [r for r, g in enumerate(gathered) if g is None]
        if missing:
            plan = {"abort": f"rank(s) {missing} did not report an inventory within {args.step_timeout:.0f} s "
                             f"(their output says why)"}
        else:
            keys: List[str] = []
            host_of = []
            for g in gathered:
                if g["host_key"] not in keys:
                    keys.append(g["host_key"])
                host_of.append(keys.index(g["host_key"]))
            host_invs = [gathered[host_of.index(h)]["inventory"] for h in range(len(keys))]
            problems, warnings, rails = inventory.compare(host_invs)
            cuda = all(g["cuda"] for g in gathered)
            device = args.device if args.device != "auto" else ("cuda" if cuda else "cpu")
            if device == "cuda" and not cuda:
                problems.append(f"--device cuda, but rank(s) {[r for r, g in enumerate(gathered) if not g['cuda']]} "
                                f"see no CUDA GPU")
            rdma = all(any(inventory.port_active(p) for d in inv["rdma"]["devices"] for p in d["ports"])
                       for inv in host_invs)
            ib_plugin = any((inv["rdma"].get("plugin_transport") or {}).get("kind") == "ib" for inv in host_invs)
            plan = {"host_of": host_of, "rails": rails, "device": device, "rdma": rdma, "ib_plugin": ib_plugin,
                    "hosts_listed": not any(inv.get("error") for inv in host_invs),
                    "inventory": verdict(problems, warnings=warnings, rails=rails, hosts=host_invs)}
    plan = job.publish("plan", plan, args.step_timeout + STORE_SLACK_S)
    if "abort" in plan:
        raise QualifyError(plan["abort"])
    job.set_hosts(plan["host_of"])
    return plan


# ---------------------------------------------------------------- 2 reachability


def run_reach(job: Job, args, plan: Dict[str, Any], events: EventLog, say: Progress) -> Optional[Dict[str, Any]]:
    """Rank 0: the reach check's record; the hosts' lowest ranks dial, the others wait."""
    hosts = len(job.hosts)
    rails = plan["rails"]
    way = "every pair of hosts, both ways" if hosts <= reach.FULL_MESH_MAX_HOSTS else \
        f"each host's ring neighbours (more than {reach.FULL_MESH_MAX_HOSTS} hosts)"
    say(f"reachability: {rails} rail(s) between {way}")
    mine: Dict[str, Any] = {}
    closers: List[Any] = []
    try:
        if job.is_leader:
            mine = _reach_leader(job, args, plan, events, closers)
    except Exception as error:  # noqa: BLE001 - reported for this host; the other hosts go on
        mine = {"error": f"could not run its dials: {type(error).__name__}: {error}"}
    finally:
        # every host's listeners stay up until every host is done dialing
        job.barrier("reach/done", 2 * (args.reach_timeout + reach.PING_SLACK_S) + STORE_SLACK_S)
        for closer in closers:
            closer.close()
    gathered = job.gather("reach/result", mine, args.step_timeout)
    if not job.is_root:
        return None
    by_host = {job.host_of[r]: g for r, g in enumerate(gathered) if g}
    invs = plan["inventory"]["hosts"]
    rows, verbs_rows, problems, warnings = [], [], [], []
    for src in range(hosts):
        got = by_host.get(src)
        for dst in reach.targets(hosts, src):
            for rail in range(rails):
                key = f"{dst}/{rail}"
                a, b = invs[src]["nics"][rail], invs[dst]["nics"][rail]
                where = (f"rail {rail}: host {src} {a['name']} ({a['address']}) -> host {dst} "
                         f"{b['name']} ({b['address']})")
                if got is None or got.get("error"):
                    why = got["error"] if got else "reported no result (its output says why)"
                    problems.append(f"{where}: host {src} {why}")
                    continue
                tcp, hello = got["tcp"].get(key), got["hello"].get(key)
                rows.append({"src": src, "dst": dst, "rail": rail, "tcp": tcp, "hello": hello})
                if not tcp["connected"]:
                    problems.append(f"{where}: TCP does not connect: {tcp['error']}")
                elif tcp["error"]:
                    problems.append(f"{where}: TCP: {tcp['error']}")
                elif not hello["ok"]:
                    refused = (by_host.get(dst) or {}).get("rejected") or {}
                    why = (f"; host {dst} refused handshakes: " + "; ".join(f"{d} ({n}x)" for d, n in refused.items())
                           if refused else "")
                    problems.append(f"{where}: TCP connects, but reccl's handshake did not complete: "
                                    f"{hello['error']}{why}")
            for key, row in sorted((got or {}).get("verbs", {}).items()):
                dst_v, rail = (int(v) for v in key.split("/"))
                if dst_v != dst:
                    continue
                verbs_rows.append({"src": src, "dst": dst, "rail": rail, **row})
                if not row["ok"]:
                    # a failure the jobs would meet only where the plugin runs over IB
                    text = f"verbs rail {rail} ({row.get('device')}): host {src} -> host {dst}: {row['error']}"
                    if plan["ib_plugin"]:
                        problems.append(text)
                    else:
                        warnings.append(text + " (the plugin runs over TCP here, RECCL_TRANSPORT)")
    verbs_note = sorted({f"host {h}: {g['verbs_note']}" for h, g in by_host.items() if g.get("verbs_note")})
    (problems if plan["ib_plugin"] else warnings).extend(f"verbs not checked on {note}" for note in verbs_note)
    return verdict(problems, warnings=warnings, plan=way, rows=rows, verbs_rows=verbs_rows,
                   verbs_note=verbs_note, timeout_s=args.reach_timeout)


def _reach_leader(job: Job, args, plan: Dict[str, Any], events: EventLog, closers: List[Any]) -> Dict[str, Any]:
    """This host's dials, rail by rail; its listeners go into ``closers`` (closed once
    every host is done)."""
    import threading

    hosts = len(job.hosts)
    rails = plan["rails"]
    inv = plan["inventory"]["hosts"][job.host]
    addresses = [nic["address"] for nic in inv["nics"][:rails]]
    started = time.time()
    echo = reach.EchoServer(addresses)
    closers.append(echo)
    tcp = reach.RailListeners(reach.tcp_transport_maker(addresses), rails)
    closers.append(tcp)
    verbs, verbs_note, devices = None, None, []
    if inv["rdma"]["devices"]:
        devices, verbs_note = reach.verbs_rails()
        if devices:
            verbs = reach.RailListeners(reach.verbs_transport_maker(devices), len(devices))
            closers.append(verbs)
    job.put(f"reach/host/{job.host}", {
        "addresses": addresses, "ports": echo.ports, "port_errors": echo.errors,
        "handles": tcp.handles(), "handle_errors": tcp.errors,
        "verbs_handles": verbs.handles() if verbs else []})
    deadline = time.monotonic() + args.reach_timeout
    peers = {h: job.get(f"reach/host/{h}", max(0.001, deadline - time.monotonic()))
             for h in sorted(set(reach.targets(hosts, job.host)) | set(reach.sources(hosts, job.host)))}
    out: Dict[str, Any] = {"tcp": {}, "hello": {}, "verbs": {}, "verbs_note": verbs_note}
    probes, outbound, verbs_out = [], [], []
    for dst in reach.targets(hosts, job.host):
        peer = peers[dst]
        for rail in range(rails):
            key = f"{dst}/{rail}"
            if peer is None:
                missing = f"host {dst} published no listeners within {args.reach_timeout:.0f} s"
                out["tcp"][key] = {"connected": False, "rtt_us": None, "error": missing}
                out["hello"][key] = {"ok": False, "rtt_us": None, "error": missing}
                continue
            if peer["ports"][rail] is None:
                out["tcp"][key] = {"connected": False, "rtt_us": None,
                                   "error": f"host {dst} could not listen: {peer['port_errors'][rail]}"}
            else:
                probes.append((key, addresses[rail], peer["addresses"][rail], peer["ports"][rail]))
            if tcp.transports[rail] is None or peer["handles"][rail] is None:
                why = tcp.errors[rail] or f"host {dst}: {peer['handle_errors'][rail]}"
                out["hello"][key] = {"ok": False, "rtt_us": None, "error": f"no reccl transport: {why}"}
            else:
                outbound.append((dst, rail, peer["handles"][rail]))
        if verbs is not None and peer is not None:
            for rail, handle in enumerate(peer["verbs_handles"][:len(devices)]):
                if handle is not None and verbs.transports[rail] is not None:
                    verbs_out.append((dst, rail, handle))
    expected = {rail: sum(1 for h in reach.sources(hosts, job.host)
                          if peers[h] is not None and peers[h]["handles"][rail] is not None)
                for rail in range(rails)}
    probed: Dict[str, Any] = {}
    prober = threading.Thread(target=lambda: probed.update(reach.tcp_probes(probes, deadline)),
                              name="reccl-qualify-probe", daemon=True)
    prober.start()
    for (dst, rail), row in reach.dial(tcp, outbound, expected, deadline).items():
        out["hello"][f"{dst}/{rail}"] = row
    if verbs is not None:
        verbs_expected = {rail: sum(1 for h in reach.sources(hosts, job.host) if peers[h] is not None
                                    and rail < len(peers[h]["verbs_handles"])
                                    and peers[h]["verbs_handles"][rail] is not None)
                          for rail in range(len(devices))}
        # the same window on every host: after every host's TCP dials and pings
        verbs_deadline = deadline + reach.PING_SLACK_S + args.reach_timeout
        for (dst, rail), row in reach.dial(verbs, verbs_out, verbs_expected, verbs_deadline).items():
            out["verbs"][f"{dst}/{rail}"] = {**row, "device": devices[rail]}
    prober.join(timeout=max(0.0, deadline - time.monotonic()) + reach.PING_SLACK_S + 5.0)
    for key, _, _, _ in probes:
        out["tcp"][key] = probed.get(key, {"connected": False, "rtt_us": None,
                                           "error": "the probe did not finish in time"})
    rejected: Dict[str, int] = {}
    for e in events.since(started, ("handshake_rejected",)):
        rejected[e.detail] = rejected.get(e.detail, 0) + 1
    out["rejected"] = rejected
    return out


# ---------------------------------------------------------------- 3 and 4 on CPUs


def nic_names(plan: Dict[str, Any], host: int) -> List[str]:
    return [nic["name"] for nic in plan["inventory"]["hosts"][host]["nics"][:plan["rails"]]]


def faulted_host(rail: int, hosts: int) -> int:
    """The host that loses rail ``rail``: each rail on another host, in turn."""
    return rail % hosts


class CpuGroups:
    """The job's "reccl" process group and, beside it, a Gloo group over rail 0's NIC
    (GLOO_SOCKET_IFNAME, unless set): reccl and its baseline on the same ranks."""

    def __init__(self, job: Job, plan: Dict[str, Any], timeout_s: float):
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        iface = plan["inventory"]["hosts"][job.host]["nics"][0]["interface"]
        os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group("reccl", store=dist.PrefixStore("reccl-qualify/pg/", job.store),
                                rank=job.rank, world_size=job.world, timeout=timeout)
        self.reccl = dist.group.WORLD
        self.gloo = dist.new_group(backend="gloo", timeout=timeout)
        self.device = torch.device("cpu")


def perf_record(rows_by_label: Dict[str, Optional[List[Dict[str, Any]]]], baseline: str,
                errors: Dict[str, str]) -> Dict[str, Any]:
    """The perf check from each variant's busbw rows ("reccl" and "baseline")."""
    problems = [f"{label}: {error}" for label, error in errors.items()]
    warnings = []
    rows = []
    ours, theirs = rows_by_label.get("reccl") or [], rows_by_label.get("baseline") or []
    for i, row in enumerate(ours):
        other = theirs[i] if i < len(theirs) else None
        entry = {"op": row["op"], "bytes": row["bytes"], "reccl": row, "baseline": other,
                 "ratio": round(row["busbw_gbps"] / other["busbw_gbps"], 3)
                 if other and other["busbw_gbps"] > 0 else None}
        rows.append(entry)
        for label, r in (("reccl", row), (baseline, other)):
            if r and r["wrong"]:
                problems.append(f"{label} {row['op']} at {row['bytes'] // MIB} MiB: {r['wrong']} wrong "
                                f"elements in the checked result")
        if entry["ratio"] is not None and entry["ratio"] < 1.0:
            warnings.append(f"{row['op']} at {row['bytes'] // MIB} MiB: reccl reaches {entry['ratio']:.2f}x "
                            f"{baseline}'s busbw")
    return verdict(problems, warnings=warnings, baseline=baseline, rows=rows)


def run_cpu_perf(job: Job, args, groups: CpuGroups, say: Progress) -> Optional[Dict[str, Any]]:
    import torch.distributed as dist

    sizes = [int(m * MIB) for m in args.sizes_mib]
    say(f"performance: reccl against Gloo, all_reduce and all_gather at "
        f"{', '.join(f'{m:g}' for m in args.sizes_mib)} MiB")
    rows: Dict[str, List[Dict[str, Any]]] = {"reccl": [], "baseline": []}
    for op in OPS:
        for size in sizes:  # the two back to back at each size: a slow spell of the machine hits both
            for label, group in (("reccl", groups.reccl), ("baseline", groups.gloo)):
                rows[label].append({"op": op, **measure(dist, group, groups.device, op, size, args.perf_budget)})
    return perf_record(rows, "Gloo", {}) if job.is_root else None


def failover_record(job: Job, per_rail: List[Optional[List[Dict[str, Any]]]], errors: List[Optional[str]],
                    names: List[str], settle_s: float) -> Dict[str, Any]:
    """The failover check from every rank's fault_stream results, rail by rail."""
    hosts = len(job.hosts)
    problems, rails = [], []
    for rail, ranks in enumerate(per_rail):
        host = faulted_host(rail, hosts)
        nic = names[rail] if rail < len(names) else f"rail {rail}"
        where = f"rail {rail} ({nic}) down on host {host}"
        if errors[rail] or ranks is None:
            problems.append(f"{where}: {errors[rail] or 'no result'}")
            rails.append({"rail": rail, "nic": nic, "host": host, "error": errors[rail]})
            continue
        root = ranks[0]
        wrong = {r["rank"]: r["wrong_ops"] for r in ranks if r["wrong_ops"]}
        if wrong:
            problems.append(f"{where}: wrong results on rank(s) {sorted(wrong)} "
                            f"({sum(wrong.values())} collectives)")
        # A rank fails over where its connections used the NIC: with one rank per host, every
        # rank; with one per GPU, those whose channels the NIC carried (NCCL pairs GPUs with
        # their nearest NICs).
        on_host = [r for r in ranks if job.host_of[r["rank"]] == host]
        if not any(r["failover"] for r in on_host):
            problems.append(f"{where}: no rank of host {host} failed over (rank(s) "
                            f"{[r['rank'] for r in on_host]}): the stream never failed over off {nic}")
        elsewhere = [r for r in ranks if job.host_of[r["rank"]] != host]
        if elsewhere and not any(r["failover"] for r in elsewhere):
            problems.append(f"{where}: no rank of another host failed over (their paths to host {host} "
                            f"on this rail should have)")
        no_failback = [r["rank"] for r in ranks if r["failover"] and not r["failback"]]
        if no_failback:
            problems.append(f"{where}: no failback on rank(s) {no_failback} after the NIC came back "
                            f"(within {settle_s:g} s)")
        durations = [d for r in ranks for d in r["failover_s"]]
        rails.append({
            "rail": rail, "nic": nic, "host": host, "bytes": root["bytes"], "ops": root["ops"],
            "fault_free_ms": root["fault_free_ms"], "down_ms": root["down_ms"],
            "longest_down_ms": root["longest_down_ms"], "kept": root["kept"],
            "failover_ms_max": round(max(durations) * 1e3, 3) if durations else None,
            "ranks": [{k: r[k] for k in ("rank", "ops", "wrong_ops", "failover", "failback", "events")}
                      for r in ranks],
        })
    return verdict(problems, rails=rails)


def run_cpu_failover(job: Job, args, plan: Dict[str, Any], groups: CpuGroups, events: EventLog,
                     say: Progress) -> Optional[Dict[str, Any]]:
    import torch.distributed as dist

    names = nic_names(plan, job.host)
    per_rail: List[Optional[List[Dict[str, Any]]]] = []
    errors: List[Optional[str]] = []
    for rail in range(plan["rails"]):
        host = faulted_host(rail, len(job.hosts))
        say(f"failover: rail {rail} ({names[rail]}) down on host {host} for {args.failover_hold:g} s "
            f"in a stream of {args.failover_mib:g} MiB all_reduces, then up")
        try:
            mine = fault_stream(dist, groups.reccl, groups.device, int(args.failover_mib * MIB), names[rail],
                                job.host == host, events, args.failover_base, args.failover_hold,
                                args.failover_settle)
            error = None
        except Exception as exc:  # noqa: BLE001 - a collective that failed: the check fails, saying so
            mine, error = None, f"{type(exc).__name__}: {exc}"
        gathered = job.gather(f"failover/{rail}", {"result": mine, "error": error}, args.step_timeout)
        if job.is_root:
            errs = [f"rank {r}: {g['error']}" for r, g in enumerate(gathered) if g and g["error"]]
            missing = [r for r, g in enumerate(gathered) if g is None]
            if missing:
                errs.append(f"rank(s) {missing} reported nothing within {args.step_timeout:.0f} s")
            per_rail.append(None if errs else [g["result"] for g in gathered])
            errors.append("; ".join(errs) or None)
        # a stream that failed leaves the group broken: no rank goes on to the next rail
        if not job.publish(f"failover/{rail}/go", errors[-1] is None if job.is_root else None,
                           args.step_timeout + STORE_SLACK_S):
            break
    if not job.is_root:
        return None
    while len(errors) < plan["rails"]:
        per_rail.append(None)
        errors.append("not run: an earlier rail's stream failed")
    return failover_record(job, per_rail, errors, names, args.failover_settle)


# ---------------------------------------------------------------- 3 and 4 on GPUs


def gpu_variant_env(variant: str, rdma: bool) -> Dict[str, str]:
    """What a GPU variant's process sets over this process's environment."""
    from torch_reccl._native import plugin_path

    if variant == "plugin":
        return {"NCCL_NET": "ReCCL", "NCCL_NET_PLUGIN": plugin_path()}
    # NCCL's own network, with no external plugin in its way
    return {"NCCL_NET": "IB" if rdma else "Socket", "NCCL_NET_PLUGIN": "none"}


def baseline_name(rdma: bool) -> str:
    return "NCCL IB" if rdma else "NCCL Socket"


def _tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:]) or "(no output)"
    except OSError:
        return "(no output)"


def run_gpu_variant(job: Job, args, plan: Dict[str, Any], variant: str, workdir: str,
                    failover: bool) -> Dict[str, Any]:
    """Starts this rank's process of ``variant`` (every rank at once), waits for it
    (bounded) and returns its result, or {"error": ...} with the end of its log."""
    job.barrier(f"gpu/{variant}/start", args.step_timeout + STORE_SLACK_S)
    spec_path = os.path.join(workdir, f"{variant}.spec.json")
    out_path = os.path.join(workdir, f"{variant}.result.json")
    log_path = os.path.join(workdir, f"{variant}.log")
    spec: Dict[str, Any] = {
        "variant": variant, "prefix": f"reccl-qualify/gpu/{variant}/", "out": out_path,
        "sizes": [int(m * MIB) for m in args.sizes_mib] if "perf" in args.checks else [],
        "budget_s": args.perf_budget, "collective_timeout_s": args.collective_timeout}
    if failover:
        spec["failover"] = {"rails": plan["rails"], "hosts": len(job.hosts), "host_of": job.host_of,
                            "names": nic_names(plan, job.host), "bytes": int(args.failover_mib * MIB),
                            "base_s": args.failover_base, "hold_s": args.failover_hold,
                            "settle_s": args.failover_settle}
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = {**os.environ, **gpu_variant_env(variant, plan["rdma"])}
    bound = GPU_WORKER_SLACK_S + 4 * len(spec["sizes"]) * (args.perf_budget + 1.0) + (
        plan["rails"] * (args.failover_base + args.failover_hold + args.failover_settle + 10.0) if failover else 0)
    with open(log_path, "w") as log:
        # -W: the baseline imports torch_reccl (this package) with NCCL_NET_PLUGIN=none, which it warns about
        proc = subprocess.Popen([sys.executable, "-W", "ignore::UserWarning", "-m", "torch_reccl.qualify.gpu_worker",
                                 "--spec", spec_path], env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=bound)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
            return {"rank": job.rank, "variant": variant,
                    "error": f"did not finish within {bound:.0f} s; the end of its output:\n{_tail(log_path)}"}
    try:
        with open(out_path) as f:
            result = json.load(f)
    except (OSError, ValueError):
        return {"rank": job.rank, "variant": variant,
                "error": f"exited with code {proc.returncode} and no result; the end of its output:\n"
                         f"{_tail(log_path)}"}
    if result.get("error"):
        if (variant == "plugin" and result.get("stage") == "nccl"
                and not (result.get("plugin") or {}).get("transport")):
            result["error"] = (f"NCCL did not load or could not start torch_reccl's net plugin "
                               f"(NCCL_NET_PLUGIN={env['NCCL_NET_PLUGIN']}, NCCL_NET=ReCCL): {result['error']}")
        result["error"] += f"\nthe end of its output:\n{_tail(log_path)}"
    return result


def run_gpu(job: Job, args, plan: Dict[str, Any], say: Progress) -> Dict[str, Optional[Dict[str, Any]]]:
    """Both GPU variants, the baseline first; rank 0 gets the perf and failover records."""
    failover = "failover" in args.checks and plan["rails"] >= 2
    baseline = baseline_name(plan["rdma"])
    results: Dict[str, Optional[List[Dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory(prefix="reccl-qualify-") as workdir:
        for variant in ("baseline", "plugin"):
            if variant == "baseline" and "perf" not in args.checks:
                continue
            what = [f"busbw at {', '.join(f'{m:g}' for m in args.sizes_mib)} MiB"] if "perf" in args.checks else []
            if variant == "plugin" and failover:
                what.append(f"{plan['rails']} rails lost in turn")
            say(f"GPU: {'NCCL through torch_reccl' if variant == 'plugin' else baseline}: {' and '.join(what)}")
            mine = run_gpu_variant(job, args, plan, variant, workdir, failover and variant == "plugin")
            results[variant] = job.gather(f"gpu/{variant}/result", mine, args.step_timeout + STORE_SLACK_S)
    if not job.is_root:
        return {}
    out: Dict[str, Optional[Dict[str, Any]]] = {}
    errors = {}
    for variant, gathered in results.items():
        bad = [f"rank {r}: {g['error']}" if g else f"rank {r}: no result" for r, g in enumerate(gathered)
               if not g or g.get("error")]
        if bad:
            errors[variant] = "; ".join(bad)
    plugin = (results.get("plugin") or [None])[0] or {}
    transport = (plugin.get("plugin") or {}).get("transport")
    if "perf" in args.checks:
        rows = {"reccl": None if "plugin" in errors else plugin.get("busbw"),
                "baseline": None if "baseline" in errors else results["baseline"][0].get("busbw")}
        labels = {"plugin": "NCCL through torch_reccl", "baseline": baseline}
        out["perf"] = perf_record(rows, baseline, {labels[v]: e for v, e in errors.items()})
        out["perf"]["plugin_transport"] = transport
    if "failover" in args.checks:
        if not failover:
            out["failover"] = skipped("one NIC per host: nothing to fail over to")
        else:
            gathered = results["plugin"]
            per_rail, errs = [], []
            for rail in range(plan["rails"]):
                if "plugin" in errors:
                    per_rail.append(None)
                    errs.append("the run through the plugin failed (performance says why)"
                                if "perf" in args.checks else errors["plugin"])
                else:
                    per_rail.append([g["failover"][rail] for g in gathered])
                    errs.append(None)
            names = plugin.get("failover_names") or nic_names(plan, 0)
            out["failover"] = failover_record(job, per_rail, errs, names, args.failover_settle)
            out["failover"]["path"] = f"NCCL through torch_reccl's plugin ({transport or '?'})"
    return out
