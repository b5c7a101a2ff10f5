"""When and where the main process reads its workers' private memory (USS).

A reading makes the kernel walk every page a worker maps, inherited ones
included, so its cost grows with the parent's heap
(``benchmarks/stats_overhead.py``).  So the training thread never pays it unasked: the periodic check reads
in a thread of its own, the log line and the shutdown read nothing, and a fork
never finds that thread alive.  The readings here are the real ones, made slow
by a sleep in front, so that one on the wrong thread, or one still running at
a fork, cannot go unnoticed.
"""
from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import subprocess
import sys
import threading
import time

import psutil
import pytest
from sample_datasets import SleepDataset
from share_datasets import own_private_bytes

import torchfeed
import torchfeed._processes as _processes
import torchfeed._worker_costs as costs

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")

SLOW = 0.3  # seconds added to each reading


@pytest.fixture
def readings(monkeypatch):
    """Every reading of workers' memory, as (on the main thread?, figures), each SLOW late."""
    calls = []
    read = costs.private_bytes

    def slow_read(pids):
        on_main = threading.current_thread() is threading.main_thread()
        time.sleep(SLOW)
        out = read(pids)
        calls.append((on_main, out))
        return out

    monkeypatch.setattr(costs, "private_bytes", slow_read)
    monkeypatch.setattr(costs, "_warned", False)
    return calls


@pytest.mark.timeout(60)
def test_the_periodic_check_and_the_log_line_read_nothing_on_the_training_thread(
        monkeypatch, readings):
    monkeypatch.setattr(costs, "MEMORY_CHECK_EVERY", 0.0)  # a check at every batch
    loader = torchfeed.DataLoader(SleepDataset(40, 0.02), batch_size=1, num_workers=2,
                                  log_every=1, multiprocessing_context="fork")
    assert [b.item() for b in loader] == list(range(40))
    # 40 batches from 2 workers at 20 ms each take 0.4 s or more: readings ran
    # while they were made, and the last one was taken up at the shutdown.
    assert readings, "the periodic check read nothing"
    assert not [c for c in readings if c[0]], "a reading ran on the training thread"
    shown = [w["uss_bytes"] for w in loader.stats()["workers"]]
    assert shown == readings[-1][1], (shown, readings)
    assert all(isinstance(u, int) and u > 0 for u in shown), shown


@pytest.mark.timeout(60)
def test_a_short_epoch_shows_each_workers_own_reading_and_pays_for_none(readings):
    loader = torchfeed.DataLoader(SleepDataset(8, 0.0), batch_size=2, num_workers=2,
                                  multiprocessing_context="fork")
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert readings == [], "the shutdown read the workers' memory"
    workers = loader.stats()["workers"]
    # Each worker read its own after its first batch and sent it with its second.
    assert all(isinstance(w["uss_bytes"], int) and w["uss_bytes"] > 0 for w in workers), workers
    assert all(w["uss_growth_bytes"] == 0 for w in workers), workers


@pytest.mark.timeout(60)
def test_stats_read_memory_when_asked(readings):
    loader = torchfeed.DataLoader(SleepDataset(8, 0.0), batch_size=1, num_workers=1,
                                  persistent_workers=True, multiprocessing_context="fork")
    list(loader)
    s = loader.stats()  # the worker lives: a fresh reading, on the caller's thread
    assert [on_main for on_main, _ in readings] == [True]
    assert s["workers"][0]["uss_bytes"] == readings[0][1][0]


def _read_every_record(records, go, ready, release) -> None:
    """Once this is the last process that maps ``records``' buffer, read all of
    it (so each of its pages is mapped here only), then wait."""
    assert go.wait(30)
    assert all(len(r) == 4096 for r in records)
    ready.set()
    release.wait(50)


def _psutil_uss(pid: int) -> int:
    return psutil.Process(pid).memory_full_info().uss


def _ours(pid: int) -> int:
    [read] = costs.private_bytes([pid])
    return read


def _side_by_side(reference, pid: int) -> tuple[int, int]:
    """(``reference(pid)``, our reading) taken while the reference stayed the same.

    A process's private pages move while nothing runs in it: a page becomes
    its own when the other process that mapped it writes its own copy (the
    parent of a forked one) or lets go (an interpreter of this suite's that
    ends), and shared when another one maps it."""
    for _ in range(50):
        before, read, after = reference(pid), _ours(pid), reference(pid)
        if before == after:
            return before, read
    raise AssertionError(f"process {pid}'s private memory never held still")


