"""DataPipe datasets: seeded and sharded as torch's DataLoader does it.

torch's iterators treat ``IterDataPipe`` and ``MapDataPipe`` datasets
specially (``_BaseDataLoaderIter``, ``_SingleProcessDataLoaderIter``,
``_MultiProcessingDataLoaderIter`` and ``_utils/worker.py``), and so does
torchfeed, step for step:

* the shared seed: for an ``IterDataPipe``, one int64 drawn from the loader's
  generator (the global RNG without one), broadcast from rank 0 over a gloo
  group when ``torch.distributed`` is initialized, and handed to
  ``graph_settings.apply_random_seed`` through a ``torch.Generator`` seeded
  with it.  Every worker (and every rank) seeds its copy of the graph the same
  way, so all ``shuffle()`` stages deal the same order and a
  ``sharding_filter()`` after them keeps each sample exactly once.  torch draws
  it when an iterator is made and again at each epoch's reset (``_reset``,
  which a multi-process iterator runs at once as well), so the loader's
  generator advances as it does under torch;
* sharding: ``graph_settings.apply_sharding`` with ``num_workers × world_size``
  instances, worker ``k`` of rank ``r`` being instance ``k × world_size + r``,
  before the user's ``worker_init_fn``; without workers, ``world_size``
  instances, this rank being instance ``rank``.

Where each step runs: the draws in ``_index_stream.py`` (with the epoch's other
draws, so a resumed epoch replays them), the main process's seeding in
``_iterator_base.py``, the worker's seeding and sharding in ``_worker.py``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import IterDataPipe, MapDataPipe
from torch.utils.data.graph_settings import apply_random_seed, apply_sharding


def is_iter_datapipe(dataset) -> bool:
    return isinstance(dataset, IterDataPipe)


def is_datapipe(dataset) -> bool:
    return isinstance(dataset, (IterDataPipe, MapDataPipe))


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class SharedSeed:
    """Draws torch's shared seed for one iterator (``_share_dist_seed``)."""

    def __init__(self) -> None:
        self._group = None  # torch makes one gloo group per iterator, on first need

    def draw(self, generator) -> int:
        seed = torch.empty((), dtype=torch.int64).random_(generator=generator)
        if _distributed():
            if self._group is None:
                self._group = dist.new_group(backend="gloo")
            dist.broadcast(seed, src=0, group=self._group)
        return int(seed.item())


def seed_graph(dataset, shared_seed: int | None):
    """``apply_random_seed`` with a generator seeded from ``shared_seed``; the
    graph it returns (torch rebinds its dataset to it)."""
    if shared_seed is None or not is_iter_datapipe(dataset):
        return dataset
    rng = torch.Generator()
    rng.manual_seed(shared_seed)
    return apply_random_seed(dataset, rng)


def shard_graph(dataset, num_workers: int, worker_id: int) -> None:
    """torch's sharding of a DataPipe graph, for worker ``worker_id`` of
    ``num_workers`` (``num_workers=0``: the main process loads)."""
    if not is_datapipe(dataset):
        return
    world_size, rank = (dist.get_world_size(), dist.get_rank()) if _distributed() else (1, 0)
    if num_workers == 0:
        apply_sharding(dataset, world_size, rank)
    else:
        apply_sharding(dataset, num_workers * world_size, worker_id * world_size + rank)
