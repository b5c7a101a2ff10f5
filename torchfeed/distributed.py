"""Rank-aware sampling on ``torch.distributed``, and resume across a changed world size.

This module owns the stage in front of the sampler under DDP: which rank gets
which indices, and how a job saved at one world size continues at another.

``DistributedSampler``
    A subclass of ``torch.utils.data.distributed.DistributedSampler`` with the
    same constructor, validation and output. It shards ONE global order per
    epoch (``torch.randperm`` from a generator seeded with ``seed + epoch``, or
    ``range(len(dataset))`` without shuffle) across ranks: rank ``r`` of ``W``
    takes the positions ``r, r + W, r + 2W, ...`` of that order, padded or cut
    exactly as torch does. Its state is a global position in that order, never
    a rank-specific list.

State (``state_dict()``: plain ints and bools, safe for ``json`` and for
``torch.load(weights_only=True)``)::

    {"kind": "torchfeed.DistributedSampler", "version": 1,
     "epoch": 3, "seed": 0, "shuffle": True, "drop_last": False,
     "dataset_len": 1000,
     "samples_consumed": 640,   # positions 0..639 of the epoch order are done
     "world_size": 2}           # saved at; for information only

Elastic rule. A state with ``samples_consumed = c`` resumes, at any world size
``W'``, on the remainder ``order[c:]`` of the same epoch (``R = N - c``
indices), treated the way torch treats a whole epoch:

* ``drop_last=False``: the remainder is padded to ``ceil(R / W') * W'`` with
  the head of the epoch order, ``order[0], order[1], ...`` (cycling if needed),
  exactly as torch pads a full epoch. The ranks together yield the remainder
  plus ``p < W'`` padding indices. When ``c >= p`` (any checkpoint past the
  first ``W' - 1`` samples) the padding indices were consumed before the
  checkpoint, so every remaining sample is yielded exactly once; earlier, a
  padding index can be a remaining one and is yielded twice, as in torch.
* ``drop_last=True``: the remainder is cut to ``floor(R / W') * W'``; the last
  ``R mod W'`` remaining samples are skipped, as torch skips a full epoch's tail.
  Every other remaining sample is yielded exactly once, and nothing repeats.
* The padded or cut remainder is dealt round-robin: rank ``r`` takes its
  positions ``r, r + W', ...``.

Consequences: resuming at ``c = 0`` is exactly a fresh torch epoch at ``W'``;
resuming at the world size the state was saved at gives exactly the indices an
uninterrupted run would have yielded next; after the resumed pass, the next
epoch (``set_epoch(epoch + 1)``) is exactly an uninterrupted run's at ``W'``.
``samples_consumed`` never exceeds ``N``: a position inside an epoch's padding
means the whole epoch order was consumed. Note that with ``drop_last=True`` the
tail a run at ``W`` would have skipped is part of the remainder at ``W'``.

Lockstep, and which rank's state to keep. Every rank computes the position as
``start + consumed * W``, assuming all ranks consumed the same number of
indices, as they do under DDP (every step takes one batch on every rank).
Then every rank's state is identical, and ANY rank's state is enough to
resume: save rank 0's. If ranks may differ (an uneven last step, a rank that
died mid-step), gather all states and pass them to ``merge_states``, which
keeps the smallest position: nothing is skipped, and at most the samples the
faster ranks consumed after it are repeated.

With ``torchfeed.DataLoader`` the sampler's state travels inside
``loader.state_dict()`` (``sampler_state``, protocol ``"position"``). At the
same world size, each rank may load its own loader state. At another world
size, load one rank's (rank 0's) on every rank: coverage is exact, and the
only per-rank value it carries is the epoch's worker base seed, which matters
to random augmentations for the rest of that epoch if ranks seed differently.

The ``state_dict_at`` protocol. A loader prefetches, so the sampler has handed
out more indices than the user consumed, and ``state_dict()`` (which counts
the indices this sampler yielded) runs ahead. A loader therefore calls
``sampler.state_dict_at(consumed)`` on any sampler that has it, where
``consumed`` is the number of this rank's indices that reached the user since
the latest ``iter(sampler)``: since the start of the epoch, or since the resume
point when that iteration was a resumed one. Before the next ``iter()``, right
after ``load_state_dict``, ``consumed`` counts from the resume point too, so
``state_dict_at(0)`` returns the loaded position. To restore, the loader calls
``load_state_dict(state)`` and then ``iter(sampler)`` yields only this rank's
share of the remainder; it must not also skip indices itself.
``set_epoch(e)`` with a new epoch discards a pending resume position (with a
warning if it still had indices to yield), so the usual loop
``sampler.set_epoch(epoch)`` with the checkpoint's epoch keeps it.

IterableDatasets under DDP: ``rank_and_world_size``, ``shard_info``,
``shard_iterable`` and ``check_iterable_world_size`` live in
``_iterable_shards.py`` and are public from here.
"""
from __future__ import annotations

