"""The releaser of page-locked slots: runs each queued release (a slot going
back to its worker, or being given back) in a thread of its own, once a
*fence* proves that no copy queued before can still read the slot (NOTE [ No
slot reused while a copy may read it ] in ``_page_lock.py``, which owns the
registrations and the one ``Releaser`` of the process).

The thread starts on demand and ends after ``LINGER`` seconds without work;
``no_thread`` ends it before a fork and holds off a new one until the fork
is done. A start that fails (``can't start new thread``) leaves the releases
queued, for the next ``defer`` or ``quiesce``. A release whose fence cannot
be proven never runs: it is tried again, then dropped with a warning.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from typing import Callable

import torch

LINGER = 0.5  # seconds the releaser's thread waits for more work before it ends
FENCE_RETRIES = 8  # rounds a fence that cannot be proven is tried again, LINGER apart
logger = logging.getLogger("torchfeed")


def _has_context(device: int) -> bool:
    check = getattr(torch._C, "_cuda_hasPrimaryContext", None)  # private; absent: assume one
    return True if check is None else bool(check(device))


class _Job:
    __slots__ = ("fn", "event", "tries", "addr")

    def __init__(self, fn, event, addr):
        self.fn, self.event, self.addr = fn, event, addr
        self.tries = 0  # rounds whose fence could not be proven


class Releaser:
    """Runs each queued function once the copies that may read its slot are done
    (NOTE [ No slot reused while a copy may read it ]); one per process, its
    thread started on demand and ended after ``LINGER`` seconds without work.

    A function whose fence cannot be proven (the event query and
    ``torch.cuda.synchronize()`` both raise, as while another thread captures
    a CUDA graph in global mode) is never run: it waits for the next round, up
    to ``FENCE_RETRIES`` rounds, and is then dropped with a warning: its slot
    stays page-locked and never goes back to its worker (``leaked``)."""

    def __init__(self, locked_bytes: Callable[[int], int] = lambda addr: 0) -> None:
        self._locked_bytes = locked_bytes  # address -> bytes page-locked there (for warnings)
        self.leaked = [0, 0]  # slots (count, bytes) kept from their workers: no fence proven
        # Entered as ``with self._lock``, never ``with self._cond``: a lock's __enter__ is
        # C, so a Ctrl-C cannot land between taking it and the ``with`` holding it, as
        # it can in Condition.__enter__ (Python code), leaving it held for good; defer()
        # runs in weakref callbacks in the main thread (NOTE [ Ctrl-C in a release ]).
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._jobs: list[_Job] = []
        self._pending = 0  # queued or in a round not yet finished
        self._thread: threading.Thread | None = None
        self._local = threading.local()
        self._streams: dict[int, list] = {}  # device index -> the streams torch hands out
        self._quiescing = False  # end the thread as soon as nothing is queued
        self._held = 0  # forks under way (``no_thread``): start no thread
        self._start_failed = False
        self.rounds = 0

    # -- producers ------------------------------------------------------------
    def copies_done_at(self, event, addrs) -> None:
        """In this thread, from now until the next call, a slot at one of ``addrs``
        released here was read only by copies that ``event`` follows."""
        self._local.events = dict.fromkeys(addrs, event)

    def forget_copies(self) -> None:
        self._local.events = None

    def defer(self, fn, addr: int | None = None) -> None:
        """Run ``fn()`` in the releaser's thread once no copy can read the slot at ``addr``."""
        events = getattr(self._local, "events", None)
        event = events.get(addr) if events else None
        with self._lock:
            self._jobs.append(_Job(fn, event, addr))
            self._pending += 1
            self._start_thread()
            self._cond.notify_all()

    def _start_thread(self) -> None:
        """Start the thread if it is needed and allowed; with ``_lock`` held. A
        start that fails (``can't start new thread`` under a pids limit) leaves
        the jobs queued, for the next ``defer`` or the next ``quiesce``."""
        if self._thread is not None or self._held or not self._jobs:
            return
        thread = threading.Thread(target=self._run, name="torchfeed-slot-releaser", daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:
            if not self._start_failed:
                self._start_failed = True
                logger.warning("torchfeed: could not start the thread that gives page-locked "
                               "slots back to their workers (%s); the slots wait for the next "
                               "release, or for the next start of a worker.", exc)
            return
        self._thread = thread

    def deferring(self, fn, addr: int):
        """``fn`` as a weakref callback whose run waits for the fence."""
        def release(ref):
            self.defer(lambda: fn(ref), addr)
        return release

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until every queued function ran (or was dropped, its fence
        unprovable); False on timeout."""
        with self._lock:
            self._start_thread()  # after a failed start
            return self._cond.wait_for(lambda: self._pending == 0, timeout)

    def quiesce(self, timeout: float = 30.0) -> None:
        """Run what is queued and end the thread now, not ``LINGER`` later.

        Called before workers are forked (``no_thread``): torch's loader forks
        them with only the main thread alive, and Python 3.12 warns at a fork
        from a process with threads (a lock another thread holds is held for
        ever in the child).  The wait is for copies already queued on the GPU,
        once per worker start, never per batch.  Where no thread runs and
        jobs are queued (its start failed), they run here, in the caller."""
        with self._lock:
            thread = self._thread
            if thread is None and not self._jobs:
                return
            self._quiescing = True
            if thread is None:  # run the rounds here; a defer meanwhile starts no other thread
                thread = self._thread = threading.current_thread()
            self._cond.notify_all()
        if thread is threading.current_thread():
            self._run()
        else:
            thread.join(timeout)

    def running(self) -> bool:
        """Whether the thread is alive (after ``quiesce``: it did not end in time)."""
        thread = self._thread
        return thread is not None and thread is not threading.current_thread() and thread.is_alive()

    @contextlib.contextmanager
    def no_thread(self, timeout: float = 30.0):
        """For a fork: the thread ended (``quiesce``), and none started until the
        block ends; releases deferred meanwhile wait for the block's end."""
        with self._lock:
            self._held += 1
        try:
            self.quiesce(timeout)
            yield
        finally:
            with self._lock:
                self._held -= 1
                self._start_thread()

    # -- the thread -------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    if not self._quiescing:
                        self._cond.wait(LINGER)
                    if not self._jobs:
                        self._thread = None
                        self._quiescing = False
                        return
                jobs, self._jobs = self._jobs, []
            kept = self._round(jobs)
            finished = len(jobs) - len(kept)
            del jobs  # no slot's function kept alive while the thread waits
            with self._lock:
                self._jobs[:0] = kept
                self._pending -= finished
                self._cond.notify_all()
            if kept:
                del kept
                time.sleep(LINGER)  # give whatever forbids CUDA calls time to end

    def _round(self, jobs: list[_Job]) -> list[_Job]:
        """Run the jobs once their fence has passed; the jobs kept for the next
        round, their fence not proven (none kept: each has run, or was dropped)."""
        try:
            self._fence(jobs)
        except Exception as fence_error:  # noqa: BLE001 - wait for everything instead
            try:
                torch.cuda.synchronize()
            except Exception as sync_error:  # noqa: BLE001 - nothing proves any copy done
                return self._unfenced(jobs, fence_error, sync_error)
        for job in jobs:
            try:
                job.fn()
            except Exception as exc:  # noqa: BLE001 - a slot's release must not stop the others
                logger.warning("torchfeed: giving a page-locked slot back to its worker "
                               "failed (%s: %s); the slot stays with this process.",
                               type(exc).__name__, exc)
        self.rounds += 1
        return []

    def _unfenced(self, jobs: list[_Job], fence_error, sync_error) -> list[_Job]:
        """No fence could be proven for ``jobs``: none may run. Those tried
        ``FENCE_RETRIES`` times are dropped (their slots stay page-locked and
        out of their workers' hands, for as long as this process lives); the
        others are returned, for the next round."""
        kept: list[_Job] = []
        dropped: list[_Job] = []
        for job in jobs:
            job.tries += 1
            (dropped if job.tries > FENCE_RETRIES else kept).append(job)
        if dropped:
            size = sum(self._locked_bytes(job.addr) for job in dropped if job.addr is not None)
            self.leaked[0] += len(dropped)
            self.leaked[1] += size
            warnings.warn(
                f"torchfeed: {len(dropped)} page-locked shared-memory slot(s) ({size} bytes) "
                f"are kept from their workers for good: no CUDA fence could prove that the "
                f"copies from them are done (the event query raised {fence_error!r}, and "
                f"torch.cuda.synchronize() raised {sync_error!r}). This happens while another "
                f"thread captures a CUDA graph with capture_error_mode='global': capture "
                f"before iterating, or with capture_error_mode='thread_local'.",
                RuntimeWarning, stacklevel=2)
        return kept

    def _fence(self, jobs) -> None:
        events = [job.event for job in jobs if job.event is not None]
        if any(job.event is None for job in jobs):
            events.extend(self._stream_events())
        for event in events:
            event.synchronize()  # a blocking event: sleeps, without the GIL

    def _stream_events(self) -> list:
        events = []
        for device in range(torch.cuda.device_count()):
            if not _has_context(device):
                continue  # no context: nothing was ever copied there
            for stream in self._known_streams(device):
                if stream.query():
                    continue  # idle: everything enqueued on it is done
                event = torch.cuda.Event(blocking=True)
                event.record(stream)
                events.append(event)
        return events

    def _known_streams(self, device: int) -> list:
        """The default stream and every pooled stream torch hands out on ``device``."""
        streams = self._streams.get(device)
        if streams is None:
            seen: dict[int, object] = {}
            default = torch.cuda.default_stream(device)
            seen[default.cuda_stream] = default
            least, greatest = default.priority_range()
            for priority in range(min(least, greatest), max(least, greatest) + 1):
                # The pool is handed out round-robin: go round it twice, so that
                # streams another thread takes meanwhile are still seen once.
                first, size, calls = None, 0, 0
                while calls < 1024 and (size == 0 or calls < 2 * size):
                    stream = torch.cuda.Stream(device=device, priority=priority)
                    calls += 1
                    if first is None:
                        first = stream.cuda_stream
                    elif stream.cuda_stream == first and size == 0:
                        size = calls - 1
                    seen.setdefault(stream.cuda_stream, stream)
            streams = self._streams[device] = list(seen.values())
        return streams
