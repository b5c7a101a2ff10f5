"""Worker processes: starting one (with its index queue and stack pipe) and stopping them all.

NOTE [ No thread of ours at a fork ]
Every worker, first start and restart alike, is started by ``launch_worker``,
and only while ``_alone_for_fork`` holds: torch's loader forks its workers
with only the main thread alive, and a fork from a process with threads can
deadlock the child on a lock another thread held (Python 3.12 warns at every
such fork).  Before the fork it waits for a running reading of the workers'
memory (``_worker_costs.finish_readings``), stops the portable backend's relay
threads (``_ipc.paused_for_fork``; they restart on the next wait), runs the
page-locked slots' pending releases and ends their thread (``_releaser.Releaser.no_thread``,
which starts no new one until the fork is done: a release deferred
meanwhile waits), and says once if the test-only fault hook is set in vain
(``_fault_hook.report_misuse``).  The iterator's own pin-memory thread is
started after its workers, and stopped before a restart (``_restart.py``).

NOTE [ Shutdown ]
Workers are told to stop with ``None`` on their index queue and given one
shared second to leave, then terminated, then killed: never 5 s per worker,
as torch's sequential joins can take.  Index queues have
``cancel_join_thread`` set, so their feeder threads never block interpreter
exit, and are closed and joined with a bound.  Workers also watch the main
process themselves (see ``_worker.py``), so a main process that is SIGKILLed
leaves nothing behind.

NOTE [ The collector and fork ]
A forked worker inherits the parent's heap and its GC counters.  Left alone,
the worker's first full collection walks every object it inherited: time
(0.5 s and more for a heap of a million dicts), and a write to each object's
GC header, which turns every page of the parent's heap into a private copy
in every worker.  CPython's remedy for fork without exec is ``gc.freeze()``
(see the ``gc`` docs): the worker moves what it inherited into the permanent
generation, which no collection visits, before its first collection.  Nothing
may collect in between, so the collector is paused in the parent for the few
milliseconds of ``Process.start()`` (a fork inherits it paused) and the
worker turns it back on right after freezing (``_worker.settle_heap``).
Freezing is O(1) (a list splice), and the parent's own objects and frozen set
are left as they are.  Objects the worker creates itself are collected as
usual.  Under forkserver the worker is forked from the server, whose heap
(torch, preloaded modules) is shared the same way, so it freezes too.

NOTE [ Forkserver preload ]
Under forkserver each worker is forked from one server process, which by
default has imported only ``__main__``: every worker then imports torch again
(about a second), at every epoch without persistent workers.  When the first
worker is about to start the server, torch, torchfeed and the module that
defines the dataset join the server's preload list (after whatever the user
put there), so workers are forked with them already imported.  The server is
one per process whatever context object the user passed (the string or the
object: the context's meaning is unchanged); its list is put back once it
runs, and a server already running is left as it is.  The dataset's module is
added only where the server would import that same file (``_server_finds``);
``__main__`` is the server's own default where it has a file (an interactive
``__main__`` has none: nothing to preload, today's behaviour).
"""
from __future__ import annotations

import contextlib
import gc
import importlib.machinery
import os
import pickle
import site
import sys
import threading
import time
import warnings
import weakref

from . import _fault_hook, _worker_tempdir
from ._ipc import IndexQueue, join_process, paused_for_fork
from ._pickling import describe_unpicklable
from ._stack_dump import StackPipe
from ._torch_compat import WARNS_OF_PICKLE_ERROR
from ._transport import _page_lock
from ._worker import WorkerSpec, worker_loop
from ._worker_costs import finish_readings

SHUTDOWN_GRACE = 1.0  # seconds all workers share to exit before termination

# When each worker process was launched (time.monotonic()), for stats().
_launched: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# One start at a time pauses the collector, so two threads starting workers
# cannot disagree about whether it was on (NOTE [ The collector and fork ]).
_gc_pause_lock = threading.Lock()

_TORCH_PICKLE_WARNING = (  # torch's, word for word
    "Got pickle error when attempting to start a worker Process. "
    "This might be because the worker Process arguments are not picklable. "
    "Python 3.14+ changed the multiprocessing start method in non-Mac POSIX platforms "
    "to 'forkserver', which requires the worker Process arguments to be picklable. "
    "You can also try multiprocessing.set_start_method('fork').")


