"""Datasets, collate functions and helpers shared by the core test files.

Everything a worker process needs is defined at module level, so it pickles by
reference and the same classes work under ``fork`` and ``spawn``.
"""
from __future__ import annotations

import collections
import ctypes
import dataclasses
import os
import random
import signal
import threading
import time

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

Point = collections.namedtuple("Point", ["x", "y"])


# -- map-style -------------------------------------------------------------------
class RangeDataset(Dataset):
    """Sample i is ``tensor([i, i+1, i+2])`` and the int i."""

    def __init__(self, n: int = 20):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.arange(i, i + 3), i


class GetItemsDataset(RangeDataset):
    """Batched fetch through ``__getitems__``; the samples say they came that way."""

    def __getitems__(self, indices):
        return [(torch.arange(i, i + 3), -i) for i in indices]


@dataclasses.dataclass
class Custom:
    """A type default_collate knows nothing about (it is collected into a list)."""
    value: int


class RichDataset(Dataset):
    """Every kind of leaf and container default_collate / default_convert handle.

    With ``uncollatable=True`` samples also hold what default_convert passes
    through but default_collate rejects: a custom type, a numpy string array
    and None."""

    def __init__(self, n: int = 12, uncollatable: bool = False):
        self.n = n
        self.uncollatable = uncollatable

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        sample = {
            "tensor": torch.full((2, 2), float(i)),
            "int": i,
            "float": i / 4,
            "bool": i % 2 == 0,
            "str": f"s{i}",
            "bytes": b"b%d" % i,
            "ndarray": np.arange(3, dtype=np.int16) + i,
            "np_scalar": np.float32(i) / 2,
            "np_int": np.int64(i),
            "point": Point(torch.tensor(i), [i, i * 2]),
            "nested": {"list": [i, (i, float(i))], "tuple": (torch.tensor([i]), f"t{i}")},
        }
        if self.uncollatable:
            sample["custom"] = Custom(i)
            sample["np_str_array"] = np.array(["a", "b"])
            sample["none"] = None
        return sample


class CustomTypeDataset(Dataset):
    """Samples holding a custom type, for a collate_fn_map that knows it."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        return {"custom": Custom(i), "x": torch.tensor(i)}


def _collate_custom(batch, *, collate_fn_map=None):
    return Custom(sum(c.value for c in batch))


def custom_type_collate(samples):
    """torch's documented way to teach default_collate a new type."""
    from torch.utils.data._utils.collate import collate, default_collate_fn_map

    return collate(samples, collate_fn_map={**default_collate_fn_map, Custom: _collate_custom})


class SlowIndexDataset(Dataset):
    """Sample ``slow`` takes ``delay`` seconds; the rest are instant.  With
    ``mark``, a file of that name is made as the slow sample begins."""

    def __init__(self, n: int = 12, slow: int = 0, delay: float = 1.0, mark: str | None = None):
        self.n, self.slow, self.delay, self.mark = n, slow, delay, mark

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.slow:
            if self.mark is not None:
                open(self.mark, "w").close()
            time.sleep(self.delay)
        return i


class SleepDataset(Dataset):
    """Every sample takes ``delay`` seconds."""

    def __init__(self, n: int = 1000, delay: float = 0.05):
        self.n, self.delay = n, delay

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.delay)
        return i


