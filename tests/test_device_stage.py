"""``DataLoader(device=...)``, the device stage, as far as it runs without a GPU:
the argument's checks, ``"cpu"`` (no stage: the batches of ``device=None``), and
a CUDA device on a machine without CUDA (a clear error, nothing left running).
The stage itself, page-locked slots and their release are tested on a GPU in
``test_gpu_feed.py``."""
from __future__ import annotations

import collections
import multiprocessing
import os

import pytest
import torch
from loader_helpers import rerun_without_accelerator
from sample_datasets import RangeDataset

import torchfeed


def _batches(loader):
    return [(b[0].tolist(), b[1].tolist()) for b in loader]


@pytest.mark.parametrize("bad", ["foo", 3.5, object()])
def test_not_a_device_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match=r"(?s)DataLoader\(device=.*not a device.*'cuda'"):
        torchfeed.DataLoader(RangeDataset(4), device=bad)


@pytest.mark.parametrize("device", ["mps", "meta", torch.device("xpu")])
def test_other_accelerators_are_refused_at_construction(device):
    with pytest.raises(ValueError, match="CUDA devices only"):
        torchfeed.DataLoader(RangeDataset(4), device=device)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_cpu_device_changes_nothing(num_workers):
    plain = torchfeed.DataLoader(RangeDataset(12), batch_size=5, num_workers=num_workers)
    staged = torchfeed.DataLoader(RangeDataset(12), batch_size=5, num_workers=num_workers,
                                  device="cpu")
    assert staged.device == "cpu"
    assert _batches(staged) == _batches(plain)
    assert staged.stats()["batches_yielded"] == 3


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("device", ["cuda", "cuda:1", 0])
def test_cuda_device_without_cuda_raises_at_iter_and_starts_nothing(num_workers, device, request):
    if torch.cuda.is_available():  # this is about a machine without CUDA
        rerun_without_accelerator(request)
        return
    loader = torchfeed.DataLoader(RangeDataset(8), batch_size=2, num_workers=num_workers,
                                  device=device)  # constructing is fine: Lightning builds on CPU
    before = set(multiprocessing.active_children())
    with pytest.raises(RuntimeError, match=r"CUDA is not available.*device=None"):
        iter(loader)
    assert set(multiprocessing.active_children()) == before
    loader.device = None  # the attribute is the option, as for torch's own
    assert len(_batches(loader)) == 4


