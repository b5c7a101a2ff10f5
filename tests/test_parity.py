"""Batch-for-batch parity with torch.utils.data.DataLoader.

Each test runs one configuration through torch's loader and torchfeed's, with
the same seeds, and compares every batch exactly (types, dtypes, values)."""
from __future__ import annotations

import traceback
from collections import Counter

import numpy as np
import pytest
import torch
from loader_helpers import (
    assert_same,
    both_kinds,
    canonical,
    needs_in_order,
    torch_and_ours,
    torch_kwargs,
    workers,
)
from sample_datasets import (
    Custom,
    CustomTypeDataset,
    EveryOtherSampler,
    GetItemsDataset,
    LyingLengthIterable,
    Point,
    RangeDataset,
    RichDataset,
    ShardedIterable,
    SlowIndexDataset,
    UnevenBatchSampler,
    UnevenIterable,
    WorkerInfoProbe,
    custom_type_collate,
    list_collate,
    sum_collate,
)
from torch.utils.data import BatchSampler, RandomSampler, Subset

import torchfeed

WORKERS = [0, 1, 3]  # the three torch-parity settings the issue names
FEW = [0, 2]         # enough for behaviour that does not depend on the count
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def check(dataset, **kwargs):
    theirs, ours = torch_and_ours(dataset, **kwargs)
    assert len(ours[0]) > 0
    assert_same(theirs, ours)
    return ours


# -- map-style -----------------------------------------------------------------------
@pytest.mark.timeout(60)
@workers(*WORKERS)
def test_map_sequential(num_workers, worker_method):
    check(RangeDataset(23), batch_size=4, num_workers=num_workers, worker_method=worker_method)


@pytest.mark.timeout(60)
@workers(*WORKERS)
def test_map_shuffle_seeded_generator(num_workers, worker_method):
    out = check(RangeDataset(23), batch_size=4, shuffle=True, generator=1234,
                num_workers=num_workers, worker_method=worker_method)
    order = [i for batch in out[0] for i in batch[1].tolist()]
    assert sorted(order) == list(range(23)) and order != list(range(23))


@pytest.mark.timeout(60)
@workers(0, 2)
def test_map_shuffle_global_rng(num_workers, worker_method):
    # No generator: the permutation and the base seed come from the global RNG.
    check(RangeDataset(17), batch_size=3, shuffle=True, seed=99, num_workers=num_workers,
          worker_method=worker_method)


@pytest.mark.timeout(60)
@workers(*FEW)
def test_drop_last(num_workers, worker_method):
    out = check(RangeDataset(23), batch_size=4, drop_last=True, num_workers=num_workers,
                worker_method=worker_method)
    assert len(out[0]) == 5 and all(len(b[1]) == 4 for b in out[0])


@pytest.mark.timeout(60)
@workers(*WORKERS)
def test_batch_size_none(num_workers, worker_method):
    out = check(RangeDataset(7), batch_size=None, num_workers=num_workers,
                worker_method=worker_method)
    # default_convert, not default_collate: no batch dimension, ints stay ints.
    assert out[0][3][1] == 3 and out[0][3][0].shape == (3,)


@pytest.mark.timeout(60)
@workers(*FEW)
def test_custom_collate(num_workers, worker_method):
    check(RangeDataset(14), batch_size=4, collate_fn=sum_collate, num_workers=num_workers,
          worker_method=worker_method)


@pytest.mark.timeout(60)
@workers(*FEW)
def test_custom_sampler(num_workers, worker_method):
    check(RangeDataset(11), batch_size=3, sampler=EveryOtherSampler(11),
          num_workers=num_workers, worker_method=worker_method)


@pytest.mark.timeout(60)
@workers(*FEW)
def test_custom_batch_sampler(num_workers, worker_method):
    out = check(RangeDataset(20), batch_sampler=UnevenBatchSampler(20), num_workers=num_workers,
                worker_method=worker_method)
    assert [len(b[1]) for b in out[0]] == [1, 2, 3, 4, 5, 5]


@pytest.mark.timeout(60)
@workers(0, 2)
def test_torch_batch_sampler_over_random_sampler(num_workers, worker_method):
    def make():
        sampler = RandomSampler(range(19), generator=torch.Generator().manual_seed(5))
        return BatchSampler(sampler, 4, drop_last=False)

    theirs = list(torch.utils.data.DataLoader(RangeDataset(19), batch_sampler=make(),
                                              num_workers=num_workers))
    ours = list(torchfeed.DataLoader(RangeDataset(19), batch_sampler=make(),
                                     num_workers=num_workers, worker_method=worker_method))
    assert_same(theirs, ours)


@pytest.mark.timeout(60)
@workers(*FEW)
def test_getitems(num_workers, worker_method):
    out = check(GetItemsDataset(10), batch_size=4, num_workers=num_workers,
                worker_method=worker_method)
    assert out[0][1][1].tolist() == [-4, -5, -6, -7]  # __getitems__ was used


