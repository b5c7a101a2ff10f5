"""Datasets, collate functions and worker_init_fns that fail on purpose.

A fault fires at one sample (``at``): map-style datasets fire when that index
is fetched, iterable ones when the worker whose share contains it reaches it
(worker ``k`` of ``n`` yields samples ``k, k + n, k + 2n, ...``).  With
persistent workers a test can ask for the fault on a later visit of the sample
(``visit=2``: the second epoch), so the fault hits a worker that has already
been through ``ResumeIteration``.

Just before firing, the dataset writes the wall-clock time, its pid and
worker id to ``marker``, so a
test can measure how long the loader took to report the fault.  With
``once=True`` the marker's existence means "already fired": the fault happens
once per test even across worker restarts.

Everything is defined at module level so it also works with the spawn and
forkserver start methods.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

FAULTS = ("sigkill", "segv", "exit3", "raise", "sleep")


class DatasetBoom(Exception):
    """A custom exception type, to check the type survives the trip."""


def sample(i: int):
    return torch.tensor([i, 2 * i])


def fire(fault: str, marker: str | None, where: str = "__getitem__") -> None:
    if marker is not None:
        info = get_worker_info()
        with open(marker, "w") as f:
            f.write(f"{time.time()!r} {os.getpid()} {info.id if info is not None else -1}")
    if fault == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "segv":
        ctypes.string_at(0)
    elif fault == "exit3":
        os._exit(3)
    elif fault == "raise":
        raise DatasetBoom(f"injected failure in {where}")
    elif fault == "sleep":
        while True:
            time.sleep(3600)
    else:
        raise AssertionError(f"unknown fault {fault!r}")
    time.sleep(60)  # a signal may take a moment to arrive; never return a sample


class _Trigger:
    def __init__(self, fault, at, marker, visit, once):
        self.fault, self.at, self.marker, self.visit, self.once = fault, at, marker, visit, once
        self._visits = 0

    def check(self, i: int, where: str = "__getitem__") -> None:
        if self.fault is None or i != self.at:
            return
        self._visits += 1
        if self._visits != self.visit:
            return
        if self.once and self.marker is not None and os.path.exists(self.marker):
            return
        fire(self.fault, self.marker, where)


class FaultyMap(Dataset):
    def __init__(self, n=64, fault=None, at=21, marker=None, visit=1, once=False, delay=0.0):
        self.n = n
        self.delay = delay
        self.trigger = _Trigger(fault, at, marker, visit, once)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.delay:
            time.sleep(self.delay)
        self.trigger.check(i)
        return sample(i)


class FaultyIterable(IterableDataset):
    def __init__(self, n=64, fault=None, at=21, marker=None, visit=1, once=False, delay=0.0,
                 fault_in_iter=False):
        self.n = n
        self.delay = delay
        self.fault_in_iter = fault_in_iter
        self.trigger = _Trigger(fault, at, marker, visit, once)

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        if self.fault_in_iter and wid == self.trigger.at % nw:
            self.trigger.check(self.trigger.at, "__iter__")
        for i in range(wid, self.n, nw):
            if self.delay:
                time.sleep(self.delay)
            if not self.fault_in_iter:
                self.trigger.check(i)
            yield sample(i)


def make_dataset(kind: str, **kwargs):
    return (FaultyMap if kind == "map" else FaultyIterable)(**kwargs)


class FailingCollate:
    """collate_fn that fails (or not) on the batch containing sample ``at``."""

    def __init__(self, at=21, fault="raise", marker=None):
        self.at, self.fault, self.marker = at, fault, marker

    def __call__(self, samples):
        if any(int(s[0]) == self.at for s in samples):
            fire(self.fault, self.marker, "collate_fn")
        return torch.stack(samples)


class FailingInit:
    def __init__(self, worker_id=1, marker=None):
        self.worker_id, self.marker = worker_id, marker

    def __call__(self, worker_id):
        if worker_id == self.worker_id:
            fire("raise", self.marker, "worker_init_fn")


def share_through_files(worker_id: int) -> None:
    """worker_init_fn: torch's ``file_system`` sharing strategy (macOS's default),
    whose first shared tensor starts a ``torch_shm_manager`` child of the worker."""
    torch.multiprocessing.set_sharing_strategy("file_system")


class HoldSentinel:
    """worker_init_fn: starts ``cat`` reading the FIFO ``fifo`` with the worker's
    inheritable descriptors, as torch's ``torch_shm_manager`` is started; under
    ``spawn`` those include the write end of the worker's sentinel, so ``cat``
    keeps the sentinel quiet after the worker's death, until the test closes
    its end of the FIFO and ``cat`` exits."""

    def __init__(self, fifo: str):
        self.fifo = fifo

    def __call__(self, worker_id: int) -> None:
        subprocess.Popen(["cat", self.fifo], close_fds=False, stdout=subprocess.DEVNULL)


class UnpicklableMeta(Dataset):
    """Samples whose metadata holds something that cannot be pickled at
    position 3 of the batch: a lock or a lambda."""

    def __init__(self, leaf="lock", n=16):
        self.leaf, self.n = leaf, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        bad = threading.Lock() if self.leaf == "lock" else (lambda x: x)
        return {"x": sample(i), "meta": bad if i % 4 == 3 else f"sample-{i}"}


class UnpicklableMetaIterable(IterableDataset):
    def __init__(self, leaf="lock", n=16):
        self.inner = UnpicklableMeta(leaf, n)

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        for j, i in enumerate(range(wid, self.inner.n, nw)):
            item = self.inner[i]
            bad = threading.Lock() if self.inner.leaf == "lock" else (lambda x: x)
            yield {"x": item["x"], "meta": bad if j % 4 == 3 else f"sample-{i}"}


def collate_meta(samples):
    """Tensors stacked, metadata kept as a list: batch['meta'][k] is sample k's."""
    return {"x": torch.stack([s["x"] for s in samples]), "meta": [s["meta"] for s in samples]}


