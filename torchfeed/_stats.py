"""Live loader statistics: the counters an iterator keeps for the current epoch.

Every iterator owns one ``IteratorStats``.  The hot path touches it twice per
batch, and only with float and int arithmetic:

* ``BaseIterator.__next__`` reads ``perf_counter()`` before asking for the batch
  and calls ``on_yield(t0)`` after, which adds the time the consumer was blocked
  and counts the batch (and, every ``log_every`` batches, logs a line);
* the multi-process iterator's ``_receive`` calls ``on_result(worker, seconds)``
  for each batch that arrives, with the fetch + collate + pack time the worker
  measured and sent along in its result message.

Everything else (queue depths, shared-memory slots, the pin-memory thread's
time, fractions) is read only when someone asks: ``DataLoader.stats()`` or the
log line.  The iterator says what is live in one call, ``live_counts()``
(a ``LiveCounts``); the stats object holds the iterator through a weak
reference, so asking for stats never keeps workers alive.  What the figures
say in words (``str()``, the verdict, the log line) is ``_stats_report.py``'s.

Counters restart at each epoch of a persistent-workers loader (``begin``,
before the epoch's first task is sent) and the clock when ``iter(loader)``
returns (``start_clock``), so ``stats()`` always describes the current epoch.
Wall time stops when the epoch ends (``StopIteration``) or the iterator is
dropped, so stats read after the loop still describe the loop.

With ``num_workers=0`` the main process is the worker: its fetch + collate time
is the time spent in ``__next__``, so its busy fraction equals the stall
fraction.

Worker start and worker memory (``_worker_costs.py``): ``stats()`` shows the
seconds spent starting the workers this epoch; when that is most of an epoch
the loop waited on (spawn, or forkserver, without persistent workers), the
verdict and the log line say so and suggest ``persistent_workers=True``.  It
also shows each worker's private memory (USS) and its growth since the worker
started.  A worker reads its own after its first batch; the main process reads
them when ``stats()`` is called while the workers live, and every
``MEMORY_CHECK_EVERY`` seconds of iteration (for the copy-on-read warning) in a
background ``MemoryReading``, whose figures the next batch takes up.  Nothing
reads them on the training thread unasked: not the log line, and not the
shutdown, which only waits for a reading already running.  An epoch without
persistent workers so keeps its latest reading.  ``large_attributes`` names
the dataset's lists, dicts and arrays of 1 MiB or more: those that
``share_dataset=True`` shared, and the Python containers every worker copies
(``_share_dataset.census``, looked at once, when first asked).
"""
from __future__ import annotations

import copy
import logging
import os
import weakref
from time import monotonic, perf_counter
from typing import Any, NamedTuple

from . import _share_dataset, _worker_costs
from ._stats_report import LoaderStats, log_line, make_visible

logger = logging.getLogger("torchfeed")


class LiveCounts(NamedTuple):
    """What a multi-process iterator has live when its stats ask (``live_counts()``)."""

    pids: list[int | None]              # each worker's pid
    launched: list[float | None]        # when each worker was launched (``monotonic()``)
    pin_busy_seconds: float | None      # the pin-memory thread's busy time so far; None without one
    in_flight: int                      # tasks sent whose batch has not come back
    ready: int                          # batches back, waiting for their turn or the user
    slots: dict | None                  # the transport's ``stats()`` ({} if it has none); None if it failed


