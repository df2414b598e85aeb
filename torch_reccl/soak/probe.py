"""The machine's own scheduling gaps during a soak, beside which its failover
interruptions are read.

A process asks to wake every PERIOD_S and records how late each wake-up came: on a
busy 2-core machine a thread that is ready can wait several milliseconds for a core,
and no failover can be shorter than the delay its threads wait to run. The lateness
goes into a histogram of BUCKET_S buckets (bounded memory for any duration); the
runner starts the probe with the job and reads its histogram at the end.

    python -m torch_reccl.soak.probe --out FILE --max-s SECONDS

writes the histogram on SIGTERM or after --max-s, whichever comes first.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import List, Optional

PERIOD_S = 0.005
BUCKET_S = 0.0001
BUCKETS = 2000  # 0..200 ms in 0.1 ms steps; later wake-ups count in the last one, and in max_ms


class LatenessHistogram:
    def __init__(self) -> None:
        self.counts: List[int] = [0] * BUCKETS
        self.max_s = 0.0

    def add(self, late_s: float) -> None:
        late_s = max(0.0, late_s)
        self.counts[min(BUCKETS - 1, int(late_s / BUCKET_S))] += 1
        self.max_s = max(self.max_s, late_s)

    def to_json(self) -> dict:
        return {"bucket_ms": BUCKET_S * 1e3, "counts": self.counts, "max_ms": self.max_s * 1e3}


def summarize(histogram: Optional[dict]) -> dict:
    """count, p50_ms, p99_ms and max_ms of a histogram written by the probe (the upper
    edge of the bucket holding each percentile)."""
    if not histogram or not sum(histogram["counts"]):
        return {"count": 0, "p50_ms": float("nan"), "p99_ms": float("nan"), "max_ms": float("nan")}
    counts, width = histogram["counts"], histogram["bucket_ms"]
    total = sum(counts)

    def percentile(q: float) -> float:
        rank, seen = q * total, 0
        for index, count in enumerate(counts):
            seen += count
            if seen >= rank:
                return min((index + 1) * width, histogram["max_ms"])
        return histogram["max_ms"]

    return {"count": total, "p50_ms": percentile(0.5), "p99_ms": percentile(0.99),
            "max_ms": histogram["max_ms"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where the histogram goes (JSON)")
    parser.add_argument("--max-s", type=float, required=True, help="stop after this many seconds")
    args = parser.parse_args(argv)
    histogram = LatenessHistogram()
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    deadline = time.monotonic() + args.max_s
    while not stopping and time.monotonic() < deadline:
        asked = time.monotonic()
        time.sleep(PERIOD_S)
        histogram.add(time.monotonic() - asked - PERIOD_S)
    with open(args.out + ".tmp", "w") as f:
        json.dump(histogram.to_json(), f)
    os.replace(args.out + ".tmp", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