@pytest.mark.timeout(60)
@workers(0, 2)
def test_subset_getitems(num_workers, worker_method):
    # torch's Subset forwards __getitems__ to the dataset.
    check(Subset(GetItemsDataset(30), list(range(29, 0, -3))), batch_size=3,
          num_workers=num_workers, worker_method=worker_method)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("prefetch_factor", [1, 5])
@both_kinds
def test_prefetch_factor(prefetch_factor, worker_method):
    check(RangeDataset(25), batch_size=2, num_workers=2, prefetch_factor=prefetch_factor,
          worker_method=worker_method)


# -- iterable ----------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("drop_last", [False, True])
@workers(0, 1, 3)
def test_iterable_sharded(num_workers, worker_method, drop_last):
    out = check(ShardedIterable(0, 23), batch_size=3, drop_last=drop_last,
                num_workers=num_workers, worker_method=worker_method)
    seen = sorted(int(row[0]) for batch in out[0] for row in batch)
    if not drop_last:
        assert seen == list(range(23))


@pytest.mark.timeout(60)
@workers(*FEW)
def test_iterable_batch_size_none(num_workers, worker_method):
    check(ShardedIterable(0, 10), batch_size=None, num_workers=num_workers,
          worker_method=worker_method)


@pytest.mark.timeout(60)
@workers(1, 3)
def test_iterable_workers_end_independently(num_workers, worker_method):
    out = check(UnevenIterable(), batch_size=2, num_workers=num_workers,
                worker_method=worker_method)
    expected = sorted(w * 100 + j for w in range(num_workers) for j in range(3 * w + 1))
    assert sorted(int(x) for batch in out[0] for x in batch) == expected


# -- persistent workers and epochs ------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent", [False, True])
@both_kinds
def test_epochs_shuffle(persistent, worker_method):
    check(RangeDataset(15), batch_size=4, shuffle=True, generator=7, num_workers=2,
          persistent_workers=persistent, epochs=3, worker_method=worker_method)


@pytest.mark.timeout(60)
@both_kinds
def test_persistent_iterable_epochs(worker_method):
    out = check(ShardedIterable(0, 11), batch_size=2, num_workers=3, persistent_workers=True,
                epochs=3, worker_method=worker_method)
    assert_same(out[0], out[2])


@pytest.mark.timeout(60)
def test_persistent_keeps_workers_and_dataset():
    loader = torchfeed.DataLoader(WorkerInfoProbe(), batch_size=None, num_workers=2,
                                  persistent_workers=True)
    first = [(s["pid"], s["id"]) for s in loader]
    second = [(s["pid"], s["id"]) for s in loader]
    assert first == second  # same processes, same worker id to shard mapping
    assert len({pid for pid, _ in first}) == 2


@pytest.mark.timeout(60)
@both_kinds
def test_abandoned_epoch_then_next_epoch(worker_method):
    # A new epoch started before the last one finished (persistent workers):
    # stale batches of the old epoch must not leak into the new one.
    kwargs = dict(batch_size=2, shuffle=True, num_workers=2, persistent_workers=True,
                  worker_method=worker_method)
    results = []
    for cls, cls_kwargs in ((torch.utils.data.DataLoader, torch_kwargs(kwargs)),
                            (torchfeed.DataLoader, kwargs)):
        loader = cls(RangeDataset(20), generator=torch.Generator().manual_seed(3), **cls_kwargs)
        it = iter(loader)
        first = [next(it), next(it)]
        results.append((first, list(loader), list(loader)))
        del it, loader
    assert_same(results[0], results[1])


# -- in_order=False ---------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("dataset", [RangeDataset(23), ShardedIterable(0, 23)],
                         ids=["map", "iterable"])
@needs_in_order
@both_kinds
def test_out_of_order_same_multiset(dataset, worker_method):
    theirs, ours = torch_and_ours(dataset, batch_size=3, num_workers=3, in_order=False,
                                  worker_method=worker_method)
    assert Counter(map(canonical, theirs[0])) == Counter(map(canonical, ours[0]))


@pytest.mark.timeout(60)
@needs_in_order
@both_kinds
def test_out_of_order_slow_sample_does_not_block(worker_method):
    # Sample 0 takes 1.5 s; the other batches must come out while it sleeps.
    loader = torchfeed.DataLoader(SlowIndexDataset(12, slow=0, delay=1.5), batch_size=1,
                                  num_workers=2, in_order=False, worker_method=worker_method)
    order = [int(b) for b in loader]
    assert sorted(order) == list(range(12))
    assert order[0] != 0 and order.index(0) >= 3


@pytest.mark.timeout(60)
@both_kinds
def test_in_order_slow_sample_keeps_order(worker_method):
    loader = torchfeed.DataLoader(SlowIndexDataset(8, slow=1, delay=0.5), batch_size=1,
                                  num_workers=2, worker_method=worker_method)
    assert [int(b) for b in loader] == list(range(8))


