"""torch_reccl: keep torch.distributed training alive through last-hop network faults.

Importing the package is cheap: the C++ extension is loaded on first use of an
API that needs it.
"""
from __future__ import annotations

__version__ = "0.1.0"

# Registers the "reccl" torch.distributed backend: at once when torch is already
# imported, otherwise from a one-shot import hook the moment torch.distributed
# loads (before any init_process_group can run). So importing torch_reccl stays
# cheap (torch_reccl.sim, the CLI and spawned test peers never load torch).
from torch_reccl import backend  # noqa: E402,F401
from torch_reccl._native import inject_fault, nics, plugin_path, stats  # noqa: E402
from torch_reccl.backend import monitored_barrier  # noqa: E402
from torch_reccl.events import flush_events, on_event  # noqa: E402
from torch_reccl.gpu_topo import export_nvlink_peers  # noqa: E402
from torch_reccl.nccl_setup import point_nccl_at_plugin  # noqa: E402

point_nccl_at_plugin()
# RECCL_NVL=on: NVL's transit GPUs are NVML's NVLink peers (pynvml, where present)
export_nvlink_peers()

__all__ = ["nics", "stats", "inject_fault", "on_event", "flush_events", "plugin_path",
           "monitored_barrier", "__version__"]
