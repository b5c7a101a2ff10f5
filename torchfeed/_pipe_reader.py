"""Reading one message off the result queue without ever hanging on half of it.

``multiprocessing.Queue.get`` reads a message's length, then blocks until that
many bytes have arrived.  A worker SIGKILLed while its feeder thread is writing
a large message (more than the pipe holds, so the write is split) leaves half a
message in the pipe, and ``get`` then blocks forever; torch escapes only
because its SIGCHLD handler raises in the blocked main thread.

``MessageReader`` reads the same wire format (a 4-byte big-endian length, or -1
and an 8-byte length, then the bytes) itself, in whatever pieces arrive,
watching the workers' sentinels while it waits.  If the message stops arriving while a worker is
dead, that worker is the writer that died mid-message: ``HalfMessage`` names it.

Only the main process reads the result queue (workers close their read end),
and only one thread at a time (the pin-memory thread while it runs, else the
main thread), so the queue's read lock is not needed.
"""
from __future__ import annotations

import math
import os
import select
import struct
import threading
import time

CHUNK = 1 << 16    # bytes asked for per read
STALL = 2.0        # seconds a message may stop arriving, with a writer dead, before we give up
WAIT_SLICE = 0.1   # longest single wait, so timeouts, dead writers and stop requests are noticed


class HalfMessage(Exception):
    """A worker died part-way through writing a message: the queue is unusable."""

    def __init__(self, worker_id: int):
        super().__init__(f"worker {worker_id} died while writing to the result queue")
        self.worker_id = worker_id


class Stopped(Exception):
    """The iterator is shutting down while a message was half read."""


_pollers = threading.local()


def wait_ready(fds, timeout: float | None) -> list:
    """The file descriptors among ``fds`` that are readable (or closed, or in
    error), waiting up to ``timeout`` seconds: ``connection.wait`` for plain
    fds, without building and tearing down a selector on every call, which is
    most of its cost when it runs once or twice per batch.  One poll object per
    thread and set of fds (a fd number reused by a new worker's sentinel means
    the same to poll, so the cache needs no invalidation)."""
    key = tuple(fds)
    cache = getattr(_pollers, "cache", None)
    if cache is None:
        cache = _pollers.cache = {}
    poller = cache.get(key)
    if poller is None:
        if len(cache) > 16:  # sentinel sets change only when workers retire or restart
            cache.clear()
        poller = cache[key] = select.poll()
        for fd in key:
            poller.register(fd, select.POLLIN)
    ms = -1 if timeout is None else max(0, math.ceil(timeout * 1000))
    while True:
        try:
            return [fd for fd, event in poller.poll(ms) if event & ~select.POLLOUT]
        except InterruptedError:  # pragma: no cover - PEP 475 retries poll itself
            continue


class MessageReader:
    """Whole messages from ``reader`` (the result queue's read end).

    Each read takes everything the pipe holds (up to ``CHUNK`` bytes) and keeps
    what follows the first message, so a batch that arrives while another is
    being handled costs no extra wait or read.  Only one thread reads at a
    time (see the module docstring), so the buffer needs no lock."""

    def __init__(self, reader) -> None:
        self.reader = reader
        self.fd = self._fd = reader.fileno()
        self._buf = bytearray()
        self._pos = 0  # start of the first unread message in _buf

    def has_message(self) -> bool:
        """A whole message is buffered: reading it will not wait."""
        return self._whole() is not None

    def started(self) -> bool:
        """A message has begun to arrive (buffered bytes, or bytes in the pipe)."""
        return len(self._buf) > self._pos or bool(wait_ready([self._fd], 0))

    def _whole(self):
        """(start, end) of the first buffered message if it is whole, else None."""
        have = len(self._buf) - self._pos
        if have < 4:
            return None
        size, = struct.unpack_from("!i", self._buf, self._pos)
        start = self._pos + 4
        if size == -1:
            if have < 12:
                return None
            size, = struct.unpack_from("!Q", self._buf, start)
            start += 8
        return (start, start + size) if len(self._buf) >= start + size else None

    def read(self, sentinels: dict, stopping, dead: int | None = None,
             ready: bool = False) -> bytes:
        """One whole message; a message must have begun to arrive (``started``).

        ``sentinels`` maps live workers' sentinels to their ids; ``dead`` is a
        worker already known to be dead, ``stopping()`` says the iterator is
        shutting down; ``ready`` says the pipe is known to be readable now."""
        sentinels = dict(sentinels)
        stalled_since = None
        while True:
            span = self._whole()
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
                return message
            if not ready:
                woken = wait_ready([self._fd, *sentinels], WAIT_SLICE)
                ready = self._fd in woken
                for sentinel in woken:  # stop watching it: a dead sentinel stays ready
                    if sentinel in sentinels:
                        dead = sentinels.pop(sentinel)
            if ready:
                # os.read allocates all it asks for; a pipe rarely holds more than 1 MiB.
                chunk = os.read(self._fd, min(max(CHUNK, self._missing()), 1 << 20))
                if not chunk:
                    raise EOFError("the result queue was closed mid-message")
                self._buf += chunk
                stalled_since = None
                ready = False
                continue
            if stopping():
                raise Stopped()
            if dead is not None:
                now = time.monotonic()
                stalled_since = stalled_since or now
                if now - stalled_since > STALL:
                    raise HalfMessage(dead)

    def _missing(self) -> int:
        """Bytes still to come of the first buffered message (0 if unknown)."""
        have = len(self._buf) - self._pos
        if have < 12:
            return 0
        size, = struct.unpack_from("!i", self._buf, self._pos)
        if size == -1:
            size, = struct.unpack_from("!Q", self._buf, self._pos + 4)
            return size + 12 - have
        return size + 4 - have
