"""GPU check of the standalone plugin in a program with no torch and no Python: a
plain C NCCL all_reduce (tests/gpu/nccl_allreduce.c), two ranks that look like two
hosts (``two_host_env``; with one GPU they share it), loads the library that
``python -m torch_reccl --plugin-path`` names through ``NCCL_NET_PLUGIN``. NCCL's
log must say it uses the ReCCL network, every element must be exact, and neither
rank may have libtorch, libc10 or libpython mapped. This is what nccl-tests or a
JAX job would do with the plugin (docs/nccl_plugin.md).

Compiled here with gcc against the CUDA toolkit's headers and the NCCL that torch
ships (or the system's): skipped with the reason where either is missing.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from conftest import needs_gpus, two_host_env

pytestmark = needs_gpus(1)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
JOB_TIMEOUT_S = 180
COUNT = 16 << 20  # floats: 64 MiB
ITERS = 8


def _nccl_dirs():
    """(include dir, lib dir) of an NCCL with both nccl.h and libnccl.so.2."""
    candidates = []
    try:
        import nvidia.nccl  # torch's pip dependency

        candidates += [os.path.join(path, "") for path in nvidia.nccl.__path__]
    except ImportError:
        pass
    candidates += ["/usr/", "/usr/local/"]
    for root in candidates:
        include = os.path.join(root, "include")
        for lib in (os.path.join(root, "lib"), os.path.join(root, "lib", "x86_64-linux-gnu"),
                    "/usr/lib/x86_64-linux-gnu"):
            if os.path.isfile(os.path.join(include, "nccl.h")) and glob.glob(os.path.join(lib, "libnccl.so.2*")):
                return include, lib
    return None


def _cuda_root():
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")):
            return root
    return None


def _build(tmp_path) -> str:
    nccl, cuda, gcc = _nccl_dirs(), _cuda_root(), shutil.which("gcc")
    if nccl is None or cuda is None or gcc is None:
        pytest.skip(f"needs gcc, the CUDA toolkit's headers and NCCL's nccl.h with libnccl.so.2 "
                    f"(gcc {gcc}, CUDA {cuda}, NCCL {nccl})")
    include, lib = nccl
    exe = str(tmp_path / "nccl_allreduce")
    cuda_lib = os.path.join(cuda, "lib64")
    subprocess.run([gcc, "-O2", "-Wall", "-o", exe, os.path.join(HERE, "nccl_allreduce.c"),
                    f"-I{include}", f"-I{os.path.join(cuda, 'include')}", f"-L{lib}", f"-L{cuda_lib}",
                    "-l:libnccl.so.2", "-lcudart", f"-Wl,-rpath,{lib}", f"-Wl,-rpath,{cuda_lib}"],
                   check=True, timeout=120)
    return exe


@pytest.mark.timeout(JOB_TIMEOUT_S + 180)
def test_c_nccl_program_runs_over_the_standalone_plugin(tmp_path):
    exe = _build(tmp_path)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    plugin = subprocess.run([sys.executable, "-m", "torch_reccl", "--plugin-path"], check=True,
                            capture_output=True, text=True, env=env, timeout=60).stdout.strip()
    assert os.path.isfile(plugin), plugin
    # Nothing of torch's or Python's on the program's library path.
    base = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONPATH")}
    logs = [tmp_path / f"rank{rank}.log" for rank in range(2)]
    procs = []
    for rank in range(2):
        rank_env = {**base, **two_host_env(rank, "c-nccl"), "NCCL_NET_PLUGIN": plugin, "NCCL_NET": "ReCCL",
                    "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
        with open(logs[rank], "w") as log:  # a file, not a pipe: NCCL's INFO log can fill a pipe
            procs.append(subprocess.Popen([exe, str(rank), str(tmp_path / "nccl.id"), str(COUNT), str(ITERS)],
                                          env=rank_env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + JOB_TIMEOUT_S
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("the C NCCL job did not finish in time:\n" + logs[0].read_text()[-3000:])
    for rank, (p, log) in enumerate(zip(procs, logs)):
        text = log.read_text()
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{text[-3000:]}"
        result = re.search(r"RESULT-OK rank=(\d) busbw_GBps=([\d.]+) foreign=(\S+)", text)
        assert result, text[-3000:]
        assert result.group(3) == "none", f"rank {rank} mapped {result.group(3)}"
        uses = "Using network ReCCL" in text or "NET/ReCCL" in text
        assert uses, "NCCL did not use the ReCCL network:\n" + text[-3000:]
        print(f"rank {rank}: 64 MiB all_reduce busbw {float(result.group(2)):.2f} GB/s through {plugin}")
