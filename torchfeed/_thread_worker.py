"""A thread worker: everything that runs in one of a loader's worker threads
(``worker_method="thread"``).

A thread worker does what a worker process does (``_worker.py``), the way
pytorch PR 161044's thread workers do it: it publishes ``get_worker_info()``
for its own thread, with ``worker_method="thread"`` and ``rng`` holding its
own generators (``_seeding.thread_worker_rng``; it never reseeds the global
RNGs, which the training loop and the other workers share), runs
``worker_init_fn``, then answers tasks from its own index queue until told
to stop.  Each answer goes on the iterator's result queue as
``(send_idx, worker_id, payload, seconds, cpu_seconds, started, drew)``: the batch
itself, by reference (nothing pickled, nothing copied beyond what
``collate_fn`` makes), wrapped as a process worker wraps it when it carries a
dataset's state or a short batch's count; or a ``WorkerFailure`` naming the
worker thread in torch's words; or ``IterableExhausted``.  torch's ``default_collate`` becomes
``_thread_collate.InMemoryCollate`` (ordinary memory, reused once a batch is
gone, where torch's would take shared memory).  ``seconds`` and
``cpu_seconds`` are the task's wall and thread CPU time, for ``stats()``;
``started`` is ``(launched, ready)`` on the first answer, else None; ``drew``
says the task drew from a global RNG (``_GlobalDraws``: a worker's first
``GLOBAL_RNG_CHECKS`` tasks are watched), which the iterator warns of once.

NOTE [ Thread-local get_worker_info ]
torch's ``get_worker_info()`` returns a module global, which a worker process
sets for its whole process; the threads of one process need one each.
torch's thread workers read a ``threading.local`` first; where the installed
torch has that (``_torch_compat.THREAD_LOCAL_WORKER_INFO``) a thread worker
sets torch's own.  No release up to 2.15 has it: there, the first thread
iterator gives torch's function that same behaviour, once per process, by
replacing its code with ``_THREAD_LOCAL_FIRST``, which reads torchfeed's
thread-local first and torch's global otherwise.  The function object stays
torch's, so every reference to it sees the change (one taken by ``from
torch.utils.data import get_worker_info`` before, ``torch.thread_safe_generator``),
and outside a thread worker it returns what it always did.

Nothing of the loader's own state is shared with the main thread except
through ``queue.SimpleQueue``, ``threading.Event`` and one slot per worker of
a list, each written by one thread: no reliance on the GIL
(free-threaded Python is designed for, not tested: no such build is on the
test machines).
"""
from __future__ import annotations

import queue
import random
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.utils.data._utils.worker as _torch_worker

from . import _seeding
from ._errors import WorkerFailure
from ._fetch import Fetched, create_fetcher, fetch_task
from ._protocol import IterableExhausted, ResumeIteration, WorkerResume
from ._stateful import StateTaker
from ._thread_collate import in_memory_collate
from ._torch_compat import THREAD_LOCAL_WORKER_INFO
from ._worker_spec import WorkerBasis

POLL_INTERVAL = 0.25  # seconds between a waiting worker's checks of the stop flag
GLOBAL_RNG_CHECKS = 8  # a worker's first tasks are watched for draws from the global RNGs

_local = threading.local()
_install_lock = threading.Lock()
_THREAD_LOCAL_FIRST = '''
def get_worker_info():
    info = getattr(_torchfeed_thread_worker, "info", None)
    return _worker_info if info is None else info
'''


def _install_thread_local_info() -> None:
    """NOTE [ Thread-local get_worker_info ]: once per process."""
    with _install_lock:
        if THREAD_LOCAL_WORKER_INFO or getattr(_torch_worker, "_torchfeed_thread_worker", None):
            return
        made: dict = {}
        exec(compile(_THREAD_LOCAL_FIRST, "<torchfeed: thread-local get_worker_info>", "exec"), made)
        _torch_worker._torchfeed_thread_worker = _local  # type: ignore[attr-defined]
        _torch_worker.get_worker_info.__code__ = made["get_worker_info"].__code__


def _thread_safe_generator():
    """``torch.thread_safe_generator()`` for the releases before it (2.13).

    Returns:
        torch.Generator: in a thread worker (``worker_method="thread"``), that
            worker's own generator, seeded from ``base_seed + id``; ``None``
            anywhere else, as torch's.

    Raises:
        Nothing of its own: it only reads this thread's ``get_worker_info()``.
    """
    info = _torch_worker.get_worker_info()
    if info is not None and getattr(info, "worker_method", None) == "thread":
        rng = getattr(info, "rng", None)
        return None if rng is None else rng.torch_generator
    return None


# torchfeed.thread_safe_generator: torch's own where the release has it.
thread_safe_generator = getattr(torch, "thread_safe_generator", _thread_safe_generator)


def _set_info(info) -> None:
    if THREAD_LOCAL_WORKER_INFO:
        _torch_worker._thread_local_worker_info.worker_info = info  # type: ignore[attr-defined]
    else:
        _local.info = info


@dataclass
class ThreadWorkerSpec(WorkerBasis):
    """What every worker thread of one iterator starts from (read, never written)."""
    stopping: threading.Event  # set when the iterator shuts down: leave at the next task
    main_waiting: Any  # the iterator's MainWait: whether a global-RNG draw can be ours
    resume_states: list[WorkerResume] | None = None
    ships_state: bool = False


