"""A worker's index queue, written to straight from the main thread.

``multiprocessing.Queue.put`` hands every object to a feeder thread, which
pickles it and writes it to the pipe: per task, a thread wakeup and a GIL
hand-over in the main process, which is a large share of its per-batch CPU
when batches are small.  ``IndexQueue.put`` writes the same wire format
(``Connection.send_bytes`` of a pickle: a 4-byte big-endian length, then the
pickle) to the pipe itself, so the worker still reads it with
``Queue.get``.

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
"""
from __future__ import annotations

import os
import pickle
import select
import struct
import threading
from multiprocessing.reduction import ForkingPickler

PIPE_BUF = getattr(select, "PIPE_BUF", 512)  # POSIX guarantees at least 512


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
        self._fd = self.queue._writer.fileno()
        os.set_blocking(self._fd, False)
        self._direct = True

    def put(self, obj) -> None:
        q = self.queue
        if self._direct:
            if q._closed:
                raise ValueError(f"Queue {q!r} is closed")
            body = _dumps(obj)
            message = struct.pack("!i", len(body)) + body
            if len(message) <= PIPE_BUF:
                # Queue.get in the worker releases the size semaphore, so take it
                # as Queue.put would (the queue is unbounded: this never waits).
                q._sem.acquire()
                try:
                    os.write(self._fd, message)
                    return
                except BlockingIOError:
                    q._sem.release()
            self._direct = False
            os.set_blocking(self._fd, True)  # the feeder thread's writes block
        q.put(obj)

    def close(self) -> None:
        """Close the queue; with no feeder thread, close its pipe ends too
        (``Queue.close`` leaves that to the feeder, which may never have run)."""
        q = self.queue
        q.cancel_join_thread()
        q.close()
        if q._thread is None:
            q._reader.close()
            q._writer.close()
        elif q._thread is not threading.current_thread():
            q._thread.join(timeout=1.0)
