"""The GPU-hour simulator, ``reccl sim`` (see :mod:`torch_reccl.sim.simulator`, docs/simulation.md).

It applies the restart-or-failover rule of :mod:`torch_reccl.advisor` to thousands of
simulated runs at once. Needs numpy; never loads torch or the C++ extension.
"""
from torch_reccl.sim.simulator import AnalyticPoint, SimParams, SimResult, analytic, simulate  # noqa: F401

__all__ = ["AnalyticPoint", "SimParams", "SimResult", "analytic", "simulate"]
