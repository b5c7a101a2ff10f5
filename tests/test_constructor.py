"""The constructor is torch's: arguments, defaults, validation, attributes,
warnings, and rebuilding a loader from its attributes as frameworks do."""
from __future__ import annotations

import inspect
import multiprocessing
import warnings

import pytest
import torch
import torch.utils.data
from loader_helpers import assert_same, rerun_without_accelerator, warning_messages
from sample_datasets import EveryOtherSampler, LyingLengthIterable, RangeDataset, ShardedIterable, UnevenBatchSampler
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler

import torchfeed
from torchfeed._torch_compat import (
    HONOURS_PIN_MEMORY_DEVICE,
    PINS_FOR_CURRENT_ACCELERATOR,
    TAKES_IN_ORDER,
    TAKES_WORKER_METHOD,
    accelerator_available,
)

TorchLoader = torch.utils.data.DataLoader
TORCHFEED_ONLY = {"transport", "seed_per_batch", "snapshot_every_n_steps", "log_every",
                  "max_worker_restarts", "device", "share_dataset"}
if not TAKES_WORKER_METHOD:  # torch's argument (pytorch PR 161044), torchfeed's before it
    TORCHFEED_ONLY.add("worker_method")


# -- signature ---------------------------------------------------------------------------
def test_signature_has_torchs_parameters_in_order_with_torchs_defaults():
    theirs = inspect.signature(TorchLoader.__init__).parameters
    ours = inspect.signature(torchfeed.DataLoader.__init__).parameters
    shared = [name for name in ours if name in theirs]
    assert shared == list(theirs), "torch's parameters, in torch's order"
    for name, param in theirs.items():
        assert ours[name].kind == param.kind, name
        assert ours[name].default == param.default, name


def test_only_extras_are_keyword_only_torchfeed_options_with_defaults():
    theirs = inspect.signature(TorchLoader.__init__).parameters
    ours = inspect.signature(torchfeed.DataLoader.__init__).parameters
    extras = {name: p for name, p in ours.items() if name not in theirs}
    assert set(extras) == TORCHFEED_ONLY
    for name, param in extras.items():
        assert param.kind is inspect.Parameter.KEYWORD_ONLY, name
        assert param.default is not inspect.Parameter.empty, name


def test_positional_call_like_torch():
    gen = torch.Generator()
    args = (RangeDataset(10), 3, False, None, None, 0, None, False, True, 0, None, None, gen)
    theirs, ours = TorchLoader(*args), torchfeed.DataLoader(*args)
    assert (ours.batch_size, ours.drop_last, ours.generator) == (3, True, gen)
    assert_same(list(theirs), list(ours))


def test_is_a_torch_dataloader():
    loader = torchfeed.DataLoader(RangeDataset(4))
    assert isinstance(loader, TorchLoader)
    assert issubclass(torchfeed.DataLoader, TorchLoader)


# -- invalid arguments -------------------------------------------------------------------
def _dist_sampler():
    return DistributedSampler(RangeDataset(10), num_replicas=2, rank=0)


