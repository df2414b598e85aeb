"""libnccl-net-reccl.so, the library NCCL loads (issue 17): standalone (no torch,
no Python), loaded by a plain C program exactly as NCCL loads it, one copy in a
process that also imports torch_reccl, and free of emulations and test hooks,
which live in the test module torch_reccl._testing."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

import torch_reccl
from torch_reccl._native import native

from conftest import HELPERS, REPO

LIBRARY = torch_reccl.plugin_path()
RUNTIME = {"libstdc++.so.6", "libgcc_s.so.1", "libc.so.6", "libm.so.6",
           "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"}
VERSIONS = (12, 11, 10, 8)
LOOPBACK = {"RECCL_NICS": "127.0.0.1,127.0.0.2", "RECCL_TRANSPORT": "tcp", "RECCL_HEARTBEAT_MS": "300"}


def dynamic_section(path: str) -> str:
    return subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True,
                          timeout=30).stdout


def needed(path: str) -> set:
    return {line.split("[")[1].rstrip("]") for line in dynamic_section(path).splitlines()
            if "(NEEDED)" in line}


def defined_symbols(path: str) -> str:
    """Demangled names of the dynamic symbols `path` defines."""
    return subprocess.run(["nm", "-DC", "--defined-only", path], capture_output=True, text=True,
                          check=True, timeout=60).stdout


def test_plugin_path_is_the_standalone_library():
    assert os.path.isabs(LIBRARY) and os.path.basename(LIBRARY) == "libnccl-net-reccl.so"
    out = subprocess.run([sys.executable, "-m", "torch_reccl", "--plugin-path"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == LIBRARY and os.path.isfile(LIBRARY)


def sanitizer_runtimes(names):
    """The sanitizers' runtimes among `names`: a build of scripts/sanitize.sh
    (which sets TORCH_RECCL_SANITIZE for its tests) needs them too; no other."""
    if not os.environ.get("TORCH_RECCL_SANITIZE"):
        return set()
    return {name for name in names if name.startswith(("libasan.", "libubsan.", "libtsan."))}


def test_the_library_needs_only_the_c_and_cxx_runtimes():
    section = dynamic_section(LIBRARY)
    libraries = needed(LIBRARY)
    assert libraries - sanitizer_runtimes(libraries) <= RUNTIME, libraries
    assert "Library soname: [libnccl-net-reccl.so]" in section
    assert "NODELETE" in section  # NCCL dlclose()s it while its threads still run


def test_the_extension_links_the_library_instead_of_a_copy_of_it():
    extension = native().__file__
    assert "libnccl-net-reccl.so" in needed(extension)
    assert "$ORIGIN" in dynamic_section(extension)
    assert "reccl::NicHealth::instance()" in defined_symbols(LIBRARY)
    assert "reccl::NicHealth" not in defined_symbols(extension)  # one health table: the library's


def test_emulations_and_their_hooks_are_only_in_the_test_module():
    testing = importlib.util.find_spec("torch_reccl._testing").origin
    for path in (LIBRARY, native().__file__):
        symbols = defined_symbols(path)
        assert "VerbsEmulation" not in symbols and "CudaEmulation" not in symbols, path
    assert "VerbsEmulation" in defined_symbols(testing) and "CudaEmulation" in defined_symbols(testing)
    for name in ("IbEmulation", "CudaEmulation", "nccl_plugin_use_verbs", "nccl_plugin_use_cuda"):
        assert not hasattr(native(), name), name
    # The process groups' executor (and its test-only idle period setter) is
    # engine code: not in what NCCL loads.
    assert "reccl::Executor" not in defined_symbols(LIBRARY)


@pytest.fixture(scope="module")
def plugin_program(tmp_path_factory):
    """tests/helpers/c/plugin_dlopen.c, compiled against our ABI header only (no reccl library)."""
    binary = str(tmp_path_factory.mktemp("c") / "plugin_dlopen")
    subprocess.run(["gcc", "-std=c11", "-O1", "-Wall", "-Wextra", "-Werror",
                    "-I", os.path.join(REPO, "csrc"), os.path.join(HELPERS, "c", "plugin_dlopen.c"),
                    "-o", binary, "-ldl", "-pthread"], check=True, timeout=120)
    assert "libnccl-net-reccl.so" not in needed(binary)
    return binary


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["path", "name"])
def test_a_c_program_loads_and_drives_every_abi_version_like_nccl(plugin_program, how, tmp_path):
    # A clean environment: nothing of torch or Python on the library path (but
    # the sanitizer's runtime, preloaded, under scripts/sanitize.sh).
    env = {"PATH": "/usr/bin:/bin", **LOOPBACK}
    if os.environ.get("TORCH_RECCL_SANITIZE"):
        env.update({k: v for k, v in os.environ.items() if k == "LD_PRELOAD" or k.endswith("SAN_OPTIONS")})
    if how == "path":
        target = LIBRARY  # NCCL_NET_PLUGIN=/abs/path/libnccl-net-reccl.so
    else:
        target = "libnccl-net-reccl.so"  # NCCL_NET_PLUGIN=reccl, found on LD_LIBRARY_PATH
        env["LD_LIBRARY_PATH"] = os.path.dirname(LIBRARY)
    out = subprocess.run([plugin_program, target], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=200)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "PASS"
    for version in VERSIONS:
        assert f"v{version}: ReCCL, 2 devices" in lines
        assert f"v{version}: 6 messages on each of 2 devices intact" in lines
    assert "failover net plugin over tcp using lo:127.0.0.1" in out.stderr  # init logged through the logger


def test_the_c_program_fails_on_a_library_without_the_tables(plugin_program, tmp_path):
    # The program really checks: libc exports no ncclNetPlugin_v* tables.
    out = subprocess.run([plugin_program, "libc.so.6"], env={"PATH": "/usr/bin:/bin", **LOOPBACK},
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    for version in VERSIONS:
        assert f"ncclNetPlugin_v{version} not exported" in out.stderr


def run_one_copy_case(order: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECCL_")}
    env.update(LOOPBACK)
    env["PYTHONPATH"] = os.pathsep.join([HELPERS, REPO, env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, os.path.join(HELPERS, "plugin_one_copy_case.py"), order],
                         env=env, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("order", ["plugin-first", "python-first"])
def test_one_nic_health_table_whichever_loaded_the_library_first(order):
    report = run_one_copy_case(order)
    count = 18
    assert report["first"] == {"errors": [], "intact": count}
    if order == "plugin-first":
        # NCCL's way in: the plugin ran before torch or torch_reccl._C existed here.
        assert report["torch_mapped_before_import"] == []
    # The Python API sees the NICs and the bytes of the plugin's connection...
    assert {"lo:127.0.0.1", "lo:127.0.0.2"} <= set(report["nics_seen_by_python"])
    assert report["bytes_before"]["lo:127.0.0.1"] >= report["sent_per_exchange"]
    # ...and a fault injected through it steers the plugin's traffic.
    assert report["second"] == {"errors": [], "intact": count}
    assert report["nic0_up_after"] is False
    moved = {nic: report["bytes_after"][nic] - report["bytes_before"][nic] for nic in report["bytes_after"]}
    assert moved["lo:127.0.0.1"] == 0 and moved["lo:127.0.0.2"] >= report["sent_per_exchange"], moved
    assert ["nic_down", "lo:127.0.0.1", "injected"] in report["events"]
    assert len(report["library_copies"]) == 1 and report["library_copies"][0].endswith("libnccl-net-reccl.so")
