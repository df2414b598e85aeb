"""nccl-tests through a real link fault, on the standalone plugin.

Two MPI ranks run an nccl-tests binary (all_reduce_perf, all_gather_perf, ...)
with `NCCL_NET_PLUGIN` pointing at `libnccl-net-reccl.so`, each with its own
`NCCL_HOSTID` so that every byte crosses the plugin even when they share one
GPU. Each rank has two "NICs": the ends of two veth pairs made in this network
namespace (rank 0 owns the `a` ends, rank 1 the `b` ends). While the test runs,
rank 0's NIC 0 is set down (its peer end loses carrier: both ranks see a real
link-down event from the kernel) and later up again. mpirun cannot reach ranks
inside separate namespaces (its daemons talk over the launching namespace), so
the pairs live in one namespace and the kernel still delivers their packets
locally: what this exercises is the plugin's reaction to the link events, and
nccl-tests' own data check (`-c`, every checked iteration compares every
element) says whether every byte survived the move and the return.

    python bench/nccl_tests_fault.py --binary PATH/all_reduce_perf [--down-s 3 --up-s 8]
        [--json out.json] [-- extra nccl-tests arguments]

Needs root, pyroute2, mpirun and a GPU; prints the test's output, when the
faults were made, the plugin's failover/failback events (its INFO log), and a verdict: ok when
the test exits 0, every data check reports 0 wrong elements, sizes finished after
the fault, and the plugin failed over and back.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from typing import List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PAIRS = [("rcnt0a", "rcnt0b", "10.231.0.1", "10.231.0.2"),
         ("rcnt1a", "rcnt1b", "10.231.1.1", "10.231.1.2")]
DEFAULT_TEST_ARGS = ["-b", "1M", "-e", "64M", "-f", "2", "-n", "5", "-w", "2", "-c", "20"]
SIZE_LINE = re.compile(r"^\s+(\d+)\s+\d+\s+\w+\s+\w+\s+-?\d+\s")
WRONG = re.compile(r"Out of bounds values\s*:\s*(\d+)\s*(\w+)")


class VethPairs:
    """The two veth pairs, made on entry and deleted on exit (also after an error)."""

    def __init__(self):
        from pyroute2 import IPRoute

        self.ipr = IPRoute()

    def __enter__(self):
        self.remove()
        for a, b, addr_a, addr_b in PAIRS:
            self.ipr.link("add", ifname=a, kind="veth", peer=b)
            for name, addr in ((a, addr_a), (b, addr_b)):
                index = self.index(name)
                self.ipr.addr("add", index=index, address=addr, prefixlen=24)
                self.ipr.link("set", index=index, state="up")
        return self

    def __exit__(self, *exc):
        self.remove()
        self.ipr.close()

    def index(self, name: str) -> int:
        found = self.ipr.link_lookup(ifname=name)
        if not found:
            raise RuntimeError(f"interface {name} is missing")
        return found[0]

    def remove(self) -> None:
        for a, _, _, _ in PAIRS:
            if self.ipr.link_lookup(ifname=a):
                self.ipr.link("del", index=self.index(a))  # deletes its peer too

    def set(self, name: str, state: str) -> None:
        self.ipr.link("set", index=self.index(name), state=state)


def rank_command(binary: str, test_args: List[str]) -> List[str]:
    """Each rank picks its own NICs and host id from its MPI rank."""
    nics = [",".join(p[2] for p in PAIRS), ",".join(p[3] for p in PAIRS)]
    script = (f'if [ "$OMPI_COMM_WORLD_RANK" = 0 ]; then export RECCL_NICS={nics[0]}; '
              f'else export RECCL_NICS={nics[1]}; fi; '
              f'export NCCL_HOSTID=reccl-host$OMPI_COMM_WORLD_RANK; exec "$0" "$@"')
    return ["bash", "-c", script, binary, *test_args]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--binary", required=True, help="an nccl-tests binary, e.g. build/all_reduce_perf")
    parser.add_argument("--plugin", help="libnccl-net-reccl.so (default: torch_reccl.plugin_path())")
    parser.add_argument("--down-s", type=float, default=3.0, help="rank 0's NIC 0 down this long after start")
    parser.add_argument("--up-s", type=float, default=8.0, help="and up again this long after start")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--mpirun", default="mpirun")
    parser.add_argument("--json")
    parser.add_argument("test_args", nargs="*", help=f"nccl-tests arguments (default: {' '.join(DEFAULT_TEST_ARGS)})")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root (veth pairs)", file=sys.stderr)
        return 2
    if not 0 < args.down_s < args.up_s < args.timeout:
        print(f"need 0 < --down-s ({args.down_s}) < --up-s ({args.up_s}) < --timeout ({args.timeout})",
              file=sys.stderr)
        return 2
    plugin = args.plugin
    if plugin is None:
        import torch_reccl

        plugin = torch_reccl.plugin_path()
    env = {**os.environ, "NCCL_NET_PLUGIN": plugin, "NCCL_NET": "ReCCL", "NCCL_P2P_DISABLE": "1",
           "NCCL_SHM_DISABLE": "1", "NCCL_NVLS_ENABLE": "0", "NCCL_DEBUG": "WARN", "RECCL_DEBUG": "INFO",
           "NCCL_SOCKET_IFNAME": "lo", "NCCL_TESTS_DEVICE": os.environ.get("NCCL_TESTS_DEVICE", "0")}
    forwarded = [x for k in env if k.startswith(("NCCL_", "RECCL_", "CUDA_")) for x in ("-x", k)]
    command = [args.mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", *forwarded,
               *rank_command(args.binary, args.test_args or DEFAULT_TEST_ARGS)]
    record = {"command": command, "faults": [], "sizes_done_at_s": []}
    lines: List[str] = []
    with VethPairs() as pairs:
        started = time.monotonic()
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)

        def read() -> None:
            for line in proc.stdout:
                lines.append(line)
                sys.stdout.write(line)
                if SIZE_LINE.match(line):
                    record["sizes_done_at_s"].append(round(time.monotonic() - started, 3))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        for at, state in ((args.down_s, "down"), (args.up_s, "up")):
            while proc.poll() is None and time.monotonic() - started < at:
                time.sleep(0.05)
            if proc.poll() is not None:
                break
            pairs.set(PAIRS[0][0], state)
            record["faults"].append({"at_s": round(time.monotonic() - started, 3), "nic": PAIRS[0][0],
                                     "state": state})
            print(f"[nccl_tests_fault] {PAIRS[0][0]} (rank 0's NIC 0) {state} at "
                  f"{record['faults'][-1]['at_s']} s", flush=True)
        try:
            rc = proc.wait(timeout=max(1.0, args.timeout - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            rc = proc.wait()
            print(f"[nccl_tests_fault] killed after {args.timeout} s", flush=True)
        reader.join(timeout=10)
    text = "".join(lines)
    wrong = WRONG.findall(text)
    record.update(rc=rc, elapsed_s=round(time.monotonic() - started, 3),
                  out_of_bounds=[int(n) for n, _ in wrong],
                  failovers=sum(1 for line in lines if re.search(r"\bfailover nic=", line)),
                  failbacks=sum(1 for line in lines if re.search(r"\bfailback nic=", line)),
                  busbw_avg=[float(x) for x in re.findall(r"Avg bus bandwidth\s*:\s*([\d.]+)", text)])
    sizes_during = [t for t in record["sizes_done_at_s"] if args.down_s <= t]
    ok = (rc == 0 and len(record["faults"]) == 2 and bool(wrong) and all(n == 0 for n in record["out_of_bounds"])
          and bool(sizes_during) and record["failovers"] > 0 and record["failbacks"] > 0)
    record["verdict"] = "ok" if ok else "FAILED"
    print(f"[nccl_tests_fault] rc {rc}; faults {record['faults']}; sizes finished at {record['sizes_done_at_s']} s; "
          f"out-of-bounds {record['out_of_bounds']}; plugin events: {record['failovers']} failover, "
          f"{record['failbacks']} failback; verdict {record['verdict']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
