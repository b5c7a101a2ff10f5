"""The result queue, written to straight from a worker's main thread.

``multiprocessing.Queue.put`` hands each result to a feeder thread that
pickles and writes it, so every batch costs the worker a thread wakeup and a
GIL hand-over: a visible share of a small batch's cost.  ``ResultWriter.put``
writes the same wire format (``_framing.py``) itself, under the
queue's write lock, which all workers share, so it never interleaves with
another worker's (possibly larger, split) write.

Only messages of at most ``PIPE_BUF`` bytes go directly (a shared-memory
batch's message is a few hundred bytes): such a write is all-or-nothing, so a
worker killed during it leaves no half message behind, just as before.  The
first bigger message (a batch pickled inline, a long error) switches this
worker to the feeder thread for good, so messages never overtake one another:
the main process relies on a worker's results arriving in order (an
``IterableExhausted`` after that worker's last batch, an acknowledgement after
the previous epoch's results).  The write blocks while the pipe is full, as
the feeder's would; a worker whose main process is gone is ended by its
watchdog, and an ``EPIPE`` is reported as ``BrokenPipeError`` to the caller.

The write lock may be held by a worker that died holding it.  The main process
notices that death and stops the workers; a writer waiting for the lock waits
in slices and, once ``stopping()`` says so, raises ``Stopped`` instead of
waiting for a lock that will never be released, so it exits on its ``None``
like the others rather than being terminated.

The portable backend (``_host.fd_backend()`` false: Windows) writes every
result through ``Queue.put``, as torch does: its feeder thread takes the lock.
"""
from __future__ import annotations

import os
import pickle

from .. import _host
from ._framing import PIPE_BUF, frame
from ._mp_queue import size_semaphore, write_lock, writer_fd
from ._pipe_reader import Stopped
from ._wait import WAIT_SLICE


class ResultWriter:
    def __init__(self, result_queue, stopping=lambda: False) -> None:
        self.queue = result_queue
        self._direct = _host.fd_backend()
        self._fd = writer_fd(result_queue) if self._direct else -1
        self._take_slot = size_semaphore(result_queue).acquire
        self._lock = write_lock(result_queue)
        self._stopping = stopping  # () -> bool: the main process is stopping the workers

    def put(self, obj) -> None:
        if self._direct:
            # The envelope is plain data (the payload inside is already
            # pickled), so pickle's C pickler will do: ForkingPickler copies
            # two dispatch tables per call.
            message = frame(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL))
            if len(message) <= PIPE_BUF:
                self._take_slot()  # the main process releases it per message read
                lock = self._lock
                if lock is not None and not lock.acquire(False):
                    while not lock.acquire(timeout=WAIT_SLICE):
                        if self._stopping():
                            raise Stopped()
                try:
                    _write_all(self._fd, message)
                finally:
                    if lock is not None:
                        lock.release()
                return
            self._direct = False
        self.queue.put(obj)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:  # a blocking pipe write of <= PIPE_BUF bytes is whole, but be safe
        view = view[os.write(fd, view):]
