"""What the always-on stats hooks cost the main process, per batch.

The main process pays for two hooks per batch (see ``torchfeed/_stats.py``):

* ``BaseIterator.__next__`` reads the clock before and after ``_next_data`` and
  calls ``IteratorStats.on_yield``;
* ``_receive`` calls ``IteratorStats.on_result`` for each arriving batch
  (multi-process loaders only).

This script times ``__next__`` as shipped against a copy of it with the hooks
taken out, on the same iterator of a ``num_workers=0`` loader whose batch
fetch is replaced by a constant (so the difference is not lost in fetch
noise), then times ``on_result`` directly against an empty call.  Runs
alternate between the two variants; the figure is the median over runs of
the per-call difference.  It also reports the same comparison with the
loader's real fetch of an in-memory list, for scale.

Last, what the periodic log line costs a 2-worker loader of small batches:
``log_every=100`` against no log line, batches/s of whole epochs with
persistent workers, alternated; the figure is the median of the per-pair
ratios.  The line is built from counters only: it reads no worker's memory,
which walks the worker's page tables.  What one such reading costs is
printed too: wall time of ``private_bytes`` for one forked worker, median of
``--log-runs`` readings, with the parent holding nothing of its own, then
holding ``--heap-records`` annotation-like dicts (1,000,000 by default, about
300 MiB of Python objects, which its workers inherit).  That is what the
periodic check spends every 10 s, in a background thread
(``_worker_costs.MemoryReading``).

Time is this thread's CPU time by default, so a busy shared machine that
deschedules the process does not inflate the figure; ``--clock wall`` uses
``perf_counter`` instead.

    python benchmarks/stats_overhead.py --runs 31 --calls 200000
"""
import argparse
import logging
import os
import statistics
import sys
import time
import warnings

# Runnable from a checkout without installing torchfeed.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import torchfeed  # noqa: E402
from torchfeed import DataLoader  # noqa: E402


def unhooked_next(self):
    """``BaseIterator.__next__`` without the stats hooks, otherwise identical."""
    data = self._next_data()
    self._num_yielded += 1
    if (self._is_iterable and self._IterableDataset_len_called is not None
            and self._num_yielded > self._IterableDataset_len_called):
        warnings.warn("unreachable here", stacklevel=2)
    return data


clock = time.thread_time


def _loop(step, it, calls: int) -> float:
    start = clock()
    for _ in range(calls):
        step(it)
    return (clock() - start) / calls


def _compare(make_iterator, calls: int, runs: int):
    hooked_next = type(make_iterator()).__next__
    hooked, plain, diffs = [], [], []
    for run in range(runs):
        it = make_iterator()
        pair = [(hooked_next, hooked), (unhooked_next, plain)]
        if run % 2:
            pair.reverse()
        for step, out in pair:
            out.append(_loop(step, it, calls))
        diffs.append(hooked[-1] - plain[-1])
    return statistics.median(hooked), statistics.median(plain), statistics.median(diffs)


def _on_result_cost(calls: int, runs: int) -> float:
    loader = DataLoader(list(range(8)), batch_size=None, num_workers=0)
    stats = iter(loader).hand_over()
    stats.worker_batches, stats.worker_busy = [0], [0.0]  # as for one worker
    on_result = stats.on_result

    def empty(worker_id, seconds):
        pass

    diffs = []
    for _ in range(runs):
        times = []
        for fn in (on_result, empty):
            start = clock()
            for _ in range(calls):
                fn(0, 0.001)
            times.append((clock() - start) / calls)
        diffs.append(times[0] - times[1])
    return statistics.median(diffs)


class _Numbers:
    def __len__(self):
        return 64 * 2000

    def __getitem__(self, i):
        return i


