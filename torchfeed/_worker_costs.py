"""What workers cost besides their batches: the time to start them, and their
private memory (issue 19).

Each worker's first message says when it was launched and when it was ready
(``time.monotonic()``, one clock for all processes on the machine) and its
private memory (USS) then; ``_stats.py`` keeps those per epoch.  This module
reads workers' USS now, works out the seconds spent starting workers this
epoch, and logs the copy-on-read warning: a worker whose USS grew by more than
``USS_GROWTH_WARN`` since it started is almost always copying the parent's
Python objects page by page as it reads them (pytorch issue 13246); the
warning names the dataset's attributes that are copied (``_share_dataset``'s
``census``) and says to pass ``share_dataset=True``.  The
growth is checked every ``MEMORY_CHECK_EVERY`` seconds of iteration, and the
warning is logged once per process.

Reading a worker's USS makes the kernel walk every page the worker maps,
inherited ones included: 6 ms for a worker of a process that imported
torch, 14 ms once the parent holds a million small dicts, and more as the
parent's heap grows (``benchmarks/stats_overhead.py``), per worker.  So the
periodic check reads in a ``MemoryReading`` thread, never on the training
thread; the kernel's walk runs without the GIL.  That thread is
joined before a worker is forked (``finish_readings``), so that a fork never
happens with a thread of ours alive, as in torch.
"""
from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable

import psutil

logger = logging.getLogger("torchfeed")

USS_GROWTH_WARN = 256 * 2**20  # a worker's private memory grown this much since its start
MEMORY_CHECK_EVERY = 10.0      # seconds of iteration between checks of workers' memory

_warned = False
# ``suspects`` when share_dataset=True shared every large attribute it found.
SHARED_ALREADY = "(shared already)"


def private_bytes(pids) -> list:
    """Each process's private memory (USS) in bytes, or None where it cannot be read.

    Pages of ``torchfeed.share``'s buffers are left out: they are the one copy
    all processes map, private to a worker only because no other process has
    touched them yet (``share_dataset=True``; see ``uss_without_shared_buffers``)."""
    out = []
    for pid in pids:
        try:
            out.append(uss_without_shared_buffers(pid) if pid else None)
        except (psutil.Error, OSError, AttributeError):
            out.append(None)
    return out


_PRIVATE = re.compile(rb"\nPrivate_(?:Clean|Dirty):\s+(\d+)")
_SHARED_BUFFER_NAME = b"memfd:torchfeed-share"
_SHARED_BUFFER = re.compile(rb"\n[0-9a-f]+-[0-9a-f]+ [^\n]*" + re.escape(_SHARED_BUFFER_NAME)
                            + rb"[^\n]*(.*?)(?=\n[0-9a-f]+-[0-9a-f]+ |\Z)", re.S)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return b"\n" + f.read()


def _private_kib(text: bytes) -> int:
    """The Private_Clean and Private_Dirty kibibytes of an smaps text (or part of one)."""
    return sum(int(kib) for kib in _PRIVATE.findall(text))


def uss_without_shared_buffers(pid: int) -> int:
    """``pid``'s USS, less the pages of ``torchfeed.share`` buffers (memfds named
    ``torchfeed-share``) that only it maps.  psutil's USS where there is no smaps."""
    try:
        uss = _rollup_uss(pid)
        if uss is not None:
            return uss
        smaps = _read(f"/proc/{pid}/smaps")
    except FileNotFoundError:
        if psutil.pid_exists(pid):
            return psutil.Process(pid).memory_full_info().uss
        raise psutil.NoSuchProcess(pid) from None
    total = _private_kib(smaps)
    for buffer in _SHARED_BUFFER.finditer(smaps):
        total -= _private_kib(buffer.group(1))
    return total * 1024


def _rollup_uss(pid: int) -> int | None:
    """``pid``'s USS from ``smaps_rollup``, or None where the full ``smaps`` is needed.

    Most processes map no ``torchfeed.share`` buffer: for them the kernel's own
    sum, in one walk of the page tables, is the answer.  The full ``smaps``, a
    text block per mapping, took a reading from 6 to 9.5 ms for a worker of a
    process that imported torch.  The mappings are looked at (``maps``, no page
    walk) before and after the sum, so a buffer mapped meanwhile is never
    counted.  A kernel before Linux 4.14 has no ``smaps_rollup``."""
    maps = f"/proc/{pid}/maps"
    if _SHARED_BUFFER_NAME in _read(maps):
        return None
    try:
        rollup = _read(f"/proc/{pid}/smaps_rollup")
    except FileNotFoundError:  # no rollup here, or the process is gone: smaps says which
        return None
    if _SHARED_BUFFER_NAME in _read(maps):
        return None
    return _private_kib(rollup) * 1024


