"""Inside a worker: get_worker_info(), worker_init_fn, and both start methods."""
from __future__ import annotations

import os

import pytest
import torch
import torch.utils.data
from loader_helpers import assert_same, torch_and_ours
from sample_datasets import RangeDataset, ShardedIterable, WorkerInfoProbe

import torchfeed

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


class NoWorkerInfoDataset(torch.utils.data.Dataset):
    """Without workers, the dataset sees no worker info, as in torch."""

    def __len__(self):
        return 2

    def __getitem__(self, i):
        assert torch.utils.data.get_worker_info() is None
        return i


def test_get_worker_info_is_none_in_main_process():
    assert torchfeed.get_worker_info() is None
    assert torch.utils.data.get_worker_info() is None
    list(torchfeed.DataLoader(NoWorkerInfoDataset(), batch_size=None))
    assert torchfeed.get_worker_info() is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [1, 3])
def test_get_worker_info_inside_workers(num_workers):
    gen = torch.Generator().manual_seed(2024)
    base_seed = int(torch.empty((), dtype=torch.int64).random_(
        generator=torch.Generator().manual_seed(2024)).item())
    loader = torchfeed.DataLoader(WorkerInfoProbe(), batch_size=None, num_workers=num_workers,
                                  generator=gen)
    samples = list(loader)
    assert len(samples) == 6
    pids = {}
    for i, sample in enumerate(samples):
        assert sample["same"], "torchfeed.get_worker_info() is torch's"
        assert sample["id"] == i % num_workers  # round-robin, in order
        assert sample["num_workers"] == num_workers
        assert sample["seed"] == base_seed + sample["id"]
        assert sample["dataset_is_self"]
        pids.setdefault(sample["id"], set()).add(sample["pid"])
        assert sample["pid"] != os.getpid()
    assert all(len(p) == 1 for p in pids.values()) and len(pids) == num_workers
    assert torchfeed.get_worker_info() is None


@pytest.mark.timeout(60)
def test_worker_info_same_as_torchs():
    def strip(epochs):
        return [[{k: v for k, v in s.items() if k != "pid"} for s in e] for e in epochs]

    theirs, ours = torch_and_ours(WorkerInfoProbe(), batch_size=None, num_workers=2,
                                  generator=11)
    assert_same(strip(theirs), strip(ours))


def record_worker_init(worker_id):
    info = torch.utils.data.get_worker_info()
    assert info is not None and info.id == worker_id
    info.dataset.init_calls = getattr(info.dataset, "init_calls", 0) + 1
    info.dataset.init_seed = torch.initial_seed()


class InitRecorder(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        return {"id": info.id, "calls": self.init_calls, "seed": self.init_seed}


@pytest.mark.timeout(60)
def test_worker_init_fn_runs_once_per_worker_after_seeding():
    gen = torch.Generator().manual_seed(5)
    base_seed = int(torch.empty((), dtype=torch.int64).random_(
        generator=torch.Generator().manual_seed(5)).item())
    loader = torchfeed.DataLoader(InitRecorder(), batch_size=None, num_workers=2, generator=gen,
                                  persistent_workers=True, worker_init_fn=record_worker_init)
    for _ in range(2):  # the second epoch reuses the workers: no second call
        for sample in loader:
            assert sample["calls"] == 1
            assert sample["seed"] == base_seed + sample["id"]


@pytest.mark.timeout(60)
def test_fork_start_method():
    kwargs = dict(batch_size=3, num_workers=2, multiprocessing_context="fork")
    theirs, ours = torch_and_ours(RangeDataset(10), **kwargs)
    assert_same(theirs, ours)
    theirs, ours = torch_and_ours(ShardedIterable(0, 9), **kwargs)
    assert_same(theirs, ours)


@pytest.mark.long
@pytest.mark.timeout(120)
def test_spawn_start_method():
    # One loader only: every spawned worker imports torch afresh (seconds each).
    # Its samples are compared with torch's loader under fork, which yields the
    # same values: worker info and seeds do not depend on the start method.
    ctx = torch.multiprocessing.get_context("spawn")
    loader = torchfeed.DataLoader(WorkerInfoProbe(), batch_size=None, num_workers=2,
                                  multiprocessing_context=ctx, persistent_workers=True,
                                  generator=torch.Generator().manual_seed(8))
    assert loader.multiprocessing_context.get_start_method() == "spawn"
    first, second = list(loader), list(loader)
    assert [s["pid"] for s in first] == [s["pid"] for s in second]
    theirs = list(torch.utils.data.DataLoader(WorkerInfoProbe(), batch_size=None, num_workers=2,
                                              generator=torch.Generator().manual_seed(8)))
    for a, b in zip(theirs, first, strict=True):
        del a["pid"], b["pid"]
        assert_same(a, b)
