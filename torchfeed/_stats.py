"""Live loader statistics and the periodic log line.

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
log line.  The stats object holds the iterator through a weak reference, so
asking for stats never keeps workers alive.

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
started, read when asked while the workers live, every ``MEMORY_CHECK_EVERY``
seconds of iteration (for the copy-on-read warning), and just before the
workers stop unless the last reading is under ``LAST_LOOK_AFTER`` old (a
reading costs tens of ms, which short epochs without persistent workers
must not pay each time).
"""
from __future__ import annotations

import copy
import logging
import os
import sys
import weakref
from time import monotonic, perf_counter

from . import _worker_costs
from ._processes import launched_at
from ._transport._space import human

logger = logging.getLogger("torchfeed")

STALL_WARN = 0.10   # stall fractions above this are called data-bound in str()
BUSY_SATURATED = 0.80
START_DOMINATES = 0.5  # worker start-up above this share of the epoch is called out


class IteratorStats:
    __slots__ = ("_iterator", "num_workers", "transport", "log_every", "limit",
                 "start", "end", "wait", "yielded", "next_log", "worker_batches",
                 "worker_busy", "epoch", "_pin_base", "_live", "_window", "persistent",
                 "_begun", "_start_mono", "_starts", "_uss_start", "_next_memory_check",
                 "_memory_read_at",
                 "__weakref__")
    end: float | None
    _next_memory_check: float
    _memory_read_at: float  # perf_counter() of the last USS reading, or the epoch's start
    _starts: dict[int, tuple[float, float]]  # worker -> (launched, ready), monotonic()
    _uss_start: dict[int, int | None]

    def __init__(self, iterator, loader, epoch: int) -> None:
        self._iterator = weakref.ref(iterator, self._iterator_gone)
        self.num_workers = loader.num_workers
        self.transport = getattr(loader, "transport", None) if self.num_workers else None
        self.log_every = getattr(loader, "log_every", None)
        self.limit = (loader.prefetch_factor or 0) * self.num_workers
        self.persistent = bool(loader.persistent_workers)
        self._live = _idle_live(self.num_workers)
        self.begin(epoch)

    # -- the hot path -------------------------------------------------------
    def on_yield(self, t0: float) -> None:
        now = perf_counter()
        self.wait += now - t0
        self.yielded += 1
        if self.yielded == self.next_log:
            self.next_log += self.log_every or 0  # never None here: next_log stays 0 without it
            self._log(now)
        if now >= self._next_memory_check:
            self._next_memory_check = now + _worker_costs.MEMORY_CHECK_EVERY
            self._check_memory()

    def on_result(self, worker_id: int, seconds: float) -> None:
        self.worker_batches[worker_id] += 1
        self.worker_busy[worker_id] += seconds

    def on_started(self, worker_id: int, launched: float, ready: float, uss: int) -> None:
        """A worker's first two messages: when it was launched and ready
        (``monotonic()``); its USS after its first batch, in the second (0 in the first)."""
        if launched >= self._begun:  # a persistent worker's start belongs to its first epoch
            self._starts[worker_id] = (launched, ready)
        self._uss_start[worker_id] = uss or None  # a new process: a new baseline

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
        it = self._iterator()
        pin = getattr(it, "_pin_thread", None)
        self._pin_base = pin.busy_seconds if pin is not None else 0.0
        self.epoch = epoch
        self.wait = 0.0
        self.yielded = 0
        self.worker_batches = [0] * self.num_workers
        self.worker_busy = [0.0] * self.num_workers
        self.next_log = self.log_every or 0  # 0 never equals a count after +1
        self.end = None
        # Workers launched from now on started in this epoch; a persistent
        # worker's start belongs to the epoch that launched it.
        self._begun = monotonic()
        self._starts = {}
        if getattr(self, "_uss_start", None) is None:
            self._uss_start = {}  # kept across a persistent iterator's epochs
        self.start_clock()

    def start_clock(self) -> None:
        """Wall time starts here: when ``iter(loader)`` hands the iterator over."""
        self._read_live()  # worker pids, while the iterator is surely alive
        self.start = perf_counter()
        self._start_mono = monotonic()
        self._window = (self.start, 0.0, 0)
        self._next_memory_check = (self.start + _worker_costs.MEMORY_CHECK_EVERY if self.num_workers
                                   else float("inf"))
        self._memory_read_at = self.start

    def _iterator_gone(self, _ref) -> None:
        if self.end is None:
            self.end = perf_counter()
        self._live = {**self._live, "queues": (0, 0)}  # nothing is in flight any more

    # -- reading ---------------------------------------------------------------
    def _read_live(self) -> dict:
        """Queue depths, slots and pin time from the iterator, if it is still alive."""
        it = self._iterator()
        if it is None or self.num_workers == 0:
            return self._live
        pin = getattr(it, "_pin_thread", None)
        workers = list(getattr(it, "_workers", ()))
        live = {"pids": [getattr(w, "pid", None) for w in workers],
                "launched": [launched_at(w) for w in workers],
                "pin": None if pin is None else pin.busy_seconds - self._pin_base}
        if getattr(it, "_shutdown", False):
            live["queues"] = (0, 0)
        else:
            try:
                pinned = pin.out.qsize() if pin is not None else 0
            except (AttributeError, NotImplementedError):
                pinned = 0
            outstanding = getattr(it, "_tasks_outstanding", 0)
            live["queues"] = (max(0, outstanding - pinned),
                              len(getattr(it, "_arrived", ())) + pinned)
        live["shm"] = _shm_stats(getattr(it, "_unpacker", None), self._live["shm"])
        live["uss"] = self._live.get("uss", [None] * self.num_workers)
        self._live = live
        return live

    def _read_memory(self) -> list:
        """Each live worker's private memory (USS) now, in bytes, or None."""
        self._memory_read_at = perf_counter()
        out = (_worker_costs.private_bytes(self._live["pids"])
               + [None] * self.num_workers)[:self.num_workers]
        # A worker that has exited keeps its last reading.
        self._live["uss"] = [now if now is not None else last
                             for now, last in zip(out, self._live["uss"])]
        return self._live["uss"]

    def last_look(self) -> None:
        """The workers are about to stop: keep their memory figures for stats()."""
        # Reading USS parses each worker's smaps (tens of ms for freshly
        # started workers), so an epoch that ended within LAST_LOOK_AFTER of
        # the last reading keeps that reading: short create-iterate-delete
        # cycles must not pay it every time.
        if self.num_workers and perf_counter() - self._memory_read_at >= _worker_costs.LAST_LOOK_AFTER:
            try:
                self._read_memory()
            except Exception:  # statistics must never break the shutdown
                pass

    def _growth(self, worker_id: int, uss):
        start = self._uss_start.get(worker_id)
        if uss is None or start is None:
            return None
        return uss - start

    def _check_memory(self) -> None:
        if _worker_costs._warned:
            return
        try:
            self._read_live()
            uss = self._read_memory()
            _worker_costs.check_growth([self._growth(i, u) for i, u in enumerate(uss)], uss)
        except Exception:  # statistics must never break the training loop
            logger.debug("torchfeed: could not read workers' memory", exc_info=True)

    def snapshot(self) -> LoaderStats:
        it = self._iterator()
        # Workers' memory first (a few /proc reads), then the queues and slots,
        # so those are read as close to the return as they can be.
        # Read while the workers are there: during an epoch, and between the
        # epochs of persistent workers.
        workers_alive = it is not None and not getattr(it, "_shutdown", False)
        uss = (self._read_memory() if self.num_workers and workers_alive
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
        start_seconds, since_launch = _worker_costs.start_span(
            self._starts, live.get("launched") or [], self._begun,
            now + self._start_mono - self.start, self.num_workers)  # perf_counter to monotonic
        in_flight, ready = live["queues"]
        running = it is not None and self.end is None and not getattr(it, "_shutdown", False)
        return LoaderStats(
            state="running" if running else "finished", epoch=self.epoch, num_workers=self.num_workers,
            transport=self.transport,
            batches_yielded=self.yielded, wall_seconds=wall, wait_seconds=self.wait,
            stall_fraction=min(1.0, self.wait / wall), workers=workers,
            queues={"in_flight": in_flight, "ready": ready, "limit": self.limit},
            shm=dict(live["shm"]), pin_thread_busy_seconds=live["pin"],
            persistent_workers=self.persistent, worker_start_seconds=start_seconds,
            worker_start_fraction=(None if start_seconds is None
                                   else min(1.0, start_seconds / max(since_launch, 1e-9))))

    def __reduce__(self):
        # A loader that is pickled or deep-copied keeps its last stats, not the
        # weak reference to an iterator that cannot travel with it.
        return FrozenStats, (dict(self.snapshot()),)

    # -- the log line ------------------------------------------------------------
    def _log(self, now: float) -> None:
        try:
            _make_visible()
            s = self.snapshot()
            t_prev, wait_prev, n_prev = self._window
            self._window = (now, self.wait, self.yielded)
            window = max(now - t_prev, 1e-9)
            logger.info(
                "%d batches | data stall %.1f%% (last %d: %.1f%%) | %.1f batches/s"
                " | slowest %s | in flight %d, ready %d%s",
                s["batches_yielded"], 100 * s["stall_fraction"], self.yielded - n_prev,
                100 * min(1.0, (self.wait - wait_prev) / window),
                (self.yielded - n_prev) / window, _slowest(s),
                s["queues"]["in_flight"], s["queues"]["ready"],
                f" | {start_advice(s)}" if starting_dominates(s) else "")
        except Exception:  # statistics must never break the training loop
            logger.warning("torchfeed: could not write the stats log line", exc_info=True)


class FrozenStats:
    """The stats of an iterator left behind by pickling or copying its loader."""

    def __init__(self, stats: dict) -> None:
        self._stats = stats

    def snapshot(self) -> LoaderStats:
        return LoaderStats(copy.deepcopy(self._stats))


class LoaderStats(dict):
    """``DataLoader.stats()``: a plain dict whose ``str()`` is a readable summary."""

    def __str__(self) -> str:
        s = self
        n = s["num_workers"]
        head = (f"torchfeed loader stats: epoch {s['epoch']}, "
                + (f"{n} workers, transport {s['transport']}" if n else "num_workers=0 (loading in the main process)")
                + ("" if s["state"] == "running" else f", {s['state']}"))
        rate = s["batches_yielded"] / s["wall_seconds"] if s["wall_seconds"] else 0.0
        lines = [
            head,
            f"  batches yielded     {s['batches_yielded']} in {s['wall_seconds']:.2f} s "
            f"({rate:.1f} batches/s)",
            f"  data stall          {100 * s['stall_fraction']:.1f}% "
            f"(blocked in __next__ {s['wait_seconds']:.2f} s)",
            f"  {'worker':<8}{'pid':>9}{'batches':>10}{'busy':>8}{'ms/batch':>11}",
        ]
        for w in s["workers"]:
            name = "main" if n == 0 else str(w["id"])
            mean = "-" if w["mean_fetch_seconds"] is None else f"{1000 * w['mean_fetch_seconds']:.1f}"
            lines.append(f"  {name:<8}{w['pid'] or '-':>9}{w['batches']:>10}"
                         f"{100 * w['busy_fraction']:>7.0f}%{mean:>11}")
        if n:
            q, m = s["queues"], s["shm"]
            lines.append(f"  queues              in flight {q['in_flight']}, ready {q['ready']} "
                         f"(prefetch limit {q['limit']})")
            if m["slots"]:
                in_use_bytes = ("" if m["in_use_bytes"] is None
                                else f", {human(m['in_use_bytes'])} in use")
                lines.append(f"  shared memory       {m['in_use']} of {m['slots']} slots in use, "
                             f"{human(m['bytes'])} allocated{in_use_bytes}")
            else:
                lines.append("  shared memory       no slots")
            if s["pin_thread_busy_seconds"] is not None:
                lines.append(f"  pin-memory thread   {s['pin_thread_busy_seconds']:.2f} s busy")
            if s.get("worker_start_seconds") is not None:
                lines.append(f"  worker start        {s['worker_start_seconds']:.2f} s "
                             f"({100 * s['worker_start_fraction']:.0f}% of the epoch)")
            grown = [w for w in s["workers"] if w.get("uss_bytes") is not None]
            if grown:
                lines.append("  worker memory (USS) " + ", ".join(
                    f"{'main' if n == 0 else w['id']}: {human(w['uss_bytes'])}"
                    + ("" if w["uss_growth_bytes"] is None
                       else f" ({'+' if w['uss_growth_bytes'] >= 0 else '-'}"
                            f"{human(abs(w['uss_growth_bytes']))} since start)")
                    for w in grown))
        lines.append(f"  verdict             {verdict(s)}")
        return "\n".join(lines)


def verdict(s) -> str:
    if s["batches_yielded"] == 0:
        return "no batches yet"
    if starting_dominates(s):
        return start_advice(s)
    stall = s["stall_fraction"]
    if stall < STALL_WARN:
        return (f"not data-bound: the loop waited on data {100 * stall:.0f}% of the time")
    if s["num_workers"] == 0:
        return (f"data-bound: loading takes {100 * stall:.0f}% of the time in the main process; "
                "try num_workers > 0")
    busy = min(w["busy_fraction"] for w in s["workers"])
    if busy >= BUSY_SATURATED:
        return (f"data-bound: the loop waited {100 * stall:.0f}% of the time and every worker "
                "is busy; add workers or make __getitem__/collate_fn cheaper")
    return (f"data-bound: the loop waited {100 * stall:.0f}% of the time and the least busy "
            f"worker was idle {100 * (1 - busy):.0f}% of it; raise prefetch_factor or look at the "
            "main process (transport, pinning). Short runs also count worker start-up")


def starting_dominates(s) -> bool:
    """Starting workers took most of an epoch the loop waited on."""
    fraction = s.get("worker_start_fraction")
    return (fraction is not None and fraction >= START_DOMINATES
            and s["stall_fraction"] >= STALL_WARN)


def start_advice(s) -> str:
    text = (f"starting workers took {s['worker_start_seconds']:.2f} s, "
            f"{100 * s['worker_start_fraction']:.0f}% of this epoch")
    if s.get("persistent_workers"):
        return text + "; with persistent_workers=True only the first epoch pays it"
    return text + "; pass persistent_workers=True to start them once instead of at every epoch"


def running_now(it, stats) -> bool:
    return it is not None and stats.end is None and not getattr(it, "_shutdown", False)


def empty_stats(loader) -> LoaderStats:
    """What ``stats()`` says before the loader was ever iterated."""
    n = loader.num_workers
    return LoaderStats(
        state="not started", epoch=0, num_workers=n, transport=getattr(loader, "transport", None) if n else None,
        batches_yielded=0, wall_seconds=0.0, wait_seconds=0.0, stall_fraction=0.0,
        workers=[{"id": i, "pid": None, "batches": 0, "busy_seconds": 0.0, "busy_fraction": 0.0,
                  "mean_fetch_seconds": None, "start_seconds": None, "uss_bytes": None,
                  "uss_growth_bytes": None} for i in range(max(n, 1))],
        queues={"in_flight": 0, "ready": 0, "limit": (loader.prefetch_factor or 0) * n},
        shm=dict(_NO_SHM), pin_thread_busy_seconds=None,
        persistent_workers=bool(loader.persistent_workers), worker_start_seconds=None,
        worker_start_fraction=None)


_NO_SHM = {"slots": 0, "in_use": 0, "bytes": 0, "in_use_bytes": None}


def _idle_live(num_workers: int) -> dict:
    return {"pids": [None] * num_workers, "launched": [], "queues": (0, 0), "shm": dict(_NO_SHM),
            "pin": None,
            "uss": [None] * num_workers}


def _shm_stats(unpacker, last: dict) -> dict:
    """Slots from the transport's ``stats()``, if it has one; zeros otherwise."""
    read = getattr(unpacker, "stats", None)
    if read is None:
        return dict(_NO_SHM)
    try:
        raw = read() or {}
    except Exception:
        return last
    if raw.get("closed"):
        return {**_NO_SHM, "slots": last["slots"], "bytes": last["bytes"]}
    return {"slots": int(raw.get("slots", 0)), "in_use": int(raw.get("in_use", 0)),
            "bytes": int(raw.get("bytes", 0)), "in_use_bytes": raw.get("in_use_bytes")}


def _slowest(s) -> str:
    timed = [w for w in s["workers"] if w["mean_fetch_seconds"] is not None]
    if not timed:
        return "worker: none yet"
    w = max(timed, key=lambda w: w["mean_fetch_seconds"])
    name = "main" if s["num_workers"] == 0 else str(w["id"])
    return (f"worker {name}: {1000 * w['mean_fetch_seconds']:.1f} ms/batch, "
            f"{100 * w['busy_fraction']:.0f}% busy")


_visible = False


def _make_visible() -> None:
    """The user asked for the line: make sure it is not dropped by default.

    Only what the user has not decided is touched: the ``torchfeed`` logger's
    level when it is unset, and a stderr handler when no logging is configured
    anywhere (where Python would otherwise print only warnings)."""
    global _visible
    if _visible:
        return
    _visible = True
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not logger.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("torchfeed: %(message)s"))
        logger.addHandler(handler)