class IteratorStats:
    __slots__ = ("_iterator", "num_workers", "worker_method", "transport", "log_every", "limit",
                 "start", "end", "wait", "yielded", "next_log", "worker_batches",
                 "worker_busy", "worker_cpu", "epoch", "_pin_base", "_live", "_window", "persistent",
                 "_begun", "_start_mono", "_starts", "_uss_start", "_next_memory_check",
                 "_reading", "_dataset", "_shared", "_large",
                 "__weakref__")
    end: float | None
    _next_memory_check: float
    _reading: _worker_costs.MemoryReading | None  # the periodic check's, while it runs
    _starts: dict[int, tuple[float, float]]  # worker -> (launched, ready), monotonic()
    _uss_start: dict[int, int | None]

    def __init__(self, iterator, loader, epoch: int) -> None:
        self._iterator = weakref.ref(iterator, self._iterator_gone)
        self.num_workers = loader.num_workers
        # Thread workers: no pids, no memory of their own, no transport.
        self.worker_method = (getattr(loader, "worker_method", "multiprocessing")
                              if self.num_workers else None)
        threads = self.worker_method == "thread"
        self.transport = (getattr(loader, "transport", None)
                          if self.num_workers and not threads else None)
        self.log_every = getattr(loader, "log_every", None)
        self.limit = (loader.prefetch_factor or 0) * self.num_workers
        self.persistent = bool(loader.persistent_workers)
        self._live = _idle_live(self.num_workers)
        self._uss_start = {}  # kept across a persistent iterator's epochs
        self._reading = None
        # share_dataset=True's work (done before this iterator), and the dataset to
        # look at for large attributes left unshared, when stats() first asks.
        self._dataset = loader.dataset if self.num_workers else None
        self._shared = list(loader.__dict__.get("_shared_attributes", ()))
        self._large: list | None = None if self.num_workers else []
        # The iterator is still being built: nothing of it is live to read yet.
        self._zero(epoch, pin_base=0.0)
        self._start_clock(None)

    # -- the hot path -------------------------------------------------------
    def on_yield(self, t0: float) -> None:
        now = perf_counter()
        self.wait += now - t0
        self.yielded += 1
        if self.yielded == self.next_log:
            self.next_log += self.log_every or 0  # never None here: next_log stays 0 without it
            self._log(now)
        if self._reading is not None and self._reading.done:
            self._take_reading()
        if now >= self._next_memory_check:
            self._next_memory_check = now + _worker_costs.MEMORY_CHECK_EVERY
            self._start_reading()

    def on_result(self, worker_id: int, seconds: float, cpu_seconds: float | None = None) -> None:
        self.worker_batches[worker_id] += 1
        self.worker_busy[worker_id] += seconds
        if cpu_seconds is not None:  # thread workers measure their CPU time per task
            self.worker_cpu[worker_id] += cpu_seconds

    def on_started(self, worker_id: int, launched: float, ready: float, uss: int) -> None:
        """A worker's first two messages: when it was launched and ready
        (``monotonic()``); its USS after its first batch, in the second (0 in the first)."""
        if launched >= self._begun:  # a persistent worker's start belongs to its first epoch
            self._starts[worker_id] = (launched, ready)
        self._uss_start[worker_id] = uss or None  # a new process: a new baseline
        if uss and worker_id < len(self._live["uss"]):
            self._live["uss"][worker_id] = uss  # its first reading, until a later one

    def finish(self, t0: float) -> None:
        """The epoch ended: stop the clock (once), keep the last live values."""
        if self.end is None:
            self.end = perf_counter()
            self.wait += self.end - t0
            self._read_live()

    def stop(self) -> None:
        """The iterator is being dropped mid-epoch: stop the clock before its shutdown."""
        if self.end is None:
            self.end = perf_counter()
            self._read_live()

    # -- epochs --------------------------------------------------------------
    def begin(self, epoch: int) -> None:
        """Zero the counters for ``epoch``.

        The iterator calls this before it sends the epoch's first task: with pin
        memory, the pin thread counts results as they arrive (``on_result``), and
        a reset after the first task went out could drop a batch already counted.
        """
        counts = self._live_counts()
        pin_busy = counts.pin_busy_seconds if counts is not None else None
        self._zero(epoch, pin_base=pin_busy if pin_busy is not None else 0.0)
        self._start_clock(counts)

    def _zero(self, epoch: int, pin_base: float) -> None:
        self._pin_base = pin_base
        self.epoch = epoch
        self.wait = 0.0
        self.yielded = 0
        self.worker_batches = [0] * self.num_workers
        self.worker_busy = [0.0] * self.num_workers
        self.worker_cpu = [0.0] * self.num_workers
        self.next_log = self.log_every or 0  # 0 never equals a count after +1
        self.end = None
        # Workers launched from now on started in this epoch; a persistent
        # worker's start belongs to the epoch that launched it.
        self._begun = monotonic()
        self._starts = {}

    def start_clock(self) -> None:
        """Wall time starts here: when ``iter(loader)`` hands the iterator over."""
        self._start_clock(self._live_counts())  # worker pids, while the iterator is surely alive

    def _start_clock(self, counts: LiveCounts | None) -> None:
        if counts is not None:
            self._take_live(counts)
        self.start = perf_counter()
        self._start_mono = monotonic()
        self._window = (self.start, 0.0, 0)
        self._next_memory_check = (self.start + _worker_costs.MEMORY_CHECK_EVERY
                                   if self.num_workers and self.worker_method != "thread"
                                   else float("inf"))

    def _iterator_gone(self, _ref) -> None:
        if self.end is None:
            self.end = perf_counter()
        self._live = {**self._live, "queues": (0, 0)}  # nothing is in flight any more

    # -- reading ---------------------------------------------------------------
    def _live_counts(self) -> LiveCounts | None:
        """The iterator's ``live_counts()``; None once it is gone, or without workers."""
        it = self._iterator()
        if it is None or self.num_workers == 0:
            return None
        return it.live_counts()

    def _read_live(self) -> dict:
        """Queue depths, slots and pin time from the iterator, if it is still alive."""
        counts = self._live_counts()
        return self._live if counts is None else self._take_live(counts)

    def _take_live(self, counts: LiveCounts) -> dict:
        pin = counts.pin_busy_seconds
        live = {"pids": list(counts.pids), "launched": list(counts.launched),
                "pin": None if pin is None else pin - self._pin_base,
                "queues": (counts.in_flight, counts.ready),
                "shm": _shm_stats(counts.slots, self._live["shm"]),
                "uss": self._live.get("uss", [None] * self.num_workers)}
        self._live = live
        return live

    def _read_memory(self) -> list:
        """Each live worker's private memory (USS) now, in bytes, or None."""
        return self._keep_memory(_worker_costs.private_bytes(self._live["pids"]))

    def _keep_memory(self, read: list) -> list:
        out = (read + [None] * self.num_workers)[:self.num_workers]
        # A worker that has exited keeps its last reading.
        self._live["uss"] = [now if now is not None else last
                             for now, last in zip(out, self._live["uss"])]
        return self._live["uss"]

    def _start_reading(self) -> None:
        if self._reading is not None or _worker_costs.growth_warned():
            return
        try:
            self._read_live()  # the pids, should a worker have been replaced
            self._reading = _worker_costs.MemoryReading(self._live["pids"])
        except Exception:  # statistics must never break the training loop
            logger.debug("torchfeed: could not start reading workers' memory", exc_info=True)

    def settle(self) -> None:
        """The workers are about to stop: take up a reading still running, so
        that its figures and its warning are not lost (a fork must not find
        its thread alive either).  Starts none: a reading costs tens of ms per
        worker, which short epochs without persistent workers must not pay."""
        if self._reading is not None:
            self._reading.wait()
            self._take_reading()

    def _take_reading(self) -> None:
        reading, self._reading = self._reading, None
        if reading is None:
            return
        try:
            uss = self._keep_memory(reading.uss or [])
            self._read_live()
            # Slot pages that only the worker maps count in its USS: they are
            # batches in shared memory (a huge slot's), not copy-on-read.
            held = self._live["shm"].get("worker_bytes") or []
            growth = [self._growth(i, u) for i, u in enumerate(uss)]
            _worker_costs.check_growth([g if g is None or i >= len(held) else g - held[i]
                                        for i, g in enumerate(growth)], uss, self._suspects)
        except Exception:  # statistics must never break the training loop
            logger.debug("torchfeed: could not read workers' memory", exc_info=True)

    def _large_attributes(self) -> list:
        """The dataset's large attributes: shared by ``share_dataset=True``, or
        left as Python objects that every worker copies (``_share_dataset.census``)."""
        if self._large is None:
            try:
                unshared = _share_dataset.census(self._dataset)
            except Exception:  # statistics must never break the training loop
                logger.debug("torchfeed: could not look at the dataset's attributes", exc_info=True)
                unshared = []
            self._large, self._dataset = self._shared + unshared, None
        return self._large

    def _suspects(self) -> str:
        large = self._large_attributes()
        unshared = [f for f in large if not f["shared"]]
        return (_share_dataset.naming(unshared) if unshared or not large
                else _worker_costs.SHARED_ALREADY)

    def _growth(self, worker_id: int, uss):
        start = self._uss_start.get(worker_id)
        if uss is None or start is None:
            return None
        return uss - start

    def snapshot(self, read_memory: bool = True) -> LoaderStats:
        """The figures now; ``read_memory=False`` keeps the workers' last USS
        reading instead of taking a new one (tens of ms per worker)."""
        it = self._iterator()
        # Workers' memory first, then the queues and slots, so those are read
        # as close to the return as they can be.  Read while the workers are
        # there: during an epoch, and between the epochs of persistent workers.
        workers_alive = it is not None and not it.shut_down
        threads = self.worker_method == "thread"  # their memory is this process's
        uss = (self._read_memory() if read_memory and self.num_workers and workers_alive
               and not threads
               else list(self._live.get("uss") or []))
        live = self._read_live() if self.end is None else self._live
        now = self.end if self.end is not None else perf_counter()
        wall = max(now - self.start, 1e-9)
        if self.num_workers == 0:
            batches, busy, pids = [self.yielded], [self.wait], [os.getpid()]
        else:
            batches, busy = list(self.worker_batches), list(self.worker_busy)
            pids = (live["pids"] + [None] * self.num_workers)[:self.num_workers]
        uss = (uss + [None] * len(batches))[:len(batches)]
        spans = [self._starts.get(i) for i in range(len(batches))]
        starts = [None if s is None else s[1] - s[0] for s in spans]  # launched to ready
        workers = [{"id": i, "pid": pids[i], "batches": batches[i],
                    "busy_seconds": busy[i], "busy_fraction": busy[i] / wall,
                    "mean_fetch_seconds": busy[i] / batches[i] if batches[i] else None,
                    "start_seconds": starts[i],
                    "uss_bytes": uss[i], "uss_growth_bytes": self._growth(i, uss[i])}
                   for i in range(len(batches))]
        if threads:  # a thread's CPU time is its own: what its tasks computed
            for worker, cpu in zip(workers, self.worker_cpu):
                worker["cpu_seconds"] = cpu
        start_seconds, since_launch = _worker_costs.start_span(
            self._starts, live.get("launched") or [], self._begun,
            now + self._start_mono - self.start, self.num_workers)  # perf_counter to monotonic
        in_flight, ready = live["queues"]
        running = it is not None and self.end is None and not it.shut_down
        return LoaderStats(
            state="running" if running else "finished", epoch=self.epoch, num_workers=self.num_workers,
            worker_method=self.worker_method, transport=self.transport,
            batches_yielded=self.yielded, wall_seconds=wall, wait_seconds=self.wait,
            stall_fraction=min(1.0, self.wait / wall), workers=workers,
            queues={"in_flight": in_flight, "ready": ready, "limit": self.limit},
            shm=dict(live["shm"]), pin_thread_busy_seconds=live["pin"],
            persistent_workers=self.persistent, worker_start_seconds=start_seconds,
            worker_start_fraction=(None if start_seconds is None
                                   else min(1.0, start_seconds / max(since_launch, 1e-9))),
            large_attributes=[dict(f) for f in self._large_attributes()])

    def __reduce__(self):
        # A loader that is pickled or deep-copied keeps its last stats, not the
        # weak reference to an iterator that cannot travel with it.
        return FrozenStats, (dict(self.snapshot()),)

    # -- the log line ------------------------------------------------------------
    def _log(self, now: float) -> None:
        try:
            make_visible()
            s = self.snapshot(read_memory=False)  # the line shows no memory
            t_prev, wait_prev, n_prev = self._window
            self._window = (now, self.wait, self.yielded)
            log_line(s, self.yielded - n_prev, self.wait - wait_prev, max(now - t_prev, 1e-9))
        except Exception:  # statistics must never break the training loop
            logger.warning("torchfeed: could not write the stats log line", exc_info=True)


