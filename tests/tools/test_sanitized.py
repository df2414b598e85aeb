"""The C++-heavy tests under AddressSanitizer and UndefinedBehaviorSanitizer.

scripts/sanitize.sh builds the native parts instrumented (TORCH_RECCL_SANITIZE)
in its own copy of the tree, build/sanitize/address, runs the given tests there
with the runtime preloaded into Python, and fails on any report of any process
(docs/sanitizers.md). Here it runs SANITIZED: the core's tests (wire fuzzing
included), the transport contract over TCP and the IB emulation, the failback
regression ASan found, and the engine's executor: the native code's busiest
paths, sized to CI's time (the build is most of it). A
second check proves a report fails the script: a use after free made from
Python through libc, which ASan's interceptors see without instrumented code.
"""
from __future__ import annotations

import os
import subprocess
import textwrap

import pytest

from conftest import REPO

SANITIZED = [
    "tests/core",
    "tests/transport/test_transport_contract.py",
    "tests/transport/test_transport.py::test_failback_leaves_no_half_written_frame_reading_a_completed_send",
    "tests/engine/test_executor.py",
]
BUILD_AND_RUN_S = 1500


def sanitize(*args, timeout=BUILD_AND_RUN_S):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS")}
    done = subprocess.run(["bash", os.path.join(REPO, "scripts", "sanitize.sh"), "address", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.timeout(BUILD_AND_RUN_S + 60)
def test_cpp_heavy_tests_pass_under_asan_and_ubsan():
    status, output = sanitize(*SANITIZED)
    assert status == 0, output[-20000:]
    assert "no sanitizer reports (address)" in output, output[-5000:]


@pytest.mark.timeout(BUILD_AND_RUN_S + 60)
def test_a_sanitizer_report_fails_the_run(tmp_path):
    """Runs after the build above (or builds it): a test file that frees a block
    and then writes it through libc's memset."""
    case = tmp_path / "test_use_after_free.py"
    case.write_text(textwrap.dedent("""
        import ctypes

        def test_use_after_free():
            libc = ctypes.CDLL(None)
            libc.malloc.restype = ctypes.c_void_p
            libc.free.argtypes = [ctypes.c_void_p]
            block = libc.malloc(64)
            libc.free(block)
            ctypes.memset(block, 0, 64)
    """))
    status, output = sanitize(str(case))
    assert status != 0, output[-5000:]
    assert "heap-use-after-free" in output, output[-5000:]
    assert "sanitizer findings: FAILED" in output, output[-5000:]
