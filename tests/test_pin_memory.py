"""The pin-memory thread and ``pin_memory()`` of nested batches.

Without an accelerator nothing can be pinned, but the thread's plumbing (receive,
reorder, errors, shutdown) runs with TORCHFEED_PIN_THREAD_WITHOUT_ACCELERATOR=1,
passing batches through unpinned."""
from __future__ import annotations

import collections
import re
import threading
import time
import traceback

import pytest
import torch
import torch.utils.data
from loader_helpers import (
    Snapshot,
    assert_same,
    both_kinds,
    needs_in_order,
    rerun_without_accelerator,
    torch_kwargs,
    warm_up,
)
from sample_datasets import (
    BadIndexError,
    DyingDataset,
    FailingDataset,
    PinnableBatch,
    Point,
    RangeDataset,
    ShardedIterable,
    SlowIndexDataset,
    pinnable_collate,
)
from torch.utils.data._utils.pin_memory import pin_memory as torch_pin_memory

import torchfeed
from torchfeed._pin_memory import PASS_THROUGH_ENV, pin_memory
from torchfeed._torch_compat import accelerator_available

HAS_ACCELERATOR = accelerator_available()
NO_ACCELERATOR = "pinning tensors needs an accelerator (CUDA); this machine has none"
pytestmark = [pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true"),
              pytest.mark.filterwarnings("ignore:This DataLoader will create")]
PIN_THREAD = "torchfeed-pin-memory"


def pin_threads():
    return [t for t in threading.enumerate() if t.name == PIN_THREAD]


@pytest.fixture
def pass_through(monkeypatch):
    monkeypatch.setenv(PASS_THROUGH_ENV, "1")


# -- the thread ---------------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("in_order", [True, pytest.param(False, marks=needs_in_order)])
@both_kinds
def test_thread_passes_batches_through(pass_through, in_order, worker_method):
    kwargs = dict(batch_size=3, num_workers=2, **({} if in_order else {"in_order": False}))
    expected = list(torch.utils.data.DataLoader(RangeDataset(20), **kwargs))
    loader = torchfeed.DataLoader(RangeDataset(20), pin_memory=True, worker_method=worker_method,
                                  **kwargs)
    it = iter(loader)
    assert len(pin_threads()) == 1, "the pin-memory thread runs"
    got = list(it)
    if in_order:
        assert_same(expected, got)
    else:
        assert sorted(b[1].tolist() for b in got) == sorted(b[1].tolist() for b in expected)
    assert all(not b[0].is_pinned() for b in got) or HAS_ACCELERATOR
    deadline = time.monotonic() + 3
    while pin_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not pin_threads(), "the thread ends with the epoch"
    del it


@pytest.mark.timeout(150)
def test_no_thread_without_the_switch(request):
    if HAS_ACCELERATOR:  # with one the thread always runs: this is about a machine without
        rerun_without_accelerator(request)
        return
    it = iter(torchfeed.DataLoader(RangeDataset(6), pin_memory=True, num_workers=1))
    assert not pin_threads()
    assert len(list(it)) == 6


@pytest.mark.timeout(60)
@both_kinds
def test_thread_with_iterable_and_persistent_workers(pass_through, worker_method):
    kwargs = dict(batch_size=2, num_workers=3, persistent_workers=True, worker_method=worker_method)
    torch_loader = torch.utils.data.DataLoader(ShardedIterable(0, 11), **torch_kwargs(kwargs))
    expected = [list(torch_loader) for _ in range(2)]
    loader = torchfeed.DataLoader(ShardedIterable(0, 11), pin_memory=True, **kwargs)
    got = [list(loader) for _ in range(2)]
    assert_same(expected, got)
    assert len(pin_threads()) == 1, "persistent workers keep their pin thread between epochs"
    del loader, torch_loader
    deadline = time.monotonic() + 3
    while pin_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not pin_threads()


@pytest.mark.timeout(60)
@both_kinds
def test_thread_gone_after_delete_mid_epoch(pass_through, worker_method):
    warm_up()
    before = Snapshot()
    it = iter(torchfeed.DataLoader(RangeDataset(40), batch_size=2, num_workers=2,
                                   pin_memory=True, worker_method=worker_method))
    batch = next(it)
    assert pin_threads()
    del it, batch
    before.wait_clean(3)


@pytest.mark.timeout(60)
@both_kinds
def test_worker_error_through_thread(pass_through, worker_method):
    with pytest.raises(BadIndexError) as info:
        list(torchfeed.DataLoader(FailingDataset(10, bad=3), batch_size=2, num_workers=2,
                                  pin_memory=True, worker_method=worker_method))
    kind = "thread" if worker_method == "thread" else "process"
    assert f"worker {kind} 1" in str(info.value) and "sample indices [2, 3]" in str(info.value)
    traceback.clear_frames(info.value.__traceback__)


