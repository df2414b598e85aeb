"""Points NCCL at our net plugin, so CUDA traffic gets failover too.

Called by ``import torch_reccl``: sets ``NCCL_NET_PLUGIN`` to the absolute path
of ``libnccl-net-reccl.so`` unless the user set it (then warns if it is not ours:
our path, or ``reccl`` / ``libnccl-net-reccl.so``, which NCCL resolves to the
copy ``torch_reccl._C`` already loaded), and
warns when an NCCL process group already exists (NCCL read its plugin then; that
group has no failover). Cheap: it neither imports torch nor loads the library.
"""
from __future__ import annotations

import os
import sys
import warnings

from torch_reccl._native import PLUGIN_LIBRARY, plugin_path

# NCCL_NET_PLUGIN values NCCL turns into our library by name ("reccl" becomes
# "libnccl-net-reccl.so"); once torch_reccl._C is loaded, dlopen() by that name
# returns the loaded copy.
OUR_NAMES = ("reccl", PLUGIN_LIBRARY)


def point_nccl_at_plugin() -> None:
    try:
        ours = plugin_path()
    except ImportError as error:
        warnings.warn(f"torch_reccl: NCCL traffic will not fail over ({error})", stacklevel=3)
        return
    current = os.environ.get("NCCL_NET_PLUGIN")
    if current is None:
        os.environ["NCCL_NET_PLUGIN"] = ours
    elif current not in OUR_NAMES and os.path.realpath(current) != ours:
        warnings.warn(
            f"NCCL_NET_PLUGIN={current} is not torch_reccl's plugin ({ours}); NCCL traffic "
            "will not fail over. Unset it, or set it to the output of "
            "`python -m torch_reccl --plugin-path`.",
            stacklevel=3,
        )
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        if "nccl" in str(dist.get_backend()).lower():
            warnings.warn(
                "an NCCL process group already exists; NCCL loaded its network plugin before "
                "torch_reccl was imported, so that group has no NIC failover. Import "
                "torch_reccl before init_process_group.",
                stacklevel=3,
            )