def _log_line_ratio(runs: int, every: int = 100) -> float:
    """Median over runs of (batches/s with ``log_every=every``) / (without)."""
    logging.getLogger("torchfeed").addHandler(logging.NullHandler())  # lines go nowhere
    loaders = {k: DataLoader(_Numbers(), batch_size=64, num_workers=2, persistent_workers=True,
                             log_every=k) for k in (None, every)}
    for loader in loaders.values():
        list(loader)  # workers started, first epoch out of the measurement
    ratios = []
    for run in range(runs):
        rate = {}
        for k in ((None, every) if run % 2 else (every, None)):
            start = time.perf_counter()
            n = sum(1 for _ in loaders[k])
            rate[k] = n / (time.perf_counter() - start)
        ratios.append(rate[every] / rate[None])
    return statistics.median(ratios)


def _reading_cost(runs: int) -> float:
    """Median seconds of one USS reading of one forked worker (``private_bytes``)."""
    from torchfeed import _worker_costs

    loader = DataLoader(_Numbers(), batch_size=64, num_workers=1, persistent_workers=True,
                        multiprocessing_context="fork")
    it = iter(loader)
    next(it)
    pids = [w.pid for w in it._workers]
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        _worker_costs.private_bytes(pids)
        times.append(time.perf_counter() - start)
    del it, loader
    return statistics.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=31, help="runs per variant (default 31)")
    parser.add_argument("--calls", type=int, default=200_000,
                        help="__next__ calls per run (default 200000)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="thread CPU time (default) or perf_counter wall time")
    parser.add_argument("--log-runs", type=int, default=7,
                        help="pairs of epochs for the log line's cost, and readings of a "
                             "worker's memory (default 7; 0 skips both)")
    parser.add_argument("--heap-records", type=int, default=1_000_000,
                        help="dicts the parent holds for the second reading (default 1000000)")
    args = parser.parse_args(argv)
    global clock
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    big = 10 ** 9

    def constant_iterator():
        it = iter(DataLoader(range(big), batch_size=None, num_workers=0))
        it._next_data = lambda: 0  # the fetch, taken out of the measurement
        return it

    def real_iterator():
        return iter(DataLoader(range(big), batch_size=None, num_workers=0,
                               collate_fn=lambda x: x))

    print(f"torchfeed from {os.path.dirname(torchfeed.__file__)}, python {sys.version.split()[0]}, "
          f"{args.runs} runs x {args.calls} calls, {args.clock} time, medians")
    h, p, d = _compare(constant_iterator, args.calls, args.runs)
    print(f"__next__, fetch taken out:   hooked {1e9 * h:7.0f} ns  unhooked {1e9 * p:7.0f} ns  "
          f"hook cost {1e9 * d:6.0f} ns/batch")
    r = _on_result_cost(args.calls, args.runs)
    print(f"on_result (multi-process):   {1e9 * r:6.0f} ns/batch over an empty call")
    print(f"main-process hook cost per batch: {1e9 * (d + r):.0f} ns "
          f"({1e6 * (d + r):.2f} us; budget 2 us)")
    h, p, d = _compare(real_iterator, args.calls // 4, args.runs)
    print(f"for scale, real fetch of an int (num_workers=0): hooked {1e9 * h:.0f} ns, "
          f"unhooked {1e9 * p:.0f} ns per batch")
    if args.log_runs:
        ratio = _log_line_ratio(args.log_runs)
        print(f"log_every=100, 2 workers, 2000 batches of 64 ints: {ratio:.2f}x the rate "
              f"without a log line (median of {args.log_runs} pairs of epochs)")
        bare = _reading_cost(args.log_runs)
        heap = [{"id": i, "bbox": [1.0, 2.0, 3.0, 4.0], "label": "x"}
                for i in range(args.heap_records)]
        held = _reading_cost(args.log_runs)
        print(f"one reading of a worker's private memory: {1e3 * bare:.1f} ms; "
              f"{1e3 * held:.1f} ms with {len(heap):,} dicts in the parent")


if __name__ == "__main__":
    main()