def read_marker(path):
    """(time the fault fired, pid, worker id) as written by ``fire``."""
    with open(path) as f:
        when, pid, worker_id = f.read().split()
    return float(when), int(pid), int(worker_id)


def blocked_in_a_pipe_write(skip: int = -1) -> bool:
    """Whether a thread of this process (other than thread id ``skip``) is asleep
    writing into a full pipe, as the kernel names where each thread waits."""
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == skip:
            continue
        try:
            with open(f"/proc/self/task/{tid}/wchan") as f:
                if "pipe_write" in f.read():  # anon_pipe_write on newer kernels
                    return True
        except OSError:
            continue
    return False


class BigSamples(Dataset):
    """Samples of ``size`` bytes (pickled inline, not shared like tensors).
    Fetching sample ``at`` starts a thread that SIGKILLs the worker as soon as
    another of its threads is asleep part-way through writing a batch into a
    pipe the main process is not reading: on an event, not after a guessed
    delay, so a loaded machine cannot make it an ordinary death.  If that never
    happens within ``within`` seconds it kills the worker anyway, an ordinary
    death, which the test then reports."""

    def __init__(self, n=16, size=8 << 20, at=None, within=30.0, marker=None):
        self.n, self.size, self.at, self.within, self.marker = n, size, at, within, marker

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.at:
            def kill():
                deadline = time.monotonic() + self.within
                while (not blocked_in_a_pipe_write(skip=threading.get_native_id())
                       and time.monotonic() < deadline):
                    time.sleep(0.005)
                with open(self.marker + ".tmp", "w") as f:  # whole when the test sees it
                    f.write(f"{time.time()!r} {os.getpid()} {get_worker_info().id}")
                os.replace(self.marker + ".tmp", self.marker)
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Thread(target=kill, daemon=True).start()
        return bytes(self.size)


def collate_list(samples):
    return samples
