"""What loader statistics say in words: ``str(DataLoader.stats())``, the
verdict, and the periodic log line.

The counters behind them are ``_stats.py``'s; this module only reads a
``LoaderStats`` dict (``IteratorStats.snapshot()``) and writes text: the
summary table, the one-line verdict (data-bound or not, and what to try), the
call-out when starting workers took most of an epoch (which the tuner's notes
use too), and the ``log_every`` line through ``logging.getLogger("torchfeed")``.
"""
from __future__ import annotations

import logging
import os
import sys

from ._transport._space import human

logger = logging.getLogger("torchfeed")

STALL_WARN = 0.10   # stall fractions above this are called data-bound in str()
# thread workers: read as GIL-bound from this share on (thread_gil_share), only when
# together they were busy GIL_MIN_BUSY workers' worth and computed on GIL_MIN_CPU of a CPU
GIL_BOUND = 0.5
GIL_MIN_BUSY = 1.5
GIL_MIN_CPU = 0.6
BUSY_SATURATED = 0.80
START_DOMINATES = 0.5  # worker start-up above this share of the epoch is called out


class LoaderStats(dict):
    """What `DataLoader.stats()` returns: a plain dict whose ``str()`` is a readable summary.

    It describes the current (or latest) epoch of the loader's iterator; the
    counters restart with each epoch.  Being a ``dict``, it can be logged as
    JSON or compared in tests.  Its keys:

    - ``state``: ``"not started"``, ``"running"`` or ``"finished"``;
      ``epoch``; ``num_workers``; ``transport`` (``"shm"``, ``"torch"``, or
      ``None`` with no workers); ``persistent_workers``.
    - ``batches_yielded``; ``wall_seconds`` since ``iter()``;
      ``wait_seconds``, the time the loop was blocked in ``next()``, and
      ``stall_fraction``, that time's share of ``wall_seconds``.
    - ``workers``: one dict per worker (one for the main process with
      ``num_workers=0``): ``id``, ``pid``, ``batches``, ``busy_seconds`` and
      ``busy_fraction`` (fetch, collate and pack), ``mean_fetch_seconds``,
      ``start_seconds`` (launch to ready), ``uss_bytes`` (private memory,
      the pages of shared data left out) and ``uss_growth_bytes`` (since the
      worker started).  Figures not read yet are ``None``.
    - ``worker_start_seconds`` and ``worker_start_fraction``: the time spent
      starting workers this epoch, and its share of the epoch.
    - ``queues``: ``in_flight`` (tasks sent, not received), ``ready``
      (batches received, not yet yielded) and ``limit``
      (``prefetch_factor * num_workers``).
    - ``shm``: the shared-memory slots: ``slots``, ``in_use``, ``bytes``,
      ``in_use_bytes``, ``reuse_bytes`` (what free slots keep),
      ``page_locked_bytes``, ``worker_bytes`` (per worker) and
      ``slot_table`` (every slot).
    - ``pin_thread_busy_seconds``: the pin-memory thread's time, or ``None``
      without one.
    - ``large_attributes``: the dataset's lists, dicts and arrays of 1 MiB or
      more, those ``share_dataset=True`` shared and those every worker copies.
    """

    def __str__(self) -> str:
        s = self
        n = s["num_workers"]
        if not n:
            kind = "num_workers=0 (loading in the main process)"
        elif s.get("worker_method") == "thread":
            kind = f"{n} worker threads (batches by reference)"
        else:
            kind = f"{n} workers, transport {s['transport']}"
        head = (f"torchfeed loader stats: epoch {s['epoch']}, {kind}"
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
                reuse = (f", {human(m['reuse_bytes'])} kept for reuse"
                         if m.get("reuse_bytes") else "")
                locked = (f", {human(m['page_locked_bytes'])} page-locked"
                          if m.get("page_locked_bytes") else "")
                lines.append(f"  shared memory       {m['in_use']} of {m['slots']} slots in use, "
                             f"{human(m['bytes'])} allocated{in_use_bytes}{reuse}{locked}")
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
            lines.extend(_large_attribute_lines(s.get("large_attributes") or []))
        lines.append(f"  verdict             {verdict(s)}")
        return "\n".join(lines)


def _large_attribute_lines(large: list) -> list:
    """The dataset's large attributes: shared, or copied by every worker."""
    lines = []
    for f in large:
        if f["shared"]:
            lines.append(f"  shared dataset      `{f['attribute']}`: {f['description']}, "
                         f"one copy for all processes (shared in {f['seconds']:.2f} s)")
        else:
            lines.append(f"  copied per worker   `{f['attribute']}`: {f['description']}; "
                         "pass `share_dataset=True`")
    return lines


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
    gil = thread_gil_share(s)
    if gil is not None and gil >= GIL_BOUND:
        computed = sum(w.get("cpu_seconds") or 0.0 for w in s["workers"]) / s["wall_seconds"]
        together = sum(w["busy_fraction"] for w in s["workers"])
        return (f"data-bound: the loop waited {100 * stall:.0f}% of the time; the "
                f"{s['num_workers']} worker threads were busy {100 * together:.0f}% of it together "
                f"but computed on {computed:.1f} CPU between them: `__getitem__` holds the GIL "
                f"about {100 * gil:.0f}% of its time, so threads wait on each other. Use "
                "worker_method='multiprocessing' (python -m torchfeed.tune measures both)")
    if busy >= BUSY_SATURATED:
        return (f"data-bound: the loop waited {100 * stall:.0f}% of the time and every worker "
                "is busy; add workers or make __getitem__/collate_fn cheaper")
    return (f"data-bound: the loop waited {100 * stall:.0f}% of the time and the least busy "
            f"worker was idle {100 * (1 - busy):.0f}% of it; raise prefetch_factor or look at the "
            "main process (transport, pinning). Short runs also count worker start-up")


def thread_gil_share(s) -> float | None:
    """For thread workers: the share of their tasks' time spent holding the GIL,
    by Amdahl's law, from what they did together.  ``k`` threads busy at once
    on average (their busy fractions summed) that computed on ``S`` CPUs'
    worth (their tasks' thread CPU time over the wall time) were serialised
    for a share ``(k / S - 1) / (k - 1)``.  Only where that reading means
    something: two or more threads mostly busy together, on as many cores,
    computing on at least ``GIL_MIN_CPU`` of a CPU (a thread that waits on I/O
    computes on little, and holds nothing).  None otherwise."""
    if s.get("worker_method") != "thread" or s["num_workers"] < 2 or not s["wall_seconds"]:
        return None
    workers = s["workers"]
    k = sum(w["busy_fraction"] for w in workers)
    cpu = sum(w.get("cpu_seconds") or 0.0 for w in workers) / s["wall_seconds"]
    if k < GIL_MIN_BUSY or cpu < GIL_MIN_CPU or _cores() < 2:
        return None
    k = min(k, float(_cores()))  # more threads than cores compete for cores as well
    return min(1.0, max(0.0, (k / cpu - 1) / (k - 1)))


def _cores() -> int:
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; os.cpu_count() elsewhere
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def starting_dominates(s) -> bool:
    """Starting workers took most of an epoch the loop waited on."""
    fraction = s.get("worker_start_fraction")
    return (fraction is not None and fraction >= START_DOMINATES
            and s["stall_fraction"] >= STALL_WARN)


def start_advice(s) -> str:
    text = (f"starting workers took {s['worker_start_seconds']:.2f} s, "
            f"{100 * s['worker_start_fraction']:.0f}% of this epoch")
    if s.get("persistent_workers"):
        text += "; with persistent_workers=True only the first epoch pays it"
    else:
        text += "; pass persistent_workers=True to start them once instead of at every epoch"
    if s.get("worker_method") != "thread":
        # What a process loader cannot measure: whether __getitem__ would let
        # threads run together.  Threads start at once; the tuner measures both.
        text += ("; or worker_method='thread', whose workers start at once, where "
                 "__getitem__ releases the GIL (python -m torchfeed.tune measures both)")
    return text


def log_line(s: LoaderStats, window_batches: int, window_wait: float,
             window_seconds: float) -> None:
    """Log ``s`` in one line at INFO, with the stall and rate of the last
    ``window_batches`` batches (``window_wait`` of ``window_seconds`` blocked)."""
    logger.info(
        "%d batches | data stall %.1f%% (last %d: %.1f%%) | %.1f batches/s"
        " | slowest %s | in flight %d, ready %d%s",
        s["batches_yielded"], 100 * s["stall_fraction"], window_batches,
        100 * min(1.0, window_wait / window_seconds),
        window_batches / window_seconds, _slowest(s),
        s["queues"]["in_flight"], s["queues"]["ready"],
        f" | {start_advice(s)}" if starting_dominates(s) else "")


def _slowest(s) -> str:
    timed = [w for w in s["workers"] if w["mean_fetch_seconds"] is not None]
    if not timed:
        return "worker: none yet"
    w = max(timed, key=lambda w: w["mean_fetch_seconds"])
    name = "main" if s["num_workers"] == 0 else str(w["id"])
    return (f"worker {name}: {1000 * w['mean_fetch_seconds']:.1f} ms/batch, "
            f"{100 * w['busy_fraction']:.0f}% busy")


_visible = False


def make_visible() -> None:
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