@contextlib.contextmanager
def _alone_for_fork():
    """No thread of torchfeed's alive while the block runs (NOTE [ No thread of
    ours at a fork ]); a warning naming one that would not end."""
    _fault_hook.report_misuse()
    finish_readings()
    releaser = _page_lock.releaser
    with paused_for_fork(), releaser.no_thread():
        if releaser.running():
            warnings.warn("torchfeed: forking a DataLoader worker while the thread that gives "
                          "page-locked slots back still runs: a copy to the GPU from a slot "
                          "has not finished in 30 s.", RuntimeWarning, stacklevel=4)
        yield


def launch_worker(ctx, spec: WorkerSpec, worker_id: int, result_queue, channel):
    """Start worker ``worker_id``: ``(index_queue, stack_pipe, process)``.

    With the spawn and forkserver start methods the dataset, collate_fn and
    worker_init_fn are pickled; when one cannot be, the error names it."""
    index_queue = IndexQueue(ctx)
    stack_pipe = StackPipe(ctx)
    method = ctx.get_start_method() if hasattr(ctx, "get_start_method") else "?"
    try:
        with _gc_pause_lock, _alone_for_fork():
            # A forked child inherits the pause and ends it once it has frozen
            # what it inherited; other methods start with the collector on.
            gc_enabled = gc.isenabled()
            launched_at = time.monotonic()
            process = ctx.Process(target=worker_loop, name=f"torchfeed-worker-{worker_id}",
                                  args=(spec, worker_id, index_queue.queue, result_queue, channel),
                                  kwargs={"stack_pipe": stack_pipe.writer,
                                          "enable_gc": gc_enabled and method == "fork",
                                          "launched_at": launched_at},
                                  daemon=True)
            _worker_tempdir.hand_to(process, spec.temp_dir)
            if method == "fork":
                gc.disable()
            preloaded = _preload_forkserver(spec.dataset) if method == "forkserver" else None
            try:
                process.start()
            finally:
                if gc_enabled:
                    gc.enable()
                if preloaded is not None:
                    _forkserver().set_forkserver_preload(preloaded)
    except (TypeError, AttributeError, pickle.PicklingError) as exc:
        index_queue.close()
        stack_pipe.close()
        parts = {"dataset": spec.dataset, "collate_fn": spec.collate_fn,
                 "worker_init_fn": spec.worker_init_fn}
        culprits = [f"{name}: {describe_unpicklable(value).replace('batch', name, 1)}"
                    for name, value in parts.items()
                    if value is not None and _unpicklable(value)]
        detail = "; ".join(culprits) or str(exc)
        # torch warns (2.10 on), then re-raises pickle's own error: keep both,
        # with pickle's sentence as the first line and what to do after it.
        if WARNS_OF_PICKLE_ERROR:
            warnings.warn(_TORCH_PICKLE_WARNING, stacklevel=5)
        raise type(exc)(
            f"{exc}\n"
            f"DataLoader could not start worker {worker_id} with the '{method}' start "
            f"method, which pickles the dataset, collate_fn and worker_init_fn: {detail}. "
            "Define them at module level (no lambdas or local functions), or use "
            "multiprocessing_context='fork' where available.") from exc
    except BaseException:
        index_queue.close()
        stack_pipe.close()
        raise
    stack_pipe.started()
    _launched[process] = launched_at
    return index_queue, stack_pipe, process


def launched_at(process) -> float | None:
    """When ``launch_worker`` started ``process`` (``time.monotonic()``)."""
    try:
        return _launched.get(process)
    except TypeError:
        return None


def _forkserver():
    import multiprocessing.forkserver  # only where the method is used: Windows has none

    return multiprocessing.forkserver._forkserver


def _preload_forkserver(dataset):
    """Add torch, torchfeed and the dataset's module to the preload list of a
    fork server about to start (NOTE [ Forkserver preload ]); the user's list, to
    put back once it runs, or None where there is nothing to do."""
    server = _forkserver()
    if getattr(server, "_forkserver_pid", 0) is not None:
        return None  # running already, or a Python whose server we do not know
    user_list = list(getattr(server, "_preload_modules", None) or [])
    ours = ["torch", "torchfeed"] + _defining_modules(dataset)
    server.set_forkserver_preload(user_list + [m for m in ours if m not in user_list])
    return user_list