INVALID = {
    "negative num_workers": (RangeDataset(8), dict(num_workers=-1)),
    "negative timeout": (RangeDataset(8), dict(timeout=-1)),
    "prefetch_factor without workers": (RangeDataset(8), dict(prefetch_factor=2)),
    "negative prefetch_factor": (RangeDataset(8), dict(num_workers=1, prefetch_factor=-1)),
    "persistent without workers": (RangeDataset(8), dict(persistent_workers=True)),
    "batch_sampler with batch_size": (
        RangeDataset(8), dict(batch_sampler=UnevenBatchSampler(8), batch_size=2)),
    "batch_sampler with shuffle": (
        RangeDataset(8), dict(batch_sampler=UnevenBatchSampler(8), shuffle=True)),
    "batch_sampler with sampler": (
        RangeDataset(8), dict(batch_sampler=UnevenBatchSampler(8),
                              sampler=SequentialSampler(range(8)))),
    "batch_sampler with drop_last": (
        RangeDataset(8), dict(batch_sampler=UnevenBatchSampler(8), drop_last=True)),
    "batch_sampler with batch_size=None": (
        RangeDataset(8), dict(batch_sampler=UnevenBatchSampler(8), batch_size=None)),
    "sampler with shuffle": (
        RangeDataset(8), dict(sampler=SequentialSampler(range(8)), shuffle=True)),
    "iterable with shuffle": (ShardedIterable(), dict(shuffle=True)),
    "iterable with sampler": (ShardedIterable(), dict(sampler=SequentialSampler(range(8)))),
    "iterable with batch_sampler": (ShardedIterable(), dict(batch_sampler=UnevenBatchSampler(8))),
    "batch_size=None with drop_last": (RangeDataset(8), dict(batch_size=None, drop_last=True)),
    "unknown start method": (RangeDataset(8), dict(num_workers=1,
                                                   multiprocessing_context="no-such-method")),
    "context of the wrong type": (RangeDataset(8), dict(num_workers=1,
                                                        multiprocessing_context=42)),
    "context without workers": (RangeDataset(8), dict(multiprocessing_context="spawn")),
    "unknown argument": (RangeDataset(8), dict(batchsize=4)),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_arguments_raise_like_torch(case):
    dataset, kwargs = INVALID[case]
    with pytest.raises(Exception) as theirs:
        TorchLoader(dataset, **kwargs)
    with pytest.raises(Exception) as ours:
        torchfeed.DataLoader(dataset, **kwargs)
    assert type(ours.value) is type(theirs.value)
    if case != "unknown argument":  # the TypeError names the class's own __init__
        assert str(ours.value) == str(theirs.value)
    assert str(ours.value)


def test_iterable_with_shuffle_false_is_allowed_like_torch():
    for cls in (TorchLoader, torchfeed.DataLoader):
        assert len(list(cls(ShardedIterable(0, 4), shuffle=False))) == 4


@pytest.mark.parametrize("attr,value", [
    ("batch_size", 3), ("batch_sampler", None), ("sampler", None), ("drop_last", True),
    ("dataset", RangeDataset(2)), ("persistent_workers", True)])
def test_setting_protected_attribute_after_init_raises_like_torch(attr, value):
    with pytest.raises(ValueError) as theirs:
        setattr(TorchLoader(RangeDataset(8)), attr, value)
    with pytest.raises(ValueError) as ours:
        setattr(torchfeed.DataLoader(RangeDataset(8)), attr, value)
    assert str(ours.value) == str(theirs.value)


def test_unprotected_attributes_can_be_set_like_torch():
    for cls in (TorchLoader, torchfeed.DataLoader):
        loader = cls(RangeDataset(8))
        loader.num_workers = 0
        loader.collate_fn = list
        loader.pin_memory = False
        assert loader.collate_fn is list


# -- attributes ---------------------------------------------------------------------------
ATTRS = ["batch_size", "drop_last", "num_workers", "prefetch_factor", "pin_memory",
         "pin_memory_device", "timeout", "worker_init_fn", "persistent_workers",
         *(["in_order"] if TAKES_IN_ORDER else []),  # torch 2.6 on
         "collate_fn", "_auto_collation"]

CONFIGS = {
    "default": (RangeDataset(10), dict()),
    "batched, shuffled": (RangeDataset(10), dict(batch_size=4, shuffle=True, drop_last=True)),
    "workers": (RangeDataset(10), dict(num_workers=2, persistent_workers=True,
                                       multiprocessing_context="spawn", timeout=3)),
    "no batching": (RangeDataset(10), dict(batch_size=None)),
    "sampler": (RangeDataset(10), dict(batch_size=3, sampler=EveryOtherSampler(10))),
    "batch_sampler": (RangeDataset(10), dict(batch_sampler=UnevenBatchSampler(10))),
    "iterable": (ShardedIterable(), dict(batch_size=5)),
    "context object": (RangeDataset(10), dict(
        num_workers=1, multiprocessing_context=multiprocessing.get_context("fork"))),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_attributes_equal_torchs(config):
    dataset, kwargs = CONFIGS[config]
    gen = torch.Generator()
    theirs = TorchLoader(dataset, generator=gen, **kwargs)
    ours = torchfeed.DataLoader(dataset, generator=gen, **kwargs)
    for name in ATTRS:
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.dataset is theirs.dataset is dataset
    assert ours.generator is gen
    assert ours.multiprocessing_context == theirs.multiprocessing_context
    if ours.multiprocessing_context is not None:
        assert ours.multiprocessing_context.get_start_method() == \
            theirs.multiprocessing_context.get_start_method()
    for name in ("sampler", "batch_sampler"):
        a, b = getattr(theirs, name), getattr(ours, name)
        assert type(a) is type(b), name
        if name in kwargs:
            assert b is kwargs[name]
    if isinstance(ours.batch_sampler, BatchSampler):
        assert ours.batch_sampler.batch_size == theirs.batch_sampler.batch_size
        assert ours.batch_sampler.drop_last == theirs.batch_sampler.drop_last
    if isinstance(ours.sampler, RandomSampler):
        assert ours.sampler.generator is gen
    if not isinstance(dataset, torch.utils.data.IterableDataset):
        assert len(ours) == len(theirs)


def test_len_of_iterable_is_counted_like_torch():
    theirs, ours = TorchLoader(LyingLengthIterable(), batch_size=2), \
        torchfeed.DataLoader(LyingLengthIterable(), batch_size=2)
    assert ours._IterableDataset_len_called is None
    assert len(ours) == len(theirs) == 2
    assert ours._IterableDataset_len_called == theirs._IterableDataset_len_called == 3
    with pytest.raises(TypeError):
        len(torchfeed.DataLoader(ShardedIterable()))  # no __len__, as in torch


# -- rebuilding from attributes (Lightning's distributed-sampler injection) --------------
def _rebuild_with_sampler(loader, sampler):
    """Lightning's own injection (Fabric and the Trainer share it): rebuild
    ``type(loader)`` from the attributes named after ``__init__``'s parameters,
    with ``sampler`` swapped in.  The real library, from the [test] extra.

    Importing it costs some 5 CPU-seconds (its version checks import torchmetrics,
    which imports transformers), so every test that imports Lightning carries
    ``xdist_group("lightning")``: one pytest-xdist worker pays it, once."""
    data = pytest.importorskip("lightning_fabric.utilities.data",
                               reason="Lightning Fabric is not installed (the [test] extra has it)")
    return data._update_dataloader(loader, sampler)


@pytest.mark.big_imports
@pytest.mark.xdist_group("lightning")  # see _rebuild_with_sampler
@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_rebuild_with_distributed_sampler(num_workers):
    dataset = RangeDataset(10)
    loader = torchfeed.DataLoader(dataset, batch_size=2, shuffle=True, num_workers=num_workers,
                                  drop_last=False, transport="torch")
    sampler = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=False)
    rebuilt = _rebuild_with_sampler(loader, sampler)
    assert type(rebuilt) is torchfeed.DataLoader
    assert rebuilt.sampler is sampler and rebuilt.num_workers == num_workers
    assert rebuilt.transport == "torch"
    got = [i for batch in rebuilt for i in batch[1].tolist()]
    assert got == [0, 2, 4, 6, 8] == list(sampler)
    assert len(rebuilt) == 3


@pytest.mark.big_imports
@pytest.mark.xdist_group("lightning")
def test_rebuild_keeps_every_torch_attribute():
    gen = torch.Generator()
    loader = torchfeed.DataLoader(RangeDataset(10), batch_size=3, num_workers=1, timeout=2,
                                  prefetch_factor=3, pin_memory_device="",
                                  **({"in_order": False} if TAKES_IN_ORDER else {}),
                                  generator=gen, multiprocessing_context="spawn",
                                  seed_per_batch=True, device="cpu")
    rebuilt = _rebuild_with_sampler(loader, _dist_sampler())
    for name in ATTRS + ["seed_per_batch", "transport", "snapshot_every_n_steps", "device"]:
        if name != "_auto_collation":
            assert getattr(rebuilt, name) == getattr(loader, name), name
    assert rebuilt.generator is gen
    assert rebuilt.multiprocessing_context is loader.multiprocessing_context


# -- warnings -----------------------------------------------------------------------------
def _warnings_of(fn):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fn()
    return warning_messages(record)


@pytest.mark.timeout(60)
def test_too_many_workers_warns_like_torch():
    import os

    many = len(os.sched_getaffinity(0)) + 1

    def run(cls):
        loader = cls(RangeDataset(4), num_workers=many, batch_size=2)
        list(loader)

    theirs, ours = _warnings_of(lambda: run(TorchLoader)), _warnings_of(
        lambda: run(torchfeed.DataLoader))
    assert theirs == ours
    assert len(ours) == 2  # once at construction, once when iterating
    assert f"This DataLoader will create {many} worker processes in total" in ours[0][1]


def test_no_worker_warning_within_cpu_count():
    assert _warnings_of(lambda: list(torchfeed.DataLoader(RangeDataset(4), num_workers=0))) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 1])
