"""The multi-process iterator: index queues out, one result queue back, in order.

    main process                                 worker k (one process each)
    ------------                                 ---------------------------
    index stream ─ _try_put_index ─► index_queues[k] ─► fetch + collate + pack
                                                                │
    user ◄─ pin ◄─ reorder ◄─ receiver ◄────── result_queue ◄───┘
                                (_receive.py)

With ``device=`` set, the pin thread also copies each batch to the device
(``_device.py``), and ``_process_data`` hands it over on the user's stream.

Book-keeping follows torch's: ``send_idx`` numbers tasks as they go out,
``rcvd_idx`` is the next task to hand to the user, ``task_info`` maps each
outstanding task to its worker (and, unlike torch, to its sample indices, so
any failure can name them).  ``prefetch_factor × num_workers`` tasks are in
flight at once, sent round-robin.  Results that arrive early wait in
``_arrived`` until their turn, unless ``in_order=False``.

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
import itertools
import os
import queue
import time
import weakref
from typing import Any

import torch

from . import _worker_tempdir
from ._device import DeviceFeedThread, hand_over, resolve_device
from ._errors import WorkerFailure, describe_dead_worker
from ._ipc import WAIT_SLICE, close_queue
from ._iterator_base import BaseIterator
from ._pin_memory import PinMemoryThread, pass_through_requested
from ._processes import StopFlag, launch_worker, launched_at, stop_workers
from ._protocol import IterableExhausted, ResumeIteration, StatefulUnpacker, Task, TaskInfo
from ._receive import ResultReceiver, WorkerDied
from ._restart import WorkerRestarts
from ._share_job import share_before_workers
from ._stack_dump import timeout_message
from ._stats import LiveCounts
from ._torch_compat import assertion_message, in_order, pin_device_index
from ._transport import _page_lock, create_channel
from ._worker import WorkerSpec
from ._worker_costs import in_background

_live_iterators: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _shutdown_live_iterators() -> None:
    for it in list(_live_iterators):
        it._shutdown_workers()


class MultiProcessIterator(BaseIterator):
    def __init__(self, loader) -> None:
        originals = share_before_workers(loader)
        super().__init__(loader)
        self._device = resolve_device(getattr(loader, "device", None))
        self._prefetch_factor = loader.prefetch_factor
        if self._prefetch_factor <= 0:
            # torch's constructor lets 0 through and its iterator refuses it,
            # after drawing the base seed, as here.
            raise AssertionError(assertion_message(
                "prefetch_factor must be greater than 0 for MultiProcessingDataLoaderIter",
                f"prefetch_factor={self._prefetch_factor} would send no batch to the "
                f"{self._num_workers} workers. Use prefetch_factor=1 or more (torch's "
                "default is 2)."))
        self._in_order = in_order(loader)
        self._workers: list = []
        # Per worker: True while it gets tasks this epoch, False once it reported
        # IterableExhausted (its iterable stream has nothing left).
        self._worker_active: list[bool] = []
        self._index_queues: list = []
        self._stack_pipes: list = []  # per worker: where it dumps its stacks on timeout
        self._pin_thread: PinMemoryThread | None = None
        self._acks_pending: set[int] = set()  # workers yet to acknowledge ResumeIteration
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
            if (self._pin_memory or self._device is not None
                    or (loader.pin_memory and pass_through_requested())):
                self._start_pin_thread()
        except BaseException:
            self._shutdown_workers()
            raise

    def _start_pin_thread(self) -> None:
        index = pin_device_index(self._pin_memory_device) if self._pin_memory else None
        if self._device is not None:
            self._pin_thread = DeviceFeedThread(self._receiver.receive, self._pin_memory_device,
                                                index, self._pin_memory, self._device)
            return
        self._pin_thread = PinMemoryThread(self._receiver.receive, self._pin_memory_device,
                                           index, pin=self._pin_memory)

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

    # -- epochs ---------------------------------------------------------------
    def _reset(self, loader, first_iter: bool = False) -> None:
        if not first_iter:
            super()._reset(loader, first_iter)
        self._send_idx = 0
        self._rcvd_idx = 0
        self._task_info: dict[int, TaskInfo] = {}  # send_idx -> what was sent, to which worker
        self._arrived: dict[int, Any] = {}      # send_idx -> batch that came back before its turn
        self._tasks_outstanding = 0
        self._sampler_done = False
        self._worker_active[:] = [True] * self._num_workers  # the receiver shares the list
        self._workers_num_tasks = [0] * self._num_workers
        first = self._stream.next_worker  # a resumed IterableDataset goes on round-robin
        self._worker_cycle = itertools.cycle([*range(first, self._num_workers), *range(first)])
        if not first_iter:
            self._acks_pending = set(range(self._num_workers))
            for index_queue in self._index_queues:
                index_queue.put(ResumeIteration(self._epoch, self._stream.shared_seed))
            while self._acks_pending:
                # Results of the previous epoch that were still in flight
                # arrive before each worker's acknowledgement; drop them.
                marker, worker_id = self._get_data()
                if isinstance(marker, ResumeIteration):
                    self._acks_pending.discard(worker_id)
            # Nothing of the last epoch is left in flight, and nothing of this
            # one is yet: the pin thread cannot count a batch into the wrong epoch.
            self._stats.begin(self._epoch)
        for _ in range(self._prefetch_factor * self._num_workers):
            self._try_put_index()

    # -- sending ---------------------------------------------------------------
    def _try_put_index(self) -> None:
        max_tasks = self._prefetch_factor * self._num_workers
        if self._tasks_outstanding >= max_tasks:
            return
        try:
            batch_index, indices = self._next_index()
        except StopIteration:
            self._sampler_done = True
            return
        active = sum(self._worker_active)
        for _ in range(self._num_workers):
            worker_id = next(self._worker_cycle)
            if not self._worker_active[worker_id]:
                continue
            # Out of order, a slow worker must not hoard the whole budget.
            if self._in_order or self._workers_num_tasks[worker_id] < max_tasks // active:
                break
        else:
            return
        self._index_queues[worker_id].put(Task(self._send_idx, batch_index, indices))
        self._task_info[self._send_idx] = TaskInfo(worker_id, batch_index, indices)
        self._workers_num_tasks[worker_id] += 1
        self._tasks_outstanding += 1
        self._send_idx += 1

    # -- receiving: see _receive.py ---------------------------------------------

    def _raise_dead_worker(self, worker_id: int, note: str = "") -> None:
        process = self._workers[worker_id]
        process.join(timeout=0.5)  # reap it, so exitcode is known
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

    def _get_data(self):
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        while True:
            wait = WAIT_SLICE if deadline is None else max(0.0, min(WAIT_SLICE, deadline - time.monotonic()))
            ok, item = self._wait_one(wait)
            if ok:
                return item
            if deadline is not None and time.monotonic() >= deadline:
                raise RuntimeError(self._describe_timeout())

    def _describe_timeout(self) -> str:
        """torch's timeout message, plus what was awaited and the stacks of the
        workers that owe it."""
        info = self._task_info.get(self._rcvd_idx) if self._in_order else None
        owed: dict[int, TaskInfo | None] = {}  # worker -> the first task it owes, if known
        if info is not None:
            owed = {info.worker_id: info}
        else:  # out of order, or between epochs: any worker with work may be the one
            for send_idx, task in sorted(self._task_info.items()):
                if send_idx not in self._arrived:
                    owed.setdefault(task.worker_id, task)
            if not owed:
                owed = {w: None for w in range(self._num_workers)}
        return timeout_message(self._timeout, owed, self._workers, self._stack_pipes)

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

    def _unanswered(self, worker_id: int) -> list[tuple[int, TaskInfo]]:
        """``[(send_idx, task)]`` sent to ``worker_id`` whose batch has not come back."""
        return [(send_idx, task) for send_idx, task in sorted(self._task_info.items())
                if task.worker_id == worker_id and send_idx not in self._arrived]

    def _wait_one_unguarded(self, timeout: float):
        if self._pin_thread is None:
            return self._receiver.receive(timeout)
        try:
            kind, item = self._pin_thread.out.get(timeout=timeout)
        except queue.Empty:
            if not self._pin_thread.thread.is_alive():
                raise RuntimeError("Pin memory thread exited unexpectedly") from None
            return False, None
        if kind == "error":
            if not isinstance(item, WorkerDied):  # else the thread has ended; _wait_one decides
                self._shutdown_workers()
            try:
                raise item
            finally:
                del item  # its traceback holds this frame: no cycle to keep us alive
        return True, item

    def _next_data(self):
        while True:
            # Skip tasks that will never be answered: their worker exhausted its
            # iterable stream, or (in_order=False) they were already yielded.
            while self._rcvd_idx < self._send_idx:
                if self._rcvd_idx in self._arrived:
                    break
                info = self._task_info.get(self._rcvd_idx)
                if info is not None and self._worker_active[info.worker_id]:
                    break
                self._task_info.pop(self._rcvd_idx, None)
                self._rcvd_idx += 1
            else:
                if not self._persistent_workers:
                    self._shutdown_workers()
                else:  # idle until the next epoch: keep one slot per worker
                    trim = getattr(self._unpacker, "trim", None)
                    if trim is not None:
                        trim()
                raise StopIteration

            if self._rcvd_idx in self._arrived:
                data = self._arrived.pop(self._rcvd_idx)
                info = self._task_info.pop(self._rcvd_idx)
                self._rcvd_idx += 1
                return self._process_data(data, info)

            send_idx, data = self._get_data()
            self._tasks_outstanding -= 1
            if isinstance(data, IterableExhausted):
                self._stream.worker_exhausted(data.worker_id, data.state)
                self._on_worker_exhausted(data.worker_id)
                self._try_put_index()
                continue
            if send_idx != self._rcvd_idx:
                if not self._in_order:
                    return self._process_data(data, self._task_info.pop(send_idx))
                self._arrived[send_idx] = data
                continue
            info = self._task_info.pop(send_idx)
            self._rcvd_idx += 1
            return self._process_data(data, info)

    def _on_worker_exhausted(self, worker_id: int) -> None:
        """A worker reported IterableExhausted: send it no more tasks this epoch."""
        self._worker_active[worker_id] = False
        if not self._persistent_workers:
            self._index_queues[worker_id].put(None)

    def _process_data(self, data, info):
        worker_id, batch_index, indices = info
        self._workers_num_tasks[worker_id] -= 1
        self._try_put_index()
        if self._sampler_done and not self._workers_num_tasks[worker_id]:
            rest = getattr(self._unpacker, "rest", None)  # a transport may keep no slots
            if rest is not None:
                rest(worker_id)  # its last batch of the epoch: its slots need not wait for it
        if isinstance(data, WorkerFailure):
            self._stream.record_failure(batch_index, indices, worker_id)
            data.reraise()
        data = self._stream.yielded(data, batch_index, indices, worker_id)
        return data if self._device is None else hand_over(data, self._device)

    def live_counts(self) -> LiveCounts:
        """What the stats read when asked (``_stats.py``): workers, queues, slots, pin time."""
        pin = self._pin_thread
        in_flight = ready = 0
        if not self.shut_down:
            pinned = pin.out.qsize() if pin is not None else 0
            in_flight = max(0, self._tasks_outstanding - pinned)
            ready = len(self._arrived) + pinned
        read_slots = getattr(self._unpacker, "stats", None)  # a transport may keep none
        try:
            slots = {} if read_slots is None else (read_slots() or {})
        except Exception:  # statistics must never break the loop; the last figures stand
            slots = None
        return LiveCounts(pids=[w.pid for w in self._workers],
                          launched=[launched_at(w) for w in self._workers],
                          pin_busy_seconds=None if pin is None else pin.busy_seconds,
                          in_flight=in_flight, ready=ready, slots=slots)

    # -- shutdown ---------------------------------------------------------------
    @property
    def shut_down(self) -> bool:
        return self._receiver.stopped

    def shutdown(self) -> None:
        self._shutdown_workers()

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

    def __del__(self) -> None:
        try:
            self._stats.stop()  # the epoch ended here, not after the shutdown
            self._shutdown_workers()
        except Exception:
            pass  # interpreter teardown: modules may already be gone
