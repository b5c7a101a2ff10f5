"""The worker process: everything that runs on the far side of the index queue.

A worker seeds itself as torch does, publishes ``get_worker_info()``, runs
``worker_init_fn``, then answers tasks from its own index queue until told to
stop.  Each answer is one message on the shared result queue:
``(send_idx, worker_id, pickled payload, seconds)``, where payload is the packed
batch (wrapped, for an IterableDataset or a Stateful dataset, with the state its
copy and its iterator reported right after making it: ``_stateful.py``), a
``WorkerFailure`` or an ``IterableExhausted``
marker, and seconds is the time fetch + collate + pack + pickle took (for
``DataLoader.stats()``).  Small messages are written by the worker's main
thread itself (``_ipc.ResultWriter``), larger ones by the queue's feeder thread.
A worker's first messages also carry ``(launched_at, ready_at, private bytes)``:
when the main process started it and when it was ready for its first task
(``time.monotonic()``, one clock for all processes), and its private memory
(USS) just after its first batch, read by a thread and sent with the second
message, for ``DataLoader.stats()``.

Two rules keep the main process from ever hanging on a worker:

* the result is pickled here, in the worker's main thread, before it is queued.
  A batch that cannot be pickled becomes an error that names the offending leaf,
  instead of dying silently in the queue's feeder thread (pytorch#142884);
* a watchdog thread ends the worker within half a second of the main process
  going away, even while user code is busy in ``__getitem__``.
"""
from __future__ import annotations

import errno
import faulthandler
import gc
import io
import os
import pickle
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import psutil
import torch
import torch.utils.data._utils.worker as _torch_worker

from . import _fault_hook, _host, _seeding, _stack_dump, _worker_tempdir
from ._datapipes import seed_graph, shard_graph
from ._errors import WorkerFailure, add_note
from ._fetch import Fetched, create_fetcher, fetch_task
from ._ipc import ResultWriter, Stopped, become_write_only, reader_ready
from ._pickling import describe_unpicklable, find_unpicklable
from ._protocol import IterableExhausted, ResumeIteration, StatefulResult, Task, WorkerResume
from ._stateful import StateTaker
from ._transport import Plain
from ._worker_spec import WorkerBasis

POLL_INTERVAL = 0.25  # seconds between checks that the main process is alive


@dataclass
class WorkerSpec(WorkerBasis):
    """Everything a worker process needs, pickled once per worker at start."""
    main_pid: int
    # The main process's StopFlag (_processes.py), set when it stops the workers:
    # the tasks still queued are skipped, not loaded (torch's _workers_done_event).
    stopping: Any
    # A resume: what each worker loads (the dataset's state before iterating, the
    # iterator's after iter()).
    resume_states: list[WorkerResume] | None = None
    ships_state: bool = False  # send the (dataset, iterator) state with every batch
    shared_seed: int | None = None  # an IterDataPipe's (_datapipes.py)
    # multiprocessing's temporary folder for this iterator's workers (_worker_tempdir.py)
    temp_dir: str | None = None


