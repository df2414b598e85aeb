"""How fast every surviving rank fails when a peer process dies on a live host.

N ranks run all_reduce over the "reccl" backend in a loop; once every rank has
done a few, one rank is killed with SIGKILL. Its host's kernel stays up and
answers for it (end of stream on its sockets, connection refused on its ports),
so every other rank must raise, not wait out a network outage. Prints, per
surviving rank, the seconds from the kill to its exception, and the error's
first line. Default settings, except what the command line names.

Loopback (anyone): every rank on 127.0.0.1 + 127.0.0.2 as its two NICs, each
rank its own host (RECCL_HOST_ID). Emulated fabric (--fabric, root): one rank
per emulated host, two rails.

    python bench/dead_peer.py [--ranks 4] [--victim 1] [--repeat 3] [--fabric] [--json PATH]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOUND_S = 120.0  # a run that takes longer than this is reported as hung


def worker(args) -> int:
    import torch
    import torch.distributed as dist

    import torch_reccl  # noqa: F401  (registers the backend)

    store = dist.TCPStore(args.master, args.port, args.ranks, is_master=args.rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    # The group's timeout far above any bound measured here: what ends a
    # rank's wait is the library noticing the dead peer, not the op's timeout.
    dist.init_process_group("reccl", store=store, rank=args.rank, world_size=args.ranks,
                            timeout=datetime.timedelta(seconds=600))
    data = torch.ones(1 << 18)
    done = 0
    try:
        while True:
            dist.all_reduce(data)
            done += 1
            if done == 20:
                open(os.path.join(args.dir, f"ready-{args.rank}"), "w").close()
    except Exception as error:  # noqa: BLE001 - the point: which error, when
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        with open(os.path.join(args.dir, f"result-{args.rank}.json"), "w") as f:
            json.dump({"rank": args.rank, "failed_at": time.time(), "ops": done,
                       "error": first[:300]}, f)
        os._exit(0)  # the group cannot be torn down orderly with a rank gone
    return 0


def one_run(args, run: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        port = 29950 + run + (os.getpid() % 500)
        base = [sys.executable, os.path.abspath(__file__), "--worker", "--ranks", str(args.ranks),
                "--port", str(port), "--dir", tmp]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
        for key in [k for k in env if k.startswith("RECCL_")]:
            del env[key]  # default settings
        fab = None
        if args.fabric:
            from torch_reccl.fabric import Fabric

            fab = Fabric(hosts=args.ranks, rails=2, rate_mbit=2000, name="dpb").up()
            env["RECCL_NICS"] = "eth0,eth1"
            procs = [fab.popen(r, base + ["--rank", str(r), "--master", fab.mgmt_ip(0)], env=env,
                               stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, f"log-{r}"), "w"))
                     for r in range(args.ranks)]
        else:
            env["RECCL_NICS"] = "127.0.0.1,127.0.0.2"
            procs = [subprocess.Popen(base + ["--rank", str(r), "--master", "127.0.0.1"],
                                      env={**env, "RECCL_HOST_ID": f"bench-host-{r}"},
                                      stdout=subprocess.DEVNULL,
                                      stderr=open(os.path.join(tmp, f"log-{r}"), "w"))
                     for r in range(args.ranks)]
        try:
            deadline = time.monotonic() + 90
            while not all(os.path.exists(os.path.join(tmp, f"ready-{r}")) for r in range(args.ranks)):
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    logs = "".join(open(os.path.join(tmp, f"log-{r}")).read()[-1500:] for r in range(args.ranks))
                    raise RuntimeError(f"ranks did not start training\n{logs}")
                time.sleep(0.05)
            killed_at = time.time()
            procs[args.victim].send_signal(signal.SIGKILL)
            survivors = [r for r in range(args.ranks) if r != args.victim]
            end = time.monotonic() + BOUND_S
            results = {}
            while time.monotonic() < end and len(results) < len(survivors):
                for r in survivors:
                    path = os.path.join(tmp, f"result-{r}.json")
                    if r not in results and os.path.exists(path):
                        try:
                            with open(path) as f:
                                results[r] = json.load(f)
                        except ValueError:
                            pass  # being written
                time.sleep(0.05)
            rows = {r: (round(results[r]["failed_at"] - killed_at, 2), results[r]["error"])
                    if r in results else (None, f"no error within {BOUND_S:g} s") for r in survivors}
            return rows
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
            if fab is not None:
                fab.down()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--victim", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--fabric", action="store_true", help="one rank per emulated host (root)")
    parser.add_argument("--json", metavar="PATH", help="also write every run's per-rank seconds and errors here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--master", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if not 0 <= args.victim < args.ranks or args.ranks < 2:
        parser.error(f"need --ranks >= 2 and 0 <= --victim < --ranks, got {args.ranks} and {args.victim}")
    where = "emulated fabric, 2 rails" if args.fabric else "loopback, 2 NICs"
    print(f"{args.ranks} ranks ({where}), rank {args.victim} killed with SIGKILL; "
          f"seconds from the kill to each surviving rank's exception")
    worst = []
    runs = []
    for run in range(args.repeat):
        rows = one_run(args, run)
        runs.append({str(r): {"seconds": t, "error": error} for r, (t, error) in rows.items()})
        times = [t for t, _ in rows.values()]
        worst.append(None if None in times else max(times))
        cells = "  ".join(f"rank {r}: {t if t is not None else 'hung'}" for r, (t, _) in rows.items())
        print(f"run {run + 1}: {cells}")
        for r, (_, error) in rows.items():
            print(f"    rank {r}: {error}")
    done = [w for w in worst if w is not None]
    print(f"slowest surviving rank per run: {worst}; max {max(done) if done else 'n/a'} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "victim": args.victim, "fabric": args.fabric, "runs": runs,
                       "slowest_per_run": worst}, f, indent=1)
    return 0 if len(done) == len(worst) else 1


if __name__ == "__main__":
    sys.exit(main())
