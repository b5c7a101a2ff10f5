"""Helpers shared by the core test files: exact batch comparison, running the
same configuration through torch's and torchfeed's loaders, and checking that
nothing (process, thread, file descriptor) is left behind."""
from __future__ import annotations

import collections
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import numpy as np
import psutil
import pytest
import torch

import torchfeed
from torchfeed._torch_compat import TAKES_IN_ORDER

# in_order is an argument of torch's DataLoader from 2.6 on; before, passing it is
# torch's TypeError (tests/test_torch_releases.py checks that ours raises it too).
needs_in_order = pytest.mark.skipif(not TAKES_IN_ORDER, reason="torch before 2.6 has no in_order")


# Each core test with workers runs under both kinds (worker_method, torchfeed's on every
# torch release): threads start in well under a millisecond, so the second kind costs
# little.  ``workers(*counts)`` parametrizes (num_workers, worker_method): a count > 0
# under both kinds, 0 once (it has no workers to choose).
WORKER_METHODS = ("multiprocessing", "thread")
both_kinds = pytest.mark.parametrize("worker_method", WORKER_METHODS)


def workers(*counts):
    cases = []
    for n in counts:
        kinds = WORKER_METHODS if n else ("multiprocessing",)
        cases += [pytest.param(n, kind, id=f"{n}-{kind}" if n else "0") for kind in kinds]
    return pytest.mark.parametrize("num_workers,worker_method", cases)


def torch_kwargs(kwargs: dict) -> dict:
    """``kwargs`` for torch's own loader: ``worker_method`` only where the
    installed torch takes it (no release up to 2.15 does); torch's loader
    otherwise runs processes, the reference either kind must match."""
    from torchfeed._torch_compat import TAKES_WORKER_METHOD

    if TAKES_WORKER_METHOD or "worker_method" not in kwargs:
        return kwargs
    return {k: v for k, v in kwargs.items() if k != "worker_method"}


def assert_same(a, b, path: str = "batch") -> None:
    """``a`` and ``b`` are equal, with the same types, all the way down."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a!r} != {b!r}"
        assert torch.equal(a, b), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, collections.abc.Mapping):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def canonical(batch):
    """A hashable, order-free key for a batch (for comparing as multisets)."""
    if isinstance(batch, torch.Tensor):
        return ("T", str(batch.dtype), tuple(batch.shape), tuple(batch.flatten().tolist()))
    if isinstance(batch, collections.abc.Mapping):
        return ("M", tuple((k, canonical(v)) for k, v in batch.items()))
    if isinstance(batch, (list, tuple)):
        return (type(batch).__name__, tuple(canonical(x) for x in batch))
    return batch


def batches(loader_cls, dataset, *, seed: int | None = None, epochs: int = 1, **kwargs):
    """Every batch the loader yields, epoch by epoch (a list per epoch).

    ``seed`` seeds the global torch, random and numpy RNGs first; a ``generator`` kwarg given as an
    int becomes a fresh ``torch.Generator`` with that seed."""
    if seed is not None:
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
    if isinstance(kwargs.get("generator"), int):
        kwargs["generator"] = torch.Generator().manual_seed(kwargs["generator"])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        loader = loader_cls(dataset, **kwargs)
        out = [list(loader) for _ in range(epochs)]
    return out


def torch_and_ours(dataset, **kwargs):
    """(torch's batches, torchfeed's batches) for the same configuration."""
    theirs = batches(torch.utils.data.DataLoader, dataset, **torch_kwargs(kwargs))
    ours = batches(torchfeed.DataLoader, dataset, **kwargs)
    return theirs, ours


# -- leaks ------------------------------------------------------------------------------
def multiprocessing_servers() -> set[int]:
    """The pids of multiprocessing's own long-lived helpers in this process: the
    fork server (torchfeed's forkserver preload starts it, in tests/test_scale.py
    for one, and it serves the rest of the session by design) and the resource
    tracker.  They are read from the stdlib's singletons, which know their
    process exactly, so a worker (even one forked by the server, which has the
    server's command line) never passes for one."""
    pids = {getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None),
            getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None)}
    return {pid for pid in pids if pid is not None}


def _is_helper_process(proc: psutil.Process) -> bool:
    return proc.pid in multiprocessing_servers()


def live_children() -> list[psutil.Process]:
    out = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.NoSuchProcess:
            continue
        if not _is_helper_process(proc):
            out.append(proc)
    return out


