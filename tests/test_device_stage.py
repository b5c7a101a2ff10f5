"""``DataLoader(device=...)``, the device stage, as far as it runs without a GPU:
the argument's checks, ``"cpu"`` (no stage: the batches of ``device=None``), and
a CUDA device on a machine without CUDA (a clear error, nothing left running).
The stage itself, page-locked slots and their release are tested on a GPU in
``test_gpu_feed.py``."""
from __future__ import annotations

import collections
import dataclasses
import multiprocessing
import os
import threading

import pytest
import torch
from loader_helpers import rerun_without_accelerator, workers
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
@workers(0, 2)
def test_cpu_device_changes_nothing(num_workers, worker_method):
    plain = torchfeed.DataLoader(RangeDataset(12), batch_size=5, num_workers=num_workers)
    staged = torchfeed.DataLoader(RangeDataset(12), batch_size=5, num_workers=num_workers,
                                  device="cpu", worker_method=worker_method)
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

    from torchfeed._transport._releaser import LINGER, Releaser

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
    from torchfeed._transport._releaser import Releaser

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
@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true")
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
    from torchfeed._transport import _releaser

    monkeypatch.setattr(_releaser, "LINGER", 0.02)
    monkeypatch.setattr(_releaser, "FENCE_RETRIES", 3)
    releaser = _releaser.Releaser()
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
    from torchfeed._transport import _releaser

    monkeypatch.setattr(_releaser, "LINGER", 0.02)
    releaser = _releaser.Releaser()
    tries = _no_fence(monkeypatch, releaser, failures=2)
    freed = []

    def free():
        freed.append(len(tries))

    releaser.defer(free, addr=None)
    assert releaser.drain(timeout=10)
    assert freed == [3]  # run in the round whose fence passed, not before


# -- objects with their own to() (issue 35, finding 1) -------------------------------------------
class _FakeStream:
    """A CUDA stream as the stage uses one: waited on, and named in record_stream."""

    def wait_event(self, event) -> None:
        pass


class _FakeEvent:
    def __init__(self, blocking: bool = False) -> None:
        pass

    def record(self, stream=None) -> None:
        pass


def _stage_without_cuda(monkeypatch) -> _FakeStream:
    """The device stage's CUDA calls stubbed; its copies are ``.to("cpu")``. The
    user's current stream is the returned one."""
    import contextlib

    user_stream = _FakeStream()
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: user_stream)
    return user_stream


def _through_the_stage(batch):
    """``batch`` through a real DeviceFeedThread and ``hand_over``, as the iterator does."""
    import threading

    from torchfeed._device import DeviceFeedThread, hand_over

    items = [(True, (0, batch))]
    stage = DeviceFeedThread(lambda timeout: items.pop() if items else (False, None), None,
                             None, pin=False, target=torch.device("cpu"))
    try:
        kind, (_, item) = stage.out.get(timeout=10)
    finally:
        stage.stop()
    assert kind == "data" and not stage.thread.is_alive()
    assert threading.current_thread() is threading.main_thread()
    return hand_over(item, torch.device("cpu"))


class _Calls:
    def __init__(self):
        self.to: list = []
        self.recorded: list = []


class OwnBatch:
    """A user's batch class: its own to(), no record_stream."""

    def __init__(self, x, calls):
        self.x, self.calls = x, calls

    def to(self, device, non_blocking=False):
        self.calls.to.append(threading.current_thread().name)
        return type(self)(self.x.to(device, non_blocking=non_blocking).clone(), self.calls)


class RecordedBatch(OwnBatch):
    """Like a TensorDict or a PyG Data: its own to() and record_stream()."""

    def record_stream(self, stream):
        if self.x.is_cuda:
            self.x.record_stream(stream)
        self.calls.recorded.append(stream)


@pytest.mark.timeout(30)
def test_an_object_with_record_stream_is_copied_ahead_and_marked_used_on_the_users_stream(
        monkeypatch):
    user_stream = _stage_without_cuda(monkeypatch)
    calls = _Calls()
    got = _through_the_stage({"b": RecordedBatch(torch.arange(4), calls), "i": torch.ones(2)})
    assert type(got["b"]) is RecordedBatch and got["b"].x.tolist() == [0, 1, 2, 3]
    assert calls.to == ["torchfeed-pin-memory"]  # copied ahead, on the stage's stream
    assert calls.recorded == [user_stream]  # so the allocator keeps it for the user's stream


@pytest.mark.timeout(30)
def test_an_object_with_its_own_to_and_no_record_stream_is_copied_on_the_users_stream(
        monkeypatch):
    """Its tensors cannot be marked used on the user's stream, so the stage
    must not allocate them on its own stream: the batch is copied at
    hand-over, in the training loop's thread (on its current stream)."""
    _stage_without_cuda(monkeypatch)
    calls = _Calls()
    got = _through_the_stage((OwnBatch(torch.arange(3), calls), torch.zeros(1)))
    assert type(got) is tuple and type(got[0]) is OwnBatch and got[0].x.tolist() == [0, 1, 2]
    assert calls.to == ["MainThread"]


@dataclasses.dataclass
class Pair:
    image: torch.Tensor
    label: int


@pytest.mark.timeout(30)
def test_a_dataclass_without_to_stays_on_the_cpu_with_one_warning(monkeypatch):
    from torchfeed import _device

    _stage_without_cuda(monkeypatch)
    monkeypatch.setattr(_device, "_left_on_cpu_warned", [False], raising=False)
    with pytest.warns(RuntimeWarning, match=r"holds a Pair \(a dataclass without a to\(\) "
                                            r"method\), whose tensors \(image\) stay on the CPU"):
        got = _through_the_stage([Pair(torch.ones(2), 1)])
    assert type(got[0]) is Pair and got[0].image.tolist() == [1.0, 1.0]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _through_the_stage([Pair(torch.ones(2), 1)])  # warned once


@pytest.mark.timeout(30)
def test_a_release_that_raises_is_logged_and_the_others_still_run(caplog):
    import logging

    from torchfeed._transport._releaser import Releaser

    releaser = Releaser()
    ran = []

    def broken():
        raise OSError(22, "Invalid argument")

    with caplog.at_level(logging.WARNING, logger="torchfeed"):
        releaser.defer(broken, addr=None)
        releaser.defer(lambda: ran.append(1), addr=None)
        assert releaser.drain(timeout=10)
    assert ran == [1]
    assert any("giving a page-locked slot back to its worker failed (OSError: [Errno 22] "
               "Invalid argument)" in r.getMessage() for r in caplog.records), caplog.text
