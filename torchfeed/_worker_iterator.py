"""What the process and thread iterators share: tasks out, results back, in order.

    main thread                                  worker k (a process or a thread)
    -----------                                  --------------------------------
    index stream ─ _try_put_index ─► index_queues[k] ─► fetch + collate
                                                                │
    user ◄─ device ◄─ pin ◄─ reorder ◄─ receiver ◄── results ◄──┘

Book-keeping follows torch's: ``send_idx`` numbers tasks as they go out,
``rcvd_idx`` is the next task to hand to the user, ``task_info`` maps each
outstanding task to its worker (and, unlike torch, to its sample indices, so
any failure can name them).  ``prefetch_factor × num_workers`` tasks are in
flight at once, sent round-robin.  Results that arrive early wait in
``_arrived`` until their turn, unless ``in_order=False``.  With pin memory
(or ``device=``) the pin thread calls the receiver and hands on what it
pinned (``_pin_memory.py``, ``_device.py``).

What the workers are is the subclass's: ``MultiProcessIterator``
(``_multiprocess.py``: processes, the transport, the result queue's pipe,
restarts) and ``ThreadIterator`` (``_thread_iterator.py``: threads of this
process, batches by reference).  Each provides its workers' index queues
(``put``), a receiver (``receive(timeout)`` -> ``(ok, (send_idx, payload))``),
the timeout error's account of where the owing workers are
(``_timeout_message``), ``live_counts`` and the shutdown.  No other module
reads these fields.
"""
from __future__ import annotations

import itertools
import queue
import time
from typing import Any

from ._device import DeviceFeedThread, hand_over, resolve_device
from ._errors import WorkerFailure
from ._ipc import WAIT_SLICE
from ._iterator_base import BaseIterator
from ._pin_memory import PinMemoryThread, pass_through_requested
from ._protocol import IterableExhausted, ResumeIteration, Task, TaskInfo
from ._torch_compat import assertion_message, in_order, pin_device_index


class WorkerIterator(BaseIterator):
    """The reorder step and everything it counts, over workers of either kind."""

    _receiver: Any      # the subclass's: receive(timeout) -> (ok, item)
    _unpacker: Any = None  # the process transport's (rest, trim); None for threads

    def __init__(self, loader) -> None:
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
        # Per worker: True while it gets tasks this epoch, False once it reported
        # IterableExhausted (its iterable stream has nothing left).
        self._worker_active: list[bool] = []
        self._index_queues: list = []
        self._pin_thread: PinMemoryThread | None = None
        self._acks_pending: set[int] = set()  # workers yet to acknowledge ResumeIteration

    def _wants_pin_thread(self, loader) -> bool:
        return bool(self._pin_memory or self._device is not None
                    or (loader.pin_memory and pass_through_requested()))

    def _start_pin_thread(self) -> None:
        index = pin_device_index(self._pin_memory_device) if self._pin_memory else None
        if self._device is not None:
            self._pin_thread = DeviceFeedThread(self._receiver.receive, self._pin_memory_device,
                                                index, self._pin_memory, self._device)
            return
        self._pin_thread = PinMemoryThread(self._receiver.receive, self._pin_memory_device,
                                           index, pin=self._pin_memory)

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

    # -- receiving ---------------------------------------------------------------
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
        """torch's timeout message, plus what was awaited and where the workers
        that owe it are (``_timeout_message``)."""
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
        return self._timeout_message(owed)

    def _timeout_message(self, owed: dict[int, TaskInfo | None]) -> str:
        raise NotImplementedError

    def _wait_one(self, timeout: float):
        return self._wait_one_unguarded(timeout)

    def _unanswered(self, worker_id: int) -> list[tuple[int, TaskInfo]]:
        """``[(send_idx, task)]`` sent to ``worker_id`` whose batch has not come back."""
        return [(send_idx, task) for send_idx, task in sorted(self._task_info.items())
                if task.worker_id == worker_id and send_idx not in self._arrived]

    def _ends_the_thread(self, error: BaseException) -> bool:
        """Whether the pin thread's ``error`` leaves the workers to the main
        thread's decision (``_multiprocess.py``: a dead worker, restarted or
        reported) rather than stopping them at once."""
        return False

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
            if not self._ends_the_thread(item):
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

    def _queue_counts(self) -> tuple[int, int, float | None]:
        """(tasks in flight, batches ready, the pin thread's busy seconds) for the stats."""
        pin = self._pin_thread
        in_flight = ready = 0
        if not self.shut_down:
            pinned = pin.out.qsize() if pin is not None else 0
            in_flight = max(0, self._tasks_outstanding - pinned)
            ready = len(self._arrived) + pinned
        return in_flight, ready, None if pin is None else pin.busy_seconds

    # -- shutdown ---------------------------------------------------------------
    @property
    def shut_down(self) -> bool:
        return self._receiver.stopped  # the receiver stops taking results first

    def shutdown(self) -> None:
        self._shutdown_workers()

    def _shutdown_workers(self) -> None:
        raise NotImplementedError

    def __del__(self) -> None:
        try:
            self._stats.stop()  # the epoch ended here, not after the shutdown
            self._shutdown_workers()
        except Exception:
            pass  # interpreter teardown: modules may already be gone
