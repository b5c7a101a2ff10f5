"""The thread iterator (``worker_method="thread"``): ``num_workers`` threads of
this process, batches handed over by reference.

    main thread                                  worker thread k (_thread_worker.py)
    -----------                                  -----------------------------------
    index stream ─ _try_put_index ─► index_queues[k] ─► fetch + collate
                                                                │
    user ◄─ device ◄─ pin ◄─ reorder ◄─ ThreadResults ◄── results ◄┘

Everything from the index stream to the user is the process iterator's
(``_worker_iterator.py``): the same tasks, in the same order, to the same
worker ids, so the batches, their order and ``state_dict()`` are those of
process workers, and a state taken under one kind resumes under the other.
What threads change: no transport (a batch is the object ``collate_fn``
returned), no worker start (a thread is ready in well under a millisecond),
no copy of the dataset (every thread reads the loader's own, as torch's thread
workers do; ``share_dataset`` has nothing to do), and no process to kill.

NOTE [ A thread cannot be killed ]
A worker thread stuck in ``__getitem__`` cannot be stopped from outside.  So
nothing waits on one without a deadline: the receiver waits on the result
queue in slices; ``timeout=`` gives torch's error with the thread's Python
stack (``sys._current_frames``); and the shutdown sets the stop flag, sends
each thread ``None`` and joins them all within one shared second of grace.  A
thread still inside ``__getitem__`` then is left running (a daemon thread,
which the interpreter does not wait for at exit): it finishes that call,
sees the flag and ends, dropping the batch.  Until then it keeps what that
call holds (the dataset, the sample), and, after a shutdown that was not
a timeout's, it is named in one warning.  A thread that ends by itself
(a ``SystemExit`` from the dataset) while it owes batches is reported as a
dead process worker is.
"""
from __future__ import annotations

import atexit
import queue
import sys
import threading
import time
import traceback
import warnings
import weakref
from typing import Any

from ._datapipes import is_datapipe
from ._errors import WorkerFailure, describe_samples
from ._protocol import IterableExhausted, TaskInfo
from ._stats import LiveCounts
from ._thread_worker import MainWait, ThreadWorkerSpec, thread_worker_loop
from ._worker_iterator import WorkerIterator

SHUTDOWN_GRACE = 1.0  # seconds all worker threads share to end at shutdown

_live_iterators: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _shutdown_live_iterators() -> None:
    for it in list(_live_iterators):
        it._shutdown_workers()


class ThreadResults:
    """The next result from the worker threads, for the main thread or the pin
    thread; like the process receiver it holds no reference to the iterator."""

    def __init__(self, results: queue.SimpleQueue, stats, threads: list, worker_active: list,
                 ended: list) -> None:
        self.results = results
        self.stats = stats
        self.threads = threads
        self.worker_active = worker_active
        self.ended = ended  # per worker: the traceback of whatever ended its thread early
        self.stopped = False
        self.drew_global_rng = False  # a worker's task drew from a global RNG

    def receive(self, timeout: float):
        """One ``(send_idx, payload)``, an acknowledgement ``(marker, worker_id)``,
        or ``(False, None)`` when nothing came within ``timeout``."""
        try:
            message = self.results.get(timeout=timeout)
        except queue.Empty:
            self._check_threads()
            return False, None
        send_idx, worker_id, payload, seconds, cpu_seconds, started, drew = message
        if started is not None:
            self.stats.on_started(worker_id, *started, 0)
        if payload is None:
            return True, (send_idx, worker_id)
        self.drew_global_rng = self.drew_global_rng or drew
        if not isinstance(payload, (WorkerFailure, IterableExhausted)):
            self.stats.on_result(worker_id, seconds, cpu_seconds)
        return True, (send_idx, payload)

    def _check_threads(self) -> None:
        if self.stopped:
            return
        for worker_id, thread in enumerate(self.threads):
            if self.worker_active[worker_id] and not thread.is_alive():
                what = self.ended[worker_id] or "it returned without being told to stop"
                raise RuntimeError(
                    f"DataLoader worker thread {worker_id} exited unexpectedly\n"
                    f"Worker thread {worker_id} ended while it owed batches. What ended it:\n"
                    f"{what}")


