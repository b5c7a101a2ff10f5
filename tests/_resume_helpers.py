"""Datasets, samplers and the interrupt/resume harness shared by the resume tests.

Everything here is defined at module level so that workers can unpickle it
under any start method.
"""
from __future__ import annotations

import json
import os
import random

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

SEED = 1234


# -- datasets -------------------------------------------------------------------
class Ids(Dataset):
    """Sample i is i.  Counts __getitem__ calls in this process."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        self.calls += 1
        return i


class SlowFirst(Ids):
    """Sample 0 takes a while, so later batches overtake it (in_order=False)."""

    def __getitem__(self, i):
        if i == 0:
            import time
            time.sleep(0.8)
        return super().__getitem__(i)


class Augmented(Ids):
    """A random augmentation from all three RNGs: what seed_per_batch makes reproducible."""

    def __getitem__(self, i):
        return (i, torch.rand(()).item(), random.random(), float(np.random.rand()))


class Stream(IterableDataset):
    """Yields 0..n-1 split across workers, reshuffled per epoch of this copy.

    With ``state_dict``/``load_state_dict`` (torchdata's Stateful protocol): the
    state is this copy's epoch and how many items of its shard it produced.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = 0
        self.pos = 0

    def _shard(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        shard = list(range(wid, self.n, nw))
        random.Random(self.epoch * 1000 + wid).shuffle(shard)
        return shard

    def __iter__(self):
        shard = self._shard()
        while self.pos < len(shard):
            self.pos += 1
            yield shard[self.pos - 1]
        self.epoch += 1
        self.pos = 0


class IteratorStream(IterableDataset):
    """Yields 0..n-1 split across workers, its state in the iterator ``__iter__``
    returns (a new one per call), not on the dataset: so thread workers, which
    share the one dataset object, each keep their own (torchdata's Stateful
    iterator)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        shard = list(range(wid, self.n, nw))
        random.Random(wid).shuffle(shard)
        return _ShardIterator(shard)


class _ShardIterator:
    def __init__(self, shard) -> None:
        self.shard, self.pos = shard, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.pos >= len(self.shard):
            raise StopIteration
        self.pos += 1
        return self.shard[self.pos - 1]

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


class StatefulStream(Stream):
    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state):
        self.epoch, self.pos = state["epoch"], state["pos"]


# -- samplers -------------------------------------------------------------------
class EpochSampler(Sampler):
    """A user sampler with its own state: a new permutation per epoch it counts itself."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n).tolist()
        self.epoch += 1
        return iter(order)

    def state_dict(self):
        return {"epoch": self.epoch}

    def load_state_dict(self, state):
        self.epoch = state["epoch"]


class EagerGlobalSampler(Sampler):
    """No state, and draws from the global torch RNG inside __iter__ itself."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter(torch.randperm(self.n).tolist())


class PositionSampler(Sampler):
    """The ``state_dict_at`` protocol (as torchfeed.DistributedSampler has it): a
    seeded permutation per epoch, and a position in it."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed, self.epoch = n, seed, 0
        self._resume_at = None
        self._start = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n - (self._resume_at or 0)

    def __iter__(self):
        start = self._resume_at or 0
        self._resume_at, self._start = None, start
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.n, generator=g)[start:].tolist())

    def state_dict_at(self, consumed: int) -> dict:
        return {"epoch": self.epoch, "position": self._start + consumed}

    def load_state_dict(self, state) -> None:
        self.epoch = state["epoch"]
        self._resume_at = state["position"]


# -- the harness -------------------------------------------------------------------
def ids(batch):
    if isinstance(batch, torch.Tensor):
        return batch.tolist()
    if isinstance(batch, (list, tuple)):
        return [ids(b) for b in batch]
    if isinstance(batch, dict):
        return {k: ids(v) for k, v in batch.items()}
    return batch


def run_epochs(loader, epochs: int, before_epoch=None, start: int = 0):
    out = []
    for e in range(start, start + epochs):
        if before_epoch is not None:
            before_epoch(loader, e)
        out.append([ids(b) for b in loader])
    return out


def close(loader) -> None:
    """Stop a persistent iterator's workers now rather than whenever gc gets to it."""
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()


def disturb_rngs() -> None:
    """Move torch's, numpy's and Python's global RNGs somewhere new, as a new process
    would have them: a resume that does not load its state no longer matches."""
    torch.manual_seed(987654321)
    np.random.seed(98765)
    random.seed(98765)


