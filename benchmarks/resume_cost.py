"""What checkpointing costs: ``state_dict()`` per call, and resuming from a state.

    python benchmarks/resume_cost.py [--n 100000] [--batch-size 32] [--workers 0 2]
                                     [--steps 1 100 1000] [--calls 2000] [--repeats 5]

For torchfeed's DataLoader and, when it is importable, torchdata's
StatefulDataLoader (install it for the benchmark only, e.g. in a venv made with
``--system-site-packages`` so it uses the same torch), in the same run:

* ``state_dict()`` cost in microseconds: the median of ``--calls`` timed calls,
  after 1, 100 and 1000 batches (``--steps``);
* resume cost after the last of ``--steps`` batches: the time from
  ``load_state_dict()`` to the first batch, and how many ``__getitem__`` calls
  (all processes) had happened by then.  Medians of ``--repeats`` runs.  For
  scale, ``fresh ms`` is the same loader's plain ``iter()`` to first batch
  (an epoch start pays the sampler's permutation and, with workers, their start);
* the state's size (``torch.save`` bytes) and whether it survives ``json``.

Every resumed first batch is checked against the uninterrupted run.  A map-style
dataset of ints, shuffled, so the numbers are the loaders' own overhead.
"""
from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import statistics
import sys
import time

import torch
from torch.utils.data import Dataset


class Counting(Dataset):
    """Sample i is i; counts __getitem__ calls in every process (a fork-shared counter)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls = multiprocessing.RawValue("q", 0)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        self.calls.value += 1
        return i


def loaders():
    from torchfeed import DataLoader
    found = {"torchfeed": DataLoader}
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
        found["torchdata"] = StatefulDataLoader
    except ImportError:
        print("torchdata is not installed: reporting torchfeed only "
              "(pip install torchdata, ideally in a throwaway venv)", file=sys.stderr)
    return found


def make(cls, ds, args, workers):
    kwargs = dict(batch_size=args.batch_size, shuffle=True, num_workers=workers,
                  generator=torch.Generator().manual_seed(0))
    if workers:
        kwargs["multiprocessing_context"] = "fork"
    return cls(ds, **kwargs)


def close(loader):
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()


def state_dict_cost(cls, args, workers, steps):
    ds = Counting(args.n)
    loader = make(cls, ds, args, workers)
    it = iter(loader)
    out, done = {}, 0
    for s in steps:
        while done < s:
            next(it)
            done += 1
        times = []
        for _ in range(args.calls):
            t0 = time.perf_counter_ns()
            loader.state_dict()
            times.append(time.perf_counter_ns() - t0)
        out[s] = statistics.median(times) / 1000
    state = loader.state_dict()
    expected = next(it).tolist()
    buf = io.BytesIO()
    torch.save(state, buf)
    try:
        json_ok = json.loads(json.dumps(state)) is not None
    except (TypeError, ValueError):
        json_ok = False
    del it
    close(loader)
    return out, state, expected, len(buf.getvalue()), json_ok


def fresh_cost(cls, args, workers):
    seconds = []
    for _ in range(args.repeats):
        loader = make(cls, Counting(args.n), args, workers)
        t0 = time.perf_counter()
        it = iter(loader)
        next(it)
        seconds.append(time.perf_counter() - t0)
        del it
        close(loader)
    return statistics.median(seconds)


def resume_cost(cls, args, workers, state, expected):
    seconds, calls = [], []
    for _ in range(args.repeats):
        ds = Counting(args.n)
        loader = make(cls, ds, args, workers)
        t0 = time.perf_counter()
        loader.load_state_dict(state)
        it = iter(loader)
        first = next(it)
        seconds.append(time.perf_counter() - t0)
        calls.append(ds.calls.value)
        assert first.tolist() == expected, f"{cls.__name__}: resumed at the wrong batch"
        del it
        close(loader)
    return statistics.median(seconds), statistics.median(calls)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--steps", type=int, nargs="+", default=[1, 100, 1000])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    steps = sorted(args.steps)

    rows = []
    for name, cls in loaders().items():
        for workers in args.workers:
            costs, state, expected, size, json_ok = state_dict_cost(cls, args, workers, steps)
            secs, calls = resume_cost(cls, args, workers, state, expected)
            fresh = fresh_cost(cls, args, workers)
            rows.append({"loader": name, "num_workers": workers,
                         "state_dict_us": costs, "state_bytes": size, "json_ok": json_ok,
                         "resume_ms": secs * 1000, "resume_getitem_calls": calls,
                         "fresh_ms": fresh * 1000, "resumed_at_batch": steps[-1]})
    print(f"n={args.n} batch_size={args.batch_size} shuffle=True; state_dict: median of "
          f"{args.calls} calls; resume after {steps[-1]} batches: median of {args.repeats}")
    head = " ".join(f"sd@{s:>5} us" for s in steps)
    print(f"{'loader':10} {'workers':>7} {head} {'state B':>8} {'json':>5} {'resume ms':>10} "
          f"{'getitem':>8} {'fresh ms':>9}")
    for r in rows:
        cells = " ".join(f"{r['state_dict_us'][s]:11.1f}" for s in steps)
        print(f"{r['loader']:10} {r['num_workers']:7d} {cells} {r['state_bytes']:8d} "
              f"{'yes' if r['json_ok'] else 'no':>5} {r['resume_ms']:10.1f} "
              f"{r['resume_getitem_calls']:8.0f} {r['fresh_ms']:9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
