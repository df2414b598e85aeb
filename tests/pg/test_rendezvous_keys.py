"""Rendezvous keys in the store: a rank's handle key is deleted once every other
rank of the group has connected to it (each read it before dialing and keeps
the handles for the group's life), not before; and connections made after
that (a new p2p lane, a failover, the failback's re-dial) need no key.

Counted with the store's own num_keys() in a 4-rank job on loopback."""

import os
import time

import pytest

from conftest import init_rank_groups, report_rank, run_rank_job

WORLD = 4
NIC0 = "lo:127.0.0.1"


def wait_for_keys(store, want, bound_s=15.0):
    """The store's key count once it equals `want` (the deletions run after
    each rank's op completes, so they land a moment later), or the last count."""
    deadline = time.monotonic() + bound_s
    count = store.num_keys()
    while count != want and time.monotonic() < deadline:
        time.sleep(0.05)
        count = store.num_keys()
    return count


def keys_rank(rank, port, out_dir):
    def body(result):
        import datetime

        # Two loopback NICs: a backup for the failover below.
        os.environ.update({"RECCL_NICS": "127.0.0.1,127.0.0.2", "RECCL_HEARTBEAT_MS": "500",
                           "RECCL_CONNECT_TIMEOUT_MS": "3000"})
        import torch_reccl

        torch, dist, _groups = init_rank_groups(rank, port, WORLD)
        store = dist.TCPStore("127.0.0.1", port, WORLD, False,
                              timeout=datetime.timedelta(seconds=60))

        def check_all_reduce(count, tag):
            t = torch.arange(count, dtype=torch.float32) + rank
            dist.all_reduce(t)
            want = torch.arange(count, dtype=torch.float32) * WORLD + sum(range(WORLD))
            assert torch.equal(t, want), (tag, t[:8], want[:8])

        def store_barrier(key):
            store.add(key, 1)
            deadline = time.monotonic() + 60
            while store.add(key, 0) < WORLD:
                assert time.monotonic() < deadline, "the other ranks did not come"
                time.sleep(0.02)

        # Every rank past init (torch's own keys written) before the count,
        # and every rank counted before any publishes (the second barrier's
        # key exists before the first completes).
        store.add("keys_test/counted", 0)
        store_barrier("keys_test/ready")
        before = store.num_keys()
        store_barrier("keys_test/counted")
        # Nothing was published yet: the engine starts on the first CPU op.
        check_all_reduce(3, "first")
        check_all_reduce(3, "second")  # every rank has published by now
        # Recursive doubling at 4 ranks: each rank hears from 2 of its 3 peers,
        # so no key is spent: an incarnation and a handle key per rank remain.
        published = store.num_keys() - before
        result["published"] = published
        assert published == 2 * WORLD, published

        # all_to_all: every rank now has a connection from every other.
        out = torch.empty(WORLD, dtype=torch.float32)
        dist.all_to_all_single(out, torch.full((WORLD,), float(rank)))
        assert torch.equal(out, torch.arange(WORLD, dtype=torch.float32)), out
        left = wait_for_keys(store, before + WORLD)
        result["after_all_to_all"] = left - before
        assert left == before + WORLD, f"{left - before} keys left, want {WORLD} (incarnations)"

        # A lane never used before is dialed from the handles read earlier.
        if rank in (1, 2):
            peer = 3 - rank
            got = torch.zeros(5)
            if rank == 1:
                dist.send(torch.full((5,), 7.0), peer)
                dist.recv(got, peer)
            else:
                dist.recv(got, peer)
                dist.send(torch.full((5,), 9.0), peer)
            assert torch.equal(got, torch.full((5,), 9.0 if rank == 1 else 7.0)), got

        # Failover right after: rank 0's NIC 0 down, then up (the primary is
        # re-dialed, again without the key). Results exact throughout.
        check_all_reduce(20000, "healthy")
        if rank == 0:
            torch_reccl.inject_fault(NIC0, "down")
        check_all_reduce(20000, "nic 0 down")
        check_all_reduce(3, "nic 0 down, small")
        if rank == 0:
            torch_reccl.inject_fault(NIC0, "up")
        check_all_reduce(20000, "nic 0 up")
        if rank == 0:
            stats = torch_reccl.stats()
            result["failovers"] = sum(int(n.get("failovers", 0)) for n in stats["nics"].values())
            result["failbacks"] = sum(int(n.get("failbacks", 0)) for n in stats["nics"].values())
        dist.barrier()
        dist.destroy_process_group()

    report_rank(out_dir, rank, body)


@pytest.mark.timeout(240)
def test_handle_keys_go_once_every_peer_connected_and_are_not_needed_after(tmp_path):
    results = run_rank_job(tmp_path, keys_rank, WORLD, (), job_timeout_s=200)
    assert all(r["published"] == 2 * WORLD for r in results)
    assert all(r["after_all_to_all"] == WORLD for r in results)
    assert results[0]["failovers"] >= 1, results[0]
