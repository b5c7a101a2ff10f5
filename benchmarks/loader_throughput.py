"""Throughput of torch's and torchfeed's DataLoader across num_workers, per workload.

Answers what the side-by-side table cannot: does turning workers on pay off
at all?  Every row is also shown as a ratio to torch with ``num_workers=0``
(loading in the training process), measured in the same run.  The logic lives
in ``torchfeed/bench/sweep.py``; this file only reads the command line.

    python benchmarks/loader_throughput.py --workloads small,image --num-workers 0,1,2
"""
import argparse
import json
import os
import sys

# Runnable from a checkout without installing torchfeed.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from torchfeed.bench.compare import LOADERS  # noqa: E402
from torchfeed.bench.report import command_line, describe_machine, machine_info  # noqa: E402
from torchfeed.bench.sweep import format_sweep, run_sweep  # noqa: E402
from torchfeed.bench.workloads import WORKLOADS  # noqa: E402


def _names(choices):
    def parse(text):
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in choices]
        if not names or bad:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}")
        return names
    return parse


def _ints(text):
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 0,1,2, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected integers of 0 or more, got {text!r}")
    return values


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", type=_names(list(WORKLOADS)), default=list(WORKLOADS),
                        help=f"comma-separated, from {', '.join(WORKLOADS)} (default: all)")
    parser.add_argument("--loaders", type=_names(list(LOADERS)), default=list(LOADERS),
                        help="comma-separated, from torch,torchfeed (default: both)")
    parser.add_argument("--num-workers", type=_ints, default=[0, 1, 2],
                        help="comma-separated num_workers values (default: 0,1,2)")
    parser.add_argument("--batches", type=int, default=None,
                        help="timed batches per run (default: each workload's own)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell; medians (default 3)")
    parser.add_argument("--transport", choices=["torch", "shm"], default=None,
                        help="passed to torchfeed.DataLoader as transport=... when given")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch.set_num_threads() in this process first; with num_workers=0 "
                             "the collate runs here, and on a busy machine torch's intra-op "
                             "threads make that baseline swing (default: torch's own choice)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    if args.torch_threads is not None:
        import torch

        torch.set_num_threads(args.torch_threads)
    info = machine_info()
    notes = [note for w in args.workloads if (note := WORKLOADS[w].skip_note())]
    workloads = [w for w in args.workloads if WORKLOADS[w].skip_note() is None]
    rows = run_sweep(workloads, args.loaders, args.num_workers, args.batches,
                     args.repeats, args.transport, progress=not args.no_progress)
    command = command_line()
    print(f"machine: {describe_machine(info)}\ncommand: {command}\n"
          f"median of {args.repeats} run(s) per row\n")
    print(format_sweep(rows))
    for note in notes:
        print(f"note: {note}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"command": command, "machine": info,
                       "rows": [r.to_dict() for r in rows]}, f, indent=2)
            f.write("\n")
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
