"""The processes of torch_reccl.bench.torchft_compare, one replica group (one rank)
per host, all started by its driver:

- ``agent``: what a launcher's agent is to a replica group (torchrun's agent hosts
  the store): the replica group's TCPStore, and on the first host also torchft's
  Lighthouse. It outlives the replica's process, as an agent does when its worker
  is killed. Prints ``@reccl {"kind": "ready"}`` and serves until stdin closes.
- ``replica``: one replica group of the training job under torchft's ``Manager``:
  a small MLP, every step's gradients averaged across the replicas in the quorum
  with one ``manager.allreduce`` (what torchft's DDP does per bucket), SGD with
  momentum applied only when ``should_commit``; a replica that (re)joins heals from
  a peer (model and optimizer state). Each replica's batch at step s comes from a
  generator seeded by (replica, s), so the run is deterministic. The process group
  is ``ProcessGroupReccl`` (``--backend reccl``) or torchft's ``ProcessGroupGloo``.
  Reports ``step`` lines (the step number it trained, whether it committed,
  whether it was participating, the quorum id and the participants), and at the
  end ``done`` with the SHA-256 of its parameters and optimizer state and the
  reccl failovers it saw. Commands on stdin: ``{"cmd": "inject", "nic": ...,
  "kind": ...}`` (torch_reccl.inject_fault), ``{"cmd": "die"}`` (SIGKILLs itself
  in its next step, after the backward pass and the step's quorum, before the
  gradients' all-reduce, so that its peer waits in that all-reduce when it dies).

Run by the driver inside each host's network namespace (fabric) or on this
machine (loopback): ``python -m torch_reccl.bench.torchft_replica replica ...``.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import threading
import time
from datetime import timedelta

READY_TIMEOUT_S = 60.0


def agent(args) -> int:
    from torch.distributed import TCPStore

    from torch_reccl.cli.launch import report

    store = TCPStore(args.host, args.store_port, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=READY_TIMEOUT_S))
    lighthouse = None
    if args.lighthouse_port:
        from torchft.coordination import LighthouseServer

        lighthouse = LighthouseServer(bind=f"[::]:{args.lighthouse_port}", min_replicas=1,
                                      join_timeout_ms=args.join_timeout_ms, quorum_tick_ms=50,
                                      heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    report("ready")
    sys.stdin.read()  # until the driver closes stdin (or is gone)
    if lighthouse is not None:
        lighthouse.shutdown()
    del store
    return 0


class _Job:
    """The model, its optimizer and the data of one replica."""

    def __init__(self, width: int, seed: int):
        import torch

        torch.manual_seed(seed)  # every replica starts from the same parameters
        self.torch = torch
        self.model = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.ReLU(),
                                         torch.nn.Linear(width, width), torch.nn.ReLU(),
                                         torch.nn.Linear(width, 10))
        self.optim = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(seed + 1))

    def batch(self, replica: int, step: int, size: int = 32):
        g = self.torch.Generator().manual_seed(1_000_003 * (replica + 1) + step)
        x = self.torch.randn(size, 32, generator=g)
        return x, (x @ self.teacher).argmax(dim=1)

    def state_dict(self):
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict()}

    def load_state_dict(self, state) -> None:
        self.model.load_state_dict(state["model"])
        self.optim.load_state_dict(state["optim"])

    def digest(self) -> str:
        h = hashlib.sha256()
        for p in self.model.parameters():
            h.update(p.detach().contiguous().numpy().tobytes())
        for state in self.optim.state.values():
            h.update(state["momentum_buffer"].contiguous().numpy().tobytes())
        return h.hexdigest()


def _transport(host: str, timeout: timedelta):
    """torchft's HTTP checkpoint transport, advertised at ``host`` (its default is
    this machine's hostname, which a network namespace of the fabric cannot reach)."""
    from torchft.checkpointing.http_transport import HTTPTransport

    class AdvertisedHTTPTransport(HTTPTransport):
        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            return f"http://{host}:{port}/checkpoint/"

    return AdvertisedHTTPTransport(timeout=timeout, num_chunks=0)


