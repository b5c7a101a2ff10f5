"""Bad input: nonsense constructor arguments fail at construction; a sampler
that yields out-of-range indices fails with an error naming the index and
``len(dataset)``, while a lookup that fails for an index in range (a ``__len__``
that lies, a dict inside ``__getitem__``) is torch's error alone; an IterableDataset that yields
nothing warns (torch is silent; an empty dataset is legal, so no error).
"""
import time

import pytest
import torch
from faults_helpers import SURFACE_WITHIN, Failure, iterate_until_failure
from torch.utils.data import Dataset, IterableDataset

from torchfeed import DataLoader, _errors


class Tiny(Dataset):
    """Ten samples in a list: an index past the end raises IndexError, as most
    real datasets do.  (One that serves any index is never stopped: torch does
    not check indices against len(dataset), and neither does torchfeed.)"""

    def __init__(self):
        self.samples = [torch.tensor([i]) for i in range(10)]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


@pytest.mark.parametrize("kwargs,words", [
    (dict(num_workers=-1), "num_workers option should be non-negative"),
    (dict(prefetch_factor=2), "prefetch_factor option could only be specified in multiprocessing"),
    (dict(batch_sampler=[[0, 1]], shuffle=True), "batch_sampler option is mutually exclusive"),
    (dict(timeout=-1), "timeout option should be non-negative"),
    (dict(persistent_workers=True), "persistent_workers option needs num_workers > 0"),
    (dict(sampler=[0, 1], shuffle=True), "sampler option is mutually exclusive with shuffle"),
    (dict(batch_size=None, drop_last=True), "batch_size=None option disables auto-batching"),
    (dict(num_workers=2, prefetch_factor=-1), "prefetch_factor option should be non-negative"),
    (dict(max_worker_restarts=-1), "max_worker_restarts must be"),
    (dict(max_worker_restarts=1.5), "max_worker_restarts must be"),
])
def test_nonsense_arguments_fail_at_construction(kwargs, words):
    with pytest.raises((ValueError, TypeError), match=words):
        DataLoader(Tiny(), **kwargs)


class LyingLength(Dataset):
    """Says 12, holds 10."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9][i]])


class DictLookup(Dataset):
    """Looks each sample up by name; sample 5's name is missing, so an index in
    range raises KeyError from the dataset's own dict."""

    table = {f"img_{i}": i for i in range(10) if i != 5}

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return torch.tensor([self.table[f"img_{i}"]])


def _torchs_failure(loader) -> Failure:
    """torch's failure, its iterator shut down as the exception goes.

    torch re-raises a worker's error from a frame that holds the exception
    (``ExceptionWrapper.reraise``), so the traceback keeps the iterator in a
    reference cycle.  Freed by the collector, the iterator's index queues are
    finalized before its ``__del__``, the ``None`` it sends each worker never
    leaves, and torch waits 5 s per worker before terminating them: 10 s of
    torch's teardown per test, and nothing this test compares.  Dropping the
    traceback frees the iterator by reference count, as torch expects."""
    try:
        for batch in loader:
            del batch
    except Exception as exc:
        failure = Failure(exc, time.time(), 0)
        exc.__traceback__ = None
        return failure
    pytest.fail("torch's loader ran its epoch without an error")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("dataset_cls", [LyingLength, DictLookup])
def test_lookup_error_for_an_index_in_range_is_torchs_alone(dataset_cls, num_workers):
    """The index was in range: the failed lookup may be the dataset's own, so
    nothing blames the sampler or __len__; the error is torch's."""
    started = time.time()
    failure = iterate_until_failure(DataLoader(dataset_cls(), batch_size=4,
                                               num_workers=num_workers))
    theirs = _torchs_failure(torch.utils.data.DataLoader(dataset_cls(), batch_size=4,
                                                         num_workers=num_workers))
    assert failure.raised_at - started < SURFACE_WITHIN
    assert failure.type is theirs.type, (failure, theirs)
    assert failure.notes == theirs.notes == [], failure.notes
    assert "len(dataset)" not in failure.message and "__len__" not in failure.message, failure
    assert failure.message.splitlines()[0] == theirs.message.splitlines()[0]
    assert failure.message.splitlines()[-1] == theirs.message.splitlines()[-1]
    if num_workers == 0:
        assert failure.message == theirs.message


@pytest.mark.timeout(30)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_sampler_out_of_range_names_index_and_length(num_workers):
    loader = DataLoader(Tiny(), batch_size=2, sampler=[3, 4, 5, 17, 6, 7],
                        num_workers=num_workers)
    started = time.time()
    failure = iterate_until_failure(loader)
    assert failure.raised_at - started < SURFACE_WITHIN
    assert failure.type is IndexError, failure
    msg = _with_notes(failure)
    assert "The sampler asked for index 17, but len(dataset) is 10: out of range" in msg, msg
    if num_workers:
        assert "sample indices [5, 17]" in msg, msg


@pytest.mark.timeout(30)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_notes_reach_the_user_without_add_note(num_workers, monkeypatch):
    # As on Python 3.10, which has no BaseException.add_note: the explanation
    # must then travel in the message itself (workers are forked, so they see
    # the patched flag too).
    monkeypatch.setattr(_errors, "_NATIVE_NOTES", False)
    loader = DataLoader(Tiny(), batch_size=2, sampler=[3, 4, 5, 17], num_workers=num_workers)
    failure = iterate_until_failure(loader)
    assert failure.type is IndexError, failure
    assert failure.notes == [], failure.notes
    assert "The sampler asked for index 17, but len(dataset) is 10" in failure.message, failure


class Empty(IterableDataset):
    def __iter__(self):
        return iter([])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_empty_iterable_warns(num_workers):
    with pytest.warns(UserWarning, match="IterableDataset Empty yielded no batches this epoch"):
        assert list(DataLoader(Empty(), batch_size=2, num_workers=num_workers)) == []


def _with_notes(failure):
    return failure.message + "\n" + "\n".join(failure.notes)
