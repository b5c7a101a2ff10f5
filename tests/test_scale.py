"""How the loader's costs grow with the job (issue 19): the parent's heap as
seen from forked workers, worker start under forkserver and spawn, huge
shuffled datasets, and workers' private memory."""
from __future__ import annotations

import gc
import itertools
import json
import logging
import os
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import psutil
import pytest
import scale_datasets
import torch
import torch.utils.data

import torchfeed

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


# -- the collector in forked workers ---------------------------------------------
class HeapProbe(torch.utils.data.Dataset):
    """Runs a full collection in the worker and reports what it cost in private
    memory, and where the worker's collector keeps what it inherited."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        me = psutil.Process()
        before = me.memory_full_info().uss
        gc.collect()  # what the worker's GC counters trigger on their own, sooner or later
        after = me.memory_full_info().uss
        return {"uss_growth": after - before, "frozen": gc.get_freeze_count(),
                "enabled": gc.isenabled()}


def _parent_heap(n):
    """Annotation-like records, as json.load of a COCO-style file gives them."""
    return [{"id": i, "bbox": [1.0, 2.0, 3.0, 4.0], "label": "x"} for i in range(n)]


@pytest.mark.long
@pytest.mark.timeout(90)
def test_full_collection_in_a_worker_leaves_the_parents_heap_shared():
    heap = _parent_heap(150_000)  # about 300,000 tracked objects, ~45 MiB
    loader = torchfeed.DataLoader(HeapProbe(), batch_size=None, num_workers=2,
                                  multiprocessing_context="fork")
    for epoch in range(2):  # fresh workers each epoch, as with persistent_workers=False
        for sample in loader:
            # Everything inherited sits in the permanent generation, which no
            # collection visits ...
            assert sample["frozen"] >= 2 * len(heap), sample
            # ... so a full collection writes to none of the parent's pages.
            assert sample["uss_growth"] < 8 * 2**20, (
                f"epoch {epoch}: a full collection in the worker made "
                f"{sample['uss_growth'] / 2**20:.1f} MiB of the parent's heap private")
            assert sample["enabled"]
    del heap


class CycleMaker(torch.utils.data.Dataset):
    """Each sample leaves a reference cycle behind; reports how many are alive."""

    alive = 0

    class Node:
        def __init__(self):
            CycleMaker.alive += 1
            self.me = self
            self.payload = bytearray(4096)

        def __del__(self):
            CycleMaker.alive -= 1

    def __len__(self):
        return 3000

    def __getitem__(self, i):
        self.Node()
        return CycleMaker.alive


@pytest.mark.timeout(60)
def test_reference_cycles_made_in_workers_are_collected():
    loader = torchfeed.DataLoader(CycleMaker(), batch_size=None, num_workers=1,
                                  multiprocessing_context="fork")
    alive = list(loader)
    # The collector runs in the worker: garbage cycles never pile up past a
    # young-generation threshold's worth of allocations.
    assert max(alive) < 1500, max(alive)


class GcState(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        return gc.isenabled()


@pytest.mark.timeout(60)
def test_parents_collector_settings_are_kept_and_inherited():
    frozen = gc.get_freeze_count()
    loader = torchfeed.DataLoader(GcState(), batch_size=None, num_workers=2,
                                  multiprocessing_context="fork")
    assert list(loader) == [True, True]
    assert gc.isenabled() and gc.get_freeze_count() == frozen
    gc.disable()  # a user who turned the collector off: forked workers inherit that, as in torch
    try:
        assert list(loader) == [False, False]
        assert not gc.isenabled() and gc.get_freeze_count() == frozen
    finally:
        gc.enable()


# -- worker start under forkserver -------------------------------------------------
_FORKSERVER_SCRIPT = """
import json, multiprocessing, sys
sys.path.insert(0, {tests!r})
import torchfeed
from scale_datasets import ImportProbe

