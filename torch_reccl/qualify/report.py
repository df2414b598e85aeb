"""What ``reccl qualify`` shows of its record: the summary it prints, the failures
that set its exit code, and the Markdown ``--report`` a user attaches to an issue."""
from __future__ import annotations

import statistics
from typing import Any, Dict, List

TITLES = {"inventory": "inventory", "reach": "reachability", "perf": "performance", "failover": "failover"}
MIB = 1 << 20


def failures(record: Dict[str, Any]) -> List[str]:
    """Every reason the run failed, one line each, check by check."""
    out = [f"{TITLES[name]}: {problem}" for name, check in record["checks"].items()
           for problem in check.get("problems", [])]
    if record.get("error"):
        out.append(f"the run stopped: {record['error']}")
    return out


def _size(nbytes: int) -> str:
    return f"{nbytes / MIB:g} MiB" if nbytes >= MIB else f"{nbytes / 1024:g} KiB"


def _median(values: List[float]) -> str:
    values = [v for v in values if v is not None]
    return f"{statistics.median(values):.0f} us" if values else "-"


def _line(name: str, check: Dict[str, Any]) -> str:
    status = check["status"].upper() if check["status"] == "failed" else check["status"]
    if check["status"] == "skipped":
        return f"{TITLES[name]:<13} skipped: {check['reason']}"
    if name == "inventory":
        hosts = check["hosts"]
        what = f"{len(hosts)} host(s), {check['rails']} rail(s)"
        if hosts and not hosts[0].get("error"):
            what += ": " + ", ".join(f"{n['name']} {n['subnet'] or n['address']}" for n in hosts[0]["nics"])
        if check.get("warnings"):
            what += f"; {len(check['warnings'])} warning(s)"
    elif name == "reach":
        rows = check["rows"]
        good = sum(1 for r in rows if r["tcp"]["connected"] and not r["tcp"]["error"] and r["hello"]["ok"])
        what = (f"{good} of {len(rows)} (host pair, rail) connect and shake hands ({check['plan']}); RTT "
                f"median TCP {_median([r['tcp']['rtt_us'] for r in rows])}, "
                f"reccl {_median([r['hello']['rtt_us'] for r in rows])}")
        if check.get("verbs_rows"):
            verbs = check["verbs_rows"]
            what += f"; verbs {sum(1 for r in verbs if r['ok'])} of {len(verbs)}"
    elif name == "perf":
        parts = [f"{r['op']} {_size(r['bytes'])} {r['reccl']['busbw_gbps']:.2f}/"
                 + (f"{r['baseline']['busbw_gbps']:.2f} ({r['ratio']:.2f}x)" if r.get("ratio") is not None else "-")
                 for r in check["rows"]]
        what = f"busbw GB/s reccl/{check['baseline']}: " + ", ".join(parts) if parts else "no measurement"
    else:
        parts = []
        for r in check["rails"]:
            if r.get("error"):
                parts.append(f"rail {r['rail']} ({r['nic']}): {r['error'][:80]}")
                continue
            ranks = r["ranks"]
            parts.append(f"rail {r['rail']} ({r['nic']}) on host {r['host']}: "
                         f"{sum(1 for x in ranks if x['failover'])}/{len(ranks)} ranks failed over and "
                         f"{sum(1 for x in ranks if x['failback'])} back, longest collective "
                         f"{r['longest_down_ms']} ms (fault-free {r['fault_free_ms']} ms), kept "
                         f"{_kept(r['kept'])}")
        what = "; ".join(parts)
    return f"{TITLES[name]:<13} {status}: {what}"


def _kept(kept) -> str:
    return f"{kept * 100:.0f}%" if kept is not None else "-"


def summary(record: Dict[str, Any]) -> str:
    hosts = record.get("hosts") or []
    lines = [f"reccl qualify: {len(hosts)} host(s), {record['world']} rank(s), {record.get('rails', '?')} "
             f"rail(s), {record.get('device', '?')}; {record['date']}; {record.get('elapsed_s', '?')} s"]
    for name, check in record["checks"].items():
        lines.append("  " + _line(name, check))
    for name, check in record["checks"].items():
        for warning in check.get("warnings", []):
            lines.append(f"  warning: {TITLES[name]}: {warning}")
    if record.get("step_s"):
        lines.append("  time          " + ", ".join(f"{k} {v:g} s" for k, v in record["step_s"].items()))
    fails = record.get("failures") or []
    if record.get("ok"):
        lines.append("verdict: PASSED")
    else:
        lines.append("verdict: FAILED")
        lines.extend(f"  - {line}" for line in fails)
    return "\n".join(lines)


