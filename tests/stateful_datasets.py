"""Datasets for tests/test_stateful.py, importable by spawned workers.

Each follows torchdata's Stateful protocol (``state_dict()`` with no arguments,
``load_state_dict(state)``) or deliberately breaks it.
"""
from __future__ import annotations

import random

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


class Counting(Dataset):
    """Map-style, with its own state: each sample carries how many samples this copy made.

    Stands for a dataset with its own RNG or shuffle: ``__getitem__`` depends on
    what the copy did before.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.made = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        self.made += 1
        return [i, self.made]

    def state_dict(self):
        return {"made": self.made}

    def load_state_dict(self, state):
        self.made = state["made"]


class SelfIterating(IterableDataset):
    """Builds its iteration state in ``__iter__`` and returns ``self`` (litdata's shape).

    Each ``__iter__`` starts this copy's next epoch (a new shuffle of its shard);
    each sample is ``[value, iters]``, ``iters`` being how many times ``__iter__``
    ran on this copy, so a loader that calls it more than once per epoch shows.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = -1
        self.iters = 0
        self.order: list = []
        self.pos = 0

    def __iter__(self):
        self.iters += 1
        self._build(self.epoch + 1)
        return self

    def _build(self, epoch: int) -> None:
        self.epoch = epoch
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        self.order = list(range(wid, self.n, nw))
        random.Random(epoch * 100 + wid).shuffle(self.order)
        self.pos = 0

    def __next__(self):
        if self.pos >= len(self.order):
            raise StopIteration
        self.pos += 1
        return [self.order[self.pos - 1], self.iters]

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state):
        # Meaningful after __iter__, which this state's position is within.
        self._build(state["epoch"])
        self.pos = state["pos"]


class ArgsState(IterableDataset):
    """``state_dict`` needs arguments (mosaicml-streaming's and litdata's shape): not Stateful."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(wid, self.n, nw))

    def state_dict(self, num_samples, from_beginning):
        raise AssertionError("a state_dict that needs arguments must never be called")

    def load_state_dict(self, state):
        raise AssertionError("never called either")


class RaisingState(Dataset):
    """Stateful by signature, but its ``state_dict()`` raises."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return i

    def state_dict(self):
        raise ValueError("no state here")

    def load_state_dict(self, state):
        pass


class RandomDraws(IterableDataset):
    """Each worker's share, drawn at random from torch's global RNG by a Stateful
    iterator whose state holds that RNG (torchdata's ``DummyIterator``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        return RandomDrawsIterator(list(range(wid, self.n, nw)))


class RandomDrawsIterator:
    def __init__(self, shard: list) -> None:
        self.shard, self.i = shard, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= len(self.shard):
            raise StopIteration
        self.i += 1
        return self.shard[int(torch.randint(len(self.shard), ()))]

    def state_dict(self):
        return {"i": self.i, "rng": torch.get_rng_state()}

    def load_state_dict(self, state):
        self.i = state["i"]
        torch.set_rng_state(state["rng"])


class GlobalRngItems(Dataset):
    """Map-style: each item is a draw from torch's global RNG, and the dataset's
    state is that RNG (torchdata's ``DummyMapDataset`` with ``shuffle=True``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return [i, int(torch.randint(1000, ()))]

    def state_dict(self):
        return {"rng": torch.get_rng_state()}

    def load_state_dict(self, state):
        torch.set_rng_state(state["rng"])