def test_iterable_length_warning_like_torch(num_workers):
    dataset = LyingLengthIterable()  # the warning names it

    def run(cls):
        loader = cls(dataset, batch_size=None, num_workers=num_workers)
        assert len(loader) == 3
        assert [int(x) for x in loader] == list(range(6))

    theirs, ours = _warnings_of(lambda: run(TorchLoader)), _warnings_of(
        lambda: run(torchfeed.DataLoader))
    assert ours == theirs
    assert len(ours) == 3  # samples 4, 5 and 6 each exceed the promised 3
    assert "Length of IterableDataset" in ours[0][1]
    assert ("configuring the IterableDataset replica" in ours[0][1]) == (num_workers > 0)


def test_iterable_no_length_warning_without_len_call():
    assert _warnings_of(lambda: list(torchfeed.DataLoader(LyingLengthIterable()))) == []


@pytest.mark.timeout(150)
@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize("device", [""] if HONOURS_PIN_MEMORY_DEVICE else ["", "cuda"])  # see below
def test_pin_memory_without_accelerator_warns_like_torch(num_workers, device, request):
    # Before torch 2.9 a pin_memory_device is honoured, accelerator or not:
    # tests/test_torch_releases.py compares that with torch's loader.
    if accelerator_available():  # the warning is a machine without one's
        rerun_without_accelerator(request)
        return

    def run(cls):
        loader = cls(RangeDataset(4), batch_size=2, pin_memory=True, num_workers=num_workers,
                     pin_memory_device=device)
        out = list(loader)
        assert not out[0][0].is_pinned()
        return out

    theirs, ours = _warnings_of(lambda: run(TorchLoader)), _warnings_of(
        lambda: run(torchfeed.DataLoader))
    assert ours == theirs
    # torch 2.7 on says so; before, it pinned only for CUDA and said nothing
    assert any("no accelerator is found" in m for _, m in ours) == PINS_FOR_CURRENT_ACCELERATOR
    assert any("pin_memory_device is deprecated" in m for _, m in ours) == bool(device)


