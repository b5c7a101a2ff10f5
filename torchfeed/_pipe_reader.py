"""Reading one message off the result queue without ever hanging on half of it.

``multiprocessing.Queue.get`` reads a message's length, then blocks until that
many bytes have arrived.  A worker SIGKILLed while its feeder thread is writing
a large message (more than the pipe holds, so the write is split) leaves half a
message in the pipe, and ``get`` then blocks forever; torch escapes only
because its SIGCHLD handler raises in the blocked main thread.

``read_message`` reads the same wire format (a 4-byte big-endian length, or -1
and an 8-byte length, then the bytes) in slices, watching the workers'
sentinels while it waits.  If the message stops arriving while a worker is
dead, that worker is the writer that died mid-message: ``HalfMessage`` names it.

Only the main process reads the result queue (workers close their read end),
and only one thread at a time (the pin-memory thread while it runs, else the
main thread), so the queue's read lock is not needed.
"""
from __future__ import annotations

import os
import struct
import time
from multiprocessing import connection

STALL = 2.0        # seconds a message may stop arriving, with a writer dead, before we give up
WAIT_SLICE = 0.1


class HalfMessage(Exception):
    """A worker died part-way through writing a message: the queue is unusable."""

    def __init__(self, worker_id: int):
        super().__init__(f"worker {worker_id} died while writing to the result queue")
        self.worker_id = worker_id


class Stopped(Exception):
    """The iterator is shutting down while a message was half read."""


def read_message(reader, sentinels: dict, stopping, dead: int | None = None) -> bytes:
    """One whole message from ``reader`` (a Connection with data ready).

    ``sentinels`` maps live workers' sentinels to their ids; ``dead`` is a
    worker already known to be dead, ``stopping()`` says the iterator is
    shutting down."""
    state = {"sentinels": dict(sentinels), "dead": dead}
    fd = reader.fileno()
    size, = struct.unpack("!i", _read_exact(fd, 4, state, stopping))
    if size == -1:
        size, = struct.unpack("!Q", _read_exact(fd, 8, state, stopping))
    return _read_exact(fd, size, state, stopping)


def _read_exact(fd: int, n: int, state: dict, stopping) -> bytes:
    buf = bytearray()
    stalled_since = None
    while len(buf) < n:
        ready = connection.wait([fd, *state["sentinels"]], WAIT_SLICE)
        if fd in ready:
            chunk = os.read(fd, n - len(buf))
            if not chunk:
                raise EOFError("the result queue was closed mid-message")
            buf += chunk
            stalled_since = None
            continue
        for sentinel in ready:  # stop watching it: a dead sentinel stays ready
            state["dead"] = state["sentinels"].pop(sentinel)
        if stopping():
            raise Stopped()
        if state["dead"] is not None:
            now = time.monotonic()
            stalled_since = stalled_since or now
            if now - stalled_since > STALL:
                raise HalfMessage(state["dead"])
    return bytes(buf)