# -- default_collate / default_convert through the loader --------------------------------
@pytest.mark.timeout(60)
@workers(0, 2)
def test_default_collate_semantics(num_workers, worker_method):
    out = check(RichDataset(12), batch_size=5, num_workers=num_workers, worker_method=worker_method)
    batch = out[0][0]
    assert isinstance(batch["point"], Point)
    assert batch["str"] == ["s0", "s1", "s2", "s3", "s4"]
    assert batch["ndarray"].dtype == torch.int16 and batch["ndarray"].shape == (5, 3)
    assert batch["np_scalar"].dtype == torch.float32
    assert batch["nested"]["list"][1][0].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.timeout(60)
@workers(0, 2)
def test_default_convert_semantics(num_workers, worker_method):
    out = check(RichDataset(4, uncollatable=True), batch_size=None, num_workers=num_workers,
                worker_method=worker_method)
    sample = out[0][3]
    assert isinstance(sample["ndarray"], torch.Tensor) and sample["int"] == 3
    assert isinstance(sample["np_scalar"], torch.Tensor)
    assert isinstance(sample["np_str_array"], np.ndarray)  # strings are not converted
    assert sample["custom"] == Custom(3) and sample["none"] is None


@pytest.mark.timeout(60)
@workers(0, 2)
def test_default_collate_error_same_type(num_workers, worker_method):
    errors = []
    kwargs = dict(batch_size=2, num_workers=num_workers, worker_method=worker_method)
    for cls, cls_kwargs in ((torch.utils.data.DataLoader, torch_kwargs(kwargs)),
                            (torchfeed.DataLoader, kwargs)):
        with pytest.raises(TypeError) as info:
            list(cls(RichDataset(4, uncollatable=True), **cls_kwargs))
        traceback.clear_frames(info.value.__traceback__)  # torch's iterator is in it
        errors.append(str(info.value))
    theirs, ours = errors
    assert "default_collate: batch must contain tensors" in ours
    if num_workers == 0:  # raised in this process, by the same default_collate
        assert ours == theirs
        return
    # From a worker: torch's first line, word for word, then ours adds a line with
    # the batch and its samples; the traceback's frames differ (the worker loops
    # are not the same code), its last line, the original error, does not.
    theirs_lines, ours_lines = theirs.rstrip().splitlines(), ours.rstrip().splitlines()
    assert theirs_lines[0] == "Caught TypeError in DataLoader worker process 0.", theirs
    # A thread worker in the words of torch's thread workers (pytorch PR 161044).
    kind = "thread" if worker_method == "thread" else "process"
    assert ours_lines[0] == f"Caught TypeError in DataLoader worker {kind} 0.", ours
    assert ours_lines[1] == "It was raised while fetching batch 0 (sample indices [0, 1]).", ours
    assert ours_lines[2] == theirs_lines[1] == "Original Traceback (most recent call last):"
    assert ours_lines[-1] == theirs_lines[-1], (ours, theirs)


@pytest.mark.timeout(60)
@workers(0, 2)
def test_custom_type_through_collate_fn_map(num_workers, worker_method):
    out = check(CustomTypeDataset(), batch_size=4, collate_fn=custom_type_collate,
                num_workers=num_workers, worker_method=worker_method)
    assert out[0][0]["custom"] == Custom(0 + 1 + 2 + 3)


@pytest.mark.timeout(60)
@both_kinds
def test_list_collate_keeps_python_objects(worker_method):
    out = check(RichDataset(6), batch_size=3, collate_fn=list_collate, num_workers=2,
                worker_method=worker_method)
    assert isinstance(out[0][0], list) and out[0][0][1]["str"] == "s1"


# -- len() -------------------------------------------------------------------------------
def test_len_matches_torch():
    for kwargs in [dict(batch_size=4), dict(batch_size=4, drop_last=True), dict(batch_size=None),
                   dict(batch_sampler=UnevenBatchSampler(23))]:
        assert len(torchfeed.DataLoader(RangeDataset(23), **kwargs)) == \
            len(torch.utils.data.DataLoader(RangeDataset(23), **kwargs))
    for kwargs in [dict(batch_size=2), dict(batch_size=4, drop_last=True), dict(batch_size=None)]:
        assert len(torchfeed.DataLoader(LyingLengthIterable(), **kwargs)) == \
            len(torch.utils.data.DataLoader(LyingLengthIterable(), **kwargs))


def test_iterator_len():
    loader = torchfeed.DataLoader(RangeDataset(10), batch_size=3)
    assert len(iter(loader)) == len(iter(torch.utils.data.DataLoader(RangeDataset(10),
                                                                      batch_size=3))) == 4


@pytest.mark.timeout(60)
@both_kinds
def test_multiprocess_iterator_len(worker_method):
    loader = torchfeed.DataLoader(RangeDataset(10), batch_size=3, num_workers=1,
                                  worker_method=worker_method)
    it = iter(loader)
    assert len(it) == 4
    del it

