"""What every worker of one iterator starts from, process or thread.

``WorkerBasis`` holds the fields both kinds read the same way: the dataset
and how to fetch and collate from it, the seeds, ``worker_init_fn`` and the
epoch.  ``_worker.WorkerSpec`` (pickled once per worker process) and
``_thread_worker.ThreadWorkerSpec`` (shared by the threads, read, never
written) add what only their kind needs: how a process finds its main
process, how a thread knows the main thread is waiting.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class WorkerBasis:
    is_iterable: bool
    dataset: Any
    auto_collation: bool
    collate_fn: Callable
    drop_last: bool
    base_seed: int
    worker_init_fn: Callable | None
    num_workers: int
    epoch: int
    seed_per_batch: bool