import warnings
from typing import Iterator, Sequence

import torch
from torch.utils.data.distributed import DistributedSampler as _TorchDistributedSampler

from ._chunked_sampler import chunks
from ._iterable_shards import check_iterable_world_size, rank_and_world_size, shard_info, shard_iterable

__all__ = [
    "DistributedSampler",
    "merge_states",
    "rank_and_world_size",
    "shard_info",
    "shard_iterable",
    "check_iterable_world_size",
]

_KIND = "torchfeed.DistributedSampler"
_VERSION = 1
_INT_FIELDS = ("version", "epoch", "seed", "dataset_len", "samples_consumed", "world_size")
_BOOL_FIELDS = ("shuffle", "drop_last")


class DistributedSampler(_TorchDistributedSampler):
    """torch's ``DistributedSampler``, resumable at any world size.

    Same arguments, errors and (without a resume) the same indices as
    ``torch.utils.data.distributed.DistributedSampler``: one global order per
    epoch (``torch.randperm`` seeded with ``seed + epoch``, or
    ``range(len(dataset))``), rank ``r`` of ``W`` taking its positions
    ``r, r + W, ...``, padded or cut as torch does.  Adds `state_dict()`,
    `state_dict_at()` and `load_state_dict()`: the state is a global position
    in the epoch's order, so a job saved at one world size continues the epoch
    at another (the docs' "Multiple GPUs and nodes" gives the rule at the
    edges).  A ``torchfeed.DataLoader`` saves and restores it inside its own
    ``state_dict()``.

    Args:
        dataset: a sized dataset.
        num_replicas (int): the world size; default: from the current
            ``torch.distributed`` process group.
        rank (int): this process's rank; default: from the process group.
        shuffle (bool): shuffle each epoch's order (default ``True``).
        seed (int): the shuffle's seed, the same on every rank (default 0).
        drop_last (bool): cut the epoch's tail to a multiple of the world
            size instead of padding it with the order's head (default
            ``False``).

    Raises:
        RuntimeError: ``num_replicas`` or ``rank`` left out without
            ``torch.distributed`` available (torch's error).
        ValueError: ``rank`` outside ``[0, num_replicas - 1]`` (torch's
            error).
    """

    def __init__(
        self,
        dataset,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)
        self._resume_at: int | None = None  # set by load_state_dict, used by the next iter()
        self._start = 0  # global position the latest (or pending) pass starts at
        self._yielded = 0  # indices this rank yielded in the latest pass
        self._pass = 0  # so that an abandoned iterator stops counting
        self._len_start = 0  # start of the pending or unfinished pass, for __len__

    # -- the epoch order and this rank's share of it ---------------------------

    def _order(self) -> torch.Tensor:
        n = len(self.dataset)  # type: ignore[arg-type]  # a sized dataset, as torch's sampler needs
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            return torch.randperm(n, generator=g)
        return torch.arange(n)

    def _pass_size(self, start: int) -> int:
        """Global slots (all ranks) in a pass over ``order[start:]``."""
        rest, w = len(self.dataset) - start, self.num_replicas  # type: ignore[arg-type]  # a sized dataset, as torch's sampler needs
        return (rest // w) * w if self.drop_last else -(-rest // w) * w

    def _shard(self, start: int) -> torch.Tensor:
        order = self._order()
        n, size = len(order), self._pass_size(start)
        indices = order[start : start + size]
        pad = size - len(indices)
        if pad > 0:  # the head of the epoch order, cycled, as torch pads
            indices = torch.cat([indices, order[torch.arange(pad) % n]])
        # This rank's share as a tensor of its own (8 bytes per index; the
        # epoch's order is freed), made into Python ints a chunk at a time.
        return indices[self.rank :: self.num_replicas].clone()

    def __iter__(self) -> Iterator[int]:
        start = 0 if self._resume_at is None else self._resume_at
        self._resume_at = None
        self._start, self._yielded, self._len_start = start, 0, start
        self._pass += 1
        return self._count(self._shard(start), self._pass)

    def _count(self, indices: torch.Tensor, pass_id: int) -> Iterator[int]:
        for index in chunks(indices):
            if pass_id == self._pass:
                self._yielded += 1
            yield index
        if pass_id == self._pass:
            self._len_start = 0

    def __len__(self) -> int:
        """Indices this rank yields in the unfinished or pending pass."""
        start = self._len_start if self._resume_at is None else self._resume_at
        return self._pass_size(start) // self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Deal ``epoch``'s order at the next ``iter()``, as torch's ``set_epoch``.

        With another epoch than the one a loaded state continues, the loaded
        position is discarded, with a warning if it still had indices to
        yield; ``set_epoch`` with the loaded epoch keeps it.

        Args:
            epoch (int): the epoch whose order to deal.
        """
        if epoch != self.epoch:
            if self._resume_at is not None and self._pass_size(self._resume_at) > 0:
                warnings.warn(
                    f"DistributedSampler.set_epoch({epoch}) discards the resume position "
                    f"loaded for epoch {self.epoch} (sample {self._resume_at} of "
                    f"{len(self.dataset)}); call set_epoch({self.epoch}) to continue it",  # type: ignore[arg-type]  # a sized dataset, as torch's sampler needs
                    stacklevel=2,
                )
            self._resume_at = None
            self._start = self._yielded = self._len_start = 0
        super().set_epoch(epoch)

    # -- state -----------------------------------------------------------------

    def state_dict(self) -> dict:
        """The state after the indices this sampler yielded.

        A prefetching loader has taken indices its loop has not received yet;
        a loader calls `state_dict_at()` instead.

        Returns:
            dict: plain ints and bools (``kind``, ``version``, ``epoch``,
                ``seed``, ``shuffle``, ``drop_last``, ``dataset_len``,
                ``samples_consumed``, ``world_size``), safe for ``json`` and
                ``torch.load(weights_only=True)``.
        """
        return self.state_dict_at(self._yielded)

    def state_dict_at(self, consumed: int) -> dict:
        """The state once ``consumed`` of this rank's indices of the latest pass were used.

        Args:
            consumed (int): this rank's indices that reached the training loop
                since the latest ``iter(sampler)`` (or since the loaded
                position, before the next ``iter()``).

        Returns:
            dict: the state, as `state_dict()` gives it.

        Raises:
            TypeError: ``consumed`` is not an int.
            ValueError: ``consumed`` is negative or more than this rank's
                pass holds.
        """
        start = self._start if self._resume_at is None else self._resume_at
        available = self._pass_size(start) // self.num_replicas
        if isinstance(consumed, bool) or not isinstance(consumed, int):
            raise TypeError(f"consumed must be an int, got {type(consumed).__name__}")
        if not 0 <= consumed <= available:
            raise ValueError(
                f"consumed={consumed} is outside this rank's pass of {available} indices "
                f"(epoch {self.epoch}, starting at sample {start}); count the indices "
                "consumed since the latest iter(sampler)"
            )
        position = min(start + consumed * self.num_replicas, len(self.dataset))  # type: ignore[arg-type]  # a sized dataset, as torch's sampler needs
        return {
            "kind": _KIND,
            "version": _VERSION,
            "epoch": int(self.epoch),
            "seed": int(self.seed),
            "shuffle": bool(self.shuffle),
            "drop_last": bool(self.drop_last),
            "dataset_len": len(self.dataset),  # type: ignore[arg-type]  # a sized dataset, as torch's sampler needs
            "samples_consumed": int(position),
            "world_size": int(self.num_replicas),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue ``state``'s epoch at its position, at this sampler's world size.

        Takes effect at the next ``iter()``, which yields this rank's share of
        the rest of the epoch; sets the sampler's epoch to the state's.

        Args:
            state (dict): a state from `state_dict()` or `state_dict_at()` of
                a sampler at any world size (rank 0's, say), or from
                `merge_states()`.

        Raises:
            ValueError: the state is malformed, or does not describe the same
                order (dataset length, seed, shuffle, drop_last).
        """
        _validate(state)
        for field, mine in (
            ("dataset_len", len(self.dataset)),  # type: ignore[arg-type]  # a sized dataset, as torch's sampler needs
            ("seed", self.seed),
            ("shuffle", self.shuffle),
            ("drop_last", self.drop_last),
        ):
            if state[field] != mine:
                raise ValueError(
                    f"DistributedSampler state has {field}={state[field]!r} but this sampler "
                    f"has {field}={mine!r}; build the sampler with the same dataset, seed, "
                    "shuffle and drop_last as the run that saved the state"
                )
        self.epoch = state["epoch"]
        self._resume_at = state["samples_consumed"]
        self._start, self._yielded = self._resume_at, 0


def _validate(state) -> None:
    if not isinstance(state, dict):
        raise ValueError(f"DistributedSampler state must be a dict, got {type(state).__name__}")
    if state.get("kind") != _KIND:
        raise ValueError(
            f"not a torchfeed.DistributedSampler state: kind={state.get('kind')!r}, "
            f"expected {_KIND!r}"
        )
    missing = [f for f in _INT_FIELDS + _BOOL_FIELDS if f not in state]
    if missing:
        raise ValueError(f"DistributedSampler state is missing {', '.join(missing)}")
    if state["version"] != _VERSION:
        raise ValueError(
            f"DistributedSampler state has version={state['version']!r}, "
            f"this torchfeed reads version={_VERSION}"
        )
    for f in _INT_FIELDS:
        v = state[f]
        if isinstance(v, bool) or not isinstance(v, int) or (v < 0 and f != "seed"):
            raise ValueError(f"DistributedSampler state has {f}={v!r}, expected an int >= 0")
    for f in _BOOL_FIELDS:
        if not isinstance(state[f], bool):
            raise ValueError(f"DistributedSampler state has {f}={state[f]!r}, expected a bool")
    if state["samples_consumed"] > state["dataset_len"]:
        raise ValueError(
            f"DistributedSampler state has samples_consumed={state['samples_consumed']} "
            f"> dataset_len={state['dataset_len']}"
        )
    if state["world_size"] < 1:
        raise ValueError(f"DistributedSampler state has world_size={state['world_size']}, expected >= 1")


def merge_states(states: Sequence[dict]) -> dict:
    """One resumable state from every rank's state (e.g. ``dist.all_gather_object``).

    Ranks in lockstep have identical states, and this returns that state. If
    positions differ, it returns the smallest: no sample is skipped, and at
    most the samples faster ranks consumed past it are yielded again.

    Args:
        states: one `DistributedSampler` state per rank.

    Returns:
        dict: the state to load on every rank.

    Raises:
        ValueError: no state, a malformed one, or states of different runs
            or epochs (another epoch, seed, shuffle, drop_last or dataset
            length).
    """
    if not states:
        raise ValueError("merge_states needs at least one state")
    for s in states:
        _validate(s)
    first = states[0]
    for s in states[1:]:
        for field in ("epoch", "seed", "shuffle", "drop_last", "dataset_len"):
            if s[field] != first[field]:
                raise ValueError(
                    f"cannot merge DistributedSampler states from different runs or epochs: "
                    f"{field}={first[field]!r} and {field}={s[field]!r}"
                )
    return dict(min(states, key=lambda s: s["samples_consumed"]))
