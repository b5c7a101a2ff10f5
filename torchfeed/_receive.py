"""Receiving in the main process: the next result off the result queue, or the
death of a worker that owes one, whichever comes first.

``ResultReceiver`` holds the multi-process iterator's receiving methods (it is a
base class of ``MultiProcessIterator``, whose per-epoch book-keeping it reads:
which workers are live, what is pending, whether it is shutting down).  The
main thread calls ``_receive`` itself, or, with pin memory, the pin-memory
thread does through ``weak_receive``.  Either way the iterator then reorders
what arrives (``_multiprocess.py``).

NOTE [ Waiting without hanging ]
The main process never blocks on the result queue alone.  It waits on the
queue's pipe *and* every live worker's process sentinel at once
(one ``poll``, see ``_pipe_reader.wait_ready``), so a worker that dies from SIGKILL, a
segfault or ``os._exit`` wakes it immediately, and the error names that
worker's pid, its signal or exit code and the batches it had in flight.
torch instead polls every 5 seconds and relies on a SIGCHLD handler.
"""
from __future__ import annotations

import pickle
import weakref

from ._errors import WorkerFailure
from ._pipe_reader import HalfMessage, Stopped, wait_ready
from ._restart import WorkerDied
from ._worker import IterableExhausted

DYING_SENDER_WAIT = 1.0  # how long a payload that failed to arrive may wait for its sender's death


class ResultReceiver:
    """The receiving half of ``MultiProcessIterator``."""

    def _watched_sentinels(self):
        return {w.sentinel: i for i, w in enumerate(self._workers)
                if self._workers_status[i] and not self._shutdown}

    def _receive(self, timeout: float):
        """One (send_idx, batch) from the result queue, or (False, None) on timeout.

        Raises RuntimeError as soon as a worker that owes us results is dead.
        """
        if self._pending:
            return True, self._pending.popleft()
        sentinels = self._watched_sentinels()
        if self._messages.has_message():
            return self._take_ready([self._messages.fd], sentinels)
        ready = wait_ready([self._messages.fd, *sentinels], timeout)
        return self._take_ready(ready, sentinels)

    def _take_ready(self, ready, sentinels):
        """Raises WorkerDied for a worker that owes us results and is dead; the
        main thread decides whether to restart it (``_restart.py``) or raise."""
        if not ready:
            return False, None
        fd = self._messages.fd
        if fd in ready or self._messages.started():
            try:
                item = self._read_result(sentinels, ready=fd in ready)
            except Stopped:
                return False, None
            except HalfMessage as exc:
                raise WorkerDied(exc.worker_id, half_message=True) from None
            return True, item
        for sentinel in ready:
            worker_id = sentinels[sentinel]
            # The pin thread took its list of sentinels before it waited; a
            # worker retired meanwhile (its iterable ended) exits on purpose.
            if self._workers_status[worker_id] and not self._shutdown:
                raise WorkerDied(worker_id)
        return False, None

    def _read_result(self, sentinels=None, dead: int | None = None, ready: bool = False):
        """(send_idx, payload) of the next message, which has begun to arrive;
        for an acknowledgement (ResumeIteration), (marker, worker_id).  None for
        a message from worker ``dead`` that cannot be rebuilt."""
        raw = self._messages.read(sentinels or {}, lambda: self._shutdown, dead, ready)
        sem = getattr(self._result_queue, "_sem", None)
        if sem is not None:
            sem.release()  # what Queue.get does: the queue's size bound
        send_idx, worker_id, blob, seconds = pickle.loads(raw)
        if blob is None:
            return send_idx, worker_id
        try:
            payload = pickle.loads(blob)
        except Exception:
            # torch's transport hands tensors over as file descriptors
            # fetched from the sender; a sender that died, or is dying
            # (its socket already closed, its exit not yet reaped), cannot.
            if worker_id == dead:
                return None  # its task will be sent again
            process = self._workers[worker_id]
            process.join(timeout=DYING_SENDER_WAIT)
            if not process.is_alive():
                raise WorkerDied(worker_id) from None
            raise
        if not isinstance(payload, (WorkerFailure, IterableExhausted)):
            payload = self._unpacker.unpack(payload)
            self._stats.on_result(worker_id, seconds)
        return send_idx, payload


class _IteratorGone(Exception):
    pass


def weak_receive(iterator):
    """``iterator._receive`` for the pin thread, without keeping the iterator
    alive: an iterator dropped mid-epoch (``break``, an exception the caller
    swallowed) must still be collected, which is what shuts its workers down."""
    ref = weakref.ref(iterator)

    def alive():
        it = ref()
        if it is None:
            raise _IteratorGone("the iterator was garbage-collected")
        return it

    def receive(timeout: float):
        # Hold no reference while blocked: the thread waits almost all the
        # time, and a reference held then would keep an unreachable
        # iterator (and its workers) from ever being collected.
        it = alive()
        if it._pending:
            return True, it._pending.popleft()
        fd, sentinels = it._messages.fd, it._watched_sentinels()
        if it._messages.has_message():
            return it._take_ready([fd], sentinels)
        del it
        ready = wait_ready([fd, *sentinels], timeout)
        return alive()._take_ready(ready, sentinels)

    return receive