if __name__ == "__main__":
    multiprocessing.set_forkserver_preload(["__main__", "json"])  # the user's own list
    ctx = multiprocessing.get_context("forkserver")
    loader = torchfeed.DataLoader(ImportProbe(), batch_size=None, num_workers=2,
                                  multiprocessing_context=ctx)
    epochs = [list(loader) for _ in range(2)]
    print(json.dumps({{"epochs": epochs, "same_context": loader.multiprocessing_context is ctx,
                      "preload": multiprocessing.forkserver._forkserver._preload_modules}}))
"""


@pytest.mark.long
@pytest.mark.timeout(180)
def test_forkserver_workers_start_with_torch_and_the_dataset_module_preloaded():
    # A fresh interpreter: the fork server is one per process, and an earlier
    # test may have started it already.
    tests = os.path.dirname(os.path.abspath(__file__))
    # The dataset's module is on PYTHONPATH, where a fresh interpreter (the
    # server) finds it too, as an installed package would be.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [tests, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))
    proc = subprocess.run([sys.executable, "-c", _FORKSERVER_SCRIPT.format(tests=tests)],
                          capture_output=True, text=True, timeout=170, env=env)  # ~5 s alone
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for epoch in out["epochs"]:
        for sample in epoch:
            # The worker was forked from a server that had already imported
            # torch and the dataset's module, instead of importing them itself.
            assert sample["imported_in"] == sample["ppid"] != sample["pid"], sample
            assert sample["parent_has_torch"], sample
    assert out["same_context"]
    assert out["preload"] == ["__main__", "json"], "the user's preload list is put back"


@pytest.mark.long
# -- worker start under spawn -------------------------------------------------------
@pytest.mark.timeout(120)
def test_spawn_stats_show_worker_start_and_suggest_persistent_workers(caplog):
    # Each spawned worker imports torch afresh: starting dominates a tiny epoch.
    loader = torchfeed.DataLoader(scale_datasets.ImportProbe(), batch_size=1, num_workers=1,
                                  multiprocessing_context="spawn", log_every=2)
    with caplog.at_level(logging.INFO, logger="torchfeed"):
        list(loader)
    s = loader.stats()
    assert s["worker_start_seconds"] > 0 and s["workers"][0]["start_seconds"] > 0
    assert s["worker_start_fraction"] >= 0.5, s
    assert "starting workers took" in str(s) and "persistent_workers=True" in str(s)
    # a process loader cannot measure threads; it names them, and the tuner that does
    assert "worker_method='thread'" in str(s) and "torchfeed.tune" in str(s)
    assert any("starting workers took" in r.getMessage() and "persistent_workers=True"
               in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.timeout(60)
def test_persistent_workers_start_only_in_the_first_epoch():
    loader = torchfeed.DataLoader(scale_datasets.ImportProbe(), batch_size=1, num_workers=2,
                                  persistent_workers=True, multiprocessing_context="fork")
    list(loader)
    first = loader.stats()
    assert first["worker_start_seconds"] > 0
    assert all(w["start_seconds"] > 0 for w in first["workers"])
    list(loader)
    second = loader.stats()
    assert second["worker_start_seconds"] is None
    assert all(w["start_seconds"] is None for w in second["workers"])
    assert "starting workers" not in str(second)


def slow_start(worker_id):
    time.sleep(2.0)


@pytest.mark.long
@pytest.mark.timeout(120)
def test_tune_says_when_starting_workers_dominates(capfd):
    # A worker that takes two seconds to start (its worker_init_fn sleeps, as a
    # slow import would) against an epoch of two tiny samples: starting
    # dominates on any machine.  The rest of the run is the timed loop's few
    # tiny batches, which a loaded machine can stretch by a second (the suite's
    # other workers, all at once): two seconds keeps the start above half the run.
    # Forked, not spawned: the tuner reads the start from stats() whatever the
    # start method, and each spawned worker would cost seconds of CPU importing torch.
    loader = torchfeed.DataLoader(scale_datasets.ImportProbe(), batch_size=1, num_workers=1,
                                  multiprocessing_context="fork", worker_init_fn=slow_start)
    result = torchfeed.tune(loader, seconds=0.5, max_workers=1, prefetch_factors=(2,),
                            progress=False)
    assert result.rows[0].error is None  # num_workers=0 drops the start method torch rejects there
    row = [r for r in result.rows if r.num_workers == 1][0]
    assert row.worker_start_s > 0 and row.worker_start_fraction >= 0.5, row
    assert any("persistent_workers=True" in n for n in result.notes), result.notes
    assert "persistent_workers=True" in capfd.readouterr().out


# -- shuffling 10**8 samples -----------------------------------------------------------
class Indices(torch.utils.data.Dataset):
    """Sample i is i: the loader's output is its sampler's order."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def _order(loader_cls, n, seed=None, epochs=2, **kwargs):
    """Every index of ``epochs`` epochs, then one more draw from the RNG the sampler used."""
    if seed is None:
        torch.manual_seed(1234)  # the global RNG seeds RandomSampler
        generator = None
    else:
        generator = torch.Generator().manual_seed(seed)
    loader = loader_cls(Indices(n), shuffle=True, generator=generator, **kwargs)
    out = [torch.cat([torch.as_tensor(b).reshape(-1) for b in loader]) for _ in range(epochs)]
    after = torch.randint(1 << 30, (1,), generator=generator).item()
    return out, after