def open_fds() -> dict[int, str]:
    """fd -> what it points at, for this process."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the fd listdir itself used
    return out


class Snapshot:
    """Threads and file descriptors of this process, and its child processes."""

    def __init__(self) -> None:
        self.threads = set(threading.enumerate())
        self.fds = psutil.Process().num_fds()
        self.fd_map = open_fds()
        self.children = {p.pid for p in live_children()}

    def leftovers(self) -> dict:
        now = Snapshot()
        out = {}
        extra_threads = [t.name for t in now.threads - self.threads if t.is_alive()]
        if extra_threads:
            out["threads"] = extra_threads
        if now.fds > self.fds:
            out["fds"] = now.fds - self.fds
            out["new fds"] = {fd: target for fd, target in now.fd_map.items()
                              if self.fd_map.get(fd) != target}
        extra = now.children - self.children
        if extra:
            out["children"] = sorted(extra)
        return out

    def wait_clean(self, within: float = 3.0) -> float:
        """Seconds until nothing is left over; fails after ``within`` seconds."""
        start = time.monotonic()
        while True:
            left = self.leftovers()
            if not left:
                return time.monotonic() - start
            if time.monotonic() - start > within:
                raise AssertionError(f"left behind after {within}s: {left}")
            time.sleep(0.05)


def warm_up(dataset=None, num_workers: int = 2, **kwargs) -> None:
    """Run one loader to the end, so lazily opened fds and one-off helper
    processes exist before a Snapshot is taken."""
    from sample_datasets import RangeDataset

    loader = torchfeed.DataLoader(dataset or RangeDataset(8), num_workers=num_workers,
                                  batch_size=2, **kwargs)
    for _ in loader:
        pass
    del loader


# Python 3.12+ warns at every os.fork() of a process that has more than one
# thread (pytest-xdist's, torch's, a CUDA driver's), whichever loader forks:
# that is the test process's state, not what a test compares.  That torchfeed
# never forks with threads of its own where torch would not is
# tests/test_fork_threads.py's to check.
FORK_WITH_THREADS = "use of fork() may lead to deadlocks"


def warning_messages(record) -> list[tuple[type, str]]:
    """``(category, message)`` of each warning in ``record``, less Python's
    fork-with-threads DeprecationWarning."""
    return [(w.category, str(w.message)) for w in record
            if not (issubclass(w.category, DeprecationWarning)
                    and FORK_WITH_THREADS in str(w.message))]


# Hides CUDA and ROCm devices from a process started with it.
NO_ACCELERATOR_ENV = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}
_HIDDEN = "TORCHFEED_TEST_ACCELERATOR_HIDDEN"


def rerun_without_accelerator(request, timeout: float = 120) -> None:
    """For a test about a machine with no accelerator, on a machine that has
    one: run that same test again in a fresh pytest process that sees none
    (``NO_ACCELERATOR_ENV``), and fail with its output if it fails.  This
    process may not hide its devices itself: torch has already counted them."""
    if os.environ.get(_HIDDEN):
        raise AssertionError(f"an accelerator is still visible with {NO_ACCELERATOR_ENV}")
    env = {**os.environ, **NO_ACCELERATOR_ENV, _HIDDEN: "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           request.node.nodeid], cwd=str(request.config.rootpath), env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:]


def launch_in_own_session(cmd, timeout, env=None):
    """Run a launcher (torchrun and the like) in a session of its own and
    return ``(returncode, output)``: if it hangs or fails, the whole process
    group (its ranks and their workers) is killed with it.  ``env``: variables
    to set on top of this process's environment.

    The job's temporary files go to a directory of its own (``TMPDIR``), removed
    after it: what launchers and the processes they kill leave in /tmp (torchrun's
    ``torchelastic_*`` logs, Ray's sessions, the ``pymp-*`` directory of each killed
    worker's fd sharer) goes with it.  A short path: sockets live there, and an
    AF_UNIX path has 107 bytes."""
    scratch = tempfile.mkdtemp(prefix="tf-job-")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TMPDIR": scratch,
           **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of a failed launch
        except ProcessLookupError:
            pass
        shutil.rmtree(scratch, ignore_errors=True)
    return proc.returncode, output


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env_with_path(*folders) -> dict:
    """This process's environment with ``folders`` first on ``PYTHONPATH``, for a
    fresh interpreter that must import what this one imports from them (the
    checkout's torchfeed, the tests' helpers), whether torchfeed is installed or not."""
    old = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, folders)] + ([old] if old else []))}