class ThreadIterator(WorkerIterator):
    def __init__(self, loader) -> None:
        if is_datapipe(loader.dataset):
            raise ValueError(
                "worker_method='thread' does not take a DataPipe dataset: a DataPipe graph is "
                "seeded and sharded per worker copy, and thread workers share one object (torch's "
                "thread workers leave DataPipes out too). Use worker_method='multiprocessing'.")
        super().__init__(loader)
        self._threads: list[threading.Thread] = []
        self._ended: list[str | None] = [None] * self._num_workers
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._receiver = ThreadResults(self._results, self._stats, self._threads,
                                       self._worker_active, self._ended)
        self._main_wait = MainWait()
        self._timed_out = False
        self._warned_global_rng = False
        resumes = self._stream.resume_states
        if resumes is not None:
            _load_dataset_state(self._dataset, resumes)
        self._spec = ThreadWorkerSpec(
            is_iterable=self._is_iterable, dataset=self._dataset,
            auto_collation=self._auto_collation, collate_fn=self._collate_fn,
            drop_last=self._drop_last, base_seed=self._base_seed,
            worker_init_fn=loader.worker_init_fn, num_workers=self._num_workers,
            epoch=self._epoch, seed_per_batch=getattr(loader, "seed_per_batch", False),
            stopping=threading.Event(), main_waiting=self._main_wait,
            resume_states=resumes, ships_state=self._stream.ships_state)
        _live_iterators.add(self)
        try:
            for worker_id in range(self._num_workers):
                self._start_thread(worker_id)
            self._reset(loader, first_iter=True)
            if self._wants_pin_thread(loader):
                self._start_pin_thread()
        except BaseException:
            self._shutdown_workers()
            raise

    def _start_thread(self, worker_id: int) -> None:
        tasks: queue.SimpleQueue = queue.SimpleQueue()
        thread = threading.Thread(
            target=thread_worker_loop, name=f"torchfeed-worker-{worker_id}", daemon=True,
            args=(self._spec, worker_id, tasks, self._results, self._ended, time.monotonic()))
        try:
            thread.start()
        except RuntimeError as exc:  # "can't start new thread": Python's sentence first
            raise RuntimeError(
                f"{exc}\nDataLoader could not start worker thread {worker_id} "
                f"(worker_method='thread', num_workers={self._num_workers}): this process has "
                "reached its limit of threads (ulimit -u, or a container's pids limit). Use "
                "fewer workers or loaders at once, or raise the limit.") from None
        self._index_queues.append(tasks)
        self._threads.append(thread)

    # -- receiving: ThreadResults; the book-keeping: _worker_iterator.py ---------
    def _wait_one(self, timeout: float):
        wait = self._main_wait
        wait.count += 1
        wait.waiting = True
        try:
            got = self._wait_one_unguarded(timeout)
        finally:
            wait.waiting = False
        if self._receiver.drew_global_rng and not self._warned_global_rng:
            self._warned_global_rng = True
            _warn_global_rng()
        return got

    def _timeout_message(self, owed: dict[int, TaskInfo | None]) -> str:
        """torch's timeout message, then where each owing thread is."""
        self._timed_out = True  # the error says what is left running; the shutdown need not
        frames = sys._current_frames()
        lines = [f"DataLoader timed out after {self._timeout} seconds"]
        waited = [f"batch {t.batch_index} ({describe_samples(t.indices)}) from worker thread {w}"
                  if t is not None else f"worker thread {w}" for w, t in sorted(owed.items())]
        lines.append("It was waiting for " + "; ".join(waited) + ".")
        for worker_id in sorted(owed):
            thread = self._threads[worker_id]
            frame = frames.get(thread.ident) if thread.ident is not None else None
            if frame is None:
                lines.append(f"Worker thread {worker_id} is not running.")
                continue
            stack = "".join(traceback.format_stack(frame))
            lines.append(f"Python stack of worker thread {worker_id} when the timeout expired, "
                         f"most recent call last:\n{stack.rstrip()}")
        del frames
        lines.append(
            f"Hint: the stack shows where each thread was when the timeout expired: a deadlock, "
            f"a read from disk or network that never returns, or a sample that takes longer than "
            f"timeout={self._timeout} to load. Fix the code at the bottom of the stack, or raise "
            "timeout. A thread cannot be stopped from outside: the loader stops waiting for it, "
            "and it ends once that call returns.")
        return "\n".join(lines)

    def live_counts(self) -> LiveCounts:
        """What the stats read when asked (``_stats.py``): no pids, no slots."""
        in_flight, ready, pin_busy = self._queue_counts()
        return LiveCounts(pids=[None] * self._num_workers, launched=[],
                          pin_busy_seconds=pin_busy, in_flight=in_flight, ready=ready, slots={})

    # -- shutdown: NOTE [ A thread cannot be killed ] ------------------------------
    def _shutdown_workers(self) -> None:
        if self.shut_down:
            return
        self._receiver.stopped = True
        try:
            if self._pin_thread is not None:
                self._pin_thread.stop()
        finally:
            self._spec.stopping.set()
            for tasks in self._index_queues:
                tasks.put(None)
            deadline = time.monotonic() + SHUTDOWN_GRACE
            current = threading.current_thread()
            for thread in self._threads:
                if thread is not current:
                    thread.join(max(0.0, deadline - time.monotonic()))
            stuck = [i for i, t in enumerate(self._threads) if t.is_alive() and t is not current]
            _live_iterators.discard(self)
            if stuck and not self._timed_out and not sys.is_finalizing():
                warnings.warn(
                    f"DataLoader worker thread(s) {', '.join(map(str, stuck))} did not end within "
                    f"{SHUTDOWN_GRACE:g} s of the loader's shutdown: a thread cannot be stopped "
                    "from outside, so each is left to finish the __getitem__ (or collate_fn) it is "
                    "in; it then ends by itself, and its batch is dropped.", RuntimeWarning,
                    stacklevel=2)


def _load_dataset_state(dataset, resumes: list[Any]) -> None:
    """A resumed Stateful dataset's own state, into the one dataset all threads
    share: the first worker's that has one (each thread's iterator state is its
    own, and loaded by the thread)."""
    for resume in resumes:
        if resume is not None and resume.dataset_state is not None:
            dataset.load_state_dict(resume.dataset_state)
            return


def _warn_global_rng() -> None:
    warnings.warn(
        "A DataLoader worker thread drew from a global random number generator (torch's, "
        "Python's random or numpy's) while loading a batch. With worker_method='thread' the "
        "workers share the process's global generators, so which thread gets which draw changes "
        "from run to run: augmentations are not reproducible and do not resume exactly. Draw "
        "from the worker's own generators instead: torch.utils.data.get_worker_info().rng "
        "(random_generator, torch_generator, numpy_generator), or pass "
        "generator=torch.thread_safe_generator() (torchfeed.thread_safe_generator() before torch "
        "2.13) to torch's random functions; or use "
        "worker_method='multiprocessing'.", RuntimeWarning, stacklevel=4)
