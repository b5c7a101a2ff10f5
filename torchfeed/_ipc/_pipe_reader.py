"""Reading one message off the result queue without ever hanging on half of it.

``multiprocessing.Queue.get`` reads a message's length, then blocks until that
many bytes have arrived.  A worker SIGKILLed while its feeder thread is writing
a large message (more than the pipe holds, so the write is split) leaves half a
message in the pipe, and ``get`` then blocks forever; torch escapes only
because its SIGCHLD handler raises in the blocked main thread.

``MessageReader`` reads the same wire format (``_framing.py``: a 4-byte
big-endian length, or -1 and an 8-byte length, then the bytes) itself, in
whatever pieces arrive, watching the workers' sentinels while it waits.  If
the message stops arriving while a worker is dead, that worker is the writer
that died mid-message: ``HalfMessage`` names it.

Only the main process reads the result queue (workers close their read end),
and only one thread at a time (the pin-memory thread while it runs, else the
main thread), so the queue's read lock is not needed.  It does what
``Queue.get`` does for each message it takes: gives back a unit of the
queue's size semaphore, which the writer took.
"""
from __future__ import annotations

import os
import time

from ._framing import bytes_to_come, message_span
from ._mp_queue import reader_fd, size_semaphore
from ._wait import WAIT_SLICE, wait_ready

CHUNK = 1 << 16    # bytes asked for per read
STALL = 2.0        # seconds a message may stop arriving, with a writer dead, before we give up


class HalfMessage(Exception):
    """A worker died part-way through writing a message: the queue is unusable."""

    def __init__(self, worker_id: int):
        super().__init__(f"worker {worker_id} died while writing to the result queue")
        self.worker_id = worker_id


def check_stall(dead: int | None, stalled_since: float | None) -> float | None:
    """A message has stopped arriving: with a writer dead (``dead``, its
    worker id), since when (``stalled_since``, else now); ``HalfMessage``
    once that is ``STALL`` ago.  With none dead, ``stalled_since`` as it was."""
    if dead is None:
        return stalled_since
    now = time.monotonic()
    stalled_since = stalled_since or now
    if now - stalled_since > STALL:
        raise HalfMessage(dead)
    return stalled_since


class Stopped(Exception):
    """The iterator is shutting down: the main process stops reading a half-read
    message, a worker stops waiting for the write lock (``ResultWriter``)."""


class MessageReader:
    """Whole messages from ``queue``'s pipe (the result queue's).

    Each read takes everything the pipe holds (up to ``CHUNK`` bytes) and keeps
    what follows the first message, so a batch that arrives while another is
    being handled costs no extra wait or read.  Only one thread reads at a
    time (see the module docstring), so the buffer needs no lock."""

    def __init__(self, queue) -> None:
        self.fd = self._fd = reader_fd(queue)
        self._give_slot = size_semaphore(queue).release
        self._buf = bytearray()
        self._pos = 0  # start of the first unread message in _buf

    def has_message(self) -> bool:
        """A whole message is buffered: reading it will not wait."""
        return message_span(self._buf, self._pos) is not None

    def started(self) -> bool:
        """A message has begun to arrive (buffered bytes, or bytes in the pipe)."""
        return len(self._buf) > self._pos or bool(wait_ready([self._fd], 0))

    def read(self, sentinels: dict, stopping, dead: int | None = None,
             ready: bool = False, alive=None) -> bytes:
        """One whole message; a message must have begun to arrive (``started``).

        ``sentinels`` maps live workers' sentinels to their ids; ``dead`` is a
        worker already known to be dead, ``stopping()`` says the iterator is
        shutting down; ``ready`` says the pipe is known to be readable now;
        ``alive(worker_id)``, where given, is asked after a slice in which
        nothing arrived (NOTE [ A sentinel held open ] in ``_wait.py``)."""
        sentinels = dict(sentinels)
        stalled_since = None
        while True:
            span = message_span(self._buf, self._pos)
            if span is not None:
                start, end = span
                with memoryview(self._buf) as view:
                    message = bytes(view[start:end])
                if end == len(self._buf):
                    self._buf.clear()
                    self._pos = 0
                else:
                    self._pos = end
                    if end > CHUNK:  # keep the buffer from growing without bound
                        del self._buf[:end]
                        self._pos = 0
                self._give_slot()  # as Queue.get does: the writer took it
                return message
            if not ready:
                woken = wait_ready([self._fd, *sentinels], WAIT_SLICE)
                if not woken and alive is not None:
                    woken = [s for s, worker_id in sentinels.items() if not alive(worker_id)]
                ready = self._fd in woken
                for sentinel in woken:  # stop watching it: a dead sentinel stays ready
                    if sentinel in sentinels:
                        dead = sentinels.pop(sentinel)
            if ready:
                # os.read allocates all it asks for; a pipe rarely holds more than 1 MiB.
                wanted = max(CHUNK, bytes_to_come(self._buf, self._pos))
                chunk = os.read(self._fd, min(wanted, 1 << 20))
                if not chunk:
                    raise EOFError("the result queue was closed mid-message")
                self._buf += chunk
                stalled_since = None
                ready = False
                continue
            if stopping():
                raise Stopped()
            stalled_since = check_stall(dead, stalled_since)
