"""torch_reccl.bench.fabric_train with the outage's events: one rank of the same
training run, which also records every `stalled`, `recovered` and
`connection_failed` event it sees and, after fabric_train's result line,
prints one more JSON line: {"events": [...], "stalls": stats()["stalls"]}.
Run inside an emulated host's netns by tests/fabric/test_outage_fabric.py and
bench/outage_fabric.py: python -m torch_reccl.bench.outage_train --rank R ..."""
from __future__ import annotations

import json
import sys

KINDS = ("stalled", "recovered", "connection_failed")


def main() -> int:
    import torch_reccl

    events = []
    torch_reccl.on_event(lambda e: events.append(e.to_dict()), kinds=KINDS)
    from torch_reccl.bench import fabric_train

    code = fabric_train.main()
    print(json.dumps({"events": events, "stalls": torch_reccl.stats()["stalls"]}), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