class MainWait:
    """Whether the main thread is blocked waiting for a batch, and how many
    waits it began: a worker that saw the same wait in progress before and
    after a task knows the loop's own code did not run meanwhile."""

    def __init__(self) -> None:
        self.count = 0
        self.waiting = False

    def now(self) -> tuple[int, bool]:
        return self.count, self.waiting


def thread_worker_loop(spec: ThreadWorkerSpec, worker_id: int, tasks: queue.SimpleQueue,
                       results: queue.SimpleQueue, ended: list, launched: float) -> None:
    """The target of worker thread ``worker_id``.  Whatever ends it other than
    its queue's ``None`` or the stop flag (a ``SystemExit`` from the dataset,
    say) is kept in ``ended[worker_id]`` for the receiver to report."""
    _install_thread_local_info()
    try:
        _serve(spec, worker_id, tasks, results, launched)
    except BaseException as exc:  # noqa: BLE001 - reported by the main thread
        ended[worker_id] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    finally:
        _set_info(None)


def _serve(spec: ThreadWorkerSpec, worker_id: int, tasks: queue.SimpleQueue,
           results: queue.SimpleQueue, launched: float) -> None:
    # As torch's thread worker: intra-op threads of this thread's own ops.  The
    # main thread keeps its setting (torch's count is per thread here).
    torch.set_num_threads(1)
    rng = _seeding.thread_worker_rng(spec.base_seed, worker_id)
    dataset = spec.dataset  # one object for all threads, as torch's thread workers share it
    _set_info(_torch_worker.WorkerInfo(id=worker_id, num_workers=spec.num_workers,
                                       seed=spec.base_seed + worker_id, dataset=dataset,
                                       rng=rng, worker_method="thread"))
    failure = None
    try:
        if spec.worker_init_fn is not None:
            spec.worker_init_fn(worker_id)
    except Exception as exc:
        failure = WorkerFailure(exc, worker_id, "worker_init_fn", kind="thread")
    # A resumed dataset's own state was loaded once, into the one dataset, by the
    # iterator; what each thread resumes is its own iterator.
    resume = spec.resume_states[worker_id] if spec.resume_states is not None else None
    if failure is None and resume is not None and resume.ended_iterator_state is not None:
        try:
            iter(dataset).load_state_dict(resume.ended_iterator_state)
        except Exception as exc:
            failure = WorkerFailure(exc, worker_id, "iterator.load_state_dict", kind="thread")
    collate_fn = in_memory_collate(spec.collate_fn)
    fetcher = create_fetcher(spec.is_iterable, dataset, spec.auto_collation, collate_fn,
                             spec.drop_last,
                             iterator_state=resume.iterator_state if resume is not None else None)
    if resume is not None and resume.exhausted:
        fetcher.exhausted = True  # the last batch the user got exhausted its stream
    taker = StateTaker(dataset, spec.is_iterable) if spec.ships_state else None
    epoch, exhausted = spec.epoch, False
    started: tuple[float, float] | None = (launched, time.monotonic())
    checks = GLOBAL_RNG_CHECKS
    while True:
        try:
            task = tasks.get(timeout=POLL_INTERVAL)
        except queue.Empty:
            if spec.stopping.is_set():
                return
            continue
        if task is None or spec.stopping.is_set():
            return
        if isinstance(task, ResumeIteration):
            epoch, exhausted = task.epoch, False
            fetcher = create_fetcher(spec.is_iterable, dataset, spec.auto_collation,
                                     collate_fn, spec.drop_last)
            results.put((task, worker_id, None, 0.0, 0.0, None, False))
            continue
        if exhausted:
            continue  # the main thread stops sending once it hears we are exhausted
        start, cpu, drew = time.perf_counter(), time.thread_time(), False
        if failure is not None:
            payload, failure = failure.answering(task.indices, task.batch_index), None
        else:
            if spec.seed_per_batch:
                _seeding.seed_thread_batch(rng, spec.base_seed, epoch, task.batch_index)
            watch = _GlobalDraws(spec.main_waiting) if checks > 0 else None
            fetched = fetch_task(task, fetcher, taker, spec.is_iterable, worker_id, "thread")
            if watch is not None:
                checks -= 1
                drew = watch.drew()
                checks = 0 if drew else checks
            if isinstance(fetched, Fetched):
                payload = fetched.wrap(fetched.batch, spec.ships_state)
            else:
                payload = fetched
                exhausted = isinstance(fetched, IterableExhausted)
            del fetched
        results.put((task.send_idx, worker_id, payload, time.perf_counter() - start,
                     time.thread_time() - cpu, started, drew))
        started = None
        del payload, task


def _global_rng_states() -> tuple:
    numpy_state = np.random.get_state(legacy=False)
    return (torch.default_generator.get_state(), random.getstate(),
            (numpy_state["state"]["pos"], numpy_state["has_gauss"]))


class _GlobalDraws:
    """Whether a task drew from torch's, Python's or numpy's global RNG: they
    moved while the main thread was blocked in one same wait, so that no code
    of the training loop ran meanwhile (another worker thread may have drawn:
    a worker thread all the same)."""

    def __init__(self, main_waiting: MainWait) -> None:
        self._main = main_waiting
        self._wait = main_waiting.now()
        self._states = _global_rng_states()

    def drew(self) -> bool:
        if not self._wait[1] or self._main.now() != self._wait:
            return False  # the loop's own code may have run: no verdict
        torch_state, python_state, numpy_pos = _global_rng_states()
        return (not torch.equal(torch_state, self._states[0]) or python_state != self._states[1]
                or numpy_pos != self._states[2])
