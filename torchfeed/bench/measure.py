"""Timing one loader run: throughput, time to first batch, main-process CPU, peak memory.

Owns the measurement of a single run and nothing about comparing runs.  Both
the bench (fixed number of batches) and the tuner (fixed number of seconds)
time loaders through :func:`time_loader`, so their figures mean the same thing:

- ``first_batch_s``: wall time from ``iter(loader)`` to the first batch, so it
  includes starting the workers;
- ``batches_per_s``: batches after the first, over the wall time they took;
- ``cpu_us_per_batch``: ``time.process_time()`` of this (consuming) process over
  that same timed part, per batch.  Every thread of the process counts (a
  pin-memory or transport thread costs the training loop too) except the
  memory sampler's own, which is subtracted;
- ``peak_rss_bytes``: the largest sum of the RSS of this process and of the
  child processes started during the run (pages shared between processes are
  counted once per process, as RSS does);
- ``start_rss_bytes``: this process's RSS before the run, so that what the
  loader added is ``peak_mem_bytes - start_rss_bytes``;
- ``peak_shm_bytes``: the largest growth of ``/dev/shm`` use over its level when
  the run started.  It is machine-wide, so other programs using shared memory
  at the same time show up in it.

The consumer drops each batch without reading it: the figures are the cost of
getting batches to the training loop, not of using them.
"""
from __future__ import annotations

import gc
import os
import shutil
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable

import psutil

_SHM_DIR = "/dev/shm"


def shm_used_bytes() -> int:
    """Bytes in use on /dev/shm, or 0 where there is none (macOS, Windows)."""
    try:
        return shutil.disk_usage(_SHM_DIR).used
    except OSError:
        return 0