@pytest.fixture
def small_chunks(monkeypatch):
    """The order is handed out 1000 indices at a time, so small datasets cross chunks."""
    import torchfeed._chunked_sampler

    monkeypatch.setattr(torchfeed._chunked_sampler, "CHUNK", 1000)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [None, 7])
@pytest.mark.parametrize("kwargs", [dict(batch_size=100), dict(batch_size=99, drop_last=True),
                                    dict(batch_size=None)])
def test_shuffled_order_is_torchs(seed, kwargs, small_chunks):
    n = 5_001  # past five chunks
    theirs, their_next = _order(torch.utils.data.DataLoader, n, seed, **kwargs)
    ours, our_next = _order(torchfeed.DataLoader, n, seed, **kwargs)
    for a, b in zip(theirs, ours, strict=True):
        assert torch.equal(a, b)
    assert their_next == our_next, "the generators are left as torch's iterator leaves them"


@pytest.mark.timeout(60)
def test_random_sampler_with_more_samples_than_the_dataset_is_torchs(small_chunks):
    def order(loader_cls):
        sampler = torch.utils.data.RandomSampler(
            Indices(7_000), num_samples=15_000, generator=torch.Generator().manual_seed(3))
        return torch.cat([b for b in loader_cls(Indices(7_000), batch_size=500, sampler=sampler)])

    assert torch.equal(order(torch.utils.data.DataLoader), order(torchfeed.DataLoader))


def _python_peak_bytes(make_iterator):
    """Peak bytes of Python objects allocated while making an iterator and
    taking its first item (a tensor's storage is not a Python object)."""
    tracemalloc.start()
    try:
        it = make_iterator()
        next(it)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.timeout(60)
def test_shuffling_a_huge_dataset_holds_no_list_of_every_index():
    n = 1 << 22  # torch's RandomSampler makes a list of 4M ints here: ~150 MB
    loader = torchfeed.DataLoader(Indices(n), batch_size=4, shuffle=True)
    peak = _python_peak_bytes(lambda: iter(loader))
    assert peak < 16 * 2**20, f"{peak / 2**20:.0f} MiB of Python objects for the first batch"


@pytest.mark.timeout(60)
def test_distributed_sampler_holds_no_list_of_its_indices():
    n = 1 << 22
    sampler = torchfeed.DistributedSampler(Indices(n), num_replicas=2, rank=1, seed=5)
    peak = _python_peak_bytes(lambda: iter(sampler))
    assert peak < 16 * 2**20, f"{peak / 2**20:.0f} MiB of Python objects for the first index"
    theirs = torch.utils.data.distributed.DistributedSampler(Indices(n), num_replicas=2, rank=1,
                                                            seed=5)
    assert list(itertools.islice(iter(sampler), 100_000)) == list(
        itertools.islice(iter(theirs), 100_000))


