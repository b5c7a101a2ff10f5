"""Issue 51 on this Linux host: what torchfeed does where a capability is missing,
and the portable IPC backend (``TORCHFEED_PORTABLE=1``, what Windows runs).

A missing capability is simulated here by turning its ``torchfeed._host`` flag
off in this process, which is what the code reads; the whole-host simulations,
in which torchfeed's own modules see macOS's or Windows' standard library, are
``tests/host_profiles`` (``.ci/run`` runs them).  The portable backend runs
for real: real workers, real pipes, ``multiprocessing.connection.wait``.
"""
from __future__ import annotations

import multiprocessing
import os
import struct
import threading
import time
import warnings

import pytest
import torch
from sample_datasets import RangeDataset

import torchfeed
from torchfeed import _host, _ipc
from torchfeed._ipc import HalfMessage, RelayReader, paused_for_fork, wait_ready
from torchfeed._ipc._pipe_reader import STALL
from torchfeed._stack_dump import UNAVAILABLE, collect_dumps, describe_timeout
from torchfeed._transport import TorchChannel, _page_lock

FORK = multiprocessing.get_context("fork")


@pytest.fixture
def told(monkeypatch):
    """The PlatformFallbackWarnings given, each feature told afresh."""
    monkeypatch.setattr(_host, "_told", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield lambda: [str(w.message) for w in caught
                       if issubclass(w.category, _host.PlatformFallbackWarning)]


@pytest.fixture
def portable(monkeypatch):
    monkeypatch.setenv(_host.PORTABLE_ENV, "1")
    assert not _host.fd_backend()


def _relay_threads() -> list:
    return [t for t in threading.enumerate() if t.name == "torchfeed-result-relay"]


# -- where the shared-memory slots cannot exist (macOS, Windows) -------------------
@pytest.mark.timeout(60)
def test_without_slots_the_transport_is_torchs_and_says_so(monkeypatch, told):
    monkeypatch.setattr(_host, "SHM_SLOTS", False)
    monkeypatch.delenv("TORCHFEED_TRANSPORT", raising=False)
    loader = torchfeed.DataLoader(RangeDataset(12), batch_size=3, num_workers=2,
                                  multiprocessing_context=FORK)
    assert loader.transport == "torch"
    it = iter(loader)
    assert it._channel.kind == "torch"
    batches = list(it)
    assert [b[1].tolist() for b in batches] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert loader.stats()["transport"] == "torch"
    torchfeed.DataLoader(RangeDataset(12), num_workers=2)  # told once, not per loader
    messages = told()
    assert len(messages) == 1, messages
    assert messages[0].startswith("torchfeed on Linux: batches go through torch's own transport")


def test_without_slots_no_notice_for_a_loader_without_workers(monkeypatch, told):
    monkeypatch.setattr(_host, "SHM_SLOTS", False)
    monkeypatch.delenv("TORCHFEED_TRANSPORT", raising=False)
    assert torchfeed.DataLoader(RangeDataset(4)).transport == "torch"
    assert told() == []


def test_shm_asked_for_without_slots_is_an_error_naming_the_host(monkeypatch):
    monkeypatch.setattr(_host, "SHM_SLOTS", False)
    with pytest.raises(ValueError, match=r"torchfeed: transport='shm' cannot be used on this "
                                         r"host \(Linux\): its shared-memory slots need"):
        torchfeed.DataLoader(RangeDataset(4), num_workers=2, transport="shm")
    monkeypatch.setenv("TORCHFEED_TRANSPORT", "shm")
    with pytest.raises(ValueError, match="the TORCHFEED_TRANSPORT environment variable='shm' "
                                         "cannot be used on this host"):
        torchfeed.DataLoader(RangeDataset(4), num_workers=2)


def test_page_locked_slots_without_slots_pin_by_copy_and_say_so(monkeypatch, told):
    monkeypatch.setattr(_host, "SHM_SLOTS", False)
    _page_lock.enable(TorchChannel(2))
    _page_lock.enable(TorchChannel(2))
    messages = told()
    assert len(messages) == 1 and "pin_memory=True copies each batch into page-locked" in messages[0]


# -- where memfd and seals are missing: torchfeed.share, share_dataset ------------
def test_share_without_memfd_returns_its_input_and_says_so(monkeypatch, told):
    monkeypatch.setattr(_host, "SHARED_CONTAINERS", False)
    records = [{"id": i} for i in range(5)]
    assert torchfeed.share(records) is records
    assert torchfeed.share({"a": 1}, name="labels") == {"a": 1}  # no collective: nothing to share
    tensor = torchfeed.share(torch.arange(4))  # torch shares tensors on every host
    assert tensor.is_shared()
    messages = told()
    assert len(messages) == 1 and "torchfeed.share returns what it is given, unshared" in messages[0]


class _WithCaptions(RangeDataset):
    def __init__(self, n):
        super().__init__(n)
        self.captions = [f"caption {i}" for i in range(40_000)]  # over 1 MiB


@pytest.mark.timeout(60)
def test_share_dataset_without_memfd_shares_nothing_and_says_so(monkeypatch, told):
    monkeypatch.setattr(_host, "SHARED_CONTAINERS", False)
    dataset = _WithCaptions(8)
    captions = dataset.captions
    loader = torchfeed.DataLoader(dataset, batch_size=4, num_workers=2, share_dataset=True,
                                  multiprocessing_context=FORK)
    assert len(list(loader)) == 2
    assert dataset.captions is captions  # left as it was
    stats = loader.stats()
    assert [a["attribute"] for a in stats["large_attributes"]] == ["dataset.captions"]
    assert stats["large_attributes"][0]["shared"] is False
    messages = told()
    assert len(messages) == 1 and "share_dataset=True shares nothing here" in messages[0]


# -- where processes end by exit code, not signal (Windows) ------------------------
def test_restarts_refused_without_posix_signals(monkeypatch):
    monkeypatch.setattr(_host, "HAS_POSIX_SIGNALS", False)
    with pytest.raises(ValueError, match=r"max_worker_restarts=2 cannot be used on this host "
                                         r"\(Linux\): it restarts workers killed by a signal"):
        torchfeed.DataLoader(RangeDataset(4), num_workers=2, max_worker_restarts=2)
    torchfeed.DataLoader(RangeDataset(4), num_workers=2)  # 0, the default, is torch's


def test_a_start_method_the_host_lacks_keeps_torchs_error_and_names_the_host(monkeypatch):
    monkeypatch.setattr(torch.multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    with pytest.raises(ValueError) as raised:
        torchfeed.DataLoader(RangeDataset(4), num_workers=2, multiprocessing_context="fork")
    text = str(raised.value) + "\n".join(getattr(raised.value, "__notes__", []))
    assert str(raised.value).startswith("multiprocessing_context option should specify a valid "
                                        "start method in ['spawn']")
    assert "torchfeed: Linux has the start methods spawn only; 'fork' cannot be used here" in text
    with pytest.raises(ValueError) as raised:  # no start method anywhere: torch's error alone
        torchfeed.DataLoader(RangeDataset(4), num_workers=2, multiprocessing_context="no-such")
    assert not getattr(raised.value, "__notes__", []) and "torchfeed" not in str(raised.value)


# -- where there are no stack dumps (Windows: no SIGUSR1) -------------------------
def test_timeout_without_stack_dumps_says_why(monkeypatch):
    monkeypatch.setattr(_host, "HAS_STACK_DUMPS", False)
    assert collect_dumps({0: (object(), 123)}) == {0: UNAVAILABLE}
    text = describe_timeout(2.0, [(0, 123, 5, "sample indices [5]")], {0: UNAVAILABLE})
    assert text.splitlines()[0] == "DataLoader timed out after 2.0 seconds"
    assert ("Python stacks of worker 0 (pid 123) are not available on Linux, which has no "
            "SIGUSR1 for faulthandler.register.") in text
    assert "Run with num_workers=0 to see where it is stuck" in text


# -- the portable backend ----------------------------------------------------------
@pytest.mark.timeout(60)
def test_portable_backend_loads_in_order_and_leaves_no_thread(portable):
    loader = torchfeed.DataLoader(RangeDataset(40), batch_size=4, num_workers=2,
                                  multiprocessing_context=FORK)
    it = iter(loader)
    assert isinstance(it._receiver.messages, RelayReader)
    assert not any(q._direct for q in it._index_queues)
    assert [b[1].tolist() for b in it] == [list(range(i, i + 4)) for i in range(0, 40, 4)]
    del it
    deadline = time.monotonic() + 5
    while _relay_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _relay_threads() == []


@pytest.mark.timeout(30)
def test_relay_is_readable_exactly_while_a_message_waits():
    """The relay's pipe holds a token exactly while a message can be taken: a
    token left over from a message already taken would wake the receiver for
    nothing and make it wait for the next message without its timeout (a
    timeout of 0.5 s that never fired, found on the forced portable run)."""
    queue = FORK.Queue()
    relay = RelayReader(queue)
    try:
        assert not relay.started()
        queue.put("first")
        deadline = time.monotonic() + 5
        while not relay.started() and time.monotonic() < deadline:  # in the pipe, no relay yet
            time.sleep(0.01)
        assert relay.started() and _relay_threads() == []
        queue.put("second")
        assert wait_ready([relay.fd], 5) == [relay.fd]
        deadline = time.monotonic() + 5
        while len(relay._inbox) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        import pickle
        assert [pickle.loads(relay.read({}, lambda: False)) for _ in range(2)] == ["first", "second"]
        assert not relay.has_message()
        assert wait_ready([relay.fd], 0.3) == []
    finally:
        _ipc.close_queue(queue)
    assert relay.closed


@pytest.mark.timeout(30)
def test_relay_never_hangs_on_half_a_message():
    """A writer that dies part-way through a message: the relay thread waits on
    the rest, the reader gives up after STALL and names the dead writer."""
    queue = FORK.Queue()
    relay = RelayReader(queue)
    writer = queue._writer.fileno()
    child = FORK.Process(target=_write_half_a_message, args=(writer,))
    child.start()
    child.join(10)
    assert child.exitcode == 0
    assert wait_ready([relay.fd], 1.0) == []  # no whole message
    deadline = time.monotonic() + 5
    while not relay.started() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert relay.started()
    began = time.monotonic()
    with pytest.raises(HalfMessage) as raised:
        relay.read({child.sentinel: 7}, lambda: False)
    assert raised.value.worker_id == 7
    assert STALL <= time.monotonic() - began < STALL + 3
    _ipc.close_queue(queue)  # the last writer's end closes: the stuck relay thread ends
    deadline = time.monotonic() + 5
    while _relay_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _relay_threads() == []


def _write_half_a_message(fd: int) -> None:
    os.write(fd, struct.pack("!i", 1 << 20) + b"x" * 1000)


@pytest.mark.timeout(30)
def test_no_relay_thread_while_workers_are_forked():
    queue = FORK.Queue()
    relay = RelayReader(queue)
    try:
        relay.fd  # noqa: B018 - waiting on it starts the thread
        assert len(_relay_threads()) == 1
        with paused_for_fork():
            assert _relay_threads() == []
        relay.fd  # noqa: B018
        assert len(_relay_threads()) == 1
    finally:
        _ipc.close_queue(queue)


def test_portable_watchdog_watches_the_main_process_without_signals(portable, monkeypatch):
    from torchfeed import _worker

    other = FORK.Process(target=time.sleep, args=(30,))
    other.start()
    try:
        with monkeypatch.context() as patched:
            patched.setattr(os, "kill", _refuse_kill)  # Windows: os.kill(pid, 0) is a Ctrl-C
            assert _worker._main_process_alive(other.pid, os.getppid())
    finally:
        other.kill()
        other.join(5)
    monkeypatch.setattr(os, "kill", _refuse_kill)
    assert not _worker._main_process_alive(other.pid, os.getppid())
    assert not _worker._main_process_alive(os.getpid(), os.getppid() + 1)  # reparented


def _refuse_kill(pid, sig):
    raise AssertionError(f"os.kill({pid}, {sig}) on the portable backend")
