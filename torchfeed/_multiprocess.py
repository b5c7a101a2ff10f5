"""The multi-process iterator: worker processes, the transport, one result queue.

    main process                                 worker k (one process each)
    ------------                                 ---------------------------
    index stream ─ _try_put_index ─► index_queues[k] ─► fetch + collate + pack
                                                                │
    user ◄─ pin ◄─ reorder ◄─ receiver ◄────── result_queue ◄───┘
                                (_receive.py)

The book-keeping (``send_idx`` / ``rcvd_idx`` / ``task_info``, prefetch,
reorder, ``in_order=False``) is ``_worker_iterator.py``'s, shared with the
thread iterator; this module owns what processes add: starting them (with
``share_dataset=True``'s sharing first), the transport's channel and
unpacker, restarts, the dead-worker error, the stacks in the timeout error,
and stopping them.

Receiving (``_receive.py``) waits on the result queue and on every live
worker's sentinel at once, so a worker that dies wakes the main process
immediately (NOTE [ Waiting without hanging ] there).  The receiver holds no
reference to the iterator, so neither does the pin thread that calls it.

NOTE [ Shutdown ]
See ``_processes.py``: one shared second of grace for all workers, then
terminate, then kill.  Iterators still alive at interpreter exit (persistent
workers) are shut down by an ``atexit`` hook that runs before
multiprocessing's own.
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import weakref

import torch

from . import _worker_tempdir
from ._errors import describe_dead_worker
from ._ipc import close_queue, join_process
from ._processes import StopFlag, launch_worker, launched_at, stop_workers
from ._protocol import ResumeIteration, StatefulUnpacker, Task, TaskInfo
from ._receive import ResultReceiver, WorkerDied
from ._restart import WorkerRestarts
from ._share_job import share_before_workers
from ._stack_dump import timeout_message
from ._stats import LiveCounts
from ._transport import _page_lock, create_channel
from ._worker import WorkerSpec
from ._worker_costs import in_background
from ._worker_iterator import WorkerIterator

_live_iterators: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _shutdown_live_iterators() -> None:
    for it in list(_live_iterators):
        it._shutdown_workers()


class MultiProcessIterator(WorkerIterator):
    def __init__(self, loader) -> None:
        originals = share_before_workers(loader)
        super().__init__(loader)
        self._workers: list = []
        self._stack_pipes: list = []  # per worker: where it dumps its stacks on timeout
        ctx = self._ctx = loader.multiprocessing_context or torch.multiprocessing
        self._result_queue = ctx.Queue()
        self._channel = create_channel(self._num_workers, ctx, loader)
        self._unpacker = self._channel.unpacker()
        if self._pin_memory and _page_lock.wanted():
            _page_lock.enable(self._channel)  # slots page-locked once, in the pin thread
        if self._stream.ships_state:  # batches may come with a dataset state or a short count
            self._unpacker = StatefulUnpacker(self._unpacker)
        self._receiver = ResultReceiver(self._result_queue, self._unpacker, self._stats,
                                        self._workers, self._worker_active)
        self._restarts = WorkerRestarts(getattr(loader, "max_worker_restarts", 0), self._is_iterable,
                                        self._workers, self._receiver, self._result_queue,
                                        self._channel)
        spec = WorkerSpec(
            is_iterable=self._is_iterable, dataset=self._dataset,
            auto_collation=self._auto_collation, collate_fn=self._collate_fn,
            drop_last=self._drop_last, base_seed=self._base_seed,
            worker_init_fn=loader.worker_init_fn, num_workers=self._num_workers,
            epoch=self._epoch, seed_per_batch=getattr(loader, "seed_per_batch", False),
            main_pid=os.getpid(), stopping=StopFlag(ctx), resume_states=self._stream.resume_states,
            ships_state=self._stream.ships_state, shared_seed=self._stream.shared_seed,
            # the last argument: nothing evaluated after it can fail and leave it behind
            temp_dir=_worker_tempdir.make() if _worker_tempdir.wanted(self._channel) else None)
        self._spec = spec
        _live_iterators.add(self)
        try:
            for worker_id in range(self._num_workers):
                self._start_worker(ctx, spec, worker_id)
            if originals:  # share_dataset=True's replaced objects: freed while the workers start
                in_background(originals.clear, "torchfeed-free-dataset")
                del originals
            # The pin thread calls the receiver at once, which reads the
            # live-worker flags: start it only once _reset has set them.
            self._reset(loader, first_iter=True)
            if self._wants_pin_thread(loader):
                self._start_pin_thread()
        except BaseException:
            self._shutdown_workers()
            raise

    def _start_worker(self, ctx, spec: WorkerSpec, worker_id: int) -> None:
        index_queue, stack_pipe, process = launch_worker(ctx, spec, worker_id,
                                                         self._result_queue, self._channel)
        self._index_queues.append(index_queue)
        self._stack_pipes.append(stack_pipe)
        self._workers.append(process)

    def _replace_worker(self, worker_id: int, owed: list[tuple[int, TaskInfo]]):
        """Start a new process as worker ``worker_id`` (see ``_restart.py``) and
        send it the tasks ``owed``: ``[(send_idx, TaskInfo)]``."""
        spec = dataclasses.replace(self._spec, epoch=self._epoch,
                                   shared_seed=self._stream.shared_seed)
        index_queue, stack_pipe, process = launch_worker(self._ctx, spec, worker_id,
                                                         self._result_queue, self._channel)
        self._index_queues[worker_id].close()
        self._stack_pipes[worker_id].close()
        self._index_queues[worker_id] = index_queue
        self._stack_pipes[worker_id] = stack_pipe
        self._workers[worker_id] = process
        if worker_id in self._acks_pending:
            index_queue.put(ResumeIteration(self._epoch, self._stream.shared_seed))
        for send_idx, task in owed:
            index_queue.put(Task(send_idx, task.batch_index, task.indices))
        if self._pin_thread is not None:
            self._start_pin_thread()
        return process

    # -- receiving: see _receive.py; the book-keeping: _worker_iterator.py -------

    def _raise_dead_worker(self, worker_id: int, note: str = "") -> None:
        process = self._workers[worker_id]
        join_process(process, 0.5)  # reap it, so exitcode is known
        in_flight = [(task.batch_index, task.indices) for _, task in self._unanswered(worker_id)]
        # torch's sentence names every worker it finds dead, in worker order.
        dead_pids = [w.pid for i, w in enumerate(self._workers)
                     if i == worker_id or (self._worker_active[i] and not w.is_alive())]
        message = describe_dead_worker(worker_id, process.pid, process.exitcode, in_flight,
                                       dead_pids)
        if note:
            message += "\n" + note
        self._shutdown_workers()
        raise RuntimeError(message)

    def _timeout_message(self, owed: dict[int, TaskInfo | None]) -> str:
        """torch's timeout message, then the stacks of the processes that owe it."""
        return timeout_message(self._timeout, owed, self._workers, self._stack_pipes)

    def _ends_the_thread(self, error: BaseException) -> bool:
        return isinstance(error, WorkerDied)  # the thread has ended; _wait_one decides

    def _wait_one(self, timeout: float):
        try:
            return self._wait_one_unguarded(timeout)
        except WorkerDied as raised:
            # A fresh copy, handled outside the except block: the raised one's
            # traceback (from the pin thread, say) holds this iterator, and as
            # the __context__ of the error below it would keep the iterator,
            # its pipes and its shared memory alive as long as the user keeps
            # the error.
            death = WorkerDied(raised.worker_id, raised.half_message)
        # Restart the worker (_restart.py) or raise its error.
        note = self._restarts.after_death(death, self._pin_thread, self._unanswered(death.worker_id),
                                          self._replace_worker)
        if note is not None:
            self._raise_dead_worker(death.worker_id, note=note)
        return False, None

    def live_counts(self) -> LiveCounts:
        """What the stats read when asked (``_stats.py``): workers, queues, slots, pin time."""
        in_flight, ready, pin_busy = self._queue_counts()
        read_slots = getattr(self._unpacker, "stats", None)  # a transport may keep none
        try:
            slots = {} if read_slots is None else (read_slots() or {})
        except Exception:  # statistics must never break the loop; the last figures stand
            slots = None
        return LiveCounts(pids=[w.pid for w in self._workers],
                          launched=[launched_at(w) for w in self._workers],
                          pin_busy_seconds=pin_busy, in_flight=in_flight, ready=ready,
                          slots=slots)

    # -- shutdown ---------------------------------------------------------------
    def _shutdown_workers(self) -> None:
        if self.shut_down:
            return
        self._stats.settle()  # a memory reading still running, while the workers are there
        self._receiver.stopped = True
        try:
            if self._pin_thread is not None:
                self._pin_thread.stop()
            stop_workers(self._workers, self._index_queues, self._spec.stopping)
        finally:
            for index_queue in self._index_queues:
                index_queue.close()
            for stack_pipe in self._stack_pipes:
                stack_pipe.close()
            close_queue(self._result_queue)
            self._unpacker.close()
            _worker_tempdir.remove(self._spec.temp_dir)  # the workers are gone, killed ones too
            _live_iterators.discard(self)
