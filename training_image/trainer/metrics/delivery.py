"""Deliver records on a background thread through a bounded buffer: what tracking uses so that a slow,
throttling or unreachable tracker never costs the training loop more than an append.

`put` never blocks and never raises: it appends to a deque of at most `capacity` records under a lock.
When the buffer is full the OLDEST record is dropped (and counted): while a tracker is down the newest
points are the ones worth having when it comes back (they show where the run is now), and every value
also stays in the job's log as the metric line (trainstack.protocol.metrics), so a dropped point is a gap
in the tracker's chart, not a lost measurement. Records the sender fails on go back to the front of the
buffer and are retried with exponential backoff (1 s doubling to 60 s); `prepare` (finding the tracker's
run) is retried the same way before anything is sent. `close` gives the thread a bounded time to drain,
then leaves it (a daemon: it never holds the process up) and reports what was and was not delivered.
A tracker that was never reached during the job gets 2 s at its end.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("trainer.tracking")

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
UNREACHED_CLOSE_S = 2.0


@dataclass
class Counts:
    queued: int = 0  # records put
    delivered: int = 0  # records the sender accepted
    dropped: int = 0  # pushed out of a full buffer (the oldest first)
    failed_attempts: int = 0  # sends or prepares that raised (each retried later)
    undelivered: int = 0  # still buffered when close() gave up

    def line(self, name: str) -> str:
        return (
            f"tracking {name}: {self.delivered} of {self.queued} records delivered, {self.dropped} dropped "
            f"(buffer full), {self.undelivered} undelivered at exit, {self.failed_attempts} failed attempts"
        )


class Delivery:
    """A bounded buffer drained by one daemon thread that calls `send(batch)`; see the module docstring."""

    def __init__(
        self,
        name: str,
        send: Callable[[list[Any]], None],
        *,
        prepare: Callable[[], None] | None = None,
        capacity: int = 10_000,
        batch: int = 500,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.counts = Counts()
        self._send, self._prepare = send, prepare
        self._capacity, self._batch, self._interval = capacity, batch, interval_s
        self._clock = clock
        self._buffer: collections.deque[Any] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._ready = prepare is None
        self._last_error = ""
        self._thread = threading.Thread(target=self._run, name=f"tracking-{name}", daemon=True)
        self._thread.start()

    def put(self, record: Any) -> None:
        """Queue one record; O(1), never blocks on the tracker, never raises."""
        with self._lock:
            if self._closing:
                return
            self.counts.queued += 1
            if len(self._buffer) >= self._capacity:
                self._buffer.popleft()
                self.counts.dropped += 1
            self._buffer.append(record)
            wake = len(self._buffer) >= self._batch
        if wake:
            self._wake.set()

    def close(self, timeout_s: float) -> Counts:
        """Let the thread drain for at most `timeout_s` (UNREACHED_CLOSE_S when the tracker was never
        reached in the whole job: waiting longer would only bill the job), then report (what is left
        counts as undelivered)."""
        with self._lock:
            self._closing = True
            if not self._ready and self.counts.failed_attempts:
                timeout_s = min(timeout_s, UNREACHED_CLOSE_S)
        self._wake.set()
        self._thread.join(timeout=max(timeout_s, 0.0))
        with self._lock:
            self.counts.undelivered = len(self._buffer)
            self._buffer.clear()
        line = self.counts.line(self.name)
        if self.counts.dropped or self.counts.undelivered or self.counts.failed_attempts:
            log.warning("%s%s", line, f" (last error: {self._last_error})" if self._last_error else "")
        else:
            log.info("%s", line)
        return self.counts

    # --- the thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.0
        while True:
            self._wake.wait(timeout=backoff or self._interval)
            self._wake.clear()
            closing = self._closing
            try:
                if not self._ready:
                    self._prepare()  # type: ignore[misc]
                    self._ready = True
                sent_all = self._drain()
                backoff = 0.0
                if closing and sent_all:
                    return
            except Exception as exc:  # the tracker's problem is never the job's: count, back off, retry
                with self._lock:
                    self.counts.failed_attempts += 1
                self._last_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                if self.counts.failed_attempts == 1:
                    log.warning("tracking %s: %s; retrying in the background", self.name, self._last_error)
                backoff = min(BACKOFF_MAX_S, max(BACKOFF_FIRST_S, 2 * backoff))
                if closing:
                    backoff = min(backoff, 0.5)  # close() bounds the time; keep trying until it gives up

    def _drain(self) -> bool:
        """Send everything buffered in batches; True when the buffer was emptied."""
        while True:
            with self._lock:
                batch = [self._buffer.popleft() for _ in range(min(self._batch, len(self._buffer)))]
            if not batch:
                return True
            try:
                self._send(batch)
            except Exception:
                with self._lock:  # back to the front, in order, as far as the buffer has room
                    room = self._capacity - len(self._buffer)
                    kept = batch[len(batch) - room :] if room < len(batch) else batch
                    self.counts.dropped += len(batch) - len(kept)
                    self._buffer.extendleft(reversed(kept))
                raise
            with self._lock:
                self.counts.delivered += len(batch)
