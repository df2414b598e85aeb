"""A one-line progress bar for the command line (``reccl sim``, ``reccl bench``).

Uses tqdm when it is installed and the bar goes to a terminal; otherwise draws
its own bar, redrawn in place with a carriage return.
"""
from __future__ import annotations

import sys
from typing import TextIO


class ProgressBar:
    """``advance(label)`` once per finished unit of work; ``close()`` when done early."""

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 30) -> None:
        self.total = max(1, int(total))
        self.done = 0
        self.stream = sys.stderr if stream is None else stream
        self.width = width
        self._tqdm = None
        if self.stream is sys.stderr and isatty(self.stream):
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self._tqdm = tqdm(total=self.total, file=self.stream, leave=True)
        self._closed = False

    def advance(self, label: str = "") -> None:
        self.done += 1
        if self._tqdm is not None:
            self._tqdm.set_postfix_str(label, refresh=False)
            self._tqdm.update(1)
            if self.done >= self.total:
                self.close()
            return
        filled = self.width * min(self.done, self.total) // self.total
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r[{bar}] {self.done}/{self.total} {label:<16}")
        if self.done >= self.total:
            self.stream.write("\n")
            self._closed = True
        self.stream.flush()

    def close(self) -> None:
        """Ends the bar's line (idempotent); call it when stopping before ``total``."""
        if self._closed:
            return
        self._closed = True
        if self._tqdm is not None:
            self._tqdm.close()
        elif self.done:
            self.stream.write("\n")
            self.stream.flush()


def isatty(stream) -> bool:
    """Whether ``stream`` is a terminal (False for streams without a file)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
