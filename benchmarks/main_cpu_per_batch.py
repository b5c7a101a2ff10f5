"""The consuming process's CPU per batch: torch's DataLoader against torchfeed's,
and torchfeed against itself at another commit.

Each measurement runs in a fresh process: it builds one of the bench's
workloads (``torchfeed/bench/workloads.py``) behind a loader with
``--num-workers`` workers, takes ``--warmup`` batches, then times the next
``--batches`` with ``time.process_time()`` (all of this process's threads:
torch's index-queue feeder threads count, as they do in the bench's "main CPU
us/batch"). Repeats are interleaved across the columns and the minimum is
reported, the figure least disturbed by other jobs on the machine.

On a loaded machine even the minimum moves by 10-20 %, so each column also
gets one run that counts, with ``cProfile``, the Python function calls the
main thread makes per batch: a deterministic figure, which shows whether
anything was added to the per-batch path (torch's feeder threads are not in
it). For the machine instructions behind it, run the child under valgrind's
callgrind at two ``--batches`` and subtract.

``--trees`` compares checkouts: each is a directory whose ``torchfeed``
package is imported (``.`` is this one), for instance a worktree at an older
commit made with ``git worktree add --detach ../before <commit>``.

    python benchmarks/main_cpu_per_batch.py                       # image and numpy, torch vs torchfeed
    python benchmarks/main_cpu_per_batch.py --trees ../before,.   # torchfeed at two commits, and torch
    python benchmarks/main_cpu_per_batch.py --workloads small,dict30 --repeats 7
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _loader(tree: str, loader: str, workload: str, batches: int, num_workers: int):
    sys.path.insert(0, tree)
    import torch.utils.data

    import torchfeed
    from torchfeed.bench.workloads import WORKLOADS

    spec = WORKLOADS[workload]
    kwargs = {"batch_size": spec.batch_size, "num_workers": num_workers}
    if getattr(spec, "collate_fn", None) is not None:  # older trees have no such field
        kwargs["collate_fn"] = spec.collate_fn
    cls = torchfeed.DataLoader if loader == "torchfeed" else torch.utils.data.DataLoader
    return cls(spec.dataset(spec.batch_size * (batches + 100)), **kwargs)


def child(args) -> None:
    """One measurement, printed as a JSON line."""
    loader = _loader(args.tree, args.loader, args.workload, args.warmup + args.batches,
                     args.num_workers)
    it = iter(loader)
    for _ in range(args.warmup):
        next(it)
    result: dict = {"torchfeed": sys.modules["torchfeed"].__file__}
    if args.count:
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.batches):
            batch = next(it)
            del batch  # dropping it is what recycles its slot
        profile.disable()
        calls = sum(nc for (_, nc, _, _, _) in pstats.Stats(profile).stats.values())
        result["calls_per_batch"] = calls / args.batches
    else:
        cpu0 = time.process_time()
        for _ in range(args.batches):
            batch = next(it)
            del batch
        result["cpu_us_per_batch"] = (time.process_time() - cpu0) / args.batches * 1e6
    del it, loader
    print(json.dumps(result))


def _run_child(args, tree: str, loader: str, workload: str, count: bool) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--tree", tree,
           "--loader", loader, "--workload", workload, "--batches", str(args.batches),
           "--warmup", str(args.warmup), "--num-workers", str(args.num_workers)]
    if count:
        cmd.append("--count")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="image,numpy",
                    help="comma-separated names from torchfeed/bench/workloads.py")
    ap.add_argument("--trees", default=".",
                    help="comma-separated checkouts whose torchfeed to measure ('.' is this one)")
    ap.add_argument("--no-torch", action="store_true", help="leave torch's DataLoader out")
    ap.add_argument("--batches", type=int, default=300, help="timed batches per run")
    ap.add_argument("--warmup", type=int, default=20, help="batches taken before timing")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per column")
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--count", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", default=REPO, help=argparse.SUPPRESS)
    ap.add_argument("--loader", default="torchfeed", help=argparse.SUPPRESS)
    ap.add_argument("--workload", default="image", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return

    trees = [os.path.abspath(REPO if t == "." else t) for t in args.trees.split(",")]
    columns = [] if args.no_torch else [("torch", trees[0])]
    columns += [("torchfeed", tree) for tree in trees]
    for workload in args.workloads.split(","):
        cpu: dict = {c: [] for c in columns}
        for _ in range(args.repeats):  # interleaved, so a burst of load hits every column
            for loader, tree in columns:
                cpu[(loader, tree)].append(
                    _run_child(args, tree, loader, workload, False)["cpu_us_per_batch"])
        print(f"{workload}: {args.batches} batches after {args.warmup}, "
              f"num_workers={args.num_workers}, min of {args.repeats}")
        for loader, tree in columns:
            calls = _run_child(args, tree, loader, workload, True)["calls_per_batch"]
            runs = cpu[(loader, tree)]
            where = "" if loader == "torch" else f"  ({os.path.relpath(tree)})"
            print(f"  {loader:9s} {min(runs):7.1f} us/batch  runs "
                  f"{' '.join(f'{r:.0f}' for r in runs):28s} python calls/batch "
                  f"{calls:7.1f}{where}")


if __name__ == "__main__":
    main()
