"""Items 10 and 11: nothing accumulates over many loaders or many batches.

* 300 cycles of create, iterate part of an epoch, delete: open fds, threads,
  child processes and /dev/shm entries stay flat, and the main process's RSS
  grows less than 10% after warm-up.  The cycles walk the configuration matrix
  (cycle i uses configuration i mod 8).
* A soak of 50,000 batches through 2 workers: the RSS of the main process and
  of each worker stays within 10% after warm-up.  Batches of 8 small samples
  keep it to about 10 s on 2 cores, so it runs with the rest of the suite.
"""
import gc
import os
import threading
import time
import warnings

import psutil
import pytest
from faults_datasets import make_dataset
from faults_helpers import ALL_CONFIGS, children_but_servers, foreign_shm, own_shm_entries

from torchfeed import DataLoader

WARM_UP = 30


def _counts():
    me = psutil.Process()
    return {"fds": me.num_fds(), "threads": threading.active_count(),
            "children": len(children_but_servers(me)), "shm": own_shm_entries()}


def _shm_left(baseline: set) -> set:
    """/dev/shm entries made since ``baseline`` and not another run's (pytest-xdist
    runs other tests beside this one; see foreign_shm)."""
    return {n for n in own_shm_entries() - baseline if not foreign_shm(n, {os.getpid()})}


@pytest.mark.long
@pytest.mark.timeout(400)  # ~30 s alone; a hang guard, beside five busy workers
def test_300_create_iterate_delete_cycles_stay_flat(monkeypatch):
    monkeypatch.setenv("TORCHFEED_PIN_THREAD_WITHOUT_ACCELERATOR", "1")
    warnings.filterwarnings("ignore", message=".*no accelerator is found.*")
    me = psutil.Process()
    baseline = rss = None
    for cycle in range(300):
        config = ALL_CONFIGS[cycle % len(ALL_CONFIGS)]
        loader = DataLoader(make_dataset(config.kind, n=64), batch_size=4, num_workers=2,
                            **config.kwargs())
        for epoch in range(2 if config.persistent else 1):
            for step, batch in enumerate(loader):
                if step == 3:
                    break
        del batch, loader
        if cycle + 1 == WARM_UP:
            gc.collect()
            baseline, rss = _counts(), me.memory_info().rss
    # The last loader may be shutting down in its pin thread (which can hold
    # the last reference for a moment): give it the leak checker's grace.
    deadline = time.monotonic() + 3
    while True:
        gc.collect()
        after = _counts()
        if after["children"] == 0 and after["threads"] <= baseline["threads"] \
                or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert after["fds"] <= baseline["fds"], (baseline, after)
    assert after["threads"] <= baseline["threads"], (baseline, after)
    assert after["children"] == 0, after
    assert not _shm_left(baseline["shm"]), _shm_left(baseline["shm"])
    grown = me.memory_info().rss / rss - 1
    assert grown < 0.10, f"RSS grew {grown:.1%} over {300 - WARM_UP} cycles"


@pytest.mark.long
@pytest.mark.timeout(300)  # ~10 s alone; a hang guard, beside five busy workers
def test_soak_50000_batches_rss_flat():
    dataset = make_dataset("map", n=50_000 * 8)
    loader = DataLoader(dataset, batch_size=8, num_workers=2)
    me = psutil.Process()
    samples = {}
    for step, batch in enumerate(loader):
        del batch
        if step in (5_000, 49_999):  # after warm-up, and at the end
            workers = children_but_servers(me)
            assert len(workers) == 2
            samples[step] = [me.memory_info().rss] + [w.memory_info().rss for w in workers]
    assert step == 49_999
    for name, warm, end in zip(["main", "worker 0", "worker 1"], samples[5_000],
                               samples[49_999]):
        assert end / warm - 1 < 0.10, f"{name}: RSS {warm >> 20} MiB -> {end >> 20} MiB"
