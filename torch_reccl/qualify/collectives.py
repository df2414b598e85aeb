"""Steps 3 and 4 of ``reccl qualify``, on any process group: busbw, and a rail lost
in the middle of a stream of collectives.

Both run in lock step on every rank. :func:`busbw` times all_reduce and all_gather
(nccl-tests' busbw: the largest buffer's bytes / time x 2(n-1)/n or (n-1)/n, the
slowest rank's time) and checks one result of each element by element.
:func:`fault_stream` all_reduces a buffer of small integers (exact in float32 on any
number of ranks) over and over while rank 0 walks it through four phases, riding
on the collectives themselves (the last elements of every buffer carry rank 0's
phase and each rank's "I saw a failover / failback" flags, summed), so no store
traffic and no clock agreement is needed:

    0 fault-free   at least ``base_s`` and MIN_OPS collectives
    1 rail down    the faulted host's ranks call inject_fault(NIC, "down") after the
                   collective that announced it; at least ``hold_s`` and MIN_OPS
    2 rail up      inject_fault(NIC, "up"); until every rank that failed over has
                   failed back, at most ``settle_s``
    3 stop

Every result is compared with the expected sum, every collective is timed, and
each rank keeps its events of the window.
"""
from __future__ import annotations

import math
import statistics
import threading
import time
from typing import Any, Dict, List, Optional

from torch_reccl.bench.rank import bus_factor, shape_for

OPS = ("all_reduce", "all_gather")
MIN_OPS = 5
MIN_ITERS, MAX_ITERS = 2, 50
CONTROL = 3                 # elements at the end of a fault-stream buffer
FREE, DOWN, UP, STOP = 0, 1, 2, 3
PATTERN = 251               # data element i is i % PATTERN (+ a per-rank and per-op offset)


class EventLog:
    """Every torch_reccl event of this process, kept for the steps to read."""

    def __init__(self):
        import torch_reccl

        self._lock = threading.Lock()
        self._events: List[Any] = []
        self._handle = torch_reccl.on_event(self._add)

    def _add(self, event) -> None:
        with self._lock:
            self._events.append(event)

    def since(self, t: float, kinds=None) -> List[Any]:
        from torch_reccl.events import flush_events

        flush_events()
        with self._lock:
            return [e for e in self._events if e.time >= t and (kinds is None or e.kind in kinds)]

    def close(self) -> None:
        self._handle.remove()


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _run(dist, op: str, out, inp, group) -> None:
    if op == "all_reduce":
        dist.all_reduce(inp, group=group)
    else:  # all_gather_single is all_gather_into_tensor's name from torch 2.13 on
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, inp, group=group)


def _agree_max(dist, value: float, group, device) -> float:
    import torch

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def measure(dist, group, device, op: str, nominal_bytes: int, budget_s: float) -> Dict[str, Any]:
    """busbw of ``op`` at ``nominal_bytes`` on ``group`` (every rank calls it), with the
    output of one more run on known values checked element by element."""
    import torch

    ranks = dist.get_world_size(group)
    rank = dist.get_rank(group)
    _, size_bytes, n_in, n_out = shape_for(op, nominal_bytes, ranks, "float32")
    inp = torch.ones(n_in, dtype=torch.float32, device=device)
    out = inp if op == "all_reduce" else torch.empty(n_out, dtype=torch.float32, device=device)
    _sync(device)
    begin = time.perf_counter()
    _run(dist, op, out, inp, group)  # warm-up: connections, buffers
    _sync(device)
    warm = _agree_max(dist, time.perf_counter() - begin, group, device)
    iters = int(min(MAX_ITERS, max(MIN_ITERS, math.ceil(budget_s / max(warm, 1e-6)))))
    inp.fill_(1)
    _sync(device)
    begin = time.perf_counter()
    for _ in range(iters):
        _run(dist, op, out, inp, group)
    _sync(device)
    seconds = _agree_max(dist, (time.perf_counter() - begin) / iters, group, device)
    value = float(rank % 3 + 1)
    inp.fill_(value)
    _run(dist, op, out, inp, group)
    if op == "all_reduce":
        wrong = int((inp != float(sum(r % 3 + 1 for r in range(ranks)))).sum().item())
    else:
        expected = torch.arange(ranks, device=device).remainder(3).add(1).to(torch.float32)
        wrong = int((out.view(ranks, -1) != expected.view(ranks, 1)).sum().item())
    counter = torch.tensor([wrong], dtype=torch.float64, device=device)
    dist.all_reduce(counter, group=group)
    algbw = size_bytes / seconds / 1e9
    return {"bytes": size_bytes, "iters": iters, "time_us": round(seconds * 1e6, 1),
            "busbw_gbps": round(algbw * bus_factor(op, ranks), 3), "wrong": int(counter.item())}


def busbw(dist, group, device, sizes: List[int], budget_s: float, ops=OPS) -> List[Dict[str, Any]]:
    """One row per (op, size): {op, bytes, busbw_gbps, time_us, iters, wrong}."""
    rows = []
    for op in ops:
        for size in sizes:
            rows.append({"op": op, **measure(dist, group, device, op, size, budget_s)})
    return rows


