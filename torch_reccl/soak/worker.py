"""One rank of ``reccl soak``: a training job interleaved with checked collectives.

Every iteration trains one step of the drill's model (the gradients averaged by
a world all_reduce, the loss summed in each data-parallel half of the world),
then runs one operation drawn from the iteration's seed: every collective and
point-to-point op of the backend, on the world or on subgroups, 0 bytes to
``--max-bytes``, every dtype the engine reduces. Each result is compared with
values this rank computes itself from the inputs every rank was given (a
formula of seed, iteration and rank), never with the library's. The training's
final parameters are compared by the driver with a fault-free replay
(``--replay N``: the same training steps with no checked operations).

Messages (``@reccl`` lines): ``sweep`` (rank 0, each op of the opening sweep),
``start``, ``tick`` (at most once a second: the
iterations and bytes done), ``event`` (each torch_reccl event), ``wrong`` (a
result that differs from the expected one: what, where, and the first bad
element), ``done`` (iterations, training steps, the parameters' SHA-256).
Rank 0 decides when to stop (``--duration``) and tells the others with the
iteration's control broadcast.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import faulthandler
import os
import random
import signal
import sys
import time
from typing import List

# every dtype the engine reduces, with the operations it reduces them with
DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64",
          "uint8", "bool")
OPS = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
       "reduce", "gather", "scatter", "all_to_all_single", "all_to_all_uneven", "barrier",
       "send_recv", "coalesced_all_reduce")
# values lie in [-SPAN, SPAN] (or [0, 2 * SPAN] unsigned): any sum over 8 ranks is exact
# in every dtype, bfloat16 and int8 included
SPAN = 15
MAX_RANKS_FOR_EXACT = 8
TICK_EVERY_S = 1.0


def element_size(torch, dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class Inputs:
    """Every rank's input of every operation, as slices of one pool of random values
    in [-SPAN, SPAN] that each rank draws from the same seed: generating an input
    costs one conversion, and a chunk moved to the wrong place or taken from the
    wrong rank does not match."""

    def __init__(self, torch, seed: int, max_count: int):
        self.torch = torch
        generator = torch.Generator().manual_seed(seed)
        self.pool = torch.randint(-SPAN, SPAN + 1, (max_count + (1 << 20),), dtype=torch.int8,
                                  generator=generator)
        self.slack = 1 << 20

    def make(self, dtype, seed: int, iteration: int, rank: int, count: int):
        torch = self.torch
        offset = random.Random(seed * 7919 + iteration * 104729 + rank).randrange(self.slack)
        values = self.pool[offset:offset + count]
        if dtype == torch.bool:
            return (values > 0).clone()
        if dtype == torch.uint8:
            return (values.to(torch.int16) + SPAN).to(dtype)
        return values.to(dtype)


def reduce_expected(torch, inputs, op: str, dtype):
    """What reducing ``inputs`` with ``op`` gives, in int64/float64, then in ``dtype``."""
    if dtype == torch.bool:
        combine = torch.logical_and if op == "min" else torch.logical_or  # sum and max: or
        value = inputs[0].clone()
        for t in inputs[1:]:
            value = combine(value, t)
        return value
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    value = inputs[0].to(wide)
    for t in inputs[1:]:
        if op == "sum":
            value += t.to(wide)
        else:
            value = (torch.maximum if op == "max" else torch.minimum)(value, t.to(wide))
    return value.to(dtype)


class Checker:
    """Compares results with expected values; reports each mismatch once."""

    def __init__(self, report, rank: int):
        self.report = report
        self.rank = rank
        self.wrong = 0

    def same(self, torch, got, expected, what: str) -> bool:
        if got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected):
            return True
        self.wrong += 1
        first = None
        if got.shape == expected.shape:
            bad = (got != expected).nonzero()
            if bad.numel():
                index = int(bad[0][0]) if bad.dim() > 1 else int(bad[0])
                first = {"index": index, "got": float(got.reshape(-1)[index].to(torch.float64)),
                         "expected": float(expected.reshape(-1)[index].to(torch.float64))}
        self.report("wrong", rank=self.rank, what=what, got_shape=list(got.shape),
                    expected_shape=list(expected.shape), first=first)
        return False


class Groups:
    """The world and two splits of it into halves: contiguous and strided."""

    def __init__(self, dist, world: int, rank: int):
        self.world = world
        self.rank = rank
        self.families = {"world": (None, list(range(world)))}
        if world >= 2:
            half = world // 2
            contiguous = [list(range(half)), list(range(half, world))]
            strided = [list(range(0, world, 2)), list(range(1, world, 2))]
            for name, split in (("halves", contiguous), ("strided", strided)):
                groups = [dist.new_group(members) for members in split]  # every rank makes both
                mine = next(i for i, members in enumerate(split) if rank in members)
                self.families[name] = (groups[mine], split[mine])

    def pick(self, rng: random.Random) -> str:
        """A family: the world half the time, else one of the splits."""
        if rng.random() < 0.5 or len(self.families) == 1:
            return "world"
        return rng.choice([n for n in self.families if n != "world"])


def pick_count(rng: random.Random, max_bytes: int, itemsize: int) -> int:
    """Elements per rank: 0 bytes sometimes, small most often, up to max_bytes rarely."""
    roll = rng.random()
    if roll < 0.05:
        return 0
    top = max(1, max_bytes // itemsize)
    if roll < 0.80:
        return rng.randint(1, min(top, 4096))
    if roll < 0.98:
        return rng.randint(1, min(top, (1 << 20) // itemsize))
    return rng.randint(1, top)


SPLITTING_OPS = ("all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "gather", "scatter",
                 "all_to_all_single", "all_to_all_uneven")


@dataclasses.dataclass(frozen=True)
class OpChoice:
    op: str
    family: str
    dtype: str
    count: int        # elements per rank (per destination for the splitting ops)
    root_index: int   # within the group
    reduce_op: str


def draw_op(rng: random.Random, groups: Groups, max_bytes: int, itemsize_of) -> OpChoice:
    """The iteration's operation, from its own seed: the same on every rank."""
    op = rng.choice(OPS)
    family = groups.pick(rng)
    n = len(groups.families[family][1])
    dtype = rng.choice(DTYPES)
    if dtype == "bool" and op in ("coalesced_all_reduce", "reduce", "reduce_scatter_tensor"):
        dtype = "uint8"
    count = pick_count(rng, max_bytes // (n if op in SPLITTING_OPS else 1), itemsize_of(dtype))
    return OpChoice(op, family, dtype, count, rng.randrange(n), rng.choice(("sum", "max", "min")))


def sweep_ops(groups: Groups, max_bytes: int) -> List[OpChoice]:
    """Every op on every group at every size class, once: the connections and buffers
    a job of these ops ever makes exist before resources are measured."""
    choices = []
    for family, (_, members) in groups.families.items():
        n = len(members)
        for op in OPS:
            limit = max_bytes // (n if op in SPLITTING_OPS else 1)
            for size in (0, 4096, 1 << 20, limit):
                choices.append(OpChoice(op, family, "float32", min(size, limit) // 4, 0, "sum"))
    return choices


def run_op(torch, dist, checker: Checker, groups: Groups, inputs_pool: Inputs, seed: int,
           iteration: int, choice: OpChoice) -> int:
    """One checked operation; the payload bytes this rank sent."""
    op, name, count, root_index = choice.op, choice.family, choice.count, choice.root_index
    group, members = groups.families[name]
    n = len(members)
    me = members.index(groups.rank)
    dtype = getattr(torch, choice.dtype)
    itemsize = element_size(torch, dtype)
    root = members[root_index]
    reduce_op = choice.reduce_op
    what = f"iteration {iteration}: {op} on {name} ({n} ranks) of {count} x {choice.dtype}"
    print(f"op {what}", flush=True)  # the last one names the op a stalled rank is in
    inputs = [inputs_pool.make(dtype, seed, iteration, r, count) for r in members]
    mine = inputs[me].clone()
    sent = count * itemsize
    if op == "all_reduce":
        what += f" {reduce_op}"
        dist.all_reduce(mine, op=getattr(dist.ReduceOp, reduce_op.upper()), group=group)
        checker.same(torch, mine, reduce_expected(torch, inputs, reduce_op, dtype), what)
    elif op == "coalesced_all_reduce":
        parts = [mine[: count // 3].clone(), mine[count // 3:].clone()]
        with dist._coalescing_manager(group=group):
            for part in parts:
                dist.all_reduce(part, group=group)
        expected = reduce_expected(torch, inputs, "sum", dtype)
        checker.same(torch, torch.cat(parts), expected, what)
    elif op == "broadcast":
        what += f" from {root}"
        dist.broadcast(mine, src=root, group=group)
        checker.same(torch, mine, inputs[root_index], what)
    elif op == "all_gather":
        out = [torch.empty(count, dtype=dtype) for _ in members]
        dist.all_gather(out, mine, group=group)
        checker.same(torch, torch.cat(out), torch.cat(inputs), what)
    elif op == "all_gather_into_tensor":
        out = torch.empty(count * n, dtype=dtype)
        dist.all_gather_into_tensor(out, mine, group=group)
        checker.same(torch, out, torch.cat(inputs), what)
    elif op == "reduce_scatter_tensor":
        inputs = [inputs_pool.make(dtype, seed, iteration, r, count * n) for r in members]
        out = torch.empty(count, dtype=dtype)
        dist.reduce_scatter_tensor(out, inputs[me].clone(), group=group)
        expected = reduce_expected(torch, inputs, "sum", dtype)[me * count:(me + 1) * count]
        checker.same(torch, out, expected, what)
        sent = count * n * itemsize
    elif op == "reduce":
        what += f" to {root}"
        dist.reduce(mine, dst=root, group=group)
        expected = reduce_expected(torch, inputs, "sum", dtype) if me == root_index else inputs[me]
        checker.same(torch, mine, expected, what)
    elif op == "gather":
        what += f" to {root}"
        out = [torch.empty(count, dtype=dtype) for _ in members] if me == root_index else None
        dist.gather(mine, gather_list=out, dst=root, group=group)
        if out is not None:
            checker.same(torch, torch.cat(out), torch.cat(inputs), what)
    elif op == "scatter":
        what += f" from {root}"
        chunks = [inputs_pool.make(dtype, seed, iteration, 1000 + r, count) for r in members]
        out = torch.empty(count, dtype=dtype)
        dist.scatter(out, scatter_list=[c.clone() for c in chunks] if me == root_index else None,
                     src=root, group=group)
        checker.same(torch, out, chunks[me], what)
    elif op in ("all_to_all_single", "all_to_all_uneven"):
        if op == "all_to_all_uneven":
            splits = [[random.Random(seed + iteration * 31 + s * 7 + d).randint(0, count)
                       for d in range(n)] for s in range(n)]  # splits[s][d]: s sends d this many
        else:
            splits = [[count] * n for _ in range(n)]
        sources = [inputs_pool.make(dtype, seed, iteration, r, sum(splits[i]))
                   for i, r in enumerate(members)]
        out = torch.empty(sum(splits[s][me] for s in range(n)), dtype=dtype)
        dist.all_to_all_single(out, sources[me].clone(),
                               output_split_sizes=[splits[s][me] for s in range(n)],
                               input_split_sizes=splits[me], group=group)
        pieces = []
        for s in range(n):
            start = sum(splits[s][:me])
            pieces.append(sources[s][start:start + splits[s][me]])
        checker.same(torch, out, torch.cat(pieces), what)
        sent = sum(splits[me]) * itemsize
    elif op == "barrier":
        dist.barrier(group=group)
        sent = 0
    elif op == "send_recv":
        nxt, prv = members[(me + 1) % n], members[(me - 1) % n]
        if n > 1:
            out = torch.empty(count, dtype=dtype)
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, nxt, group=group),
                                            dist.P2POp(dist.irecv, out, prv, group=group)])
            for work in works:
                work.wait()
            checker.same(torch, out, inputs[(me - 1) % n], what + f" from {prv}")
    return sent


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_reccl.soak.worker")
    parser.add_argument("--duration", type=float, default=None, help="seconds (rank 0 decides)")
    parser.add_argument("--replay", type=int, default=None,
                        help="train exactly this many steps with no checked operations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-bytes", type=int, default=64 << 20)
    parser.add_argument("--timeout", type=float, default=300.0, help="bound on every collective (s)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    if (args.duration is None) == (args.replay is None):
        parser.error("give exactly one of --duration and --replay")

    import torch
    import torch.distributed as dist

    import torch_reccl
    from torch_reccl.cli.launch import report
    from torch_reccl.drill.trainer import (
        CLASSES,
        INPUTS,
        average_gradients,
        batch,
        build_model,
        parameter_digest,
        sgd_step,
    )
    from torch_reccl.events import flush_events

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver's stack dump on a stall

    def forward_event(event) -> None:
        fields = event.to_dict()
        fields.pop("rank", None)
        report("event", rank=rank, event=fields.pop("kind"), **fields)

    handle = torch_reccl.on_event(forward_event)
    dist.init_process_group("reccl", timeout=datetime.timedelta(seconds=args.timeout))
    world = dist.get_world_size()
    if world > MAX_RANKS_FOR_EXACT:
        parser.error(f"at most {MAX_RANKS_FOR_EXACT} ranks (sums stay exact); got {world}")
    groups = Groups(dist, world, rank)
    model = build_model(torch, args.width, args.depth, args.seed)
    params = list(model.parameters())
    teacher = torch.randn(INPUTS, CLASSES, generator=torch.Generator().manual_seed(args.seed + 1))
    momentum = [torch.zeros_like(p) for p in params]
    loss_fn = torch.nn.CrossEntropyLoss()
    checker = Checker(report, rank)
    inputs_pool = Inputs(torch, args.seed, args.max_bytes) if args.replay is None else None
    half_group = groups.families.get("halves", (None, None))[0]

    itemsize_of = lambda name: element_size(torch, getattr(torch, name))  # noqa: E731
    if args.replay is None:
        sweep = sweep_ops(groups, args.max_bytes)
        for k, choice in enumerate(sweep):
            run_op(torch, dist, checker, groups, inputs_pool, args.seed, -1 - k, choice)
            if rank == 0:
                report("sweep", done=k + 1, of=len(sweep))
    dist.barrier()
    t0 = time.time()
    if rank == 0:
        report("start", t0=t0, world=world)
    iteration = steps = 0
    sent = 0
    last_tick = time.monotonic()
    control = torch.zeros(1, dtype=torch.int64)
    while True:
        x, y = batch(torch, teacher, args.seed, steps, rank, args.batch, torch.device("cpu"))
        for p in params:
            p.grad = None
        loss = loss_fn(model(x), y)
        loss.backward()
        average_gradients(torch, dist, params, world)
        sgd_step(torch, params, momentum, 0.05)
        if half_group is not None:
            dist.all_reduce(torch.tensor([loss.item()], dtype=torch.float64), group=half_group)
        steps += 1
        if args.replay is not None:
            if steps >= args.replay:
                break
            continue
        choice = draw_op(random.Random(args.seed * 1_000_003 + iteration), groups, args.max_bytes,
                         itemsize_of)
        sent += run_op(torch, dist, checker, groups, inputs_pool, args.seed, iteration, choice)
        iteration += 1
        control.fill_(1 if rank == 0 and time.time() - t0 >= args.duration else 0)
        dist.broadcast(control, src=0)
        now = time.monotonic()
        if now - last_tick >= TICK_EVERY_S or control.item():
            last_tick = now
            report("tick", rank=rank, t=time.time(), iterations=iteration, steps=steps,
                   bytes=sent, wrong=checker.wrong)
        if control.item():
            break
    digest = parameter_digest(model)
    dist.barrier()
    flush_events()
    report("done", rank=rank, iterations=iteration, steps=steps, wrong=checker.wrong,
           params_sha256=digest, bytes=sent)
    handle.remove()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