# -- timeout with num_workers=0 ---------------------------------------------------------------
def test_timeout_without_workers_like_torch():
    for cls in (TorchLoader, torchfeed.DataLoader):
        loader = cls(RangeDataset(4), timeout=5)
        assert loader.timeout == 5
    with pytest.raises(Exception) as theirs:
        iter(TorchLoader(RangeDataset(4), timeout=5))
    with pytest.raises(Exception) as ours:
        iter(torchfeed.DataLoader(RangeDataset(4), timeout=5))
    assert type(ours.value) is type(theirs.value)


# -- Accelerate's prepare_data_loader ----------------------------------------------------
def _accelerate_shards(loader_class, num_workers):
    prepare_data_loader = pytest.importorskip(
        "accelerate.data_loader", reason="Accelerate is not installed (the [test] extra has it)"
    ).prepare_data_loader

    shards = []
    for rank in range(2):
        loader = loader_class(RangeDataset(10), batch_size=2, num_workers=num_workers)
        prepared = prepare_data_loader(loader, num_processes=2, process_index=rank,
                                       put_on_device=False)
        shards.append([batch[1].tolist() for batch in prepared])
    return shards


# prepare_data_loader imports some 900 modules (Hugging Face datasets, pandas,
# pyarrow, torchdata): afterwards every gc.collect() and fork in this process costs
# several times more (a faults test's own CPU went from 0.04 s to 0.15 s).  So it runs
# last, on the worker that imports datasets anyway.
@pytest.mark.big_imports
@pytest.mark.xdist_group("hf_datasets")
@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_accelerate_prepare_data_loader_deals_the_same_shards(num_workers):
    """Accelerate reads torch's constructor arguments off the loader and wraps torch's
    DataLoader in its own DataLoaderShard (torchfeed.prepare puts torchfeed's back:
    tests/test_frameworks.py).  What it deals must not change."""
    ours = _accelerate_shards(torchfeed.DataLoader, num_workers)
    assert ours == _accelerate_shards(TorchLoader, num_workers)
    # 5 batches over 2 processes, evened out by wrapping around to the start
    assert ours == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [0, 1]]]
