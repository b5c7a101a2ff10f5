"""Streaming each sample's big arrays into the slot as it arrives (_stream.py):
same batches as torch, the sample's memory freed before the next fetch, and
torch's behaviour whenever a sample does not fit the first one's layout."""

from __future__ import annotations

import collections
import threading
import weakref

import numpy as np
import pytest
import torch
from loader_helpers import assert_same, both_kinds, torch_kwargs
from torch.utils.data import Dataset, IterableDataset, default_collate

import torchfeed
from torchfeed._transport import SampleStream, create_channel
from torchfeed._transport._stream import STREAM_MIN_BATCH_BYTES, STREAM_MIN_BYTES

Views = collections.namedtuple("Views", "left right")
BATCH = 16
LENGTH = 6 * BATCH  # three batches per worker: all but each worker's first are streamed


class BigSamples(Dataset):
    """Samples whose big arrays are streamed, in every nesting and dtype the
    streaming handles, each with a flag: was the previous sample's big array
    still alive when this one was fetched?"""

    def __init__(self, kind: str):
        self.kind = kind
        self.last: dict = {}  # per thread: thread workers share the dataset

    def __len__(self):
        return LENGTH

    def _big(self, i, dtype=torch.float32, side=192):
        t = torch.arange(3 * side * side, dtype=torch.float64).reshape(3, side, side)
        return ((t + i) % 97).to(dtype)

    def __getitem__(self, i):
        last = self.last.get(threading.get_ident())
        previous_alive = last is not None and last() is not None
        if self.kind == "tensor":
            big = self._big(i)
            sample = (big, i, previous_alive)
        elif self.kind == "numpy":
            big = np.ascontiguousarray(self._big(i, torch.uint8, 320).permute(1, 2, 0).numpy())
            sample = {"image": big, "name": f"s{i}", "small": torch.tensor([i, -i]),
                      "previous_alive": previous_alive}
        else:  # nested, several dtypes, a non-contiguous input
            big = self._big(i, torch.bfloat16, 256).transpose(1, 2)
            sample = Views(left=[big, self._big(i, torch.bool, 320), 2.5 * i],
                           right={"c": self._big(i, torch.complex64, 128),
                                  "flag": previous_alive})
        self.last[threading.get_ident()] = weakref.ref(big)
        return sample


def _flags(batch, kind):
    if kind == "tensor":
        return batch[2]
    if kind == "numpy":
        return batch["previous_alive"]
    return batch.right["flag"]


def _drop_flags(batch, kind):
    if kind == "tensor":
        return batch[:2]
    if kind == "numpy":
        return {k: v for k, v in batch.items() if k != "previous_alive"}
    return Views(batch.left, batch.right["c"])


@pytest.mark.timeout(120)
@both_kinds
@pytest.mark.parametrize("kind", ["tensor", "numpy", "nested"])
def test_streamed_batches_equal_torchs_and_each_sample_is_freed_before_the_next(kind,
                                                                                worker_method):
    smallest = BigSamples(kind)._big(0, torch.uint8, 320).nbytes
    assert smallest >= STREAM_MIN_BYTES and smallest * BATCH >= STREAM_MIN_BATCH_BYTES
    kw = dict(batch_size=BATCH, num_workers=2, worker_method=worker_method)
    ours = list(torchfeed.DataLoader(BigSamples(kind), **kw))
    theirs = list(torch.utils.data.DataLoader(BigSamples(kind), **torch_kwargs(kw)))
    assert len(ours) == len(theirs) == LENGTH // BATCH
    for a, b in zip(ours, theirs):
        assert_same(_drop_flags(a, kind), _drop_flags(b, kind))
    # torch holds every sample of a batch until it collates them.
    assert all(_flags(b, kind)[1:].all() for b in theirs)
    # Streamed: every sample after a batch's first was fetched once the one
    # before it had been copied into the slot and freed. A worker process's
    # first batch has no slot yet, so it is fetched whole, as torch does; a
    # worker thread streams from its first (NOTE [ Streaming in a thread ]).
    whole = 2 if worker_method == "multiprocessing" else 0
    for b in ours[whole:]:
        assert not _flags(b, kind)[1:].any()
    assert all(_flags(b, kind)[1:].all() for b in ours[:whole])


@pytest.mark.long
@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")  # torch's, on CPU
# One spawned worker: it streams as each of two would (two stream side by side
# under fork in the tests above), and each epoch spawns its workers afresh.
@pytest.mark.parametrize("options", [dict(multiprocessing_context="spawn", num_workers=1),
                                     dict(persistent_workers=True, pin_memory=True,
                                          num_workers=2)],
                         ids=["spawn", "persistent-pinned"])
def test_streaming_under_spawn_and_across_persistent_epochs(options):
    loader = torchfeed.DataLoader(BigSamples("numpy"), batch_size=BATCH, **options)
    theirs = list(torch.utils.data.DataLoader(BigSamples("numpy"), batch_size=BATCH,
                                              num_workers=2))
    for epoch in range(2):
        ours = list(loader)
        for a, b in zip(ours, theirs):
            assert_same(_drop_flags(a, "numpy"), _drop_flags(b, "numpy"))
        streamed = [not _flags(b, "numpy")[1:].any() for b in ours]
        # Each worker's first batch has no slot yet; persistent workers keep
        # their slots: the second epoch streams from its first batch.
        first_streamed = 0 if epoch and options.get("persistent_workers") else loader.num_workers
        assert all(streamed[first_streamed:]) and len(ours) == len(theirs)


