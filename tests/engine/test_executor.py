"""The process-wide executor (csrc/engine/executor.h) and what runs on it: the op
queues of process groups (pg/op_queue.h) and the channel jobs of collectives
(engine/worker_pool.h), driven here with Python callables as jobs through _C's
test hooks. Threads per rank must follow the work in flight, not the number of
groups: a queue with nothing to do costs no thread, idle threads retire, and
there is no cap that could deadlock groups waiting on each other.
"""
from __future__ import annotations

import os
import threading
import time

import pytest

from torch_reccl.transport import _C, RecclError, Transport

from conftest import close_both, reccl_env, wait_until

pytestmark = pytest.mark.timeout(60)


def threads_named(name: str) -> int:
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().strip() == name
        except OSError:  # exited meanwhile
            continue
    return count


def workers() -> int:
    return threads_named("reccl-worker")


RETIREMENT_S = 1.5  # shorter than the default, to show that the period applies


@pytest.fixture
def quick_retirement():
    previous = _C.set_executor_idle_retirement(RETIREMENT_S)
    yield
    _C.set_executor_idle_retirement(previous)


# --------------------------------------------------------------------------- op queues


def test_jobs_of_a_queue_run_in_order_and_never_concurrently():
    queues = [_C.OpQueue() for _ in range(4)]
    ran = [[] for _ in queues]
    active = [0] * len(queues)
    overlaps = []
    lock = threading.Lock()

    def job(q, n):
        def run():
            with lock:
                active[q] += 1
                if active[q] > 1:
                    overlaps.append((q, n))
            time.sleep(0.001)  # lets the other queues' jobs (and a wrongly parallel one) run
            with lock:
                active[q] -= 1
                ran[q].append(n)
        return run

    for n in range(50):
        for q, queue in enumerate(queues):
            queue.push(job(q, n))
    for queue in queues:
        assert queue.drain(20)
    assert not overlaps, f"jobs of one queue overlapped: {overlaps[:5]}"
    for q in range(len(queues)):
        assert ran[q] == list(range(50)), f"queue {q} ran {ran[q]}"


def test_queues_whose_jobs_wait_on_each_other_both_finish():
    first, second = _C.OpQueue(), _C.OpQueue()
    first_ran, second_ran = threading.Event(), threading.Event()
    saw = {}

    def in_first():
        first_ran.set()
        saw["first saw second"] = second_ran.wait(10)

    def in_second():
        second_ran.set()
        saw["second saw first"] = first_ran.wait(10)

    first.push(in_first)
    second.push(in_second)
    assert first.drain(20) and second.drain(20)
    assert saw == {"first saw second": True, "second saw first": True}


def test_no_cap_on_threads_when_many_groups_block_at_once():
    barrier = threading.Barrier(24, timeout=10)  # passes only when all 24 jobs run at once
    passed = []

    def job():
        barrier.wait()
        passed.append(True)

    queues = [_C.OpQueue() for _ in range(24)]
    for queue in queues:
        queue.push(job)
    for queue in queues:
        assert queue.drain(20)
    assert len(passed) == 24, f"only {len(passed)} of 24 blocked jobs ran at once"


def test_stop_cancels_the_jobs_not_started_and_waits_for_the_running_one():
    queue = _C.OpQueue()
    started, release = threading.Event(), threading.Event()
    log = []

    def running():
        started.set()
        release.wait(10)
        log.append("running job finished")

    queue.push(running)
    for n in (2, 3):
        queue.push(lambda n=n: log.append(f"job {n} ran"),
                   lambda why, n=n: log.append(f"job {n} cancelled: {why}"))
    assert started.wait(5)

    def stop():
        queue.stop("the test stopped it")
        log.append("stop returned")

    stopper = threading.Thread(target=stop, daemon=True)
    stopper.start()
    assert wait_until(lambda: len(log) >= 2, 5), log
    time.sleep(0.1)
    assert stopper.is_alive(), "stop() returned before the running job finished"
    assert log == ["job 2 cancelled: the test stopped it", "job 3 cancelled: the test stopped it"]
    release.set()
    stopper.join(5)
    assert log[2:] == ["running job finished", "stop returned"]
    with pytest.raises(RecclError, match="shut down"):
        queue.push(lambda: None)
    queue.stop("again")  # idempotent


