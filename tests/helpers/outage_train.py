"""tests/helpers/fabric_train.py with the outage's events: one rank of the same
training run, which also records every `stalled`, `recovered` and
`connection_failed` event it sees and, after fabric_train.py's result line,
prints one more JSON line: {"events": [...], "stalls": stats()["stalls"]}.
Run inside an emulated host's netns by tests/fabric/test_outage_fabric.py and
bench/outage_fabric.py."""
from __future__ import annotations

import json
import os
import sys

HELPERS = os.path.dirname(os.path.abspath(__file__))
KINDS = ("stalled", "recovered", "connection_failed")


def main() -> int:
    import torch_reccl

    events = []
    torch_reccl.on_event(lambda e: events.append(e.to_dict()), kinds=KINDS)
    sys.path.insert(0, HELPERS)
    import fabric_train

    code = fabric_train.main()
    print(json.dumps({"events": events, "stalls": torch_reccl.stats()["stalls"]}), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