@pytest.mark.timeout(30)
def test_releaser_runs_every_deferred_release_once_and_its_thread_ends():
    """The releaser of page-locked slots (``_transport/_page_lock.py``) as plumbing:
    releases deferred from several threads each run once, ``drain`` waits for
    them, and its thread ends once idle. Its fences need CUDA (test_gpu_feed.py)."""
    import threading
    import time

    from torchfeed._transport._page_lock import LINGER, Releaser

    releaser = Releaser()
    ran = []

    def producer(t):
        for i in range(200):
            releaser.defer(lambda i=i: ran.append((t, i)), addr=None)

    threads = [threading.Thread(target=producer, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert releaser.drain(timeout=10)
    assert sorted(ran) == [(t, i) for t in range(4) for i in range(200)]
    deadline = time.monotonic() + LINGER + 5
    while releaser._thread is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert releaser._thread is None


class _Tagged(list):
    """A list subclass with an attribute of its own, which a copy keeps."""

    def __init__(self, items=(), tag=None):
        super().__init__(items)
        self.tag = tag


def test_device_stage_rebuilds_containers_as_the_pin_step_does():
    # On the CPU the copy is the identity, so the containers alone are compared.
    from torchfeed._device import move
    from torchfeed._pin_memory import rebuild_mapping, rebuild_sequence

    counts = collections.defaultdict(list, {"x": torch.ones(2)})
    tagged = _Tagged([torch.zeros(1)], tag="kept")
    moved = move({"counts": counts, "tagged": tagged}, torch.device("cpu"), [], [])
    assert type(moved["counts"]) is collections.defaultdict
    assert moved["counts"].default_factory is list
    assert type(moved["tagged"]) is _Tagged and moved["tagged"].tag == "kept"
    assert moved["counts"] is not counts and moved["tagged"] is not tagged  # rebuilt, not shared
    assert rebuild_mapping(counts, {"x": 1}).default_factory is list
    assert rebuild_sequence(tagged, [1]).tag == "kept"


_THREADS_AT_FORK: list | None = None  # set by the test below while it records


def _record_threads_at_fork() -> None:
    if _THREADS_AT_FORK is not None:
        import threading
        _THREADS_AT_FORK.append(sorted(t.name for t in threading.enumerate()))


os.register_at_fork(before=_record_threads_at_fork)


@pytest.mark.timeout(60)
def test_the_releaser_thread_ends_before_fresh_workers_are_forked():
    """A fresh epoch's workers are forked with no releaser thread alive (torch
    forks with the main thread alone; Python 3.12 warns otherwise): ``iter()``
    runs the queued releases and ends the thread first (``Releaser.quiesce``),
    without waiting out its ``LINGER``. The releases here need no CUDA fence."""
    global _THREADS_AT_FORK
    import threading
    import time

    from torchfeed._transport import _page_lock

    ran = threading.Event()
    _page_lock.releaser.defer(lambda: (time.sleep(0.2), ran.set()), addr=None)
    assert _page_lock.releaser._thread is not None  # alive, with a release in hand
    _THREADS_AT_FORK = []
    try:
        loader = torchfeed.DataLoader(RangeDataset(4), batch_size=2, num_workers=2,
                                      multiprocessing_context="fork")
        assert len(_batches(loader)) == 2
        forks = list(_THREADS_AT_FORK)
    finally:
        _THREADS_AT_FORK = None
    assert ran.is_set(), "the queued release ran before the fork"
    assert len(forks) >= 2
    assert all("torchfeed-slot-releaser" not in names for names in forks), forks


def _failing_start(monkeypatch, name: str, times: int = 1) -> list:
    """``threading.Thread.start`` fails ``times`` times for threads called ``name``
    (``can't start new thread``, as under a pids limit); the list counts down."""
    import threading

    real_start = threading.Thread.start
    left = [times]

    def start(thread):
        if thread.name == name and left[0] > 0:
            left[0] -= 1
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    return left


@pytest.mark.timeout(30)
def test_a_releaser_whose_thread_cannot_start_still_releases_and_keeps_working(monkeypatch):
    """A failed start leaves the release queued and no half-made thread behind:
    the next ``quiesce`` (before any fork) runs it in the caller, and the
    next release starts a thread as usual."""
    from torchfeed._transport._page_lock import Releaser

    left = _failing_start(monkeypatch, "torchfeed-slot-releaser")
    releaser = Releaser()
    ran = []
    releaser.defer(lambda: ran.append(1), addr=None)
    assert left == [0] and releaser._thread is None and ran == []
    releaser.quiesce()
    assert ran == [1] and releaser._thread is None
    releaser.defer(lambda: ran.append(2), addr=None)
    assert releaser.drain(timeout=10) and ran == [1, 2]
    releaser.quiesce()
    assert releaser._thread is None


@pytest.mark.timeout(60)
def test_a_pin_thread_that_cannot_start_is_one_clear_error_and_nothing_left(monkeypatch):
    monkeypatch.setenv("TORCHFEED_PIN_THREAD_WITHOUT_ACCELERATOR", "1")  # the thread runs on CPU
    _failing_start(monkeypatch, "torchfeed-pin-memory")
    loader = torchfeed.DataLoader(RangeDataset(8), batch_size=2, num_workers=2, pin_memory=True)
    before = set(multiprocessing.active_children())
    with pytest.raises(RuntimeError, match=r"(?s)^can't start new thread\n.*pin-memory thread"):
        iter(loader)
    assert set(multiprocessing.active_children()) == before  # its workers were stopped
    assert len(_batches(loader)) == 4  # the next iterator works


def _no_fence(monkeypatch, releaser, failures: int | None = None) -> list:
    """The releaser's fence and ``torch.cuda.synchronize()`` both raise, as
    while another thread captures a CUDA graph in global mode; the fence
    passes again after ``failures`` tries (None: never)."""
    tries = []

    def fence(jobs):
        tries.append(len(jobs))
        if failures is None or len(tries) <= failures:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    def synchronize(device=None):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(releaser, "_fence", fence)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    return tries


@pytest.mark.timeout(30)
def test_a_fence_that_cannot_be_proven_never_frees_a_slot(monkeypatch):
    from torchfeed._transport import _page_lock

    monkeypatch.setattr(_page_lock, "LINGER", 0.02)
    monkeypatch.setattr(_page_lock, "FENCE_RETRIES", 3, raising=False)
    releaser = _page_lock.Releaser()
    tries = _no_fence(monkeypatch, releaser)
    freed = []
    with pytest.warns(RuntimeWarning, match=r"(?s)1 page-locked shared-memory slot.*kept from "
                                            r"their workers.*capture_error_mode"):
        releaser.defer(lambda: freed.append("slot"), addr=None)
        assert releaser.drain(timeout=10)
    assert freed == []  # the slot never went back to its worker
    assert len(tries) == 4  # tried again, then given up


@pytest.mark.timeout(30)
def test_a_fence_that_fails_for_a_while_frees_the_slot_only_once_it_passes(monkeypatch):
    from torchfeed._transport import _page_lock

    monkeypatch.setattr(_page_lock, "LINGER", 0.02)
    releaser = _page_lock.Releaser()
    tries = _no_fence(monkeypatch, releaser, failures=2)
    freed = []

    def free():
        freed.append(len(tries))

    releaser.defer(free, addr=None)
    assert releaser.drain(timeout=10)
    assert freed == [3]  # run in the round whose fence passed, not before