@pytest.mark.parametrize("how", ["close", "last reference"])
def test_a_queue_destroyed_from_its_own_job(how):
    holder = [_C.OpQueue()]
    pushed, finished = threading.Event(), threading.Event()
    log = []

    def destroy_queue():
        assert pushed.wait(5)
        if how == "close":
            holder[0].close()
        else:
            holder.pop()  # the last reference: the queue dies while this job runs
        log.append("its job carried on")
        finished.set()

    holder[0].push(destroy_queue)
    holder[0].push(lambda: log.append("next job ran"), lambda why: log.append(f"next job cancelled: {why}"))
    pushed.set()
    assert finished.wait(5)
    assert log == ["next job cancelled: process group destroyed", "its job carried on"]
    # The executor still serves other queues.
    after = _C.OpQueue()
    after.push(lambda: log.append("another queue ran"))
    assert after.drain(5)
    assert log[-1] == "another queue ran"


# --------------------------------------------------------------------------- executor threads


def test_idle_workers_retire(quick_retirement):
    assert wait_until(lambda: workers() == 0, 5), f"{workers()} workers of earlier tests still idle"
    barrier = threading.Barrier(6, timeout=10)
    passed_at = []

    def job():
        barrier.wait()
        passed_at.append(time.monotonic())

    queues = [_C.OpQueue() for _ in range(6)]
    for queue in queues:
        queue.push(job)
    for queue in queues:
        assert queue.drain(20)
    assert len(passed_at) == 6
    assert workers() >= 6, "the blocked jobs did not run on reccl-worker threads"
    assert wait_until(lambda: workers() == 0, 6), f"{workers()} idle workers did not retire"
    # Each went idle after its job passed the barrier: none may retire sooner after it.
    assert time.monotonic() - max(passed_at) > RETIREMENT_S - 0.1, "workers retired before their idle period"


def test_an_idle_worker_is_reused():
    queue = _C.OpQueue()
    ran_on = set()
    for _ in range(20):
        queue.push(lambda: ran_on.add(threading.get_ident()))
        assert queue.drain(5)
        time.sleep(0.05)  # the worker parks before the next push (on a loaded machine, most times)
    assert len(ran_on) <= 5, f"20 jobs in a row ran on {len(ran_on)} threads"


def test_a_forked_child_starts_its_own_workers():
    queue = _C.OpQueue()
    queue.push(lambda: None)
    assert queue.drain(5)
    time.sleep(0.2)  # its worker parks: the parent has an idle worker, which a child does not inherit
    pid = os.fork()
    if pid == 0:  # the child: exits 0 only when its job ran
        ok = False
        try:
            ran = []
            child_queue = _C.OpQueue()
            child_queue.push(lambda: ran.append(True))
            ok = child_queue.drain(5) and ran == [True]
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child's job did not run"


# --------------------------------------------------------------------------- worker pools


def test_worker_pool_runs_jobs_together_and_the_first_on_the_caller():
    barrier = threading.Barrier(4, timeout=10)
    ran_on = [None] * 4

    def job(i):
        def run():
            ran_on[i] = threading.get_ident()
            barrier.wait()
        return run

    _C.worker_pool_run_all([job(i) for i in range(4)], lambda: None)
    assert ran_on[0] == threading.get_ident()
    assert len(set(ran_on)) == 4


def test_worker_pool_stops_once_and_reports_the_first_real_error():
    stopped = threading.Event()
    on_error_calls = []

    def on_error():
        on_error_calls.append(threading.get_ident())
        stopped.set()

    def stopped_by_the_others():
        assert stopped.wait(10)
        raise RuntimeError("aborted: another channel failed")

    def fails_first():
        raise RuntimeError("aborted: the op was stopped")

    def fails_for_real():
        assert stopped.wait(10)
        raise RuntimeError("channel 2 lost its peer")

    with pytest.raises(RecclError, match="channel 2 lost its peer"):
        _C.worker_pool_run_all([stopped_by_the_others, fails_first, fails_for_real], on_error)
    assert len(on_error_calls) == 1


# --------------------------------------------------------------------------- thread names


def test_transport_threads_are_named():
    t = Transport(reccl_env())
    listener = t.listen(0)
    send = t.connect(0, listener.handle)
    send.wait_ready(10)
    recv = listener.accept(10)
    try:
        for name in ("reccl-accept", "reccl-supervise", "reccl-io"):
            assert threads_named(name) > 0, f"no thread named {name}"
    finally:
        close_both(send, recv)
        listener.close()
