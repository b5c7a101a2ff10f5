"""Shared machinery of the fault-injection suite.

Every test here gets the ``leaks`` check for free (it is autouse): a snapshot
of this process's children, Python threads, open file descriptors and the
``/dev/shm`` listing is taken before the test, and after it the same things are
polled for a short grace period until they are back to where they were.
Anything left over fails the test with a list of what leaked.

``loader_config`` parametrizes a test over the matrix the issue asks for:
map-style and iterable datasets, persistent workers on and off, and the
pin-memory thread on and off (there is no accelerator here, so "on" means the
thread's plumbing runs without pinning, see ``TORCHFEED_PIN_THREAD_WITHOUT_ACCELERATOR``).
"""
from __future__ import annotations

import gc
import multiprocessing.resource_tracker
import os
import threading
import time
import warnings
from dataclasses import dataclass

import psutil
import pytest
import torch
from faults_helpers import ALL_CONFIGS, SHM_DIR, foreign_shm, shm_entries

import torchfeed

GRACE = 3.0  # seconds a leak may take to clear after the test body returns


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@dataclass
class Snapshot:
    children: dict
    threads: set
    fds: int
    shm: set

    @classmethod
    def take(cls) -> "Snapshot":
        me = psutil.Process()
        children = {p.pid: p for p in me.children(recursive=True) if _alive(p)}
        return cls(children=children,
                   threads={t.ident for t in threading.enumerate()},
                   fds=me.num_fds(), shm=shm_entries())

    def leaks_since(self, before: "Snapshot") -> list[str]:
        problems = []
        extra = [p for pid, p in self.children.items() if pid not in before.children]
        if extra:
            problems.append("child processes still alive: " + ", ".join(
                f"{p.pid} ({_name(p)})" for p in extra))
        threads = [t for t in threading.enumerate() if t.ident not in before.threads]
        if threads:
            problems.append("threads still alive: " + ", ".join(t.name for t in threads))
        if self.fds > before.fds:
            problems.append(f"file descriptors: {before.fds} before, {self.fds} after: "
                            + ", ".join(_fd_targets()))
        ours = {os.getpid(), *before.children, *self.children}
        shm = sorted(n for n in self.shm - before.shm if not foreign_shm(n, ours))
        if shm:
            problems.append(f"new {SHM_DIR} entries: {shm}")
        return problems


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return "?"


def _fd_targets() -> list[str]:
    out = []
    for fd in sorted(int(f) for f in os.listdir("/proc/self/fd")):
        try:
            out.append(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            pass
    return out


def assert_no_leaks(before: Snapshot, grace: float = GRACE) -> None:
    deadline = time.monotonic() + grace
    while True:
        gc.collect()
        problems = Snapshot.take().leaks_since(before)
        if not problems or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    assert not problems, "the loader left things behind:\n  " + "\n  ".join(problems)


@pytest.fixture(scope="session", autouse=True)
def _warm_up():
    """Start and stop one loader before any snapshot, so lazily created,
    process-wide things (torch's sharing machinery, thread pools) are not
    mistaken for leaks of the first test."""
    ds = torch.utils.data.TensorDataset(torch.arange(8.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for pin in (False, True):
            for batch in torchfeed.DataLoader(ds, batch_size=2, num_workers=2, pin_memory=pin):
                del batch
    gc.collect()


@pytest.fixture(scope="module")
def resource_tracker():
    """spawn's resource tracker, a process that outlives the loader by design,
    started before the leak check's snapshot so that it is not taken for a leak."""
    multiprocessing.resource_tracker.ensure_running()


@pytest.fixture(autouse=True)
def leaks():
    """Fails the test if it leaves a process, thread, fd or /dev/shm entry behind."""
    gc.collect()
    before = Snapshot.take()
    yield before
    assert_no_leaks(before)


@pytest.fixture(params=ALL_CONFIGS, ids=lambda c: c.id)
def loader_config(request, monkeypatch):
    config = request.param
    if config.pin_thread:
        monkeypatch.setenv("TORCHFEED_PIN_THREAD_WITHOUT_ACCELERATOR", "1")
    return config


@pytest.fixture
def no_pin_warning():
    """pin_memory=True warns that there is no accelerator; that warning is not
    what these tests are about."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*no accelerator is found.*")
        yield