def fault_stream(dist, group, device, nbytes: int, nic: str, faulted: bool, events: EventLog,
                 base_s: float, hold_s: float, settle_s: float) -> Dict[str, Any]:
    """One rail lost and healed mid-stream (see the module docstring). Every rank calls
    it; ``faulted`` ranks inject on ``nic``. Rank 0's dict has the timing; every rank's
    has its own wrong results and events."""
    import torch

    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    n = max(CONTROL + 1, nbytes // 4)
    data = n - CONTROL
    base = torch.arange(data, device=device).remainder(PATTERN).to(torch.float32)
    expected_base = base * world
    rank_sum = float(sum(r % 7 for r in range(world)))
    x = torch.empty(n, dtype=torch.float32, device=device)
    phase, op = FREE, 0
    phase_start = time.monotonic()
    ops_in_phase = 0
    times: Dict[int, List[float]] = {FREE: [], DOWN: [], UP: []}
    wrong_ops, wrong_elements = 0, 0
    down_at: Optional[float] = None   # wall clock (events carry wall-clock times): the start
    up_at: Optional[float] = None     # of the collective that announced DOWN, UP
    failed_over = failed_back = False
    most_failed_over = 0
    settled = None
    while True:  # every rank leaves on the collective that announces STOP
        x[:data].copy_(base).add_(float(rank % 7 + op % 5))
        x[data] = float(phase) if rank == 0 else 0.0
        x[data + 1] = 1.0 if failed_over else 0.0
        x[data + 2] = 1.0 if failed_back else 0.0
        _sync(device)
        # Every rank starts a collective before any rank finishes it, and the faulted host
        # injects only after finishing the one that announced the fault: so what the fault
        # causes anywhere happens after this rank's start of that collective.
        started = time.time()
        begin = time.perf_counter()
        dist.all_reduce(x, group=group)
        control = x[data:].tolist()
        elapsed = time.perf_counter() - begin
        bad = int((x[:data] != expected_base + (rank_sum + world * (op % 5))).sum().item())
        if bad:
            wrong_ops += 1
            wrong_elements += bad
        announced = int(round(control[0]))
        if announced in times:
            times[announced].append(elapsed)
        op += 1
        if announced == DOWN and down_at is None:
            down_at = started
            if faulted:
                import torch_reccl

                torch_reccl.inject_fault(nic, "down")
        elif announced == UP and up_at is None:
            up_at = started
            if faulted:
                import torch_reccl

                torch_reccl.inject_fault(nic, "up")
        elif announced == STOP:
            break
        if down_at is not None and not failed_over:
            failed_over = bool(events.since(down_at, ("failover",)))
        if up_at is not None and not failed_back:
            failed_back = bool(events.since(up_at, ("failback",)))
        if rank == 0:  # the next phase, announced by the next collective
            ops_in_phase += 1
            held = time.monotonic() - phase_start
            counted_over, counted_back = int(round(control[1])), int(round(control[2]))
            most_failed_over = max(most_failed_over, counted_over)
            next_phase = phase
            if phase == FREE and held >= base_s and ops_in_phase >= MIN_OPS:
                next_phase = DOWN
            elif phase == DOWN and held >= hold_s and ops_in_phase >= MIN_OPS and announced == DOWN:
                next_phase = UP
            elif phase == UP and announced == UP and (
                    (most_failed_over and counted_back >= most_failed_over) or held >= settle_s):
                settled = counted_back >= most_failed_over > 0
                next_phase = STOP
            if next_phase != phase:
                phase, phase_start, ops_in_phase = next_phase, time.monotonic(), 0
    window = events.since(down_at) if down_at is not None else []
    out: Dict[str, Any] = {
        "rank": rank, "ops": op, "wrong_ops": wrong_ops, "wrong_elements": wrong_elements,
        "failover": sum(1 for e in window if e.kind == "failover"),
        "failback": sum(1 for e in window if e.kind == "failback"),
        "failover_s": [e.duration_s for e in window if e.kind == "failover" and e.duration_s is not None],
        "events": [{"t": round(e.time - down_at, 4), "kind": e.kind, "reason": e.reason, "nic": e.nic,
                    "peer": e.peer, "duration_s": e.duration_s}
                   for e in window if e.kind in ("failover", "failback", "nic_down", "nic_up", "path_down")][:64],
    }
    if rank == 0:
        free = times[FREE][1:] or times[FREE]   # the first collective may still set up
        down = times[DOWN][1:]                  # the first one after the fault holds the interruption
        ff = statistics.median(free) if free else float("nan")
        out.update({
            "bytes": n * 4, "fault_free_ms": round(ff * 1e3, 3),
            "down_ms": round(statistics.median(down) * 1e3, 3) if down else None,
            "longest_down_ms": round(max(times[DOWN]) * 1e3, 3) if times[DOWN] else None,
            "kept": round(ff / statistics.median(down), 3) if down else None,
            "ops_fault_free": len(times[FREE]), "ops_down": len(times[DOWN]), "ops_up": len(times[UP]),
            "ranks_failed_over": most_failed_over, "all_failed_back": bool(settled),
        })
    return out