class FrozenStats:
    """The stats of an iterator left behind by pickling or copying its loader."""

    def __init__(self, stats: dict) -> None:
        self._stats = stats

    def snapshot(self) -> LoaderStats:
        return LoaderStats(copy.deepcopy(self._stats))


def empty_stats(loader) -> LoaderStats:
    """What ``stats()`` says before the loader was ever iterated."""
    n = loader.num_workers
    return LoaderStats(
        state="not started", epoch=0, num_workers=n,
        worker_method=getattr(loader, "worker_method", "multiprocessing") if n else None,
        transport=(getattr(loader, "transport", None)
                   if n and getattr(loader, "worker_method", None) != "thread" else None),
        batches_yielded=0, wall_seconds=0.0, wait_seconds=0.0, stall_fraction=0.0,
        workers=[{"id": i, "pid": None, "batches": 0, "busy_seconds": 0.0, "busy_fraction": 0.0,
                  "mean_fetch_seconds": None, "start_seconds": None, "uss_bytes": None,
                  "uss_growth_bytes": None} for i in range(max(n, 1))],
        queues={"in_flight": 0, "ready": 0, "limit": (loader.prefetch_factor or 0) * n},
        shm=dict(_NO_SHM), pin_thread_busy_seconds=None,
        persistent_workers=bool(loader.persistent_workers), worker_start_seconds=None,
        worker_start_fraction=None, large_attributes=[])


