"""Progress of long work on stderr (prepare-data's tokenizing, export-hf's shards): a tqdm bar on a
terminal, plain lines in a log.

A bar redraws itself with carriage returns, which a log file or a CI page keeps as one long line of
every redraw; so when stderr is not a terminal each report is a line of its own, at most one every
`LOG_EVERY_S` seconds, and one at the end.
"""

from __future__ import annotations

import sys
import time

LOG_EVERY_S = 30.0
"""Seconds between two progress lines when stderr is not a terminal."""


class Progress:
    """Items done so far (`units`: "documents" tokenized, "shards" written), of `total`, and the
    megabytes they held (where counted); `what` names the work."""

    def __init__(self, total: int, enabled: bool, what: str = "tokenizing", units: str = "documents"):
        self.total, self.enabled, self.what, self.units = total, enabled, what, units
        self.done = self.num_bytes = 0
        self.start = self.last = time.perf_counter()
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit=f" {units}", desc=what, file=sys.stderr, dynamic_ncols=True)

    def update(self, docs: int, num_bytes: int = 0) -> None:
        self.done += docs
        self.num_bytes += num_bytes
        if self.bar is not None:
            if self.num_bytes:
                self.bar.set_postfix_str(f"{self.num_bytes / 1e6:.1f} MB", refresh=False)
            self.bar.update(docs)
        elif self.enabled and time.perf_counter() - self.last >= LOG_EVERY_S:
            self._line()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            self._line()

    def _line(self) -> None:
        self.last = time.perf_counter()
        print(
            f"{self.what}: {self.done:,}/{self.total:,} {self.units}, "
            + f"{self.num_bytes / 1e6:.1f} MB, " * bool(self.num_bytes)
            + f"{self.last - self.start:.1f} s",
            file=sys.stderr,
            flush=True,
        )