# ---------------------------------------------------------------- Markdown


def _table(header: List[str], rows: List[List[Any]]) -> List[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join("-" if c is None else str(c).replace("|", "/").replace("\n", " ")
                              for c in row) + " |" for row in rows]
    return out


def markdown(record: Dict[str, Any]) -> str:
    checks = record["checks"]
    out = [f"# reccl qualify: {'PASSED' if record.get('ok') else 'FAILED'}", "",
           f"- date: {record['date']}", f"- command: `{record['command']}`",
           f"- {len(record.get('hosts') or [])} host(s), {record['world']} rank(s), "
           f"{record.get('rails', '?')} rail(s), device {record.get('device', '?')}, "
           f"{record.get('elapsed_s', '?')} s"]
    inventory = checks.get("inventory")
    if inventory and inventory.get("hosts"):
        v = inventory["hosts"][0]["versions"]
        out.append(f"- torch_reccl {v['torch_reccl']}, torch {v['torch']}, NCCL {v['nccl'] or '-'}, "
                   f"Python {v['python']}, Linux {v['kernel']} (host 0)")
    out.append("")
    if not record.get("ok"):
        out += ["## Failures", ""] + [f"- {line}" for line in record.get("failures") or []] + [""]
    out += ["## Checks", ""]
    out += _table(["check", "status", "detail"],
                  [[TITLES[n], c["status"], c.get("reason") or f"{len(c.get('problems', []))} problem(s), "
                    f"{len(c.get('warnings', []))} warning(s)"] for n, c in checks.items()])
    out.append("")
    if inventory and inventory.get("hosts"):
        out += ["## Inventory", ""]
        for h, inv in enumerate(inventory["hosts"]):
            ranks = next((x["ranks"] for x in record.get("hosts", []) if x["index"] == h), [])
            out.append(f"### host {h}: {inv['hostname']} (ranks {', '.join(map(str, ranks))})")
            out.append("")
            if inv.get("error"):
                out += [f"**{inv['error']}**", ""]
            out.append(f"RECCL_NICS={inv['nics_setting'] or '(unset: discovered)'}; NCCL_NET_PLUGIN="
                       f"{(inv.get('nccl_net_plugin') or {}).get('value') or '(unset)'}")
            out.append("")
            if inv["nics"]:
                out += _table(["rail", "NIC", "address", "subnet", "state", "speed Mb/s", "MTU", "NUMA", "PCI"],
                              [[n["rail"], n["name"], n["address"], n["subnet"],
                                "up" if n["up"] else f"DOWN ({n['operstate']})", n["speed_mbps"], n["mtu"],
                                n["numa_node"], n["pci_path"] or "-"] for n in inv["nics"]])
                out.append("")
            rdma = inv.get("rdma") or {}
            if rdma.get("devices"):
                out += _table(["RDMA device", "port", "state", "rate", "link layer", "GIDs (index type netdev)",
                               "NUMA"],
                              [[d["name"], p["port"], p["state"], p["rate"], p["link_layer"],
                                "; ".join(f"{g['index']} {g['type']} {g['netdev'] or ''} {g['gid']}"
                                          for g in p["gids"][:4]) + (" ..." if len(p["gids"]) > 4 else ""),
                                d["numa_node"]] for d in rdma["devices"] for p in d["ports"]])
                out.append("")
            lib = rdma.get("libibverbs") or {}
            transport = rdma.get("plugin_transport") or {}
            out.append(f"RDMA: {len(rdma.get('devices', []))} device(s) in sysfs; libibverbs "
                       f"{'loads' if lib.get('loaded') else 'does not load: ' + str(lib.get('error'))}; the plugin "
                       f"would run over {transport.get('kind')} ({transport.get('reason')})")
            gpu = inv.get("gpu") or {}
            out.append("")
            out.append(f"GPUs: {len(gpu.get('gpus', []))} ({gpu.get('source')}: {gpu.get('detail')})")
            if gpu.get("gpus"):
                out.append("")
                names = [n["name"] for n in inv["nics"]]
                out += _table(["GPU", "bus id", "NUMA"] + names,
                              [[f"GPU{g['index']} {g['name']}", g["bus_id"], g["numa_node"]]
                               + list(gpu["nic_links"][g["index"]]) for g in gpu["gpus"]])
            out.append("")
        for warning in inventory.get("warnings", []):
            out.append(f"- warning: {warning}")
        out.append("")
    reach = checks.get("reach")
    if reach and reach.get("rows") is not None:
        out += ["## Reachability", "", f"Plan: {reach['plan']}; deadline {reach['timeout_s']:g} s.", ""]
        out += _table(["from", "to", "rail", "TCP", "TCP RTT us", "reccl HELLO", "reccl RTT us", "error"],
                      [[r["src"], r["dst"], r["rail"], "yes" if r["tcp"]["connected"] else "NO", r["tcp"]["rtt_us"],
                        "yes" if r["hello"]["ok"] else "NO", r["hello"]["rtt_us"],
                        r["tcp"]["error"] or r["hello"]["error"]] for r in reach["rows"]])
        out.append("")
        if reach.get("verbs_rows"):
            out += _table(["from", "to", "verbs rail", "device", "ready", "RTT us", "error"],
                          [[r["src"], r["dst"], r["rail"], r.get("device"), "yes" if r["ok"] else "NO", r["rtt_us"],
                            r["error"]] for r in reach["verbs_rows"]])
            out.append("")
    perf = checks.get("perf")
    if perf and perf.get("rows"):
        transport = f" (plugin over {perf['plugin_transport']})" if perf.get("plugin_transport") else ""
        out += ["## Performance", "", f"busbw in GB/s (nccl-tests' definition), the slowest rank's time; "
                f"reccl{transport} against {perf['baseline']} in the same run.", ""]
        out += _table(["collective", "size", "reccl", perf["baseline"], "ratio", "wrong elements"],
                      [[r["op"], _size(r["bytes"]), r["reccl"]["busbw_gbps"],
                        (r["baseline"] or {}).get("busbw_gbps"), r["ratio"],
                        r["reccl"]["wrong"] + ((r["baseline"] or {}).get("wrong") or 0)] for r in perf["rows"]])
        out.append("")
        for warning in perf.get("warnings", []):
            out.append(f"- warning: {warning}")
        out.append("")
    failover = checks.get("failover")
    if failover and failover.get("rails"):
        out += ["## Failover", "", (failover.get("path") or "The reccl process group") + ": each rail taken down "
                "on one host with `torch_reccl.inject_fault` in a stream of all_reduces, then brought back. "
                "Interruption: the longest collective while the rail was down; kept: fault-free time per "
                "collective over the median time while down.", ""]
        rows = []
        for r in failover["rails"]:
            if r.get("error"):
                rows.append([r["rail"], r["nic"], r["host"]] + [None] * 6 + [r["error"]])
                continue
            ranks = r["ranks"]
            rows.append([r["rail"], r["nic"], r["host"], _size(r["bytes"]),
                         "yes" if not any(x["wrong_ops"] for x in ranks) else "NO",
                         ", ".join(f"{x['rank']}:{x['failover']}/{x['failback']}" for x in ranks),
                         f"{r['longest_down_ms']} ms", f"{r['fault_free_ms']} / {r['down_ms']} ms",
                         _kept(r["kept"]), f"{r['failover_ms_max']} ms" if r.get("failover_ms_max") else None])
        out += _table(["rail", "NIC", "host", "size", "exact", "failovers/failbacks by rank",
                       "interruption", "per collective free / down", "kept", "failover took"], rows)
        out.append("")
    out += ["## Warnings", ""]
    warnings = [f"- {TITLES[n]}: {w}" for n, c in checks.items() for w in c.get("warnings", [])]
    out += warnings or ["none"]
    out.append("")
    return "\n".join(out)
