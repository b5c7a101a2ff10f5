"""Where an IterableDataset's items go under ``torch.distributed``: this
process's rank and world size, each DataLoader worker's global shard, and the
check that a per-rank iterable state resumes at the world size it was saved at.

``shard_info()`` gives a worker its global shard,
``(rank * num_workers + worker_id, world_size * num_workers)``; a dataset keeps
the items whose running count ``i`` has ``i % num_shards == shard_id`` (see
``shard_iterable``). Every rank then reads a disjoint share, and every
DataLoader worker of a rank a disjoint part of it. A per-rank iterable state
only means something at the world size it was saved at: a loader records
``rank_and_world_size()[1]`` in its state and calls
``check_iterable_world_size(saved, current)`` on resume, which raises
``ValueError`` naming both values.

Public through ``torchfeed.distributed``; the loader's own modules import it
from here, without the sampler.
"""
from __future__ import annotations

import itertools
import os
from typing import Iterable, Iterator

import torch.distributed as dist
from torch.utils.data import get_worker_info

__all__ = ["rank_and_world_size", "shard_info", "shard_iterable", "check_iterable_world_size"]


def rank_and_world_size() -> tuple[int, int]:
    """``(rank, world_size)`` of this process.

    From ``torch.distributed`` when a process group is up (also in a forked
    DataLoader worker, which inherits it), else from the ``RANK`` and
    ``WORLD_SIZE`` environment variables that torchrun sets (a spawned worker
    inherits those), else ``(0, 1)``.

    Returns:
        tuple[int, int]: ``(rank, world_size)``.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is not None and world is not None:
        return int(rank), int(world)
    return 0, 1


def shard_info(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """``(shard_id, num_shards)`` of the calling DataLoader worker across the whole job.

    ``shard_id = rank * num_workers + worker_id`` and
    ``num_shards = world_size * num_workers``; outside a worker, the worker
    counts as ``(0, 1)``. ``rank`` and ``world_size`` default to
    ``rank_and_world_size()``. Every rank must use the same ``num_workers``.

    Args:
        rank (int): this process's rank; default: `rank_and_world_size()`'s.
        world_size (int): the number of ranks; default:
            `rank_and_world_size()`'s.

    Returns:
        tuple[int, int]: ``(shard_id, num_shards)``.

    Raises:
        ValueError: ``rank`` outside ``[0, world_size - 1]``.
    """
    if rank is None or world_size is None:
        found_rank, found_world = rank_and_world_size()
        rank = found_rank if rank is None else rank
        world_size = found_world if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"Invalid rank {rank}, rank should be in the interval [0, {world_size - 1}]")
    info = get_worker_info()
    worker_id, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
    return rank * num_workers + worker_id, world_size * num_workers


def shard_iterable(iterable: Iterable, rank: int | None = None, world_size: int | None = None) -> Iterator:
    """The items of ``iterable`` that belong to the calling worker's global shard.

    Use it in ``IterableDataset.__iter__``: ``return shard_iterable(self.source())``.
    Every item is read by every worker and kept by one; shard at the source
    (files, row groups) when reading is expensive, with the same ``shard_info()``.

    Args:
        iterable: the items every worker of every rank would read.
        rank (int): as for `shard_info()`.
        world_size (int): as for `shard_info()`.

    Returns:
        Iterator: the items ``i`` with ``i % num_shards == shard_id``.

    Raises:
        ValueError: ``rank`` outside ``[0, world_size - 1]``.
    """
    shard_id, num_shards = shard_info(rank, world_size)
    return itertools.islice(iterable, shard_id, None, num_shards)


def check_iterable_world_size(saved: int | None, current: int | None = None) -> None:
    """Raise ``ValueError`` if an IterableDataset state saved at ``saved`` ranks resumes at another world size.

    Args:
        saved (int): the world size the state was saved at; ``None`` (a
            state that did not record it) passes.
        current (int): the world size now; default:
            ``rank_and_world_size()[1]``.

    Raises:
        ValueError: ``saved`` and ``current`` differ; the message names both.
    """
    if current is None:
        current = rank_and_world_size()[1]
    if saved is not None and saved != current:
        raise ValueError(
            f"this IterableDataset state was saved at world size {saved}, but the job now runs "
            f"at world size {current}: a per-rank iterable state only resumes at the world size "
            f"it was saved at. Resume with {saved} ranks, or use a map-style dataset with "
            "torchfeed.DistributedSampler, which resumes at any world size"
        )