def replica(args) -> int:
    import torch
    from torchft import Manager

    import torch_reccl
    from torch_reccl.cli.launch import listen_for_commands, report

    timeout = timedelta(seconds=args.timeout)
    if args.backend == "reccl":
        from torch_reccl.integrations.torchft import ProcessGroupReccl

        pg = ProcessGroupReccl(timeout=timeout)
    else:
        from torchft.process_group import ProcessGroupGloo

        pg = ProcessGroupGloo(timeout=timeout)
    die = threading.Event()

    def on_command(message: dict) -> None:
        if message.get("cmd") == "die":
            die.set()
        elif message.get("cmd") == "inject":
            torch_reccl.inject_fault(message["nic"], message["kind"])
            report("injected", nic=message["nic"], fault=message["kind"])
        else:
            raise ValueError(f"unknown command {message.get('cmd')!r}; valid: die, inject")

    listen_for_commands(on_command)

    failovers = []
    torch_reccl.on_event(failovers.append, kinds=["failover"])
    job = _Job(args.width, args.seed)
    manager = Manager(pg=pg, load_state_dict=job.load_state_dict, state_dict=job.state_dict,
                      min_replica_size=1, timeout=timeout, quorum_timeout=timeout,
                      connect_timeout=timeout, rank=0, world_size=1,
                      store_addr=args.host, store_port=args.store_port,
                      lighthouse_addr=args.lighthouse, replica_id=f"replica_{args.replica}",
                      hostname=args.host, checkpoint_transport=_transport(args.host, timeout))
    params = list(job.model.parameters())
    report("start", replica=args.replica, backend=args.backend, pid=os.getpid())
    try:
        while manager.current_step() < args.steps:
            started = time.monotonic()
            manager.start_quorum()
            job.optim.zero_grad()
            step = manager.current_step()
            x, y = job.batch(args.replica, step)
            loss = torch.nn.functional.cross_entropy(job.model(x), y)
            loss.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            if die.is_set():  # killed in mid-step, in the step's quorum: its peers wait in the all-reduce
                manager.wait_quorum()
                report("dying", step=step, t=time.time())
                os.kill(os.getpid(), signal.SIGKILL)
            manager.allreduce(flat).wait()
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            participating = manager.is_participating()
            participants = manager.num_participants()
            committed = manager.should_commit()
            if committed:
                job.optim.step()
            error = manager.errored()
            report("step", step=step, committed=committed, participating=participating,
                   participants=participants, quorum=manager._quorum_id, t=time.time(),
                   loss=loss.item(), error=None if error is None else str(error.original_exception)[:300])
            rest = args.step_s - (time.monotonic() - started)
            if rest > 0:
                time.sleep(rest)
        report("done", step=manager.current_step(), digest=job.digest(), failovers=len(failovers))
    finally:
        manager.shutdown(wait=False)
        pg.shutdown()
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_reccl.bench.torchft_replica")
    sub = parser.add_subparsers(dest="role", required=True)
    a = sub.add_parser("agent")
    a.add_argument("--host", required=True)
    a.add_argument("--store-port", type=int, required=True)
    a.add_argument("--lighthouse-port", type=int, default=0)
    a.add_argument("--join-timeout-ms", type=int, default=1000)
    a.add_argument("--heartbeat-timeout-ms", type=int, default=5000)
    r = sub.add_parser("replica")
    r.add_argument("--backend", choices=("reccl", "gloo"), required=True)
    r.add_argument("--replica", type=int, required=True)
    r.add_argument("--host", required=True, help="this host's address others reach (store, manager, checkpoints)")
    r.add_argument("--store-port", type=int, required=True)
    r.add_argument("--lighthouse", required=True)
    r.add_argument("--steps", type=int, required=True)
    r.add_argument("--step-s", type=float, default=0.1, help="each step takes at least this long")
    r.add_argument("--timeout", type=float, default=30.0)
    r.add_argument("--width", type=int, default=64)
    r.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    return agent(args) if args.role == "agent" else replica(args)


if __name__ == "__main__":
    sys.exit(main())