class MemoryReading:
    """One reading of some processes' USS (``private_bytes``) in a thread of its own."""

    __slots__ = ("uss", "_thread")

    def __init__(self, pids) -> None:
        self.uss: list | None = None
        self._thread = threading.Thread(target=self._read, args=(list(pids),),
                                        name="torchfeed-memory", daemon=True)
        # Listed only once started: a start that fails (``can't start new
        # thread`` under a pids limit) raises here and leaves nothing that a
        # later ``finish_readings`` would try to join.  Under the lock, so the
        # thread cannot unlist itself before it is listed.
        with _readings_lock:
            self._thread.start()
            _readings.add(self._thread)

    def _read(self, pids) -> None:
        try:
            self.uss = private_bytes(pids)
        finally:
            with _readings_lock:
                _readings.discard(threading.current_thread())

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> list | None:
        """The figures, once read: one per pid, None where unreadable."""
        self._thread.join()
        return self.uss


_readings: set[threading.Thread] = set()
_readings_lock = threading.Lock()


def in_background(work, name: str) -> None:
    """Run ``work()`` in a daemon thread that ``finish_readings`` joins too, so
    that no fork happens while it runs (``share_dataset=True`` frees the
    dataset's replaced objects so, while the workers start)."""
    def run() -> None:
        try:
            work()
        finally:
            with _readings_lock:
                _readings.discard(threading.current_thread())

    thread = threading.Thread(target=run, name=name, daemon=True)
    # As MemoryReading: listed only once started, under the lock.  A thread
    # that cannot start (a pids limit) leaves nothing listed; the work is done
    # here instead.
    try:
        with _readings_lock:
            thread.start()
            _readings.add(thread)
    except RuntimeError:
        work()


def finish_readings() -> None:
    """Wait for every reading still running: called just before a worker is forked."""
    with _readings_lock:
        running = list(_readings)
    for thread in running:
        thread.join()


def start_span(starts: dict, launched: list, begun: float, now: float, num_workers: int):
    """(seconds from the first launch this epoch until the last worker was
    ready, or until ``now`` while one is still starting; the seconds from that
    launch to ``now``), or (None, None) when no worker started this epoch.

    ``starts``: worker -> (launched, ready, USS) from its first message;
    ``launched``: each current worker process's launch time; ``begun``: when the
    epoch began (a persistent worker launched before it started in an earlier
    epoch).  All in ``time.monotonic()`` seconds."""
    spans = []
    for i in range(num_workers):
        record = starts.get(i)
        if record is not None:
            spans.append(record[:2])
        elif i < len(launched) and launched[i] is not None and launched[i] >= begun:
            spans.append((launched[i], now))  # launched this epoch, not ready yet
    if not spans:
        return None, None
    first = min(a for a, _ in spans)
    return max(b for _, b in spans) - first, now - first


def growth_warned() -> bool:
    """Whether this process has logged the copy-on-read warning already."""
    return _warned


def check_growth(growth: list, uss: list, suspects: Callable[[], str] = str) -> None:
    """Log the copy-on-read warning, once per process, for the first worker
    that grew past ``USS_GROWTH_WARN``; ``suspects()`` names the dataset's
    attributes that are copied (``_share_dataset.naming``), only then."""
    global _warned
    if _warned:
        return
    for worker_id, (grown, now) in enumerate(zip(growth, uss)):
        if grown is not None and grown > USS_GROWTH_WARN:
            _warned = True
            logger.warning(copy_on_read_warning(worker_id, grown, now, suspects()))
            return


def copy_on_read_warning(worker_id: int, growth: int, uss: int, suspects: str = "") -> str:
    if suspects == SHARED_ALREADY:
        named = ("The dataset's large attributes are shared already (share_dataset=True): "
                 "look for other Python objects the workers read (module globals, objects "
                 "deeper than two levels of attributes), or hold the data ")
    elif suspects:
        named = (f"The dataset's large Python containers, copied by every worker: {suspects}; "
                 "pass `share_dataset=True` to the DataLoader to hold them once, in shared "
                 "memory, for the main process and all workers. Or hold the data ")
    else:
        named = ("Pass `share_dataset=True` to the DataLoader to share the dataset's lists, "
                 "dicts and arrays of 1 MiB or more (its attributes, two levels deep) between "
                 "all processes, or hold the data ")
    return (f"DataLoader worker {worker_id}'s private memory grew by {growth / 2**20:.0f} MiB "
            f"since it started (now {uss / 2**20:.0f} MiB). This is most often copy-on-read: "
            "every read of a Python object (a list, dict or str) the dataset holds writes its "
            "reference count, so each worker slowly copies the parent's memory pages (pytorch "
            f"issue 13246). {named}"
            "in numpy arrays, tensors or Arrow-backed storage (a pyarrow Table, a Hugging Face "
            "dataset) instead of Python lists and dicts. See the docs, 'Workers' memory "
            "grows' (docs/sharing-data.md). (Logged once.)")