_NO_SHM: dict[str, Any] = {"slots": 0, "in_use": 0, "bytes": 0, "in_use_bytes": None, "reuse_bytes": 0,
                           "page_locked_bytes": 0, "worker_bytes": [], "slot_table": []}


def _idle_live(num_workers: int) -> dict:
    return {"pids": [None] * num_workers, "launched": [], "queues": (0, 0), "shm": dict(_NO_SHM),
            "pin": None,
            "uss": [None] * num_workers}


def _shm_stats(raw: dict | None, last: dict) -> dict:
    """Slots from the transport's ``stats()`` (``LiveCounts.slots``): zeros for none,
    the last figures if reading failed."""
    if raw is None:
        return last
    if raw.get("closed"):
        return {**_NO_SHM, "slots": last["slots"], "bytes": last["bytes"]}
    return {"slots": int(raw.get("slots", 0)), "in_use": int(raw.get("in_use", 0)),
            "bytes": int(raw.get("bytes", 0)), "in_use_bytes": raw.get("in_use_bytes"),
            "reuse_bytes": int(raw.get("reuse_bytes", 0)),
            "page_locked_bytes": int(raw.get("page_locked_bytes", 0)),
            "worker_bytes": list(raw.get("worker_bytes", ())),
            "slot_table": list(raw.get("slot_table", ()))}
