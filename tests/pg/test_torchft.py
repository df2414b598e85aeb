"""reccl under torchft (torch_reccl.integrations.torchft, docs/torchft.md).

- ProcessGroupReccl as torchft's Manager drives it, in 2 processes: a group per
  quorum (configure with a new store prefix each time), exact all_reduce results in
  each, the wait/future contract torchft's callbacks need (the Future is done when
  wait() returns), a bounded abort(), errored(), shutdown(), and bad arguments.
- The job of torch_reccl.bench.torchft_compare on reccl: 2 replica groups under
  the Manager with torchft's Lighthouse. (a) replica 1's host loses NIC 0 for good:
  no step fails, the quorum never changes, both replicas are in every step and
  end with equal parameters. (b) replica 1's process is SIGKILLed and started
  again: the quorum goes on without it, it rejoins, heals from replica 0 and both
  end with equal parameters and optimizer state. In the emulated fabric when root
  can build one (a veth that loses carrier), else over loopback NICs with
  torch_reccl.inject_fault.

Skips with the reason only where torchft is not installed.
"""
from __future__ import annotations

import datetime
import os
import time

import pytest

from conftest import reccl_env, report_rank, run_rank_job

pytest.importorskip("torchft", reason="needs torchft (pip install torchft, or the test extras)")

ABORT_BOUND_S = 15  # close handshakes + the op queue's 5 s stop bound, on a loaded 2-core box


def _values(rank, n, quorum):
    import torch

    return torch.arange(n, dtype=torch.float32) * (rank + 1) + quorum


def _quorum_job(rank, port, out_dir):
    os.environ.update({**reccl_env(), "RECCL_HOST_ID": f"torchft-test-host-{rank}"})

    def body(result):
        import torch
        from torch.distributed import AllreduceOptions, ReduceOp

        from torch_reccl.integrations.torchft import ProcessGroupReccl

        pg = ProcessGroupReccl(timeout=datetime.timedelta(seconds=30))
        assert pg.getBackendName() == "torchft-reccl"
        for quorum in (1, 2, 3):
            pg.configure(f"127.0.0.1:{port}/torchft/{quorum}/0", f"replica_{rank}", rank, 2,
                         quorum_id=quorum, group_rank=0, group_world_size=1, global_ranks=[0, 1])
            assert pg.errored() is None and pg.size() == 2
            for n in (16, 1 << 16):
                for _ in range(20):
                    t = _values(rank, n, quorum)
                    opts = AllreduceOptions()
                    opts.reduceOp = ReduceOp.SUM
                    work = pg.allreduce([t], opts)
                    work.wait()
                    # torchft chains its callbacks on the Future right after wait()
                    assert work.get_future().done(), "the Future is not done when wait() returned"
                    expected = _values(0, n, quorum) + _values(1, n, quorum)
                    assert torch.equal(t, expected), f"quorum {quorum}: all_reduce of {n} differs"
        # abort with an op pending (rank 1 never joins it): bounded, the op fails, errored() says so
        if rank == 0:
            pending = pg.allreduce([torch.ones(8)], AllreduceOptions())
            time.sleep(0.5)
            started = time.monotonic()
            pg.abort()
            result["abort_s"] = time.monotonic() - started
            with pytest.raises(Exception):
                pending.wait()
            assert isinstance(pg.errored(), RuntimeError)
        # the next quorum's group works after the abort (rank 1 leaves its group by configure)
        pg.configure(f"127.0.0.1:{port}/torchft/4/0", f"replica_{rank}", rank, 2, quorum_id=4)
        assert pg.errored() is None
        t = _values(rank, 1024, 4)
        pg.allreduce([t], AllreduceOptions()).wait()
        assert torch.equal(t, _values(0, 1024, 4) + _values(1, 1024, 4))
        pg.shutdown()
        pg.shutdown()  # idempotent

    report_rank(out_dir, rank, body)


@pytest.mark.timeout(180)
def test_a_group_per_quorum_exact_and_abort_bounded(tmp_path):
    results = run_rank_job(tmp_path, _quorum_job, 2, (), job_timeout_s=150)
    assert results[0]["abort_s"] < ABORT_BOUND_S, results[0]


def test_bad_arguments_are_named():
    from torch_reccl.integrations.torchft import ProcessGroupReccl

    with pytest.raises(ValueError, match="timeout=0 is not valid"):
        ProcessGroupReccl(timeout=0)
    with pytest.raises(ValueError, match="timeout=.* it must be positive"):
        ProcessGroupReccl(timeout=datetime.timedelta(seconds=-1))
    with pytest.raises(ValueError, match="options=.* expected a torch_reccl.backend.Options"):
        ProcessGroupReccl(options={"channels": 2})
    assert ProcessGroupReccl(timeout=5.0)._timeout == datetime.timedelta(seconds=5)


def _mode():
    from torch_reccl.fabric.fabric import is_root

    try:
        import pyroute2  # noqa: F401
    except ImportError:
        return "inject"
    return "fabric" if is_root() else "inject"


@pytest.mark.timeout(240)
def test_reccl_under_torchft_nic_lost_and_replica_killed():
    from torch_reccl.bench import torchft_compare

    mode = _mode()
    nic = torchft_compare.run("reccl", "nic", mode=mode, steps=200, fault_step=30, timeout_s=30,
                              run_timeout_s=150)
    assert nic.finished and nic.fault_applied, nic
    assert nic.quorum_changes == 0, nic
    assert nic.missed == {0: 0, 1: 0} and nic.failed == {0: 0, 1: 0}, nic
    assert nic.errors == {} and nic.restarts == 0, nic
    assert nic.failovers >= 1, nic               # reccl moved the connections off the lost NIC
    assert nic.recovery_s is not None and nic.params_equal is True, nic

    kill = torchft_compare.run("reccl", "kill", mode=mode, steps=300, fault_step=30, timeout_s=30,
                               run_timeout_s=180)
    assert kill.finished and kill.fault_applied, kill
    assert kill.quorum_changes >= 1, kill          # without replica 1, then with it again
    assert kill.missed[0] == 0 and kill.missed[1] > 0, kill
    assert kill.restarts == 0, kill                # no replica died but the one killed
    assert kill.recovery_s is not None, kill       # it rejoined and healed before the end
    assert kill.params_equal is True, kill
