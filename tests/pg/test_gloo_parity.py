"""reccl behaves as Gloo where users switch a job from "gloo" to "reccl".

Each check runs in one spawned job whose default group is reccl and which also
has a Gloo group of the same ranks, so both backends see the same inputs:

* sparse all_reduce: COO tensors of every dtype reccl takes, with 1-3 sparse
  and 0-2 dense dimensions, uncoalesced inputs with duplicate indices, a
  different nnz on every rank, empty tensors on some ranks and on all; the
  reccl result equals Gloo's bit for bit (indices, values, coalesced flag). For
  a dtype Gloo refuses (int16) it equals what Gloo's algorithm computes; where
  torch's sparse add itself fails (float16 on the CPU), both fail with its error.
* timeouts: a barrier only rank 0 enters raises torch.distributed.DistBackendError
  (what ProcessGroupNCCL raises; a RuntimeError, the class Gloo raises), worded
  as Gloo's "Timed out waiting <bound>ms for ...", naming the group and rank,
  after the bound.
* names: dist.get_backend, the ProcessGroup's name and DDP's logging data say
  "reccl".
* monitored_barrier: torch's refuses reccl groups (it allows only Gloo);
  torch_reccl.monitored_barrier passes when every rank arrives and names the
  ranks that did not, within the timeout.
"""
from __future__ import annotations

import datetime
import time

from conftest import reccl_env, report_rank, run_rank_job

JOB_TIMEOUT_S = 240


def init(rank, port, world, timeout_s=30):
    import os

    os.environ.update(reccl_env())
    import torch
    import torch.distributed as dist

    import torch_reccl  # noqa: F401

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("reccl", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    gloo = dist.new_group(list(range(world)), backend="gloo",
                          timeout=datetime.timedelta(seconds=timeout_s))
    return torch, dist, gloo


# ------------------------------------------------------------------ sparse all_reduce

SPARSE_DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32",
                 "int64", "bool"]


