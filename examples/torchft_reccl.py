"""DDP under torchft on the "reccl" backend: 2 replica groups on this machine, a NIC
fault that torchft never sees, and a replica killed and healed from its peer.

    pip install torchft
    python examples/torchft_reccl.py                    # NIC fault at step 40, kill at step 100
    python examples/torchft_reccl.py --kill-step -1     # the NIC fault only

The script starts torchft's Lighthouse, then one process per replica group (one
rank each; the two "NICs" are the loopback addresses 127.0.0.1 and 127.0.0.2).
Each replica trains with torchft's ``Manager``, its ``DistributedDataParallel`` and
``Optimizer`` wrapper, over ``torch_reccl.integrations.torchft.ProcessGroupReccl``.

- At ``--nic-step`` replica 1's primary NIC goes down for good
  (``torch_reccl.inject_fault``): reccl fails its connections over to the other
  NIC inside the collective, no step fails and the quorum does not change.
- At ``--kill-step`` this script kills replica 1's process (SIGKILL) and starts
  it again, as a torchft launcher does: replica 0's steps fail once (the error
  names the dead rank), the quorum goes on without replica 1, and replica 1
  rejoins and heals from replica 0 (model and optimizer state).

At the end every replica prints the quorum changes it saw and a digest of its
parameters; the script checks that the digests are equal.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

REPLICAS = 2
END_GRACE_S = 15.0  # once a replica is done, the others' bound to be done too


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--nic-step", type=int, default=40, help="replica 1's NIC 0 down at this step (-1: never)")
    parser.add_argument("--kill-step", type=int, default=100, help="replica 1 killed at this step (-1: never)")
    parser.add_argument("--step-s", type=float, default=0.1, help="each step takes at least this long")
    parser.add_argument("--timeout-s", type=float, default=180.0, help="the whole run's bound")
    # a replica's own arguments (the script starts its replicas with them)
    parser.add_argument("--replica", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def replica(args) -> int:
    import torch
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, Optimizer

    import torch_reccl
    from torch_reccl.integrations.torchft import ProcessGroupReccl

    # The replica group's store (a launcher's agent would host it; one rank here).
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    manager = Manager(pg=ProcessGroupReccl(timeout=timedelta(seconds=30)), min_replica_size=1,
                      load_state_dict=load_state_dict, state_dict=state_dict,
                      timeout=timedelta(seconds=30), rank=0, world_size=1,
                      store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=args.lighthouse,
                      replica_id=f"replica_{args.replica}", hostname="127.0.0.1")
    failovers = []
    torch_reccl.on_event(failovers.append, kinds=["failover"])
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    quorums, failed = set(), []
    while manager.current_step() < args.steps:
        started = time.monotonic()
        optimizer.zero_grad()                          # starts the step's quorum
        step = manager.current_step()
        if args.replica == 1 and step == args.nic_step:
            torch_reccl.inject_fault("lo:127.0.0.1", "down")
            print(f"[replica 1] step {step}: NIC lo:127.0.0.1 down for good", flush=True)
        g = torch.Generator().manual_seed(1_000_003 * (args.replica + 1) + step)
        x = torch.randn(32, 64, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True))
        loss.backward()                                # gradients averaged across the quorum
        optimizer.step()                               # only if every replica's step went through
        if manager.current_step() == step:
            failed.append(step)                        # discarded; the next attempt trains it again
        quorums.add(manager._quorum_id)
        if step % 20 == 0:
            print(f"[replica {args.replica}] step {step} loss {loss.item():.4f} "
                  f"quorum {manager._quorum_id} participants {manager.num_participants()}", flush=True)
        time.sleep(max(0.0, args.step_s - (time.monotonic() - started)))
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    print(f"[replica {args.replica}] done: step {manager.current_step()}, quorum ids seen {sorted(quorums)}, "
          f"failed steps {failed}, reccl failovers {len(failovers)}, parameters sha256 {digest}", flush=True)
    manager.shutdown(wait=False)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Lighthouse and Manager log every quorum at info
    if args.replica >= 0:
        return replica(args)
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000)
    address = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    env = {**os.environ, "RECCL_NICS": "127.0.0.1,127.0.0.2", "OMP_NUM_THREADS": "1"}

    def start(r: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--replica", str(r),
                                 "--lighthouse", address,
                                 "--steps", str(args.steps), "--nic-step", str(args.nic_step),
                                 "--step-s", str(args.step_s)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)

    def printer(p: subprocess.Popen, lines: list) -> None:
        for line in p.stdout:
            lines.append(line)
            print(line, end="", flush=True)

    procs, outputs, threads = {}, {0: [], 1: []}, []
    deadline = time.monotonic() + args.timeout_s
    try:
        for r in range(REPLICAS):
            procs[r] = start(r)
            threads.append(threading.Thread(target=printer, args=(procs[r], outputs[r]), daemon=True))
            threads[-1].start()
        killed = args.kill_step < 0
        while any(p.poll() is None for p in procs.values()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the run did not finish within --timeout-s {args.timeout_s}")
            if any(p.poll() == 0 for p in procs.values()):  # the job's end: the others finish the same step
                deadline = min(deadline, time.monotonic() + END_GRACE_S)
            if not killed and _passed(outputs[1], args.kill_step):
                os.kill(procs[1].pid, signal.SIGKILL)
                procs[1].wait(timeout=10)
                print(f"[example] replica 1 killed at step >= {args.kill_step}; starting it again", flush=True)
                outputs[1].clear()
                procs[1] = start(1)
                threads.append(threading.Thread(target=printer, args=(procs[1], outputs[1]), daemon=True))
                threads[-1].start()
                killed = True
            time.sleep(0.1)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        for t in threads:
            t.join(timeout=2)
        lighthouse.shutdown()
    digests = {r: line.rsplit(" ", 1)[1].strip() for r in range(REPLICAS)
               for line in outputs[r] if "parameters sha256" in line}
    if len(digests) != REPLICAS or any(p.returncode != 0 for p in procs.values()):
        print(f"[example] a replica failed: exit codes {[p.returncode for p in procs.values()]}", flush=True)
        return 1
    same = len(set(digests.values())) == 1
    print(f"[example] final parameters {'equal' if same else 'DIFFERENT'} on both replicas", flush=True)
    return 0 if same else 1


def _passed(lines: list, step: int) -> bool:
    """Whether replica 1's progress lines reached ``step``."""
    for line in lines[-5:]:
        m = re.match(r"\[replica 1\] step (\d+) ", line)
        if m and int(m.group(1)) >= step:
            return True
    return False


if __name__ == "__main__":
    sys.exit(main())
