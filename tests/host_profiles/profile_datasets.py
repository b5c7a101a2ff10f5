"""Datasets for ``profile_checks.py``, at module level so that spawned workers
(the only kind Windows has) can unpickle them."""
from __future__ import annotations

import os
import time

import torch
from torch.utils.data import Dataset


class Samples(Dataset):
    """Sample i: a small tensor and a label, plus a large list attribute
    (``share_dataset=True`` finds it; it is shared only where the host can)."""

    def __init__(self, n: int = 48) -> None:
        self.n = n
        self.captions = [f"caption {i}" for i in range(40_000)]  # more than 1 MiB

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return torch.full((3,), float(i)), i % 5


class Failing(Samples):
    """Sample ``bad`` raises ValueError."""

    def __init__(self, bad: int) -> None:
        super().__init__()
        self.bad = bad

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError(f"sample {i} is broken")
        return super().__getitem__(i)


class Dying(Samples):
    """Sample ``bad`` ends its worker with exit code 3, once it has written the
    time (``time.time()``) to ``mark``.  Samples are tensors: under the
    profiles' ``file_system`` sharing the batches go through torch's shared
    memory, whose manager process inherits the worker's end of its sentinel
    pipe and keeps it open after the worker's death (NOTE [ A sentinel held
    open ] in torchfeed/_ipc/_wait.py): the death must be seen all the same."""

    def __init__(self, bad: int, mark: str) -> None:
        super().__init__()
        self.bad, self.mark = bad, mark

    def __getitem__(self, i):
        if i == self.bad:
            with open(self.mark, "w") as f:
                f.write(repr(time.time()))
            os._exit(3)
        return torch.tensor([i])


class Slow(Samples):
    """Sample ``slow`` takes ``seconds``."""

    def __init__(self, slow: int, seconds: float) -> None:
        super().__init__()
        self.slow, self.seconds = slow, seconds

    def __getitem__(self, i):
        if i == self.slow:
            time.sleep(self.seconds)
        return super().__getitem__(i)