@pytest.mark.timeout(60)
def test_dead_worker_through_thread(pass_through):
    warm_up()
    before = Snapshot()
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        for batch in torchfeed.DataLoader(DyingDataset("sigkill", n=10, bad=3), batch_size=1,
                                          num_workers=2, pin_memory=True):
            del batch
    assert time.monotonic() - start < 5
    message = str(info.value)
    assert re.match(r"DataLoader worker \(pid\(s\) \d+\) exited unexpectedly\n", message), message
    assert "\nWorker 1 (pid " in message and "SIGKILL" in message, message
    traceback.clear_frames(info.value.__traceback__)
    del info
    before.wait_clean(3)


@pytest.mark.timeout(60)
@both_kinds
def test_timeout_through_thread(pass_through, worker_method):
    with pytest.raises(RuntimeError, match=r"^DataLoader timed out after 0.5 seconds\nIt was waiting for batch 1 "):
        list(torchfeed.DataLoader(SlowIndexDataset(6, slow=1, delay=2), batch_size=1,
                                  num_workers=1, pin_memory=True, timeout=0.5,
                                  worker_method=worker_method))


@pytest.mark.timeout(60)
def test_custom_batch_type_through_loader_like_torch(pass_through):
    # Without an accelerator torch does not pin at all, so the type's own
    # pin_memory() is not called; with one, both loaders call it.
    kwargs = dict(batch_size=2, num_workers=2, collate_fn=pinnable_collate, pin_memory=True)
    theirs = list(torch.utils.data.DataLoader(RangeDataset(6), **kwargs))
    ours = list(torchfeed.DataLoader(RangeDataset(6), **kwargs))
    assert [b.data for b in ours] == [b.data for b in theirs] == [[0, 1], [2, 3], [4, 5]]
    assert [b.pinned for b in ours] == [b.pinned for b in theirs] == [HAS_ACCELERATOR] * 3


# -- pin_memory() of nested batches -------------------------------------------------------------
class FrozenMapping(collections.abc.Mapping):
    """A read-only mapping built from a dict."""

    def __init__(self, data):
        self._data = dict(data)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)


class NoCopyList(list):
    """A list type that cannot be copied: pin_memory falls back to a list."""

    def __copy__(self):
        raise TypeError("no copies")


def nested():
    return {
        "custom": PinnableBatch([1, 2]),
        "list": [PinnableBatch("a"), "text", b"bytes", 3, 4.5, None],
        "tuple": (PinnableBatch(1), "x"),
        "point": Point(PinnableBatch(2), [PinnableBatch(3)]),
        "ordered": collections.OrderedDict(a=PinnableBatch(4)),
        "default": collections.defaultdict(list, b=[PinnableBatch(5)]),
        "frozen": FrozenMapping({"c": PinnableBatch(6)}),
        "nocopy": NoCopyList([PinnableBatch(7)]),
        "range": range(3),
        "str": "left alone",
    }


def _shape(x):
    """Types, values and the custom type's 'pinned' flag, all the way down."""
    if isinstance(x, PinnableBatch):
        return ("PinnableBatch", x.pinned, _shape(x.data))
    if isinstance(x, collections.abc.Mapping):
        return (type(x).__name__, tuple((k, _shape(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_shape(v) for v in x))
    if isinstance(x, range):
        return ("range", tuple(x))
    return (type(x).__name__, x)


def test_pin_memory_honours_custom_pin_memory_method_at_any_depth():
    out = pin_memory(nested())
    assert out["custom"].pinned and out["custom"].data == [1, 2]
    assert out["list"][0].pinned and out["list"][1:] == ["text", b"bytes", 3, 4.5, None]
    assert out["tuple"][0].pinned and out["point"].x.pinned and out["point"].y[0].pinned
    assert out["ordered"]["a"].pinned and out["default"]["b"][0].pinned
    assert out["frozen"]["c"].pinned and out["nocopy"][0].pinned
    assert out["str"] == "left alone"


def test_pin_memory_keeps_container_types_like_torch():
    theirs, ours = torch_pin_memory(nested()), pin_memory(nested())
    assert _shape(ours) == _shape(theirs)
    assert type(ours["point"]) is Point and type(ours["ordered"]) is collections.OrderedDict
    assert type(ours["default"]) is collections.defaultdict
    assert ours["default"].default_factory is list
    assert type(ours["nocopy"]) is list  # torch's fallback for a type it cannot rebuild
    assert type(ours["range"]) is list   # a range cannot be rebuilt from items either


def test_pin_memory_does_not_modify_its_input():
    data = nested()
    pin_memory(data)
    assert not data["custom"].pinned and not data["list"][0].pinned
    assert not data["default"]["b"][0].pinned


def test_pin_memory_tensors():
    batch = {"x": torch.arange(4), "y": [torch.ones(2)], "s": "keep"}
    if not HAS_ACCELERATOR:
        # Pinning needs an accelerator: torch raises, and so do we (same type).
        with pytest.raises(Exception) as theirs:
            torch_pin_memory(batch)
        with pytest.raises(Exception) as ours:
            pin_memory(batch)
        assert type(ours.value) is type(theirs.value)
        return
    out = pin_memory(batch)
    assert out["x"].is_pinned() and out["y"][0].is_pinned() and out["s"] == "keep"
    assert torch.equal(out["x"], torch.arange(4))
