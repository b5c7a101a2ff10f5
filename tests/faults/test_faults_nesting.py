"""Item 12: two loaders at once in one process, and a loader inside a worker.

Workers are daemonic processes, and a daemonic process cannot have children:
torch fails with multiprocessing's AssertionError, "daemonic processes are not
allowed to have children".  torchfeed fails at ``iter()`` of the inner loader
with the same type and sentence, then says what to do (``num_workers=0`` for the
inner loader), and that inner loader works.
"""
import time

import pytest
import torch
from faults_datasets import make_dataset
from faults_helpers import SURFACE_WITHIN, iterate_until_failure
from torch.utils.data import Dataset

from torchfeed import DataLoader


def _batches(loader):
    return [b.clone() for b in loader]


@pytest.mark.timeout(30)
def test_two_loaders_iterate_at_once(loader_config, no_pin_warning):
    kwargs = dict(batch_size=4, num_workers=2, **loader_config.kwargs())
    a = DataLoader(make_dataset(loader_config.kind, n=40), **kwargs)
    b = DataLoader(make_dataset(loader_config.kind, n=24), **kwargs)
    expected_a = _batches(DataLoader(make_dataset(loader_config.kind, n=40), batch_size=4))
    expected_b = _batches(DataLoader(make_dataset(loader_config.kind, n=24), batch_size=4))
    for _ in range(2 if loader_config.persistent else 1):
        got_a, got_b = [], []
        it_a, it_b = iter(a), iter(b)
        for x in it_b:  # interleaved: one from each while both last
            got_b.append(x.clone())
            got_a.append(next(it_a).clone())
        got_a.extend(x.clone() for x in it_a)
        del it_a, it_b
        # Iterable datasets come back worker by worker; compare as sets of rows.
        def key(bs):
            return sorted(map(tuple, torch.cat(bs).tolist()))
        assert key(got_a) == key(expected_a)
        assert key(got_b) == key(expected_b)
        if loader_config.kind == "map":
            assert all(torch.equal(x, y) for x, y in zip(got_a, expected_a))


class LoadsInside(Dataset):
    """Each sample is built by a loader of its own, run inside the worker."""

    def __init__(self, inner_workers):
        self.inner_workers = inner_workers

    def __len__(self):
        return 8

    def __getitem__(self, i):
        inner = DataLoader(make_dataset("map", n=6), batch_size=3, num_workers=self.inner_workers)
        return torch.cat(list(inner)).sum() + i


@pytest.mark.timeout(30)
def test_loader_inside_a_worker_says_to_use_num_workers_0():
    loader = DataLoader(LoadsInside(inner_workers=2), batch_size=2, num_workers=2)
    started = time.time()
    failure = iterate_until_failure(loader)
    assert failure.raised_at - started < SURFACE_WITHIN
    assert failure.type is AssertionError, failure  # torch's type, through the worker
    msg = failure.message
    assert msg.startswith("Caught AssertionError in DataLoader worker process 0.\n"), msg
    assert "\nAssertionError: daemonic processes are not allowed to have children\n" in msg, msg
    assert "iterated inside DataLoader worker process 0 of another loader" in msg, msg
    assert "num_workers=0" in msg, msg
    assert "daemonic processes are not allowed to have children" in msg, msg


@pytest.mark.timeout(30)
def test_loader_inside_a_worker_works_with_num_workers_0():
    total = sum(int(i) for i in range(6) for i in (i, 2 * i))  # one inner epoch's sum
    got = torch.cat(list(DataLoader(LoadsInside(inner_workers=0), batch_size=2, num_workers=2)))
    assert got.tolist() == [total + i for i in range(8)]
