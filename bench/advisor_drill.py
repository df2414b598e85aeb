"""The advisor acting end to end in the emulated fabric: degraded, checkpoint, exit, torchrun restart.

The runs, their options and what they report: torch_reccl/bench/advisor_drill.py
(``--help`` prints it). Needs root (network namespaces).

    python bench/advisor_drill.py [--steps 500] [--fault-step 80] [--checkpoint-every 50]
                                  [--restart-on same|spare] [--repair-s 1e9]
                                  [--rules advised restart run_degraded] [--json PATH]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: torch_reccl
from torch_reccl.bench.advisor_drill import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
