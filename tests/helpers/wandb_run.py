"""An offline W&B run read back from its run file: every record, the history rows, and
the records once the run is finished. The integration and example tests read the runs
their jobs logged with it."""
from __future__ import annotations

import glob
import json
import os
import struct
import time


def wandb_records(run_dir):
    """Every record of an offline run file (a LevelDB-style log of protobuf Records)."""
    from wandb.proto import wandb_internal_pb2

    [path] = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    raw = open(path, "rb").read()
    block, header = 32768, 7
    position, pieces, records = 7, b"", []  # the file starts with a 7-byte W&B header
    while position + header <= len(raw):
        left = block - position % block
        if left < header:  # a block's tail too short for a header is padding
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[position:position + header])
        if length == 0 and kind == 0:
            position += left
            continue
        if position + header + length > len(raw):
            break  # a record still being written
        data = raw[position + header:position + header + length]
        position += header + length
        if kind == 1:  # FULL
            pieces = data
        elif kind == 2:  # FIRST
            pieces = data
            continue
        elif kind == 3:  # MIDDLE
            pieces += data
            continue
        else:  # LAST
            pieces += data
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pieces)
        records.append(record)
    return records


def history_rows(records):
    """The run's history rows as dicts (a key may come as ``key`` or ``nested_key``)."""
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json)
             for item in record.history.item}
            for record in records if record.WhichOneof("record_type") == "history"]


def finished_run_records(run_dir, timeout=30.0):
    """The run file's records once it has its exit record: wandb's service process
    may still be writing the file after finish() returns."""
    deadline = time.monotonic() + timeout
    while True:
        records = wandb_records(run_dir)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, "the offline run file never got its exit record"
        time.sleep(0.2)
