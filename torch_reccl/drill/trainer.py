"""The training job of ``reccl drill``: one rank, torchrun-compatible.

A small MLP learns a fixed random "teacher" classifier from synthetic data,
data-parallel over the ``reccl`` backend (or, ``--backend gloo``, the baseline
the drill compares it with) on CPU tensors. With ``--device cuda`` the tensors
are on the GPU and the group is NCCL's: through torch_reccl's net plugin
(``--backend reccl``, the path GPU jobs run) or over NCCL's own socket transport
(``--backend nccl``, the baseline); the driver sets the NCCL environment
(:func:`torch_reccl.cli.launch.cuda_net_env`), and ranks share GPUs round-robin.
The parameters start
as rank 0's, and every step averages the gradients with one all_reduce, as DDP
does (DDP itself works with reccl too, but it imports torch._dynamo, which
takes seconds on a small machine). Everything is seeded (the
model, and each rank's batch at each step), so two runs of the same number of
steps end with bit-identical parameters unless a collective delivered wrong
data. Runs under ``torchrun`` as is::

    torchrun --nproc-per-node 2 -m torch_reccl.drill.trainer --steps 200

Messages to the driver (``@reccl`` lines, :func:`torch_reccl.cli.launch.report`):
``start`` (rank 0: the epoch time training began), ``step`` (rank 0, every
step: loss averaged over ranks, step time, samples/s), ``event`` (every rank:
each torch_reccl event), ``done`` (every rank: steps, final loss, SHA-256 of
the parameters). With ``--commands`` the rank reads JSON commands on stdin:
``{"cmd": "inject", "nic": NAME, "kind": "down"|"up"|"flap"|"blackhole",
"period": S, "count": N}`` calls :func:`torch_reccl.inject_fault` in this
process (the drill's fallback without root).

With ``--checkpoint-dir`` rank 0 saves the model, the momentum and the step every
``--checkpoint-every`` steps (the directory must be shared by the ranks) and every
rank resumes from the latest checkpoint there when it starts -- after ``torchrun
--max-restarts`` brought the job back, say. ``--policy`` puts a
:class:`torch_reccl.policy.FaultPolicy` in the loop: at its ``checkpoint_and_exit``
the ranks save and exit with code 75, at ``exit_now`` they exit at once (``exit``
message first). Since every batch is a function of (seed, step, rank), a job that
resumes replays exactly the steps it lost and ends with the fault-free parameters.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import math
import os
import sys
import time

INPUTS = 256
CLASSES = 10


def build_model(torch, width: int, depth: int, seed: int):
    torch.manual_seed(seed)
    layers, inputs = [], INPUTS
    for _ in range(depth):
        layers += [torch.nn.Linear(inputs, width), torch.nn.ReLU()]
        inputs = width
    layers.append(torch.nn.Linear(inputs, CLASSES))
    return torch.nn.Sequential(*layers)


def batch(torch, teacher, seed: int, step: int, rank: int, size: int, device):
    """This rank's batch at this step: the same in every run (drawn on the CPU)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(size, INPUTS, generator=g)
    return x.to(device), (x @ teacher).argmax(dim=1).to(device)


def average_gradients(torch, dist, params, world: int) -> None:
    """One all_reduce of every gradient, flattened; then the mean."""
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    flat.div_(world)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n


def sgd_step(torch, params, momentum, lr: float, beta: float = 0.9) -> None:
    """SGD with momentum, as torch.optim.SGD computes it (written out because
    torch.optim's first step imports torch._dynamo, which takes seconds)."""
    with torch.no_grad():
        for p, buf in zip(params, momentum):
            buf.mul_(beta).add_(p.grad)
            p.add_(buf, alpha=-lr)


def parameter_digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


CHECKPOINT_FILE = "checkpoint.pt"


