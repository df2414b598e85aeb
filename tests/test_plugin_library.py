"""libnccl-net-reccl.so, the library NCCL loads (issue 17): standalone (no torch,
no Python), one copy in a process that also imports torch_reccl, and free of
emulations and test hooks, which live in the test module torch_reccl._testing."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

import torch_reccl
from torch_reccl._native import native

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LIBRARY = torch_reccl.plugin_path()
RUNTIME = {"libstdc++.so.6", "libgcc_s.so.1", "libc.so.6", "libm.so.6",
           "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"}
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


def test_the_library_needs_only_the_c_and_cxx_runtimes():
    section = dynamic_section(LIBRARY)
    assert needed(LIBRARY) <= RUNTIME, needed(LIBRARY)
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


def run_one_copy_case(order: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECCL_")}
    env.update(LOOPBACK)
    env["PYTHONPATH"] = os.pathsep.join([HERE, ROOT, env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, os.path.join(HERE, "plugin_one_copy_case.py"), order],
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
