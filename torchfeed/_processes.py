"""Worker processes: starting one (with its index queue and stack pipe) and stopping them all.

NOTE [ Shutdown ]
Workers are told to stop with ``None`` on their index queue and given one
shared second to leave, then terminated, then killed: never 5 s per worker,
as torch's sequential joins can take.  Index queues have
``cancel_join_thread`` set, so their feeder threads never block interpreter
exit, and are closed and joined with a bound.  Workers also watch the main
process themselves (see ``_worker.py``), so a main process that is SIGKILLed
leaves nothing behind.
"""
from __future__ import annotations

import pickle
import threading
import time
import warnings

from ._index_queue import IndexQueue
from ._pickling import describe_unpicklable
from ._stack_dump import StackPipe
from ._worker import WorkerSpec, worker_loop

SHUTDOWN_GRACE = 1.0  # seconds all workers share to exit before termination

_TORCH_PICKLE_WARNING = (  # torch's, word for word
    "Got pickle error when attempting to start a worker Process. "
    "This might be because the worker Process arguments are not picklable. "
    "Python 3.14+ changed the multiprocessing start method in non-Mac POSIX platforms "
    "to 'forkserver', which requires the worker Process arguments to be picklable. "
    "You can also try multiprocessing.set_start_method('fork').")


def launch_worker(ctx, spec: WorkerSpec, worker_id: int, result_queue, channel):
    """Start worker ``worker_id``: ``(index_queue, stack_pipe, process)``.

    With the spawn and forkserver start methods the dataset, collate_fn and
    worker_init_fn are pickled; when one cannot be, the error names it."""
    index_queue = IndexQueue(ctx)
    stack_pipe = StackPipe(ctx)
    process = ctx.Process(target=worker_loop, name=f"torchfeed-worker-{worker_id}",
                          args=(spec, worker_id, index_queue.queue, result_queue, channel),
                          kwargs={"stack_pipe": stack_pipe.writer}, daemon=True)
    try:
        process.start()
    except (TypeError, AttributeError, pickle.PicklingError) as exc:
        index_queue.close()
        stack_pipe.close()
        method = ctx.get_start_method() if hasattr(ctx, "get_start_method") else "?"
        parts = {"dataset": spec.dataset, "collate_fn": spec.collate_fn,
                 "worker_init_fn": spec.worker_init_fn}
        culprits = [f"{name}: {describe_unpicklable(value).replace('batch', name, 1)}"
                    for name, value in parts.items()
                    if value is not None and _unpicklable(value)]
        detail = "; ".join(culprits) or str(exc)
        # torch warns, then re-raises pickle's own error: keep both, with
        # pickle's sentence as the first line and what to do after it.
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
