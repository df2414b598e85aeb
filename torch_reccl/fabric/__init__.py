"""Emulated rail-optimized fabric (network namespaces, veths, bridges) for
failover tests; see docs/fabric.md and docs/design.md §11.

Importing this package needs neither root nor pyroute2; building a fabric
needs both.
"""
from torch_reccl.fabric.fabric import (  # noqa: F401
    Fabric,
    FabricError,
    FlapHandle,
    list_fabrics,
    require_root,
)

__all__ = ["Fabric", "FabricError", "FlapHandle", "list_fabrics", "require_root"]
