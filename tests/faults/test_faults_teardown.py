"""Item 9: dropping a loader mid-epoch while its workers are busy.

Deleting the iterator, ``break`` out of the loop, and letting the garbage
collector find an iterator in a reference cycle: each must stop every worker
promptly (workers share one second to leave, then are terminated: never 5 s
per worker) and leave nothing behind.  ``del`` and ``break`` must work by
reference counting alone, so they run with the garbage collector disabled.
"""
import gc
import os
import threading
import time

import psutil
import pytest
import torch
from faults_datasets import make_dataset
from faults_helpers import ALL_CONFIGS

from torchfeed import DataLoader

SHUTDOWN_WITHIN = 2.5  # one shared second of grace, then terminate, with margin


def _workers(existing=frozenset()):
    """This loader's workers: children that were not there before it (the
    spawn start method's resource tracker, say, outlives the test that
    started it)."""
    return [p.pid for p in psutil.Process().children() if p.pid not in existing]


def _wait_gone(pids, since):
    deadline = since + 10
    while time.time() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return time.time() - since
        time.sleep(0.01)
    return float("inf")


CASES = [(how, c) for how in ("del-iterator", "break", "gc-cycle") for c in ALL_CONFIGS]


@pytest.mark.waits
@pytest.mark.timeout(30)
@pytest.mark.parametrize("how,loader_config", CASES, indirect=["loader_config"],
                         ids=[f"{how}-{c.id}" for how, c in CASES])
def test_drop_mid_epoch_with_busy_workers(how, loader_config, no_pin_warning):
    # 0.1 s a sample, 4 to a batch, 2 batches prefetched per worker: the workers
    # are in the middle of __getitem__ whenever the loader is dropped.
    existing = frozenset(p.pid for p in psutil.Process().children())
    dataset = make_dataset(loader_config.kind, n=400, delay=0.1)
    loader = DataLoader(dataset, batch_size=4, num_workers=2, **loader_config.kwargs())
    gc.disable()
    try:
        if how == "break":
            for step, batch in enumerate(loader):
                if step == 1:
                    workers = _workers(existing)
                    break
            del batch
            started = time.time()
            del loader  # with persistent workers the loader holds the iterator
        else:
            it = iter(loader)
            next(it)
            workers = _workers(existing)
            if how == "gc-cycle":
                it.cycle = it
                loader.cycle = loader
            started = time.time()
            del it, loader
            if how == "gc-cycle":
                assert all(psutil.pid_exists(p) for p in workers)  # only the collector can help
                gc.collect()
    finally:
        gc.enable()
    assert len(workers) == 2
    took = _wait_gone(workers, started)
    assert took < SHUTDOWN_WITHIN, f"the workers took {took:.1f} s to go"


MAIN_PID = os.getpid()
decoding = threading.Event()  # set while the main process decodes a slow sample


def _rebuild_slowly(i):
    if os.getpid() == MAIN_PID and i == 4:  # the first sample of the second batch
        decoding.set()
        time.sleep(1.0)
    return i


class SlowToDecode:
    """A leaf that takes a second to unpickle in the main process."""

    def __init__(self, i):
        self.i = i

    def __reduce__(self):
        return _rebuild_slowly, (self.i,)


class SlowToDecodeDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return {"x": torch.full((4,), i), "slow": SlowToDecode(i)}


@pytest.mark.timeout(60)
def test_collector_stops_workers_while_the_pin_thread_decodes(monkeypatch, no_pin_warning):
    # The pin thread decodes batches.  Had it held the iterator while doing so,
    # a gc.collect() at that moment would find the iterator still reachable
    # from a running thread, and the workers would live on until the next one.
    monkeypatch.setenv("TORCHFEED_PIN_THREAD_WITHOUT_ACCELERATOR", "1")
    decoding.clear()
    existing = frozenset(p.pid for p in psutil.Process().children())
    loader = DataLoader(SlowToDecodeDataset(), batch_size=4, num_workers=2, pin_memory=True,
                        collate_fn=lambda samples: samples)
    gc.disable()
    try:
        it = iter(loader)
        next(it)
        workers = _workers(existing)
        assert decoding.wait(10), "the pin thread never started on the second batch"
        it.cycle = it
        started = time.time()
        del it, loader
        gc.collect()
    finally:
        gc.enable()
    assert len(workers) == 2
    took = _wait_gone(workers, started)
    assert took < SHUTDOWN_WITHIN + 1.0, f"the workers took {took:.1f} s to go"


class UnevenShards(torch.utils.data.IterableDataset):
    """Worker 0 has 2 samples, worker 1 has 40: worker 0 is retired (told to
    exit) while worker 1 still has most of its batches to send."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        n = 2 if info.id == 0 else 40
        return iter([torch.tensor([info.id, i]) for i in range(n)])


@pytest.mark.timeout(120)  # a hang guard; a parallel run may starve it several-fold
def test_retired_worker_never_blocks_the_others():
    # A retired worker that exited while its queue feeder thread still held
    # the result queue's write lock (shared by all workers) left the other
    # worker unable to send: a hang, about one run in a hundred.
    for _ in range(40):
        started = time.time()
        rows = torch.cat(list(DataLoader(UnevenShards(), batch_size=2, num_workers=2)))
        assert len(rows) == 42
        assert time.time() - started < 5
