"""import torch_reccl points NCCL at our plugin (issue: zero-code failover for NCCL)."""
import os
import subprocess
import sys

import pytest

import torch_reccl

CHECK = ("import os, sys, torch_reccl; print(os.environ.get('NCCL_NET_PLUGIN')); "
         "print('torch' in sys.modules)")


def run(env_extra, code=CHECK):
    env = {k: v for k, v in os.environ.items() if k != "NCCL_NET_PLUGIN"}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-W", "always", "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.timeout(60)
def test_import_sets_the_plugin_path_without_importing_torch():
    out = run({})
    assert out.returncode == 0, out.stderr
    plugin, torch_loaded = out.stdout.split()
    assert plugin == torch_reccl.plugin_path() and os.path.exists(plugin)
    assert torch_loaded == "False"
    assert "NCCL_NET_PLUGIN" not in out.stderr


@pytest.mark.timeout(60)
def test_a_foreign_plugin_is_kept_with_a_warning():
    out = run({"NCCL_NET_PLUGIN": "/opt/other/libnccl-net.so"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "/opt/other/libnccl-net.so"
    assert "will not fail over" in out.stderr


@pytest.mark.timeout(60)
def test_our_plugin_set_by_the_user_is_quiet():
    out = run({"NCCL_NET_PLUGIN": torch_reccl.plugin_path()})
    assert out.returncode == 0 and "will not fail over" not in out.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["reccl", "libnccl-net-reccl.so"])
def test_our_plugin_by_name_is_quiet(name):
    # NCCL turns "reccl" into libnccl-net-reccl.so and dlopen() by that name finds
    # the copy torch_reccl._C loaded.
    out = run({"NCCL_NET_PLUGIN": name})
    assert out.returncode == 0 and out.stdout.split()[0] == name
    assert "will not fail over" not in out.stderr


@pytest.mark.timeout(60)
def test_importing_torch_loads_the_library_before_nccl_could():
    code = ("import sys, torch_reccl, torch; "
            "print('torch_reccl._C' in sys.modules)")
    out = run({}, code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
