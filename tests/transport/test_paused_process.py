"""A process that did not run for longer than the heartbeat (stopped, descheduled,
a paused VM) does not take its own absence for its peers' silence: on waking, a
late heartbeat check fails the path only after a whole heartbeat of silence that
it watched (transport/tcp/tcp_path.cc, controlTimer). Both ends of the connection
live in one child process, which the test stops with SIGSTOP and resumes: nobody
was silent but the process itself."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

HEARTBEAT_MS = 300
CHILD = textwrap.dedent(f"""
    import json, sys, time
    from torch_reccl.events import on_event
    from torch_reccl.transport import Transport
    t = Transport({{"RECCL_NICS": "127.0.0.1,127.0.0.2", "RECCL_HEARTBEAT_MS": "{HEARTBEAT_MS}"}})
    failovers = []
    on_event(lambda e: failovers.append(e.reason), kinds=["failover"])
    listener = t.listen(0)
    send = t.connect(0, listener.handle); send.wait_ready(10)
    recv = listener.accept(10)

    def exchange(n):
        buf = bytearray(n)
        r = recv.irecv(buf)
        send.isend(bytes(range(256)) * (n // 256)).wait(10)
        r.wait(10)
        return buf == bytes(range(256)) * (n // 256)

    assert exchange(1 << 16)
    print("ready", flush=True)
    sys.stdin.readline()  # the parent stops us, waits, resumes us, then says go
    time.sleep(3 * {HEARTBEAT_MS} / 1000)  # past the grace (one heartbeat): a failover would have come
    ok = exchange(1 << 16)
    time.sleep(0.2)  # events are delivered on a background thread
    print(json.dumps({{"ok": ok, "failovers": failovers}}), flush=True)
""")


@pytest.mark.timeout(60)
def test_a_stopped_process_does_not_fail_over_on_waking():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(4 * HEARTBEAT_MS / 1000)  # well past the heartbeat: its checks are all due on waking
        os.kill(child.pid, signal.SIGCONT)
        child.stdin.write("go\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["ok"]
    assert report["failovers"] == [], report