def roundtrip(state: dict, how: str = "json", tmp_path=None) -> dict:
    if how == "json":
        return json.loads(json.dumps(state))
    path = os.path.join(str(tmp_path), "state.pt")
    torch.save(state, path)
    return torch.load(path, weights_only=True)


def _position(state: dict) -> dict:
    return {k: state[k] for k in ("epoch", "epoch_finished", "batches_yielded",
                                  "samples_yielded")}


def uninterrupted(make, epochs: int, before_epoch=None):
    """The run check_resume compares against: ``epochs`` epochs of a fresh
    ``make()`` from SEED, and where its loader ends.  It depends on nothing
    else, so checks of several k with the same ``make`` may share one."""
    torch.manual_seed(SEED)
    reference = make()
    full = run_epochs(reference, epochs, before_epoch)
    where = _position(reference.state_dict())
    close(reference)
    return full, where


def check_resume(make, k: int, epochs: int, *, finished: bool = False, make_resumed=None,
                 restore_global: bool = True, before_epoch=None, how: str = "json",
                 tmp_path=None, current_epoch_only: bool = False, reference=None):
    """Take k batches, save, resume on a fresh loader: the rest must equal an uninterrupted run.

    ``finished``: k ends an epoch and the state is taken after its StopIteration.
    ``make_resumed`` builds the resumed loader (default ``make``): elastic cases.
    ``current_epoch_only``: compare the rest of the epoch in progress only.
    ``reference``: ``uninterrupted(make, epochs, before_epoch)``, when several
    checks share it (each run with workers starts them afresh: ~0.1 CPU-s).
    The global RNG is scrambled between save and resume, as a new process would
    have it, and put back from the checkpoint when ``restore_global``.
    """
    full, where = reference or uninterrupted(make, epochs, before_epoch)

    torch.manual_seed(SEED)
    loader = make()
    epoch, j = 0, 0
    if before_epoch is not None:
        before_epoch(loader, 0)
    it = iter(loader)
    taken = []
    while len(taken) < k:
        try:
            taken.append(ids(next(it)))
            j += 1
        except StopIteration:
            epoch, j = epoch + 1, 0
            if before_epoch is not None:
                before_epoch(loader, epoch)
            it = iter(loader)
    if finished:
        assert j == len(full[epoch]), "finished=True needs k at the end of an epoch"
        try:
            next(it)
            raise AssertionError("expected the epoch to be over")
        except StopIteration:
            pass
    state = roundtrip(loader.state_dict(), how, tmp_path)
    global_rng = torch.get_rng_state()
    close(loader)
    del it, loader

    torch.manual_seed(987654321)  # a new process
    resumed = (make_resumed or make)()
    resumed.load_state_dict(state)
    if restore_global:
        torch.set_rng_state(global_rng)
    # A map-style state after an epoch's last batch is at that epoch's end, StopIteration
    # or not: the resumed loader starts the next epoch.
    at_end = j == len(full[epoch]) and not isinstance(resumed.dataset, IterableDataset)
    if finished or at_end:
        got = run_epochs(resumed, epochs - epoch - 1, before_epoch, start=epoch + 1)
        expected = full[epoch + 1:]
    else:
        got = run_epochs(resumed, epochs - epoch, before_epoch, start=epoch)
        expected = [full[epoch][j:]] + full[epoch + 1:]
    # Where the resumed loader ends is where the uninterrupted one did: a resume that
    # ignored the state would count its epochs from 0 (and, at an epoch's end with the
    # global RNG put back, yield the same batches).
    assert _position(resumed.state_dict()) == where, (_position(resumed.state_dict()), where)
    close(resumed)
    if not restore_global or current_epoch_only:  # only the epoch in progress is promised
        got, expected = got[:1], expected[:1]
    assert [b for e in full for b in e][:k] == taken
    assert got == expected, f"k={k}: resumed {got} != uninterrupted {expected}"
    return state


class BucketSampler(Sampler):
    """A bucketing batch sampler: no state, shuffles with numpy's and Python's global
    RNGs inside __iter__ (the whole order before its first batch)."""

    def __init__(self, n: int, batch_size: int) -> None:
        self.n, self.batch_size = n, batch_size

    def __len__(self) -> int:
        return -(-self.n // self.batch_size)

    def __iter__(self):
        order = np.random.permutation(self.n).tolist()
        batches = [sorted(order[i:i + self.batch_size])
                   for i in range(0, self.n, self.batch_size)]
        random.shuffle(batches)
        return iter(batches)