class OddOneOut(Dataset):
    """Big tensors, except that one sample of a streamed batch breaks the layout."""

    def __init__(self, odd: str, at: int = 5 * BATCH + 3):  # in worker 1's third batch
        self.odd, self.at = odd, at

    def __len__(self):
        return LENGTH

    def __getitem__(self, i):
        big = torch.full((3, 192, 192), float(i))
        sample = {"image": big, "array": np.full((400, 200), i, np.float32), "id": i}
        if i != self.at:
            return sample
        if self.odd == "shape":
            sample["image"] = torch.full((3, 192, 191), float(i))
        elif self.odd == "dtype":
            sample["image"] = big.double()
        elif self.odd == "list":  # default_collate takes a list where it had arrays
            sample["array"] = np.full((400, 200), i, np.float32).tolist()
        elif self.odd == "type":  # a tensor where it had numpy arrays
            sample["array"] = torch.full((400, 200), float(i))
        elif self.odd == "missing":
            del sample["image"]
        return sample


@pytest.mark.timeout(120)
@both_kinds
@pytest.mark.parametrize("odd", ["dtype", "list", "type"])
def test_a_sample_that_breaks_the_layout_gets_torchs_result(odd, worker_method):
    kw = dict(batch_size=BATCH, num_workers=2)
    ours = list(torchfeed.DataLoader(OddOneOut(odd), worker_method=worker_method, **kw))
    theirs = list(torch.utils.data.DataLoader(OddOneOut(odd), **kw))
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert_same(a, b)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("odd, error, words", [
    # torch's worker says "Trying to resize storage that is not resizable" here
    ("shape", RuntimeError, "stack expects each tensor to be equal size"),
    ("missing", KeyError, "'image'"),
])
@both_kinds
def test_a_sample_that_breaks_the_layout_gets_torchs_error(odd, error, words, worker_method):
    kw = dict(batch_size=BATCH, num_workers=2)
    try:
        list(torch.utils.data.DataLoader(OddOneOut(odd), **kw))
    except error as theirs:
        # Dropped at once, as in tests/faults/test_faults_bad_input.py's
        # _torchs_failure: the traceback keeps torch's iterator in a reference
        # cycle, and freed later by the collector (in whatever test runs then)
        # it waits 5 s per worker for workers that never hear it stop.
        theirs.__traceback__ = None
    else:
        pytest.fail("torch's loader ran its epoch without an error")
    with pytest.raises(error, match=words) as info:
        list(torchfeed.DataLoader(OddOneOut(odd), worker_method=worker_method, **kw))
    assert "batch 5" in str(info.value)  # the streamed batch the odd sample is in


@pytest.mark.timeout(60)
def test_streamed_samples_get_their_own_types_back_when_streaming_stops():
    # In one process, on a real slot: the samples streamed before the odd one
    # reach default_collate as they were, numpy arrays included.
    ch = create_channel(1)
    packer, unpacker = ch.packer(0), ch.unpacker()
    data = OddOneOut("list", at=BATCH + 5)
    try:
        collate = packer.choose_collate(default_collate)
        assert getattr(collate, "takes_sample_stream", False)
        streamed = []
        for start in (0, BATCH, 2 * BATCH):  # no slot yet, the odd batch, a plain one
            indices = list(range(start, start + BATCH))
            samples = SampleStream(map(data.__getitem__, indices), len(indices))
            batch = unpacker.unpack(packer.pack(collate(samples)))
            streamed.append(len(collate.streamed))
            assert_same(batch, default_collate([data[i] for i in indices]))
            del batch
        # Both arrays stream in a batch that fits the layout: the odd batch
        # really started streaming, then gave the arrays back.
        assert streamed == [0, 0, 2]
    finally:
        packer.close()
        unpacker.close()


class BigStream(IterableDataset):
    """Each worker's share of ``length`` big samples, flagged like BigSamples;
    ``odd_tail`` gives the last sample another shape."""

    def __init__(self, length=LENGTH + 5, odd_tail=False):
        self.length, self.odd_tail = length, odd_tail

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        last = None
        for i in range(info.id, self.length, info.num_workers):
            previous_alive = last is not None and last() is not None
            side = 191 if self.odd_tail and i >= self.length - info.num_workers else 192
            big = torch.full((3, side, 192), float(i))
            last = weakref.ref(big)
            yield big, i, previous_alive
            del big


@pytest.mark.timeout(120)
@both_kinds
@pytest.mark.parametrize("drop_last", [False, True])
def test_iterable_dataset_batches_are_streamed_and_equal_torchs(drop_last, worker_method):
    kw = dict(batch_size=BATCH, num_workers=2, drop_last=drop_last)
    ours = list(torchfeed.DataLoader(BigStream(), worker_method=worker_method, **kw))
    theirs = list(torch.utils.data.DataLoader(BigStream(), **kw))
    # 51 and 50 samples per worker: three full batches each, and a short one
    assert len(ours) == len(theirs) == (6 if drop_last else 8)
    for a, b in zip(ours, theirs):
        assert_same(a[:2], b[:2])
    assert all(b[2][1:].all() for b in theirs)
    full = [b for b in ours[2:] if len(b[1]) == BATCH]
    assert full and not any(b[2][1:].any() for b in full)


@pytest.mark.timeout(120)
def test_iterable_short_last_batch_under_drop_last_is_dropped_uncollated():
    # The last two samples have another shape, and each lands in its worker's
    # short last batch: torch drops those batches without collating them.
    kw = dict(batch_size=BATCH, num_workers=2, drop_last=True)
    ours = list(torchfeed.DataLoader(BigStream(odd_tail=True), **kw))
    theirs = list(torch.utils.data.DataLoader(BigStream(odd_tail=True), **kw))
    assert len(ours) == len(theirs) == 6
    for a, b in zip(ours, theirs):
        assert_same(a[:2], b[:2])
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        list(torchfeed.DataLoader(BigStream(odd_tail=True), batch_size=BATCH, num_workers=2))