def sparse_case(torch, rank, world, dtype, sparse_dims, dense_dims, nnz, duplicates, seed):
    """A COO tensor of shape [5]*sparse_dims + [3]*dense_dims with `nnz` entries
    (uncoalesced: `duplicates` of them repeat an earlier index)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    indices = torch.randint(0, 5, (sparse_dims, nnz), generator=g)
    if duplicates and nnz > 1:
        indices[:, -duplicates:] = indices[:, :1]
    values = torch.randn([nnz] + [3] * dense_dims, generator=g) * 4
    if dtype == "bool":
        values = values > 0
    else:
        values = values.to(getattr(torch, dtype))
    return torch.sparse_coo_tensor(indices, values, [5] * sparse_dims + [3] * dense_dims)


def gloo_algorithm(torch, inputs):
    """What ProcessGroupGloo's sparse all_reduce computes from every rank's input."""
    coalesced = [t.coalesce() for t in inputs]
    out = torch.sparse_coo_tensor(coalesced[0]._indices(), coalesced[0]._values(), coalesced[0].shape)
    for t in coalesced[1:]:
        out += torch.sparse_coo_tensor(t._indices(), t._values(), t.shape)
    return out.coalesce()


def same_bits(torch, a, b) -> bool:
    if a.is_coalesced() != b.is_coalesced() or a.shape != b.shape or a.dtype != b.dtype:
        return False
    ai, bi = a._indices(), b._indices()
    av, bv = a._values().contiguous(), b._values().contiguous()
    return (torch.equal(ai, bi) and av.shape == bv.shape
            and torch.equal(av.reshape(-1).view(torch.uint8), bv.reshape(-1).view(torch.uint8)))


def sparse_rank(rank, port, out_dir, world):
    def body(result):
        torch, dist, gloo = init(rank, port, world)
        cases = []
        seed = 0
        for dtype in SPARSE_DTYPES:
            for sparse_dims, dense_dims in ((1, 0), (2, 1), (3, 2)):
                seed += 1
                cases.append((dtype, sparse_dims, dense_dims, lambda r: 3 + 2 * r, 2, seed))
        seed += 1
        cases.append(("float32", 2, 1, lambda r: 0 if r == 1 else 4, 1, seed))   # one rank empty
        seed += 1
        cases.append(("float64", 1, 1, lambda r: 0, 0, seed))                    # every rank empty
        gloo_refused = []
        for dtype, sparse_dims, dense_dims, nnz_of, dups, seed in cases:
            what = (f"{dtype} sparse_dims={sparse_dims} dense_dims={dense_dims} nnz={nnz_of(rank)} "
                    f"dups={dups}")
            inputs = [sparse_case(torch, r, world, dtype, sparse_dims, dense_dims, nnz_of(r), dups, seed)
                      for r in range(world)]
            original = inputs[rank]
            by_gloo, by_reccl = original.clone(), original.clone()
            try:
                dist.all_reduce(by_gloo, group=gloo)
            except RuntimeError as error:
                if "Invalid scalar type" not in str(error):
                    # torch's sparse add fails (float16 on CPU): so must reccl's, the same way.
                    try:
                        dist.all_reduce(by_reccl)
                    except RuntimeError as reccl_error:
                        assert str(error).splitlines()[0] in str(reccl_error), (what, error, reccl_error)
                        result.setdefault("failing_like_gloo", []).append(what)
                        continue
                    raise AssertionError(f"{what}: Gloo fails ({error}), reccl does not")
                # Gloo reduces fewer dtypes (int16: "Invalid scalar type"): reccl
                # must give what Gloo's algorithm would.
                gloo_refused.append(dtype)
                by_gloo = gloo_algorithm(torch, inputs)
            dist.all_reduce(by_reccl)
            if not same_bits(torch, by_gloo, by_reccl):
                raise AssertionError(f"{what}: reccl {by_reccl} differs from Gloo {by_gloo}")
            result["equal_bits"] = result.get("equal_bits", 0) + 1
        result["cases"] = len(cases)
        result["gloo_refused"] = sorted(set(gloo_refused))
        dist.destroy_process_group()

    report_rank(out_dir, rank, body)


def test_sparse_all_reduce_matches_gloo_bit_for_bit(tmp_path):
    results = run_rank_job(tmp_path, sparse_rank, 3, (3,), JOB_TIMEOUT_S)
    # Compared with Gloo itself for all but the dtypes Gloo refuses.
    assert set(results[0]["gloo_refused"]) <= {"int16"}, results[0]["gloo_refused"]
    assert results[0]["cases"] == 3 * len(SPARSE_DTYPES) + 2
    # Only where torch's own CPU sparse add fails (float16; bool when duplicate
    # indices must be summed) may a case fail, and then on both, with Gloo's error.
    failing = results[0].get("failing_like_gloo", [])
    assert all(w.split()[0] in ("float16", "bool") for w in failing), results[0]
    assert results[0]["equal_bits"] + len(failing) == results[0]["cases"], results[0]
    assert results[0]["equal_bits"] >= 3 * (len(SPARSE_DTYPES) - 2) + 2, results[0]


def sparse_mismatch_rank(rank, port, out_dir, world):
    def body(result):
        torch, dist, _ = init(rank, port, world)
        shape = [4, 4] if rank == 0 else [4, 5]
        t = torch.sparse_coo_tensor(torch.tensor([[0], [1]]), torch.ones(1), shape)
        try:
            dist.all_reduce(t)
        except Exception as error:  # noqa: BLE001
            result["shape_error"] = str(error)
        t = torch.sparse_coo_tensor(torch.tensor([[0], [1]]), torch.ones(1), [4, 4])
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        except Exception as error:  # noqa: BLE001
            result["max_error"] = str(error)
        dist.destroy_process_group()

    report_rank(out_dir, rank, body)


def test_sparse_all_reduce_rejects_mismatched_shapes_and_ops(tmp_path):
    results = run_rank_job(tmp_path, sparse_mismatch_rank, 2, (2,), JOB_TIMEOUT_S)
    for r in results:
        assert "differ in shape between ranks" in r.get("shape_error", ""), r
        assert "ReduceOp.SUM only" in r.get("max_error", ""), r


# ------------------------------------------------------------------ timeouts

def timeout_rank(rank, port, out_dir, world):
    def body(result):
        torch, dist, _ = init(rank, port, world)
        bound = datetime.timedelta(seconds=1)
        for backend in ("gloo", "reccl"):
            group = dist.new_group(list(range(world)), backend=backend, timeout=bound)
            if rank == 0:
                started = time.monotonic()
                try:
                    dist.barrier(group)
                except Exception as error:  # noqa: BLE001
                    result[backend] = {"classes": [f"{c.__module__}.{c.__qualname__}"
                                                   for c in type(error).__mro__],
                                       "message": str(error),
                                       "seconds": time.monotonic() - started}
            # The others do not enter: let rank 0 time out, then all meet again.
            dist.barrier(dist.new_group(list(range(world)), backend="gloo"))
        dist.destroy_process_group()

    report_rank(out_dir, rank, body)


def test_timeout_raises_what_gloo_raises(tmp_path):
    results = run_rank_job(tmp_path, timeout_rank, 2, (2,), JOB_TIMEOUT_S)
    gloo, reccl = results[0]["gloo"], results[0]["reccl"]
    # Gloo raises a RuntimeError, NCCL a DistBackendError (a RuntimeError): reccl
    # raises the latter, which code written for either catches.
    assert reccl["classes"][0] == "torch.distributed.DistBackendError", reccl
    assert gloo["classes"][0] in reccl["classes"], (gloo, reccl)
    assert " Timed out waiting 1000ms" in gloo["message"], gloo
    message = reccl["message"]
    assert message.startswith("[reccl] Timed out waiting 1000ms for barrier on process group '"), message
    assert "(rank 0 of 2)" in message and "reccl rendezvous:" in message, message
    assert reccl["seconds"] >= 0.9, reccl


# ------------------------------------------------------------------ names

def names_rank(rank, port, out_dir, world):
    def body(result):
        torch, dist, _ = init(rank, port, world)
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(torch.nn.Linear(4, 2))
        model(torch.ones(3, 4)).sum().backward()
        result["ddp"] = model._get_ddp_logging_data().get("backend_name")
        result["get_backend"] = dist.get_backend()
        result["pg_name"] = dist.group.WORLD.name()
        sub = dist.new_group([0, 1])
        result["sub_name"] = sub.name()
        t = torch.full((2,), float(rank))
        dist.all_reduce(t, group=sub)
        result["sub_sum"] = t.tolist()
        dist.destroy_process_group()

    report_rank(out_dir, rank, body)


def test_ddp_and_get_backend_say_reccl(tmp_path):
    for r in run_rank_job(tmp_path, names_rank, 2, (2,), JOB_TIMEOUT_S):
        assert (r["ddp"], r["get_backend"], r["pg_name"], r["sub_name"]) == ("reccl",) * 4, r
        assert r["sub_sum"] == [1.0, 1.0], r


# ------------------------------------------------------------------ monitored_barrier

def monitored_rank(rank, port, out_dir, world):
    def body(result):
        torch, dist, _ = init(rank, port, world)
        import torch_reccl

        meet = lambda: dist.barrier(dist.new_group(list(range(world)), backend="gloo"))  # noqa: E731
        try:
            dist.monitored_barrier()
        except ValueError as error:
            result["torch_refuses"] = str(error)
        torch_reccl.monitored_barrier(timeout=datetime.timedelta(seconds=10))
        torch_reccl.monitored_barrier(timeout=10.0, wait_all_ranks=True)
        meet()
        # Rank 2 does not arrive.
        if rank != 2:
            started = time.monotonic()
            try:
                torch_reccl.monitored_barrier(timeout=datetime.timedelta(seconds=1))
            except Exception as error:  # noqa: BLE001
                result["one_missing"] = (type(error).__name__, str(error), time.monotonic() - started)
        meet()
        # Ranks 1 and 2 do not arrive; rank 0 waits for all.
        if rank == 0:
            try:
                torch_reccl.monitored_barrier(timeout=0.5, wait_all_ranks=True)
            except Exception as error:  # noqa: BLE001
                result["all_missing"] = str(error)
        meet()
        try:
            torch_reccl.monitored_barrier(timeout=-1)
        except ValueError as error:
            result["bad_timeout"] = str(error)
        dist.destroy_process_group()

    report_rank(out_dir, rank, body)


def test_monitored_barrier_names_the_ranks_that_did_not_arrive(tmp_path):
    results = run_rank_job(tmp_path, monitored_rank, 3, (3,), JOB_TIMEOUT_S)
    for r in results:
        assert "only implemented for GLOO" in r["torch_refuses"], r
        assert "negative" in r["bad_timeout"], r
    kind, message, seconds = results[0]["one_missing"]
    assert kind == "DistBackendError" and "Rank 2 failed to pass monitoredBarrier in 1000 ms" in message
    assert 0.9 <= seconds < 10, seconds
    kind, message, _ = results[1]["one_missing"]
    assert "Rank 1 successfully reached monitoredBarrier, but received errors while waiting for " \
           "send/recv from rank 0" in message, message
    assert "Ranks 1, 2 failed to pass monitoredBarrier in 500 ms" in results[0]["all_missing"]
