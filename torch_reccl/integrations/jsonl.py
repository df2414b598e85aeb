"""Events as JSON lines in a file: one ``Event.to_json()`` per line, appended and
flushed as it happens, so ``tail -f`` and ``jq`` work while the job runs (and each
change of a :class:`~torch_reccl.policy.FaultPolicy` answer given ``loggers=``, a
line of kind ``"advice"``)::

    torch_reccl.integrations.jsonl.attach("reccl_events.jsonl")
"""
from __future__ import annotations

import json
import os
import threading
from typing import Iterable, Optional

from torch_reccl.events import Event
from torch_reccl.integrations._sink import Attachment, attach_sink


class JsonlSink:
    def __init__(self, path: str):
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"cannot write events to {path!r}: directory {directory!r} does not exist")
        self.path = path
        self._lock = threading.Lock()
        self._file = open(path, "a", encoding="utf-8")

    def handle(self, event: Event) -> None:
        with self._lock:
            if self._file.closed:
                return
            self._file.write(event.to_json() + "\n")
            self._file.flush()

    def advice(self, record: dict) -> None:
        """A FaultPolicy answer (kind "advice") as one more line."""
        with self._lock:
            if self._file.closed:
                return
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def attach(path: str, kinds: Optional[Iterable[str]] = None, job_wide: Optional[bool] = None,
           store=None) -> Attachment:
    """Appends every event (or only ``kinds``) to ``path``; ``close()`` the result to stop."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a file path, not {type(path).__name__}")
    return attach_sink(lambda: JsonlSink(os.fspath(path)), kinds, job_wide, store)
