"""The command line of the tuner: ``python -m torchfeed.tune MODULE:FACTORY [options]``.

Owns turning ``MODULE:FACTORY`` into the user's Dataset or DataLoader, and
turning every way that can fail into one line that says what is wrong and how
to fix it, with an exit status of 2 (usage) or 1 (the run failed).  A
traceback is shown only when the user's own code raised, because then it
points at their bug.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import inspect
import json
import os
import sys
import traceback
from typing import Any, Sequence

from torch.utils.data import DataLoader, Dataset

from .._tuner import tune

_USAGE_EXAMPLE = "python -m torchfeed.tune mydata:make_dataset --batch-size 32"


class TargetError(Exception):
    """MODULE:FACTORY could not be turned into a dataset or loader; the message says why."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


def _module_file(module: Any) -> str:
    return getattr(module, "__file__", None) or "built-in"


def load_target(target: str) -> Any:
    """Import MODULE, call FACTORY(), and check that it returned a Dataset or DataLoader."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise TargetError(f"expected MODULE:FACTORY, got {target!r}; for example: {_USAGE_EXAMPLE}")
    # `python -m` puts the current directory first on sys.path; an entry point
    # or `python path/to/...` does not, and users expect ./mydata.py to be found.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise TargetError(
                f"cannot import module {module_name!r}: no module named {missing!r} on the Python "
                f"path. Run from the directory that holds {module_name.split('.')[0]}.py (or its "
                f"package), or add that directory to PYTHONPATH.") from None
        raise TargetError(
            f"importing {module_name!r} failed: it imports {missing!r}, which is not installed "
            f"in this Python ({sys.executable}).\n" + traceback.format_exc(), status=1) from None
    except Exception:
        raise TargetError(f"importing {module_name!r} raised an error (in your code):\n"
                          + traceback.format_exc(), status=1) from None
    try:
        factory = getattr(module, attr)
    except AttributeError:
        callables = sorted(n for n, v in vars(module).items()
                           if callable(v) and not n.startswith("_")
                           and getattr(v, "__module__", None) == module.__name__)
        hint = (f" Callables it defines: {', '.join(callables)}." if callables
                else " It defines no public callables.")
        raise TargetError(f"module {module_name!r} ({_module_file(module)}) has no attribute "
                          f"{attr!r}.{hint} FACTORY must name a function that returns a "
                          f"Dataset or a DataLoader.") from None
    if not callable(factory):
        raise TargetError(f"{target} is not callable (it is a value of type "
                          f"{type(factory).__name__}); FACTORY must name a function that "
                          "returns a Dataset or a DataLoader")
    try:
        inspect.signature(factory).bind()
    except TypeError as exc:
        raise TargetError(f"{target} is called with no arguments, but its signature needs "
                          f"some ({exc}); give them defaults or wrap it in a function") from None
    except ValueError:
        pass  # no signature to inspect (a builtin); just call it
    try:
        source = factory()
    except Exception:
        raise TargetError(f"calling {target}() raised an error (in your code):\n"
                          + traceback.format_exc(), status=1) from None
    if not isinstance(source, (Dataset, DataLoader)):
        raise TargetError(f"{target}() returned a {type(source).__module__}."
                          f"{type(source).__qualname__}; it must return a torch Dataset "
                          "(map-style or IterableDataset) or a DataLoader")
    return source


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _factors(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 2,4, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers of at least 1, got {text!r}")
    return values


def _methods(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in ("multiprocessing", "thread") for v in values):
        raise argparse.ArgumentTypeError(f"expected multiprocessing, thread or both, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchfeed.tune",
        description="Measure batches/s of your own dataset at num_workers 0, 1, 2, ... up to "
                    "the core count, a few prefetch_factor values and both kinds of worker "
                    "(processes, threads), and recommend a setting.",
        epilog=f"example: {_USAGE_EXAMPLE} --seconds 3 --plot tune.png")
    parser.add_argument("target", metavar="MODULE:FACTORY",
                        help="a function FACTORY in the importable module MODULE that takes no "
                             "arguments and returns a Dataset, or a DataLoader whose other "
                             "arguments are kept")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="batch size (default: the DataLoader's; for a Dataset, torch's 1)")
    parser.add_argument("--seconds", type=_positive_float, default=2.0,
                        help="timed seconds per setting, after its first batch (default: 2)")
    parser.add_argument("--max-workers", type=int, default=None,
                        help="largest num_workers to try (default: the usable core count)")
    parser.add_argument("--prefetch-factors", type=_factors, default=[2, 4],
                        help="comma-separated prefetch_factor values to try (default: 2,4)")
    parser.add_argument("--worker-methods", type=_methods, default=["multiprocessing", "thread"],
                        help="comma-separated kinds of worker to try: multiprocessing, thread "
                             "(default: both, and the advice says which)")
    parser.add_argument("--plot", metavar="PNG", default=None,
                        help="write a plot of batches/s to PNG (needs matplotlib: "
                             "pip install 'torchfeed[plot]')")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the measurements and the advice as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress display")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prog = "python -m torchfeed.tune"
    if args.batch_size is not None and args.batch_size < 1:
        print(f"{prog}: error: --batch-size must be at least 1", file=sys.stderr)
        return 2
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401  (checked before the measuring starts)
        except ImportError:
            print(f"{prog}: error: --plot needs matplotlib, an optional extra of torchfeed. "
                  "Install it with: pip install 'torchfeed[plot]'   (or: pip install matplotlib)",
                  file=sys.stderr)
            return 2
    try:
        source = load_target(args.target)
    except TargetError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exc.status
    try:
        result = tune(source, batch_size=args.batch_size, seconds=args.seconds,
                      max_workers=args.max_workers, prefetch_factors=args.prefetch_factors,
                      worker_methods=args.worker_methods,
                      plot=args.plot, progress=not args.no_progress)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; no recommendation", file=sys.stderr)
        return 130
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result.to_dict(), f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    # Run as a program, this process is ours: what importing torch made (some
    # 170,000 objects) goes where no collection walks it, so that each of the
    # gc.collect() calls around every timed run costs milliseconds, not 0.1 s.
    gc.freeze()
    sys.exit(main())
