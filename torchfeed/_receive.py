"""Receiving in the main process: the next result off the result queue, or the
death of a worker that owes one, whichever comes first.

``ResultReceiver`` reads the result queue for ``MultiProcessIterator``.  The
main thread calls ``receive`` itself or, with pin memory, the pin-memory thread
does; either way the iterator then reorders what arrives (``_multiprocess.py``).

The receiver holds no reference to the iterator, so the pin thread, which
holds the receiver, never keeps the iterator alive.  A running thread is a GC
root: an iterator it referenced, even for the moment of decoding a batch,
would survive a ``gc.collect()`` that found it unreachable, and so would its
workers.  What the receiver must know of the iterator (its workers, which of
them are live) it shares as lists the iterator updates in place; the iterator
sets ``stopped`` when it shuts down.

NOTE [ Waiting without hanging ]
The main process never blocks on the result queue alone.  It waits on the
queue's pipe *and* every worker's process sentinel at once
(one wait, see ``_ipc.wait_ready``), so a worker that dies from SIGKILL, a
segfault or ``os._exit`` wakes it immediately, and the error names that
worker's pid, its signal or exit code and the batches it had in flight.
torch instead polls every 5 seconds and relies on a SIGCHLD handler.  A
sentinel can stay quiet after its worker's death (a process the worker
started holds it open: NOTE [ A sentinel held open ] in ``_ipc/_wait.py``), so
each slice in which nothing arrived also asks every watched worker
``is_alive()``, and the error comes within a slice either way.  A
worker with nothing left to do this epoch is watched too, until it exits
cleanly: it can still die holding the write lock the others need (NOTE [
Cross-process primitives ] in CONTRIBUTING.md).
"""
from __future__ import annotations

import collections
import pickle

from ._errors import WorkerFailure
from ._ipc import HalfMessage, Stopped, join_process, result_reader, wait_ready
from ._protocol import IterableExhausted
from ._transport import fd_exhaustion_error

DYING_SENDER_WAIT = 1.0  # how long a payload that failed to arrive may wait for its sender's death


class WorkerDied(Exception):
    """Internal: worker ``worker_id`` is dead; the main thread decides what next
    (``_restart.py`` replaces it, or the iterator raises the dead-worker error)."""

    def __init__(self, worker_id: int, half_message: bool = False):
        super().__init__(f"worker {worker_id} died")
        self.worker_id = worker_id
        self.half_message = half_message


class ResultReceiver:
    """The next result off the result queue, or the death of a worker that owes one."""

    def __init__(self, result_queue, unpacker, stats, workers: list, worker_active: list):
        self.messages = result_reader(result_queue)  # this host's backend (_ipc)
        self.unpacker = unpacker
        self.stats = stats
        self.workers = workers                # a restarted worker replaces its own entry
        self.worker_active = worker_active  # False once a worker's iterable is exhausted
        self.pending: collections.deque = collections.deque()    # results read while restarting a worker
        self.stopped = False                  # the iterator is shutting down
        # Workers out of tasks this epoch that then exited cleanly, as told to.
        self.retired: set = set()

    def watched_sentinels(self):
        """Every worker's sentinel, those out of tasks included: a worker whose
        stream ran out can still die holding the result queue's write lock,
        which every other worker needs to send (NOTE [ Cross-process
        primitives ] in CONTRIBUTING.md).  Only one that exited cleanly is
        left out."""
        if self.stopped:
            return {}
        return {w.sentinel: i for i, w in enumerate(self.workers) if w not in self.retired}

    def receive(self, timeout: float):
        """One (send_idx, batch) from the result queue, or (False, None) on timeout.

        Raises WorkerDied as soon as a worker that owes us results is dead.
        """
        if self.pending:
            return True, self.pending.popleft()
        sentinels = self.watched_sentinels()
        if self.messages.has_message():
            return self._take_ready([self.messages.fd], sentinels)
        ready = wait_ready([self.messages.fd, *sentinels], timeout)
        if not ready:  # a sentinel can stay quiet (NOTE [ A sentinel held open ], _ipc/_wait.py)
            ready = [s for s, worker_id in sentinels.items() if not self._alive(worker_id)]
        return self._take_ready(ready, sentinels)

    def _alive(self, worker_id: int) -> bool:
        return self.workers[worker_id].is_alive()

    def _take_ready(self, ready, sentinels):
        """Raises WorkerDied for a worker that owes us results and is dead; the
        main thread decides whether to restart it (``_restart.py``) or raise."""
        if not ready:
            return False, None
        fd = self.messages.fd
        if fd in ready or self.messages.started():
            try:
                item = self.read_result(sentinels, ready=fd in ready)
            except Stopped:
                return False, None
            except HalfMessage as exc:
                raise WorkerDied(exc.worker_id, half_message=True) from None
            return True, item
        for sentinel in ready:
            worker_id = sentinels[sentinel]
            if self.stopped:
                break
            if self.worker_active[worker_id]:
                raise WorkerDied(worker_id)
            # Out of tasks this epoch: a worker told to stop exits with 0 and
            # leaves nothing taken; any other end (a signal, the OOM killer)
            # may have left the write lock taken, and the others waiting on it.
            process = self.workers[worker_id]
            join_process(process, DYING_SENDER_WAIT)
            if process.exitcode != 0:
                raise WorkerDied(worker_id)
            self.retired.add(process)
        return False, None

    def read_result(self, sentinels=None, dead: int | None = None, ready: bool = False):
        """(send_idx, payload) of the next message, which has begun to arrive;
        for an acknowledgement (ResumeIteration), (marker, worker_id).  None for
        a message from worker ``dead`` that cannot be rebuilt."""
        raw = self.messages.read(sentinels or {}, lambda: self.stopped, dead, ready, self._alive)
        message = pickle.loads(raw)
        send_idx, worker_id, blob, seconds = message[:4]
        if len(message) > 4:  # a worker's first message: when it started, its memory then
            self.stats.on_started(worker_id, *message[4:])
        if blob is None:
            return send_idx, worker_id
        try:
            payload = pickle.loads(blob)
        except Exception as exc:
            # torch's transport hands tensors over as file descriptors
            # fetched from the sender; a sender that died, or is dying
            # (its socket already closed, its exit not yet reaped), cannot.
            if worker_id == dead:
                return None  # its task will be sent again
            process = self.workers[worker_id]
            join_process(process, DYING_SENDER_WAIT)
            if not process.is_alive():
                raise WorkerDied(worker_id) from None
            error = fd_exhaustion_error(exc)
            if error is not None:
                raise error from None
            raise
        if not isinstance(payload, (WorkerFailure, IterableExhausted)):
            payload = self.unpacker.unpack(payload)
            self.stats.on_result(worker_id, seconds)
        return send_idx, payload