def child_pids() -> set[int]:
    try:
        return {c.pid for c in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()


def _read_ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name in parentheses may hold spaces; the fields after it don't.
    return int(stat[stat.rindex(b")") + 2:].split()[1])


class _ChildTracker:
    """This process's descendants, found cheaply enough to look on every tick.

    psutil's children() reads the stat file of every process on the machine
    (milliseconds), too slow to run every tick, and a slower look misses the
    workers of a short run.  Listing /proc is cheap, and a pid's parent never
    changes while it lives, so only pids not seen before are read.
    """

    def __init__(self, ignore: set[int]) -> None:
        self._me = os.getpid()
        self._ignore = ignore
        self._parent: dict[int, int | None] = {}
        self._use_proc = os.path.isdir(f"/proc/{self._me}")

    def pids(self) -> list[int]:
        if not self._use_proc:
            return [p for p in child_pids() if p not in self._ignore]
        try:
            alive = {int(n) for n in os.listdir("/proc") if n.isdigit()}
        except OSError:
            return []
        for pid in list(self._parent):
            if pid not in alive:
                del self._parent[pid]  # gone; its pid may come back with another parent
        for pid in alive - self._parent.keys():
            self._parent[pid] = _read_ppid(pid)
        family = {self._me}
        grown = True
        while grown:
            new = {pid for pid, ppid in self._parent.items()
                   if ppid in family and pid not in family}
            family |= new
            grown = bool(new)
        family.discard(self._me)
        return [p for p in family if p not in self._ignore]


class MemorySampler(threading.Thread):
    """Samples RSS (this process + new children) and /dev/shm growth in the background."""

    def __init__(self, interval: float = 0.02) -> None:
        super().__init__(name="torchfeed-bench-memory", daemon=True)
        self.interval = interval
        self._proc = psutil.Process()
        # Processes that outlive runs (a resource tracker, say) belong to no run.
        self._children = _ChildTracker(ignore=child_pids())
        self._procs: dict[int, psutil.Process] = {}
        self._shm_base = shm_used_bytes()
        self.start_rss_bytes = self._proc.memory_info().rss
        self._stop_event = threading.Event()
        self.peak_rss_bytes = 0
        self.peak_shm_bytes = 0
        self.cpu_seconds = 0.0

    def run(self) -> None:
        while True:
            start = time.thread_time()
            self.sample()
            # Read by the main thread to take the sampler out of process_time().
            self.cpu_seconds += time.thread_time() - start
            if self._stop_event.wait(self.interval):
                return

    def sample(self) -> None:
        rss = self._proc.memory_info().rss
        pids = self._children.pids()
        for pid in pids:
            try:
                proc = self._procs.get(pid) or self._procs.setdefault(pid, psutil.Process(pid))
                rss += proc.memory_info().rss
            except psutil.Error:
                pass  # exited between the listing and now
        self.peak_rss_bytes = max(self.peak_rss_bytes, rss)
        self.peak_shm_bytes = max(self.peak_shm_bytes, shm_used_bytes() - self._shm_base)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
        self.sample()


@dataclass
class Timing:
    """The figures of one run; see the module docstring for what each means."""

    batches: int
    seconds: float
    first_batch_s: float
    batches_per_s: float
    cpu_us_per_batch: float
    peak_rss_bytes: int
    peak_shm_bytes: int
    # The main process alone before the run: peak_mem_bytes minus this is what
    # the loader itself added, which the peak hides behind the process's size.
    start_rss_bytes: int = 0
    epochs_started: int = 1
    leftover_processes: int = 0

    @property
    def peak_mem_bytes(self) -> int:
        return self.peak_rss_bytes + self.peak_shm_bytes

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["peak_mem_bytes"] = self.peak_mem_bytes
        return data


def wait_for_exit(pids: Iterable[int], timeout: float) -> int:
    """Wait up to ``timeout`` s for ``pids`` to exit; return how many are still alive."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return len(alive)


def time_loader(make_loader: Callable[[], Iterable], *, batches: int | None = None,
                seconds: float | None = None, restart_epochs: bool = False,
                sample_interval: float = 0.02, exit_timeout: float = 5.0) -> Timing:
    """Time a loader: the first batch, then ``batches`` more or ``seconds`` of batches.

    ``make_loader`` builds the loader here, so that this function holds its
    only reference and can shut it down (persistent workers included) before
    returning.  The wall time starts at ``iter(loader)``, not at construction,
    as a training loop's first batch does.  With ``restart_epochs`` an epoch
    that ends early is followed by a new ``iter(loader)`` (its start-up time
    counts, as it would in training);
    without it, running out of batches is an error, because the caller sized
    the dataset for the run.  Afterwards the iterator is dropped and this
    waits for the processes the run started to exit, so that the next run
    starts from a clean machine; how many did not is in ``leftover_processes``.
    """
    if (batches is None) == (seconds is None):
        raise ValueError("give exactly one of batches= or seconds=")
    gc.collect()
    before = child_pids()
    sampler = MemorySampler(sample_interval)
    sampler.start()
    loader = iterator = None
    try:
        loader = make_loader()
        start = time.perf_counter()
        iterator = iter(loader)
        batch = next(iterator)
        first_batch_s = time.perf_counter() - start
        del batch

        count = 0
        epochs = 1
        sampler_cpu0 = sampler.cpu_seconds
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        deadline = t0 + seconds if seconds is not None else None
        while True:
            if batches is not None and count >= batches:
                break
            if deadline is not None and time.perf_counter() >= deadline:
                break
            try:
                batch = next(iterator)
            except StopIteration:
                if not restart_epochs:
                    raise RuntimeError(
                        f"the loader ran out after {count + 1} batches, before the "
                        "end of the timed run; give it a longer dataset") from None
                iterator = None
                iterator = iter(loader)
                epochs += 1
                continue
            # Dropping the batch at once is what lets a transport recycle its memory.
            del batch
            count += 1
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0 - (sampler.cpu_seconds - sampler_cpu0)
    finally:
        # Shut the workers down before the next run, and count the shutdown's
        # memory in this run.
        iterator = loader = None
        gc.collect()
        sampler.stop()
    leftover = wait_for_exit(child_pids() - before, exit_timeout)
    return Timing(
        batches=count,
        seconds=wall,
        first_batch_s=first_batch_s,
        batches_per_s=count / wall if wall > 0 else 0.0,
        cpu_us_per_batch=max(0.0, cpu) / count * 1e6 if count else 0.0,
        peak_rss_bytes=sampler.peak_rss_bytes,
        peak_shm_bytes=max(0, sampler.peak_shm_bytes),
        start_rss_bytes=sampler.start_rss_bytes,
        epochs_started=epochs,
        leftover_processes=leftover,
    )


def cpu_count() -> int:
    """Cores this process may run on: what the tuner and the bench scale to."""
    affinity = getattr(os, "sched_getaffinity", None)  # Linux only
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def load_average() -> float | None:
    """The system's load over the last minute (psutil's, which Windows lacks
    natively), or None where it cannot be read."""
    try:
        return psutil.getloadavg()[0]
    except (OSError, AttributeError):
        return None