@pytest.mark.timeout(60)
def test_a_reading_is_the_uss_less_the_shared_buffer_pages_only_that_process_touched():
    """A reading is the worker's USS, less the pages of ``torchfeed.share``
    buffers that only it maps: those are the one copy every process maps, not
    the worker's own.  Both ways a reading is taken: a process that maps no
    buffer (the kernel's sum, ``smaps_rollup``), against psutil's USS, and one
    that has read a 32 MiB buffer no other process has touched (``smaps``,
    mapping by mapping), against the tests' own reading of ``smaps``."""
    plain = subprocess.Popen([sys.executable, "-c", "print('ready', flush=True); input()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    fork = multiprocessing.get_context("fork")
    go, ready, release = fork.Event(), fork.Event(), fork.Event()
    records = torchfeed.share([bytes([i % 251]) * 4096 for i in range(8192)])
    reader = fork.Process(target=_read_every_record, args=(records, go, ready, release))
    reader.start()
    del records  # and with it this process's mapping of the buffer
    gc.collect()
    go.set()
    try:
        assert plain.stdout.readline() == "ready\n"  # and now waits on its input
        uss, read = _side_by_side(_psutil_uss, plain.pid)
        assert read == uss > 0, (read, uss)
        assert ready.wait(30), "the reader did not read its records"
        own, read = _side_by_side(own_private_bytes, reader.pid)
        assert read == own, (read, own)
        # The premise: the kernel counts the buffer's pages private to the reader.
        assert _psutil_uss(reader.pid) - own > 30 * 2**20, (_psutil_uss(reader.pid), own)
    finally:
        release.set()
        plain.communicate("\n", timeout=30)
        reader.join(30)
    assert reader.exitcode == 0 and plain.returncode == 0


_watch: list | None = None  # while a list, each fork of this process notes ours in it
_watching_forks = False


def reading_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name == "torchfeed-memory")


def _note_reading_threads() -> None:
    if _watch is not None:
        _watch.append(reading_threads())


@contextlib.contextmanager
def reading_threads_at_forks():
    """The reading threads alive at each fork of this process while the block runs.
    A fork hook cannot be taken back: registered once, it notes nothing outside."""
    global _watch, _watching_forks
    if not _watching_forks:
        os.register_at_fork(before=_note_reading_threads)
        _watching_forks = True
    _watch = []
    try:
        yield _watch
    finally:
        _watch = None


@pytest.mark.timeout(60)
def test_no_reading_thread_is_alive_when_a_worker_is_forked(monkeypatch):
    """A reading still running when a second loader forks its worker is waited for.

    The reading waits until torchfeed is about to fork (its ``finish_readings``
    begins), so it is surely alive when the second loader starts, and it is over
    at the fork only if torchfeed waited for it; left running, it would outlive
    the fork (and give up after 10 s)."""
    armed, fork_coming = threading.Event(), threading.Event()
    read, finish = costs.private_bytes, _processes.finish_readings

    def read_once_a_fork_comes(pids):
        if armed.is_set():
            fork_coming.wait(10)
        return read(pids)

    def finish_readings():
        fork_coming.set()
        finish()

    monkeypatch.setattr(costs, "private_bytes", read_once_a_fork_comes)
    monkeypatch.setattr(costs, "MEMORY_CHECK_EVERY", 0.0)
    monkeypatch.setattr(costs, "_warned", False)  # a warned process reads no more
    monkeypatch.setattr(_processes, "finish_readings", finish_readings)
    training = torchfeed.DataLoader(SleepDataset(6, 0.0), num_workers=1,
                                    persistent_workers=True, multiprocessing_context="fork")
    it = iter(training)
    next(it)  # the training worker is forked, and a first reading starts
    while reading_threads():  # it ends unhindered, to be taken up at the next batch
        time.sleep(0.01)
    fork_coming.clear()
    armed.set()
    next(it)  # the next reading starts here, and waits for the next fork
    assert reading_threads(), "no reading is running when the second loader starts"
    with reading_threads_at_forks() as alive:
        validation = torchfeed.DataLoader(SleepDataset(6, 0.0), num_workers=1,
                                          multiprocessing_context="fork")
        assert [b.item() for b in validation] == list(range(6))
    assert alive, "the validation loader forked no worker"
    assert not any(alive), f"reading threads alive at the forks: {alive}"
    assert [b.item() for b in it] == list(range(2, 6))


def test_a_reading_whose_thread_cannot_start_leaves_nothing_behind(monkeypatch):
    """``can't start new thread`` (a pids limit, just when loaders fork): the
    reading raises once (``_stats`` logs it and goes on), and no later
    ``finish_readings``, which runs before every fork, trips over it."""
    real_start = threading.Thread.start

    def start(thread):
        if thread.name == "torchfeed-memory":
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        costs.MemoryReading([os.getpid()])
    monkeypatch.setattr(threading.Thread, "start", real_start)
    costs.finish_readings()  # nothing listed that was never started
    assert costs.MemoryReading([os.getpid()]).wait()[0] > 0
    costs.finish_readings()
