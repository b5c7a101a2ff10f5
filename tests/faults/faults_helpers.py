"""Helpers shared by the fault tests: the configuration matrix, the /dev/shm
listing, and running a loader until it fails (and when)."""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass

import psutil
import pytest
from loader_helpers import multiprocessing_servers

SURFACE_WITHIN = 5.0  # the bound between a fault and its error
SHM_DIR = "/dev/shm"


def shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return set()


def made_by_a_loader(name: str) -> bool:
    """Whether a loader (torch's or torchfeed's) could have made this /dev/shm
    entry: torch's loader names its segments ``torch_<pid>_...``, and torchfeed
    makes none (its slots are nameless memfds) unless one is named after it.

    No other name is ever a loader's, even when no live process holds it:
    multiprocessing's named semaphores (``sem.mp-*``; this suite forks, and under
    fork multiprocessing unlinks a semaphore's name as soon as it exists, while
    other runs on the machine that spawn keep theirs named for a while), glibc's
    semaphores being made (``sem.XXXXXX``), Python's ``SharedMemory`` segments
    (``psm_*``: SPDL, the bench's peer, leaves one per loader until its process
    exits) and the streaming libraries' (``000411_barrier``), all of which a test
    running beside this one (pytest-xdist) may leave after its process exited."""
    return name.startswith("torch_") or "torchfeed" in name


def own_shm_entries() -> set[str]:
    """The /dev/shm entries that a loader (torch's or torchfeed's) could have made."""
    return {name for name in shm_entries() if made_by_a_loader(name)}


def foreign_shm(name: str, ours: set[int]) -> bool:
    """Whether a new entry belongs to another test run sharing the machine: one
    no loader makes (``made_by_a_loader``), or one named after, mapped or held
    open by a live process outside this test's tree.  An entry of ours that
    nobody maps or holds is a leak."""
    if not made_by_a_loader(name):
        return True
    for pid in map(int, re.findall(r"(?<![0-9])(\d{2,9})(?![0-9])", name)):
        if pid not in ours and psutil.pid_exists(pid):
            return True
    path = os.path.join(SHM_DIR, name)
    for pid in psutil.pids():
        if pid in ours:
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                if path in f.read():
                    return True
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(path):
                    return True
        except OSError:
            continue
    return False


def children_but_servers(process) -> list:
    """``process``'s descendants (a psutil.Process), less multiprocessing's servers."""
    servers = multiprocessing_servers()
    return [p for p in process.children(recursive=True) if p.pid not in servers]


@dataclass(frozen=True)
class LoaderConfig:
    kind: str          # "map" or "iterable"
    persistent: bool
    pin_thread: bool

    @property
    def id(self) -> str:
        return (f"{self.kind}-{'persistent' if self.persistent else 'fresh'}"
                f"{'-pin' if self.pin_thread else ''}")

    def kwargs(self) -> dict:
        return {"persistent_workers": self.persistent, "pin_memory": self.pin_thread}


ALL_CONFIGS = [LoaderConfig(kind, persistent, pin)
               for kind in ("map", "iterable")
               for persistent in (False, True)
               for pin in (False, True)]
MAP_CONFIGS = [c for c in ALL_CONFIGS if c.kind == "map"]  # for what only map-style supports


class Failure:
    """What a failed iteration left us: the exception's type and text (never
    the exception itself, whose traceback would keep the iterator alive), when
    it was raised and how many batches came before it."""

    def __init__(self, exc: BaseException, raised_at: float, batches: int):
        self.type = type(exc)
        self.message = str(exc)
        self.notes = list(getattr(exc, "__notes__", ()))
        self.raised_at = raised_at
        self.batches = batches

    def __repr__(self):
        return f"{self.type.__name__}: {self.message}"


def iterate_until_failure(loader, epochs: int = 1) -> Failure:
    """Iterate ``epochs`` epochs; return the Failure, or fail the test if none came."""
    batches = 0
    try:
        for _ in range(epochs):
            for batch in loader:
                del batch
                batches += 1
    except Exception as exc:
        return Failure(exc, time.time(), batches)
    pytest.fail(f"the loader ran {epochs} epoch(s) ({batches} batches) without an error")


def epochs_for(config) -> int:
    """Persistent workers get the fault in their second epoch (see FaultyMap's
    ``visit``), so it hits a worker that went through ResumeIteration."""
    return 2 if config.persistent else 1
