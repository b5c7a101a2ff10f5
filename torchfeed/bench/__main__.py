"""The command line of ``python -m torchfeed.bench``: options in, table (and JSON) out."""
from __future__ import annotations

import argparse
import gc
import sys
from typing import Sequence

from .compare import PEERS, BenchConfig, run_comparison
from .measure import load_average
from .report import command_line, format_report, machine_info, to_json
from .workloads import WORKLOADS


def _workload_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown workload(s) {', '.join(unknown) or '(none given)'}; "
            f"choose from {', '.join(WORKLOADS)}")
    return names


def _peer_list(text: str) -> list[str]:
    if text.strip() == "none":
        return []
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown peer(s) {', '.join(unknown) or '(none given)'}; "
            f"choose from {', '.join(PEERS)}, or none")
    return names


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    workloads = "\n".join(
        f"  {w.name:<10} {w.description} ({w.batches} batches a run"
        + (f"; needs {', '.join(w.requires)}" if w.requires else "") + ")"
        for w in WORKLOADS.values())
    peers = "\n".join(f"  {p.name:<10} {p.title} (pip install {p.pip})"
                      for p in PEERS.values())
    parser = argparse.ArgumentParser(
        prog="python -m torchfeed.bench",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run workloads through torch.utils.data.DataLoader, "
                    "torchfeed.DataLoader and the installed peer loaders with the same "
                    "arguments, rotating runs, and print the medians side by side with "
                    "torchfeed's ratio to each.",
        epilog=f"workloads:\n{workloads}\npeers (all optional: pip install "
               f"'torchfeed[bench]'):\n{peers}\n\nThe jpeg and hf workloads write their "
               "files once under $TORCHFEED_BENCH_CACHE, else $XDG_CACHE_HOME/torchfeed/bench, "
               "else ~/.cache/torchfeed/bench.")
    parser.add_argument("--workloads", type=_workload_list, default=list(WORKLOADS),
                        help="comma-separated workloads to run (default: all; one whose "
                             "package is missing is skipped with a note)")
    parser.add_argument("--peers", type=_peer_list, default=list(PEERS),
                        help="comma-separated peer loaders to add as columns, or none "
                             f"(default: {','.join(PEERS)}; one that is not installed is "
                             "skipped with a note)")
    parser.add_argument("--num-workers", type=_non_negative, default=2,
                        help="num_workers for both loaders (default: 2)")
    parser.add_argument("--batches", type=_positive, default=None,
                        help="timed batches per run, after the first batch "
                             "(default: each workload's own, listed below)")
    parser.add_argument("--repeats", type=_positive, default=None,
                        help="runs per loader and workload; figures are medians (default: 3, "
                             "1 with --quick)")
    parser.add_argument("--transport", choices=["torch", "shm"], default=None,
                        help="passed to torchfeed.DataLoader as transport=...; "
                             "left out when not given, so torchfeed uses its default")
    parser.add_argument("--torch-threads", type=_positive, default=None,
                        help="torch.set_num_threads() in this process for the run; with "
                             "num_workers=0 the collate runs here, and on a busy machine "
                             "torch's intra-op threads make torch@0 crawl (default: torch's "
                             "own choice)")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write machine-readable results to PATH")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the third loader, torch with num_workers=0, and the "
                             "'vs num_workers=0' columns")
    parser.add_argument("--first-batch-runs", type=_non_negative, default=None,
                        help="more runs per loader that stop at the first batch, for a "
                             "steadier first-batch figure (default: 6, 0 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: a tenth of the batches, 1 repeat, no first-batch runs")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress display on stderr")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = BenchConfig(
        workloads=args.workloads,
        num_workers=args.num_workers,
        batches=args.batches,
        repeats=args.repeats if args.repeats is not None else (1 if args.quick else 3),
        transport=args.transport,
        progress=not args.no_progress,
        quick=args.quick,
        baseline=not args.no_baseline,
        peers=args.peers,
        torch_threads=args.torch_threads,
        first_batch_runs=(args.first_batch_runs if args.first_batch_runs is not None
                          else (0 if args.quick else 6)),
    )
    command = command_line(None if argv is None else [sys.argv[0], *argv])
    info = machine_info()
    try:
        results = run_comparison(config)
    except KeyboardInterrupt:
        # The run in flight has already shut its workers down on the way out.
        print("torchfeed.bench: interrupted; no table", file=sys.stderr)
        return 130
    end_load = load_average()
    print(format_report(results, config, info, command, end_load), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(to_json(results, config, info, command) + "\n")
        print(f"results written to {args.json}")
    failed = any(f.error for r in results for f in r.figures.values())
    return 1 if failed else 0


if __name__ == "__main__":
    # Run as a program, this process is ours: what importing torch made (some
    # 170,000 objects) goes where no collection walks it, so that each of the
    # gc.collect() calls around every timed run costs milliseconds, not 0.1 s.
    gc.freeze()
    sys.exit(main())