# -- iterable --------------------------------------------------------------------
class ShardedIterable(IterableDataset):
    """range(start, end), split between workers through get_worker_info()."""

    def __init__(self, start: int = 0, end: int = 23):
        self.start, self.end = start, end

    def __iter__(self):
        info = get_worker_info()
        if info is None:
            lo, hi = self.start, self.end
        else:
            per = -(-(self.end - self.start) // info.num_workers)
            lo = self.start + info.id * per
            hi = min(lo + per, self.end)
        for i in range(lo, hi):
            yield torch.tensor([i, -i])


class UnevenIterable(IterableDataset):
    """Worker k yields 3*k + 1 items, so workers end at different times."""

    def __iter__(self):
        info = get_worker_info()
        wid = 0 if info is None else info.id
        for j in range(3 * wid + 1):
            yield wid * 100 + j


class LyingLengthIterable(IterableDataset):
    """Reports a length smaller than what it yields."""

    def __len__(self):
        return 3

    def __iter__(self):
        info = get_worker_info()
        if info is not None and info.id != 0:
            return iter([])
        return iter(range(6))


# -- samplers ----------------------------------------------------------------------
class EveryOtherSampler(Sampler):
    """Odd indices backwards, then even ones forwards."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        yield from range(self.n - 1 if self.n % 2 == 0 else self.n - 2, -1, -2)
        yield from range(0, self.n, 2)

    def __len__(self):
        return self.n


class UnevenBatchSampler(Sampler):
    """Batches of growing size: [0], [1, 2], [3, 4, 5], ..."""

    def __init__(self, n: int):
        self.n = n

    def _batches(self):
        start, size = 0, 1
        while start < self.n:
            yield list(range(start, min(start + size, self.n)))
            start += size
            size += 1

    def __iter__(self):
        return self._batches()

    def __len__(self):
        return sum(1 for _ in self._batches())


# -- collate functions ---------------------------------------------------------------
def sum_collate(samples):
    """Custom collate: the sum of the tensors, and the indices as a tuple."""
    tensors, ids = zip(*samples)
    return {"sum": torch.stack(tensors).sum(0), "ids": tuple(ids)}


def list_collate(samples):
    return list(samples)


# -- seeds and worker info ---------------------------------------------------------------
class SeedProbe(Dataset):
    """Reports, for each sample, the worker that made it, its WorkerInfo, and the
    first values that worker drew from random, torch and numpy after seeding."""

    def __init__(self, n: int = 8):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        info = get_worker_info()
        if not hasattr(self, "_first"):
            self._first = (random.random(), torch.rand(()).item(), float(np.random.rand()))
        return {
            "index": i,
            "id": info.id,
            "num_workers": info.num_workers,
            "seed": info.seed,
            "initial_seed": torch.initial_seed(),
            "dataset_is_self": info.dataset is self,
            "first": torch.tensor(self._first, dtype=torch.float64),
            # Draws that depend on how far this worker's RNGs have advanced.
            "draws": torch.tensor([random.random(), torch.rand(()).item(),
                                   float(np.random.rand())], dtype=torch.float64),
        }


class WorkerInfoProbe(Dataset):
    """Returns what torch's and torchfeed's get_worker_info() say in the worker."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        import torchfeed

        ours, theirs = torchfeed.get_worker_info(), torch.utils.data.get_worker_info()
        return {"same": ours is theirs, "id": theirs.id, "num_workers": theirs.num_workers,
                "seed": theirs.seed, "dataset_is_self": theirs.dataset is self,
                "pid": os.getpid()}


class RandomAugment(Dataset):
    """A sample plus random 'augmentations' from all three global RNGs."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return (i, torch.rand(2), torch.tensor(np.random.randint(0, 1 << 30, size=2)),
                torch.tensor(random.getrandbits(30)))


# -- failures ------------------------------------------------------------------------------
class BadIndexError(Exception):
    pass


class TwoArgError(Exception):
    """An exception whose constructor cannot be called with a message alone."""

    def __init__(self, code, detail):
        super().__init__(f"{code}: {detail}")
        self.code, self.detail = code, detail


class FailingDataset(Dataset):
    """``__getitem__(bad)`` raises ``error`` (a type name from this module or builtins)."""

    def __init__(self, n: int = 12, bad: int = 5, error: str = "BadIndexError"):
        self.n, self.bad, self.error = n, bad, error

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            if self.error == "TwoArgError":
                raise TwoArgError(7, "needs two arguments")
            if self.error == "KeyError":
                raise KeyError(f"no sample {i}")
            raise BadIndexError(f"sample {i} is broken")
        return i


class FailingIterIterable(IterableDataset):
    """``__iter__`` itself raises (it is a plain function, not a generator)."""

    def __iter__(self):
        raise ValueError("cannot open the stream")


def failing_collate(samples):
    ids = [s[1] for s in samples]  # RangeDataset samples
    if 4 in ids:
        raise ZeroDivisionError("collate cannot handle sample 4")
    return torch.tensor(ids)


def failing_worker_init(worker_id):
    if worker_id == 1:
        raise OSError(f"worker_init_fn failed in worker {worker_id}")


class DyingDataset(Dataset):
    """Sample ``bad`` kills its worker: 'sigkill', 'segfault' or 'exit'."""

    def __init__(self, how: str, n: int = 12, bad: int = 5):
        self.how, self.n, self.bad = how, n, bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            if self.how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif self.how == "segfault":
                ctypes.string_at(0)
            elif self.how == "exit":
                os._exit(3)
            time.sleep(60)
        return i


class LockDataset(Dataset):
    """Sample 2 carries a threading.Lock deep inside it: it cannot be pickled."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        meta = [i, "ok"]
        if i == 2:
            meta.append(threading.Lock())
        return {"x": torch.tensor([i]), "meta": meta}


# -- pin memory ------------------------------------------------------------------------------
class PinnableBatch:
    """A batch type with its own pin_memory(), as torch's docs describe."""

    def __init__(self, data, pinned: bool = False):
        self.data = data
        self.pinned = pinned

    def pin_memory(self):
        return PinnableBatch(self.data, pinned=True)


def pinnable_collate(samples):
    return PinnableBatch([int(s[1]) for s in samples])
