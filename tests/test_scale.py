"""How the loader's costs grow with the job (issue 19): the parent's heap as
seen from forked workers, worker start under forkserver and spawn, huge
shuffled datasets, and workers' private memory."""
from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys

import psutil
import pytest
import torch
import torch.utils.data

import scale_datasets
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


@pytest.mark.timeout(90)
def test_forkserver_workers_start_with_torch_and_the_dataset_module_preloaded():
    # A fresh interpreter: the fork server is one per process, and an earlier
    # test may have started it already.
    tests = os.path.dirname(os.path.abspath(__file__))
    # The dataset's module is on PYTHONPATH, where a fresh interpreter (the
    # server) finds it too, as an installed package would be.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [tests, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))
    proc = subprocess.run([sys.executable, "-c", _FORKSERVER_SCRIPT.format(tests=tests)],
                          capture_output=True, text=True, timeout=80, env=env)
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


@pytest.mark.timeout(120)
def test_tune_says_when_starting_workers_dominates(capfd):
    loader = torchfeed.DataLoader(scale_datasets.ImportProbe(), batch_size=1, num_workers=1,
                                  multiprocessing_context="spawn")
    result = torchfeed.tune(loader, seconds=0.5, max_workers=1, prefetch_factors=(2,),
                            progress=False)
    assert result.rows[0].error is None  # num_workers=0 drops the start method torch rejects there
    row = [r for r in result.rows if r.num_workers == 1][0]
    assert row.worker_start_s > 0 and row.worker_start_fraction >= 0.5, row
    assert any("persistent_workers=True" in n for n in result.notes), result.notes
    assert "persistent_workers=True" in capfd.readouterr().out