def start_forkserver_now(dataset) -> None:
    """Start the fork server now, with its preload list (NOTE [ Forkserver
    preload ]), so that it imports torch while the main process still has
    work to do before its first worker (``share_dataset=True``); that worker
    then finds it running.  A server already running is left as it is."""
    preloaded = _preload_forkserver(dataset)
    if preloaded is None:
        return
    try:
        _forkserver().ensure_running()
    finally:
        _forkserver().set_forkserver_preload(preloaded)


def _defining_modules(dataset) -> list[str]:
    """The module that defines the dataset's class (and, for a wrapper such as
    torch's Subset, the wrapped dataset's), where the server would import
    that very file."""
    found = []
    for obj in (dataset, getattr(dataset, "dataset", None)):
        name = getattr(type(obj), "__module__", None) if obj is not None else None
        if (isinstance(name, str) and name not in found and name != "__main__"
                and not name.startswith(("torch.", "torchfeed.")) and _server_finds(name)):
            found.append(name)
    return found


def _server_finds(name: str) -> bool:
    """Whether a fork server would import the same file for module ``name``.

    The server is a fresh interpreter: its path is the working directory,
    PYTHONPATH and the installation's own folders, not what this process added
    to ``sys.path`` at run time (Python 3.11 ignores the path it is sent).  A
    module found only through such an addition would fail to import there, and
    one whose name another file on the server's path shadows (a local
    ``datasets.py`` and the ``datasets`` package) would be the wrong module in
    every worker: neither is preloaded."""
    top = sys.modules.get(name.partition(".")[0])
    if top is None:
        return False  # not imported
    origin = getattr(getattr(top, "__spec__", None), "origin", None)
    if not origin or not os.path.isfile(origin):
        return False  # built at run time, a namespace package, or a frozen module
    folder = os.path.dirname(origin)
    if getattr(top.__spec__, "submodule_search_locations", None) is not None:
        folder = os.path.dirname(folder)  # a package: its parent folder is on the path
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    roots = [os.getcwd(), *pythonpath]
    try:
        roots += [*site.getsitepackages(), site.getusersitepackages()]
    except AttributeError:  # an old virtualenv's site module
        pass
    real = os.path.realpath
    if real(folder) not in {real(r) for r in roots}:
        return False
    spec = importlib.machinery.PathFinder.find_spec(top.__name__, [os.getcwd(), *pythonpath, *sys.path])
    return spec is not None and spec.origin is not None and real(spec.origin) == real(origin)


class StopFlag:
    """The main process's "stop": set once when it stops the workers, read by
    each worker before each task, so that it skips the tasks still queued ahead
    of its ``None`` instead of loading them (torch's ``_workers_done_event``).

    One byte of shared memory and no lock (NOTE [ Cross-process primitives ]
    in CONTRIBUTING.md).  A ``multiprocessing.Event`` would take its
    Condition's lock in every ``is_set()``: a worker SIGKILLed inside that call
    leaves the lock taken for good, and the main process's ``set()`` then
    waits forever.  Here a read and a write of one aligned byte are all there
    is, so a worker that dies at any instant holds nothing; a worker that reads
    the byte just before it is set loads one more task, and still gets its
    ``None``.  Pickled only as a worker's start argument, like any shared ctype."""

    def __init__(self, ctx) -> None:
        self._byte = ctx.RawValue("b", 0)

    def set(self) -> None:
        self._byte.value = 1

    def is_set(self) -> bool:
        return self._byte.value != 0


def stop_workers(workers, index_queues, stopping: StopFlag) -> None:
    """Ask every live worker to exit, then terminate and kill the stragglers.

    ``stopping`` (the flag every worker holds) is set first, so that a worker
    skips the tasks still queued ahead of its ``None`` instead of loading them.
    Nothing here waits on anything a worker can hold: the flag has no lock, a
    ``None`` is a non-blocking write (``IndexQueue.put``), and every join has
    a deadline.
    """
    stopping.set()
    for worker_id, process in enumerate(workers):
        if process.is_alive():
            try:
                index_queues[worker_id].put(None)
            except (ValueError, OSError):
                pass  # queue already closed
    deadline = time.monotonic() + SHUTDOWN_GRACE
    for process in workers:  # joins sliced: a sentinel can stay quiet (_ipc/_wait.py)
        join_process(process, max(0.0, deadline - time.monotonic()))
    for process in workers:
        if process.is_alive():
            process.terminate()
            join_process(process, 0.5)
        if process.is_alive():
            process.kill()
            join_process(process, 0.5)


def _unpicklable(value) -> bool:
    try:
        pickle.dumps(value)
        return False
    except Exception:
        return True
