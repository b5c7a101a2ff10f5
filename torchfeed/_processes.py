"""Worker processes: starting one (with its index queue and stack pipe) and stopping them all.

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
"""
from __future__ import annotations

import gc
import pickle
import threading
import time

from ._index_queue import IndexQueue
from ._pickling import describe_unpicklable
from ._stack_dump import StackPipe
from ._worker import WorkerSpec, worker_loop

SHUTDOWN_GRACE = 1.0  # seconds all workers share to exit before termination

# One start at a time pauses the collector, so two threads starting workers
# cannot disagree about whether it was on (NOTE [ The collector and fork ]).
_gc_pause_lock = threading.Lock()


def launch_worker(ctx, spec: WorkerSpec, worker_id: int, result_queue, channel):
    """Start worker ``worker_id``: ``(index_queue, stack_pipe, process)``.

    With the spawn and forkserver start methods the dataset, collate_fn and
    worker_init_fn are pickled; when one cannot be, the error names it."""
    index_queue = IndexQueue(ctx)
    stack_pipe = StackPipe(ctx)
    method = ctx.get_start_method() if hasattr(ctx, "get_start_method") else "?"
    try:
        with _gc_pause_lock:
            # A forked child inherits the pause and ends it once it has frozen
            # what it inherited; other methods start with the collector on.
            gc_enabled = gc.isenabled()
            process = ctx.Process(target=worker_loop, name=f"torchfeed-worker-{worker_id}",
                                  args=(spec, worker_id, index_queue.queue, result_queue, channel),
                                  kwargs={"stack_pipe": stack_pipe.writer,
                                          "enable_gc": gc_enabled and method == "fork"},
                                  daemon=True)
            if method == "fork":
                gc.disable()
            try:
                process.start()
            finally:
                if gc_enabled:
                    gc.enable()
    except (TypeError, AttributeError, pickle.PicklingError) as exc:
        index_queue.close()
        stack_pipe.close()
        parts = {"dataset": spec.dataset, "collate_fn": spec.collate_fn,
                 "worker_init_fn": spec.worker_init_fn}
        culprits = [f"{name}: {describe_unpicklable(value).replace('batch', name, 1)}"
                    for name, value in parts.items()
                    if value is not None and _unpicklable(value)]
        detail = "; ".join(culprits) or str(exc)
        raise type(exc)(
            f"DataLoader could not start worker {worker_id} with the '{method}' start "
            f"method, which pickles the dataset, collate_fn and worker_init_fn: {detail}. "
            "Define them at module level (no lambdas or local functions), or use "
            "multiprocessing_context='fork' where available.") from exc
    except BaseException:
        index_queue.close()
        stack_pipe.close()
        raise
    stack_pipe.started()
    return index_queue, stack_pipe, process


def stop_workers(workers, index_queues) -> None:
    """Ask every live worker to exit, then terminate and kill the stragglers."""
    for worker_id, process in enumerate(workers):
        if process.is_alive():
            try:
                index_queues[worker_id].put(None)
            except (ValueError, OSError):
                pass  # queue already closed
    deadline = time.monotonic() + SHUTDOWN_GRACE
    for process in workers:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in workers:
        if process.is_alive():
            process.terminate()
            process.join(timeout=0.5)
        if process.is_alive():
            process.kill()
            process.join(timeout=0.5)


def close_queue(q) -> None:
    q.cancel_join_thread()
    q.close()
    feeder = getattr(q, "_thread", None)
    if feeder is not None and feeder is not threading.current_thread():
        feeder.join(timeout=1.0)


def _unpicklable(value) -> bool:
    try:
        pickle.dumps(value)
        return False
    except Exception:
        return True
