"""What ``torchfeed.share`` costs: building the shared copy, and reading it.

The workload is issue 34's: a list of COCO-like annotation dicts (ids, an
area, a 4-float bbox, a 16-float polygon). Each run, in one process,
alternating:

* ``pickle.dumps(records)`` (the baseline: the cost of the one copy a spawn
  worker start pickles today), then ``torchfeed.share(records)``: seconds, and
  their ratio (issue 34's goal: ``share`` within 2x of ``pickle.dumps``);
* reading: ``shared[i]`` for random indices, against ``records[i]`` and
  against ``pickle.loads`` of one record's own pickle (1,000 of them, read
  over and over: warm), per item. The first pass over a new shared list
  includes mapping its pages into the process (page faults), the second not;
* the same for a dict of the records by id (``share`` of a dict builds the key
  index too) and its lookups.

Each size in ``--records`` (100,000 and 1,000,000 by default: at 100,000 the
fixed costs weigh most, at 1,000,000 ``pickle.dumps``'s memo of every
object does) is measured in turn, and a table printed for each.

Figures are medians over ``--runs``; the ratio is the median of per-run ratios.
Time is this process's CPU time (user + system, ``process_time``) by default,
so a busy shared machine that deschedules the process does not inflate it
(``share`` writes through the kernel, whose time counts too); ``--clock wall``
uses ``perf_counter``. The garbage collector is off while timing, as
``pickle.dumps`` of the list would otherwise pay for collections the list
build triggered.

    python benchmarks/share_cost.py --records 100000 1000000 --runs 5
"""
import argparse
import gc
import os
import pickle
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torchfeed  # noqa: E402
from torchfeed._share import shared_nbytes  # noqa: E402


def coco_records(n: int, seed: int = 0) -> list:
    rnd = random.Random(seed)
    return [{"id": i, "image_id": i // 7, "category_id": i % 80, "iscrowd": 0,
             "area": rnd.random() * 1000.0, "bbox": [rnd.random() for _ in range(4)],
             "segmentation": [[rnd.random() for _ in range(16)]]} for i in range(n)]


clock = time.process_time


def timed(fn):
    start = clock()
    out = fn()
    return clock() - start, out


def per_read(get, indices) -> float:
    start = clock()
    for i in indices:
        get(i)
    return (clock() - start) / len(indices)


def share_against_dumps(rows: dict, kind: str, obj):
    """Time ``pickle.dumps(obj)`` and ``torchfeed.share(obj)`` into ``rows``; the shared one."""
    dumps_s, blob = timed(lambda: pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    del blob
    share_s, shared = timed(lambda: torchfeed.share(obj))
    rows.setdefault(f"pickle.dumps({kind}) s", []).append(dumps_s)
    rows.setdefault(f"share({kind}) s", []).append(share_s)
    rows.setdefault(f"share/dumps ({kind})", []).append(share_s / dumps_s)
    return shared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--reads", type=int, default=200_000)
    parser.add_argument("--no-dict", action="store_true", help="skip the dict rows")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = parser.parse_args()
    global clock
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for n in args.records:
        measure(n, args)


def measure(n: int, args) -> None:
    records = coco_records(n)
    by_id = {r["id"]: r for r in records}
    indices = [random.Random(1).randrange(n) for _ in range(args.reads)]
    one_pickle = [pickle.dumps(records[i], protocol=5) for i in indices[:1000]]
    rows: dict[str, list[float]] = {}
    gc.disable()
    for run in range(args.runs):
        shared = share_against_dumps(rows, "list", records)
        rows.setdefault("shared[i] us (1st pass)", []).append(
            per_read(shared.__getitem__, indices) * 1e6)
        rows.setdefault("shared[i] us (2nd pass)", []).append(
            per_read(shared.__getitem__, indices) * 1e6)
        rows.setdefault("list[i] us", []).append(per_read(records.__getitem__, indices) * 1e6)
        rows.setdefault("pickle.loads(one) us", []).append(
            per_read(lambda k: pickle.loads(one_pickle[k]), range(len(one_pickle))) * 1e6)
        nbytes = shared_nbytes(shared)
        del shared
        if not args.no_dict:
            shared_map = share_against_dumps(rows, "dict", by_id)
            rows.setdefault("shared_map[k] us", []).append(
                per_read(shared_map.__getitem__, indices) * 1e6)
            del shared_map
        print(f"{n:,} records: run {run + 1}/{args.runs} done", file=sys.stderr)
    gc.enable()
    print(f"{n:,} COCO-like dicts; shared buffer {nbytes / 2**20:.0f} MiB; "
          f"median of {args.runs} runs ({args.clock} time)")
    for name, values in rows.items():
        print(f"  {name:26s} {statistics.median(values):10.3f}   "
              f"(min {min(values):.3f}, max {max(values):.3f})")


if __name__ == "__main__":
    main()
