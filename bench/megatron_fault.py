"""Megatron-LM through a NIC failure: the loss of every iteration against a fault-free run.

The runs, their options and what they compare: torch_reccl/bench/megatron_fault.py.

    python bench/megatron_fault.py --megatron-dir .vendor/megatron --json megatron_fault.json
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: torch_reccl
from torch_reccl.bench.megatron_fault import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