class ReversedRandom(torch.utils.data.RandomSampler):
    """A subclass with its own order: it must be the one used."""

    def __iter__(self):
        return iter(range(len(self.data_source) - 1, -1, -1))


@pytest.mark.timeout(60)
def test_a_random_sampler_subclass_keeps_its_own_iter():
    sampler = ReversedRandom(Indices(10))
    assert [int(b) for b in torchfeed.DataLoader(Indices(10), batch_size=None,
                                                  sampler=sampler)] == list(range(9, -1, -1))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_of_a_huge_shuffle_is_exact(num_workers, small_chunks):
    def loader():
        return torchfeed.DataLoader(Indices(10_001), batch_size=100, shuffle=True,
                                    num_workers=num_workers,
                                    generator=torch.Generator().manual_seed(11))

    whole = torch.cat(list(loader()))
    first = loader()
    it = iter(first)
    head = [next(it) for _ in range(25)]  # past two chunks
    state = first.state_dict()
    second = loader()
    second.load_state_dict(state)
    rest = list(second)
    assert torch.equal(torch.cat(head + rest), whole)


# -- copy-on-read -------------------------------------------------------------------------
class Records(torch.utils.data.Dataset):
    """Sample i reads its share of the records the parent built."""

    def __init__(self, records):
        self.records = records

    def __len__(self):
        return 8

    def __getitem__(self, i):
        share = len(self.records) // 8
        part = self.records[i * share:(i + 1) * share]
        if isinstance(part, np.ndarray):
            return int(part.sum())
        return sum(r["id"] for r in part)


@pytest.mark.long
@pytest.mark.timeout(90)
def test_worker_memory_growth_from_python_objects_is_reported_and_warned_once(
        monkeypatch, caplog):
    import torchfeed._worker_costs as costs

    monkeypatch.setattr(costs, "USS_GROWTH_WARN", 16 * 2**20)
    monkeypatch.setattr(costs, "MEMORY_CHECK_EVERY", 0.0)  # check at every batch
    monkeypatch.setattr(costs, "_warned", False)
    records = _parent_heap(400_000)  # ~120 MiB of dicts and lists
    loader = torchfeed.DataLoader(Records(records), batch_size=None, num_workers=1,
                                  multiprocessing_context="fork")
    with caplog.at_level(logging.WARNING, logger="torchfeed"):
        it = iter(loader)
        for _ in range(6):
            next(it)
        s = loader.stats()
        list(it)
        list(loader)  # a second epoch, new workers: still one warning
    worker = s["workers"][0]
    # Reading a Python object writes its reference count: the worker copies the pages.
    assert worker["uss_growth_bytes"] > 20 * 2**20, worker
    assert worker["uss_bytes"] >= worker["uss_growth_bytes"]
    assert "since start" in str(s)
    warnings = [r.getMessage() for r in caplog.records if r.name == "torchfeed"]
    assert len(warnings) == 1, warnings
    assert "copy-on-read" in warnings[0] and "numpy arrays" in warnings[0]

    # The fix the warning names: the same values in one numpy array stay shared.
    caplog.clear()
    array = np.array([r["id"] for r in records])
    # The premise: the parent frees the records before the next worker is
    # forked, not after (freeing them then writes the pages the worker shares,
    # which makes them the worker's own: growth this check would rightly report).
    del records, it, loader, s
    gc.collect()
    monkeypatch.setattr(costs, "_warned", False)
    loader = torchfeed.DataLoader(Records(array), batch_size=None, num_workers=1,
                                  multiprocessing_context="fork")
    with caplog.at_level(logging.WARNING, logger="torchfeed"):
        it = iter(loader)
        next(it)
        next(it)
        s = loader.stats()
        list(it)
    assert s["workers"][0]["uss_growth_bytes"] < 8 * 2**20, s["workers"][0]
    assert not [r for r in caplog.records if r.name == "torchfeed"]
