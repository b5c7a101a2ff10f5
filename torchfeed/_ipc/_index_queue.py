"""A worker's index queue, written to straight from the main thread.

``multiprocessing.Queue.put`` hands every object to a feeder thread, which
pickles it and writes it to the pipe: per task, a thread wakeup and a GIL
hand-over in the main process, which is a large share of its per-batch CPU
when batches are small.  ``IndexQueue.put`` writes the same wire format
(``Connection.send_bytes`` of a pickle: a 4-byte big-endian length, then the
pickle) to the pipe itself, so the worker still reads it with
``Queue.get``.  The framing is ``_framing.py``'s, shared with the result
queue's writer and reader.

A direct write must never block the main thread: a worker that died, or is
busy with a long task while the pipe is full, would hang it.  So the pipe's
write end is non-blocking and only messages of at most ``PIPE_BUF`` bytes are
written directly; POSIX makes such writes all-or-nothing, so a full pipe
(``EAGAIN``) leaves nothing half-written.  Anything else (a big batch of
indices, a full pipe) goes through the queue's feeder thread, and so does
every later message on that queue: once the feeder may hold messages, writing
around it would reorder them (an IterableDataset's batches depend on the order
of tasks) or interleave bytes with its write.  The main process is the only
writer of an index queue, so no write lock is needed.

The portable backend (``_host.fd_backend()`` false: Windows) writes every
message through ``Queue.put``, as torch does.
"""
from __future__ import annotations

import os
import pickle
from multiprocessing.reduction import ForkingPickler

from .. import _host
from ._framing import PIPE_BUF, frame
from ._mp_queue import close_queue, quiet_epipe, size_semaphore, writer_fd


def _dumps(obj) -> bytes | memoryview:
    """A task is ints and a list of indices: pickle's C pickler handles it at
    a fraction of ForkingPickler's cost (which copies two dispatch tables per
    call). Indices only ForkingPickler can reduce take its path."""
    try:
        return pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    except Exception:
        return ForkingPickler.dumps(obj)


class IndexQueue:
    def __init__(self, ctx) -> None:
        self.queue = ctx.Queue()
        self.queue.cancel_join_thread()
        quiet_epipe(self.queue)  # a worker gone for good is no error of the feeder's
        sem = size_semaphore(self.queue)
        self._take_slot, self._give_slot = sem.acquire, sem.release
        self._direct = _host.fd_backend()
        self._fd = -1
        if self._direct:
            self._fd = writer_fd(self.queue)
            if _host.HAS_RAW_FD_PIPES:
                os.set_blocking(self._fd, False)
        self._closed = False  # only close() closes the queue

    def put(self, obj) -> None:
        if self._direct:
            if self._closed:
                raise ValueError(f"Queue {self.queue!r} is closed")
            message = frame(_dumps(obj))
            if len(message) <= PIPE_BUF:
                # Queue.get in the worker releases the size semaphore, so take it
                # as Queue.put would (the queue is unbounded: this never waits).
                self._take_slot()
                try:
                    os.write(self._fd, message)
                    return
                except BlockingIOError:
                    self._give_slot()
            self._direct = False
            if _host.HAS_RAW_FD_PIPES:
                os.set_blocking(self._fd, True)  # the feeder thread's writes block
        self.queue.put(obj)

    def close(self) -> None:
        """Close the queue; with no feeder thread, close its pipe ends too
        (``Queue.close`` leaves that to the feeder, which may never have run)."""
        self._closed = True
        close_queue(self.queue, close_pipe_ends=True)