def _main_process_alive(main_pid: int, parent_pid: int) -> bool:
    """Whether the process that started this worker's iterator is alive.

    Its child is reparented when it dies (POSIX); and ``os.kill(pid, 0)``
    finds a main process that is not the parent (forkserver's workers).  Where
    signals are not POSIX's (Windows, where ``os.kill(pid, 0)`` sends Ctrl-C
    and nothing is reparented) and on the portable backend, psutil watches the
    main process itself, by pid and creation time so that a reused pid is not
    taken for it."""
    if os.getppid() != parent_pid:
        return False
    if not _host.HAS_POSIX_SIGNALS or not _host.fd_backend():
        return _watched(main_pid).is_running()
    try:
        os.kill(main_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class _Gone:
    """What ``_watched`` gives for a process already gone."""

    @staticmethod
    def is_running() -> bool:
        return False


_watching: dict = {}


def _watched(pid: int):
    """``psutil.Process(pid)``, made once: it holds the process's creation time."""
    process = _watching.get(pid)
    if process is None:
        try:
            process = psutil.Process(pid)
        except psutil.Error:
            process = _Gone()
        _watching[pid] = process
    return process


def _watch_main_process(main_pid: int, parent_pid: int, temp_dir: str | None,
                        temp_dir_at_start: str | None) -> None:
    while _main_process_alive(main_pid, parent_pid):
        time.sleep(POLL_INTERVAL)
    # The main process is gone: nobody will read what we produce, and user
    # code may be busy for a long time.  Leave now, with nothing left in /tmp
    # (os._exit skips multiprocessing's own cleanup; the main process cannot).
    _worker_tempdir.leave(temp_dir, temp_dir_at_start)
    os._exit(0)


def _enable_crash_traces() -> None:
    """Make a segfault print the worker's Python stack.  Under pytest's capsys or
    in some notebooks ``sys.stderr`` has no file descriptor; fall back to fd 2
    rather than let the worker die before its first task."""
    target: Any
    for target in (sys.stderr, sys.__stderr__, 2):
        try:
            faulthandler.enable(file=target)
            return
        except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
            continue


def _serialize(send_idx: int, payload, worker_id: int, task: Task | None,
               plain_tuples: bool = False):
    """The result message: (send_idx, worker_id, pickled payload).

    ``plain_tuples``: a tuple payload is a shared-memory batch's message, plain
    data that pickle's C pickler handles at a fraction of ForkingPickler's cost.

    The envelope always pickles, and names the sender, so the main process can
    blame the right worker even when the payload cannot be rebuilt (its
    sender died before handing over a file descriptor, say)."""
    try:
        if plain_tuples and type(payload) is tuple:
            return send_idx, worker_id, pickle.dumps(payload, pickle.HIGHEST_PROTOCOL)
        return send_idx, worker_id, bytes(ForkingPickler.dumps(payload))
    except Exception as exc:
        if isinstance(exc, (TypeError, AttributeError, pickle.PicklingError)):
            failure = _unsendable(exc, describe_unpicklable(_batch_in(payload)), worker_id, task)
        else:  # the batch pickles, but could not be sent: /dev/shm full, say
            _explain_send_error(exc)
            failure = WorkerFailure(exc, worker_id, "sending", task.indices if task else None,
                                    task.batch_index if task else None)
        return send_idx, worker_id, bytes(ForkingPickler.dumps(failure))


def _batch_in(payload):
    """The user's batch inside the wrappers a payload may have."""
    while True:
        if isinstance(payload, StatefulResult):
            payload = payload.value
        elif isinstance(payload, Plain):
            payload = payload.batch
        else:
            return payload


def _explain_send_error(exc: Exception) -> None:
    text = str(exc).lower()
    if "shared memory" in text or "shm" in text or getattr(exc, "errno", None) == errno.ENOSPC:
        add_note(exc,
            "This batch went through torch's transport (transport='torch', or a batch that did "
            "not fit torchfeed's shared-memory slots), which puts every tensor in /dev/shm, and "
            "/dev/shm is full. Give it more room (docker run --shm-size=2g, or a larger tmpfs), "
            "or lower batch_size, num_workers or prefetch_factor.")


def _unsendable(exc: Exception, detail: str, worker_id: int, task: Task | None):
    error = TypeError(
        f"DataLoader worker {worker_id} built a batch that cannot be sent to the main "
        f"process: {detail}. Convert it to a tensor, array, number or string in "
        f"__getitem__ or collate_fn, or drop it from the sample.")
    error.__cause__ = exc
    return WorkerFailure(error, worker_id, "sending", task.indices if task else None,
                         task.batch_index if task else None)


def settle_heap(enable_gc: bool) -> None:
    """Put everything this process inherited out of the collector's reach
    (NOTE [ The collector and fork ] in ``_processes.py``); ``enable_gc``: the
    parent paused the collector for the fork and it was on before."""
    gc.freeze()
    if enable_gc:
        gc.enable()


def worker_loop(spec: WorkerSpec, worker_id: int, index_queue, result_queue, channel,
                stack_pipe=None, enable_gc: bool = False, launched_at: float = 0.0) -> None:
    settle_heap(enable_gc)  # first: before anything here can trigger a collection
    # Ctrl-C reaches the whole process group; the main process decides when
    # workers stop, so a worker must not die half-way through a message.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _enable_crash_traces()  # a segfault prints the worker's Python stack to stderr
    _stack_dump.install(stack_pipe)  # the main asks for our stacks when it times out
    parent_pid = os.getppid()
    threading.Thread(target=_watch_main_process,
                     args=(spec.main_pid, parent_pid, spec.temp_dir, _worker_tempdir.in_use()),
                     name="torchfeed-watchdog", daemon=True).start()
    # Nobody else reads the result queue in a worker; holding its read end open
    # would keep a dead main process's pipe alive.  Then a write that fails
    # with EPIPE means the main process is gone: the watchdog ends us in a
    # moment, and the feeder thread's traceback would only bury the main
    # process's own error (or its clean Ctrl-C) in noise.
    become_write_only(result_queue)

    torch.set_num_threads(1)
    seed = _seeding.seed_worker(spec.base_seed, worker_id)
    dataset = seed_graph(spec.dataset, spec.shared_seed)  # as torch's worker does
    _torch_worker._worker_info = _torch_worker.WorkerInfo(
        id=worker_id, num_workers=spec.num_workers, seed=seed, dataset=dataset)

    init_failure = None
    try:
        shard_graph(dataset, spec.num_workers, worker_id)  # torch: before worker_init_fn
        if spec.worker_init_fn is not None:
            spec.worker_init_fn(worker_id)
    except Exception as exc:
        init_failure = WorkerFailure(exc, worker_id, "worker_init_fn")
    resume = spec.resume_states[worker_id] if spec.resume_states is not None else None
    if init_failure is None and resume is not None and resume.dataset_state is not None:
        try:
            dataset.load_state_dict(resume.dataset_state)
        except Exception as exc:
            init_failure = WorkerFailure(exc, worker_id, "dataset.load_state_dict")
    if init_failure is None and resume is not None and resume.ended_iterator_state is not None:
        try:
            iter(dataset).load_state_dict(resume.ended_iterator_state)
        except Exception as exc:
            init_failure = WorkerFailure(exc, worker_id, "iterator.load_state_dict")

    packer = channel.packer(worker_id)
    # torch's default_collate becomes one that stacks straight into the transport's slot.
    collate_fn = packer.choose_collate(spec.collate_fn)
    epoch = spec.epoch
    fetcher = create_fetcher(spec.is_iterable, dataset, spec.auto_collation,
                             collate_fn, spec.drop_last,
                             iterator_state=resume.iterator_state if resume is not None else None)
    if resume is not None and resume.exhausted:
        fetcher.exhausted = True  # the last batch the user got exhausted its stream
    taker = StateTaker(dataset, spec.is_iterable) if spec.ships_state else None
    exhausted = False
    results = ResultWriter(result_queue, spec.stopping.is_set)
    if _fault_hook.ENV in os.environ:  # tests only: die holding a primitive (read once)
        _fault_hook.install(spec, worker_id, index_queue, result_queue, results, packer)
    task_ready = reader_ready(index_queue)
    plain_tuples = packer.plain_tuples
    # Sent with the first message, and with the USS with the second: reading
    # it walks the page tables of everything inherited (tens to hundreds of
    # ms under a big parent heap), so a thread does it once the first batch
    # is on its way.
    started = [launched_at, time.monotonic(), None]
    reading = threading.Thread(target=_read_start_memory, args=(started,),
                               name="torchfeed-uss", daemon=True)
    start_reported = False
    try:
        while True:
            # Queue.get(timeout=...) builds and tears down a selector per call;
            # a cached poll, then a blocking get of the message now in the
            # pipe, costs a fraction of that per task.
            if not task_ready(POLL_INTERVAL):
                if not _main_process_alive(spec.main_pid, parent_pid):
                    break
                continue
            task = index_queue.get()
            if task is None:
                break
            if spec.stopping.is_set():
                continue  # the iterator is gone: drain to the None that ends us
            if isinstance(task, ResumeIteration):
                epoch = task.epoch
                exhausted = False
                dataset = seed_graph(dataset, task.shared_seed)
                fetcher = create_fetcher(spec.is_iterable, dataset, spec.auto_collation,
                                         collate_fn, spec.drop_last)
                results.put((task, worker_id, None, 0.0))
                continue
            if exhausted:
                continue  # the main process stops sending once it hears we are exhausted
            start = time.perf_counter()
            if init_failure is not None:
                payload, init_failure = init_failure.answering(task.indices, task.batch_index), None
            else:
                payload = _run_task(task, fetcher, taker, spec, worker_id, epoch, packer)
                if isinstance(payload, IterableExhausted):
                    exhausted = True
            message = _serialize(task.send_idx, payload, worker_id, task, plain_tuples)
            busy = time.perf_counter() - start  # fetch + collate + pack + pickle, for stats
            if start_reported:
                results.put((*message, busy))
            elif reading.ident is None:  # the first message: read the USS after it
                results.put((*message, busy, started[0], started[1], 0))
                reading.start()
            else:  # the second message waits for the reading (a CPU it would compete with)
                reading.join()
                results.put((*message, busy, *started))
                start_reported = True
            del payload, task
    except BrokenPipeError:
        pass  # the main process is gone; the watchdog would end us in a moment
    except Stopped:
        pass  # stopped while waiting for the write lock, which a dead worker may hold
    finally:
        if not _main_process_alive(spec.main_pid, parent_pid):
            _worker_tempdir.remove(spec.temp_dir)  # nobody else will (_worker_tempdir.leave)
        result_queue.close()
        if spec.stopping.is_set():
            # The main process reads nothing more, and the feeder may wait
            # for good on a write lock that a dead worker holds: leave it.
            result_queue.cancel_join_thread()
        else:
            # Let the feeder thread finish writing and release the queue's
            # write lock, shared by all workers, before this process exits.  A
            # worker exhausted mid-epoch (its iterable had nothing left) that
            # exited while its feeder still held the lock would leave every
            # other worker unable to send.  The flush cannot hang for good: if
            # the main process is gone the watchdog ends us, and if it is
            # shutting down it terminates us after its grace period.
            result_queue.join_thread()


def _read_start_memory(started: list) -> None:
    try:
        started[2] = psutil.Process().memory_full_info().uss
    except (psutil.Error, AttributeError, OSError):
        started[2] = 0  # not readable here: stats show no figure


def _run_task(task: Task, fetcher, taker, spec: WorkerSpec, worker_id: int, epoch: int,
              packer):
    if spec.seed_per_batch:
        _seeding.seed_batch(spec.base_seed, epoch, task.batch_index)
    fetched = fetch_task(task, fetcher, taker, spec.is_iterable, worker_id)
    if not isinstance(fetched, Fetched):
        return fetched  # a WorkerFailure or IterableExhausted
    try:
        payload = packer.pack(fetched.batch)
    except Exception as exc:
        # The shared-memory packer pickles the non-array leaves; name the one that failed.
        if find_unpicklable(fetched.batch) is not None:
            return _unsendable(exc, describe_unpicklable(fetched.batch), worker_id, task)
        return WorkerFailure(exc, worker_id, "packing", task.indices, task.batch_index)
    return fetched.wrap(payload, spec.ships_state)