def save_checkpoint(torch, directory: str, step: int, params, momentum) -> None:
    """Rank 0's checkpoint: written to a temporary file, then renamed over the old one."""
    path = os.path.join(directory, CHECKPOINT_FILE)
    state = {"step": step, "params": [p.detach().clone() for p in params],
             "momentum": [m.clone() for m in momentum]}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def load_checkpoint(torch, directory: str, params, momentum) -> int:
    """Loads the latest checkpoint into params and momentum; the step it was taken at (0: none)."""
    path = os.path.join(directory, CHECKPOINT_FILE)
    if not os.path.exists(path):
        return 0
    state = torch.load(path, map_location="cpu")  # copy_ moves it to each rank's device
    with torch.no_grad():
        for p, saved in zip(params, state["params"]):
            p.copy_(saved)
        for m, saved in zip(momentum, state["momentum"]):
            m.copy_(saved)
    return int(state["step"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_reccl.drill.trainer")
    parser.add_argument("--steps", type=int, default=None, help="train exactly this many steps")
    parser.add_argument("--duration", type=float, default=None,
                        help="train until this many seconds have passed (rank 0 decides)")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0, help="bound on every collective (s)")
    parser.add_argument("--backend", choices=("reccl", "gloo", "nccl"), default="reccl",
                        help="reccl; the baselines gloo (CPU, on GLOO_SOCKET_IFNAME) and nccl (CUDA, "
                             "NCCL's socket transport on NCCL_SOCKET_IFNAME)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: GPU tensors over NCCL (reccl = through torch_reccl's plugin)")
    parser.add_argument("--commands", action="store_true", help="read inject commands on stdin")
    parser.add_argument("--checkpoint-dir", help="save here every --checkpoint-every steps and "
                        "resume from here at start (a directory every rank reads)")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints")
    parser.add_argument("--policy", choices=("off", "advised", "restart", "run_degraded"),
                        default="off", help="a FaultPolicy with this rule answers every step")
    parser.add_argument("--t-detect", type=float, default=1800.0, help="FaultPolicy t_detect_s")
    parser.add_argument("--t-reload", type=float, default=1800.0, help="FaultPolicy t_reload_s")
    parser.add_argument("--expected-repair", type=float, default=math.inf,
                        help="FaultPolicy expected_repair_s (default: inf, eq. 2)")
    parser.add_argument("--step-delay", type=float, default=0.0,
                        help="seconds of emulated compute added to every step")
    args = parser.parse_args(argv)
    if (args.steps is None) == (args.duration is None):
        parser.error("give exactly one of --steps and --duration")
    valid = {"cpu": ("reccl", "gloo"), "cuda": ("reccl", "nccl")}[args.device]
    if args.backend not in valid:
        parser.error(f"--device {args.device} runs over {' or '.join(valid)}, not {args.backend}")
    if (args.checkpoint_dir is None) != (args.checkpoint_every < 1):
        parser.error("--checkpoint-dir and --checkpoint-every >= 1 go together")
    if args.policy != "off" and args.checkpoint_dir is None:
        parser.error("--policy needs --checkpoint-dir and --checkpoint-every")

    import torch
    import torch.distributed as dist

    import torch_reccl
    from torch_reccl.cli.launch import listen_for_commands, report
    from torch_reccl.events import flush_events

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))

    def forward_event(event) -> None:
        fields = event.to_dict()
        fields.pop("rank", None)
        report("event", rank=rank, event=fields.pop("kind"), **fields)

    handle = torch_reccl.on_event(forward_event)
    if args.commands:
        def on_command(message: dict) -> None:
            if message.get("cmd") != "inject":
                raise ValueError(f"unknown command {message.get('cmd')!r}; valid: inject")
            torch_reccl.inject_fault(message["nic"], message["kind"],
                                     period=float(message.get("period", 0.2)),
                                     count=int(message.get("count", 10)))

        listen_for_commands(on_command)

    timeout = datetime.timedelta(seconds=args.timeout)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"--device cuda: this torch ({torch.__version__}) sees no CUDA GPU")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group(args.backend, timeout=timeout)
    world = dist.get_world_size()
    model = build_model(torch, args.width, args.depth, args.seed).to(device)
    params = list(model.parameters())
    with torch.no_grad():
        for p in params:
            dist.broadcast(p, src=0)
    teacher = torch.randn(INPUTS, CLASSES, generator=torch.Generator().manual_seed(args.seed + 1))
    momentum = [torch.zeros_like(p) for p in params]
    loss_fn = torch.nn.CrossEntropyLoss()
    step = load_checkpoint(torch, args.checkpoint_dir, params, momentum) if args.checkpoint_dir else 0
    policy = None
    if args.policy != "off":
        from torch_reccl.policy import FaultPolicy

        policy = FaultPolicy(args.checkpoint_every, t_detect_s=args.t_detect,
                             t_reload_s=args.t_reload, expected_repair_s=args.expected_repair,
                             rule=args.policy)

    dist.barrier()
    t0 = time.time()
    if rank == 0:
        report("start", t0=t0, world=world, batch=args.batch, resumed_from=step,
               restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
               nics={name: nic["up"] for name, nic in torch_reccl.stats()["nics"].items()})
    loss_value = float("nan")
    while args.steps is None or step < args.steps:
        begin = time.perf_counter()
        x, y = batch(torch, teacher, args.seed, step, rank, args.batch, device)
        for p in params:
            p.grad = None
        loss = loss_fn(model(x), y)
        loss.backward()
        if args.step_delay:
            time.sleep(args.step_delay)
        average_gradients(torch, dist, params, world)
        sgd_step(torch, params, momentum, args.lr)
        # one small all_reduce: the mean loss, and rank 0's decision to stop
        stop = 1.0 if (rank == 0 and args.duration is not None
                       and time.time() - t0 >= args.duration) else 0.0
        shared = torch.tensor([loss.item(), stop], dtype=torch.float64, device=device)
        dist.all_reduce(shared)
        step += 1
        loss_value = float(shared[0].item()) / world
        seconds = time.perf_counter() - begin
        advice = policy.step(step) if policy is not None else None
        if rank == 0:
            report("step", step=step, t=time.time(), loss=loss_value, step_s=seconds,
                   samples_per_s=args.batch * world / seconds,
                   **({"advice": advice.action, "faults": advice.faults, "k": advice.k}
                      if advice is not None else {}))
        if args.checkpoint_dir and rank == 0 and (
                step % args.checkpoint_every == 0 or (advice is not None and advice.checkpoint)):
            save_checkpoint(torch, args.checkpoint_dir, step, params, momentum)
        if advice is not None and advice.exit:
            flush_events()
            if rank == 0:
                report("exit", step=step, action=advice.action, reason=advice.reason, k=advice.k,
                       t=time.time())
            policy.exit_for_rescheduling(advice)
        if shared[1].item() > 0:
            break
    digest = parameter_digest(model)
    dist.barrier()
    flush_events()
    report("done", rank=rank, steps=step, loss=loss_value, params_sha256=digest,
           failovers=sum(int(n.get("failovers", 0)) for n in torch_reccl.stats()["nics"].values()))
    handle.remove()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
