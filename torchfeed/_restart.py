"""Opt-in worker restarts: ``DataLoader(max_worker_restarts=N)``.

By default (``N = 0``) a worker that dies is fatal, as in torch: the iterator
shuts down and raises the dead-worker error.  With ``N > 0``, a worker of a
map-style dataset that was killed by a signal (the OOM killer's SIGKILL, a
segfault in a decoder) is replaced by a new process with the same worker id,
and the tasks it owed are sent to the replacement: the same batches, the same
sample indices, in the same order, so the epoch comes out exactly as it would
have without the crash, as long as ``__getitem__`` is deterministic (random
augmentations are too with ``seed_per_batch=True``; with torch's per-worker
seeding the replacement's RNGs start over from the worker's seed).  At most
``N`` restarts happen over the iterator's lifetime (an epoch, or every epoch
with persistent workers); the next death raises the dead-worker error, which
then says the restarts ran out.  Each restart warns (RuntimeWarning), so a
recurring crash is not silently absorbed.

Never restarted:

* a worker that exited with a code (``sys.exit``, ``os._exit``): user code chose
  to end it, and would again;
* a worker of an IterableDataset: a replacement would start its stream over
  and deliver batches twice; such loaders refuse ``max_worker_restarts`` at
  construction;
* a worker that died in the middle of writing a result: half a message is
  left in the shared result queue, and no later
  message can be trusted.

How a restart keeps the output identical: messages the dead worker finished
writing are still in the result pipe.  Before anything is re-sent, every
whole message in the pipe is read; those the main process can rebuild are kept
(they are answers, not lost); those it cannot (torch's transport fetches
tensors' file descriptors from their sender, which is gone) are dropped.  The
tasks the dead worker owed and whose answers are neither kept nor already
received are re-sent, on a fresh index queue, so no task reaches the
replacement twice and no answer arrives twice.  The replacement writes its
batches to a fresh shared-memory arena (``ShmChannel.renew``), so batches of
the dead worker that the user still holds stay intact.
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable

from ._errors import describe_exit
from ._ipc import HalfMessage, join_process, write_lock
from ._protocol import TaskInfo
from ._receive import ResultReceiver, WorkerDied

if TYPE_CHECKING:
    from ._pin_memory import PinMemoryThread

LOCK_PROBE = 1.0  # seconds the write lock may stay taken with nothing arriving


class CannotRestart(Exception):
    pass


class RestartBudget:
    def __init__(self, limit: int):
        self.limit = limit
        self.history: list[str] = []  # "worker 1 (pid 123) was killed by signal SIGKILL (9)"

    def refusal(self, exitcode, is_iterable: bool) -> str | None:
        """Why a worker that died with ``exitcode`` is not restarted; None if it is.
        An empty string means "restarts are off": the message says nothing."""
        if self.limit == 0:
            return ""
        if is_iterable:  # refused at construction; kept for loaders built around that
            return "It was not restarted: restarts are not supported for an IterableDataset."
        if exitcode is None or exitcode >= 0:
            return (f"It was not restarted: max_worker_restarts restarts workers killed by a "
                    f"signal, and this one {describe_exit(exitcode)}, which code in the worker "
                    f"chose.")
        if len(self.history) >= self.limit:
            earlier = "; ".join(self.history)
            return (f"It was not restarted: all max_worker_restarts={self.limit} restarts "
                    f"were used ({earlier}).")
        return None

    def record(self, worker_id: int, pid, exitcode) -> int:
        self.history.append(f"worker {worker_id} (pid {pid}) {describe_exit(exitcode)}")
        return len(self.history)


class WorkerRestarts:
    """Restarting the dead workers of one iterator, which owns this object.

    It is built with exactly what a restart touches besides the iterator's own
    book-keeping: the budget, the workers (the iterator's list, which a
    replacement updates in place), the receiver whose pipe is drained, the
    result queue whose write lock a dead worker may hold, and the transport
    channel whose arena is renewed.  Which tasks the dead worker owed, and
    starting its replacement, stay the iterator's: ``after_death`` is handed
    them for each death and keeps no reference to the iterator."""

    def __init__(self, limit: int, is_iterable: bool, workers: list, receiver: ResultReceiver,
                 result_queue, channel) -> None:
        self.budget = RestartBudget(limit)
        self._is_iterable = is_iterable
        self._workers = workers
        self._receiver = receiver
        self._result_queue = result_queue
        self._channel = channel

    def after_death(self, death: WorkerDied, pin_thread: PinMemoryThread | None,
                    unanswered: list[tuple[int, TaskInfo]],
                    replace: Callable[[int, list[tuple[int, TaskInfo]]], Any]) -> str | None:
        """Restart the dead worker if the budget allows: None once it is restarted;
        else why not, the note for its error ("" when restarts are off: the error
        says nothing).  ``pin_thread`` (which reported the death, and so has
        ended) is stopped before the pipe is read; ``unanswered`` and ``replace``
        are ``restart``'s."""
        reason = self._refusal(death)
        if reason is not None:
            return reason
        if pin_thread is not None:
            pin_thread.stop()
        return self.restart(death.worker_id, unanswered, replace)

    def _refusal(self, death: WorkerDied) -> str | None:
        process = self._workers[death.worker_id]
        join_process(process, 0.5)  # reap it, so its exit code is known
        reason = self.budget.refusal(process.exitcode, self._is_iterable)
        if death.half_message:
            half = ("It died while writing a result to the main process, which leaves half a "
                    "message in the result queue that all workers share")
            reason = (f"{half}, so it was not restarted." if reason is None
                      else f"{half}.\n{reason}" if reason else f"{half}.")
        return reason

    def restart(self, worker_id: int, unanswered: list[tuple[int, TaskInfo]],
                replace: Callable[[int, list[tuple[int, TaskInfo]]], Any]) -> str | None:
        """Replace dead worker ``worker_id``, which the budget allows; None once
        done, else why it was not (the note for its error).

        ``unanswered``: ``[(send_idx, task)]`` sent to it and not yet received,
        in send order.  ``replace(worker_id, owed)`` starts the new process and
        sends it ``owed``, those of them whose answers are not in the pipe either;
        it returns the new process."""
        process = self._workers[worker_id]
        try:
            self._drain(worker_id)
        except CannotRestart as exc:
            return f"It was not restarted: {exc}"
        in_pipe = {send_idx for send_idx, _ in self._receiver.pending}
        owed = [(send_idx, task) for send_idx, task in unanswered if send_idx not in in_pipe]
        count = self.budget.record(worker_id, process.pid, process.exitcode)
        # Every whole message of the dead worker has been rebuilt (``_drain``); its
        # slots may still hold batches the user keeps, so the replacement writes to
        # a fresh arena.
        self._channel.renew(worker_id)
        new = replace(worker_id, owed)
        batches = ", ".join(str(task.batch_index) for _, task in owed) or "none"
        warnings.warn(
            f"DataLoader worker {worker_id} (pid {process.pid}) {describe_exit(process.exitcode)}; "
            f"restarted it as pid {new.pid} (restart {count} of max_worker_restarts="
            f"{self.budget.limit}) and re-sent the batches it owed: {batches}.",
            RuntimeWarning, stacklevel=5)  # the iterator frame that waited: _next_data or _reset
        return None

    def _drain(self, dead: int) -> None:
        """Read every whole message in the result pipe into the receiver's
        ``pending``, so that nothing the dead worker wrote is still unread when
        its tasks are re-sent; then make sure the queue's write lock is free.

        A worker's queue feeder thread takes the write lock just before it writes
        a message, so a worker killed in ``__getitem__`` while its feeder was
        starting to send the previous batch dies holding the lock.  Every other
        worker would then wait for it forever.  While we keep reading, a live
        holder finishes its write within moments; a lock that stays taken while
        nothing arrives for ``LOCK_PROBE`` seconds is held by the dead worker, and
        the pipe holds only whole messages (half of one raises ``HalfMessage``), so
        releasing the lock on its behalf is safe."""
        receiver = self._receiver
        lock = write_lock(self._result_queue)
        quiet_since = _now()
        while True:
            try:
                while receiver.messages.started():
                    item = receiver.read_result(dead=dead)
                    quiet_since = _now()
                    if item is not None:
                        receiver.pending.append(item)
            except HalfMessage:
                raise CannotRestart("it died while writing a result, which leaves half a message "
                                    "in the result queue shared by all workers.") from None
            if lock is None or lock.acquire(timeout=0.05):
                if lock is not None:
                    lock.release()
                return
            if _now() - quiet_since > LOCK_PROBE:
                lock.release()  # a multiprocessing.Lock may be released by any process
                return


def _now() -> float:
    import time

    return time.monotonic()
