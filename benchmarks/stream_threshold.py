"""When does streaming big arrays into the slot pay off? (``torchfeed/_transport/_stream.py``)

Each case loads batches of ``batch`` samples, each a uint8 array of ``kib`` KiB
(copied out of a small pool, as a decoder writes fresh memory) and an int, with
``torchfeed.DataLoader(num_workers=2)``, twice: with the arrays streamed into
the slot sample by sample, and with the thresholds raised out of reach so the
batch is stacked after all its samples are fetched; and with
``torch.utils.data.DataLoader(num_workers=2)`` for scale. Runs alternate
between the three; the figures are medians of batches/s and their ratios. It
is what the thresholds in ``_stream.py`` were chosen from: the cases that
straddle them.

The thresholds are module constants that the forked workers inherit, so this
script needs the ``fork`` start method (Linux).

    python benchmarks/stream_threshold.py
    python benchmarks/stream_threshold.py --cases 64x64,150x64 --repeats 9
"""
import argparse
import multiprocessing
import os
import statistics
import sys
import time

# Runnable from a checkout without installing torchfeed.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

import torchfeed  # noqa: E402
from torchfeed._transport import _stream  # noqa: E402

DEFAULT_CASES = "64x64,96x64,128x64,192x64,150x16,150x32,150x64"


class Arrays(Dataset):
    def __init__(self, nbytes: int, pool: int = 8):
        self.pool = torch.randint(0, 256, (pool, nbytes), dtype=torch.uint8)

    def __len__(self):
        return 1 << 30

    def __getitem__(self, i):
        return self.pool[i % len(self.pool)].clone(), i


VARIANTS = ("streamed", "stacked", "torch")


def batches_per_s(nbytes: int, batch: int, variant: str, timed: int) -> float:
    saved = _stream.STREAM_MIN_BYTES, _stream.STREAM_MIN_BATCH_BYTES
    if variant == "streamed":
        _stream.STREAM_MIN_BYTES = _stream.STREAM_MIN_BATCH_BYTES = 1
    else:
        _stream.STREAM_MIN_BYTES = _stream.STREAM_MIN_BATCH_BYTES = 1 << 62
    cls = torch.utils.data.DataLoader if variant == "torch" else torchfeed.DataLoader
    try:
        loader = cls(Arrays(nbytes), batch_size=batch, num_workers=2,
                     multiprocessing_context="fork")
        it = iter(loader)
        for _ in range(20):  # worker start, and the first batch of each, which has no slot
            next(it)
        start = time.perf_counter()
        for _ in range(timed):
            next(it)
        rate = timed / (time.perf_counter() - start)
        del it
        return rate
    finally:
        _stream.STREAM_MIN_BYTES, _stream.STREAM_MIN_BATCH_BYTES = saved


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=DEFAULT_CASES,
                        help=f"comma-separated KIBxBATCH cases (default: {DEFAULT_CASES})")
    parser.add_argument("--repeats", type=int, default=5, help="runs per variant; medians (default: 5)")
    parser.add_argument("--mib", type=float, default=3000.0,
                        help="MiB of samples loaded per timed run (default: 3000)")
    args = parser.parse_args(argv)
    if "fork" not in multiprocessing.get_all_start_methods():
        sys.exit("stream_threshold.py needs the fork start method")
    print(f"thresholds now: {_stream.STREAM_MIN_BYTES >> 10} KiB per array, "
          f"{_stream.STREAM_MIN_BATCH_BYTES >> 20} MiB per batch; 2 workers, "
          f"{os.cpu_count()} cores, median of {args.repeats}")
    print(f"{'case':>12}  {'batch MiB':>9}  {'streamed b/s':>12}  {'stacked b/s':>11}  "
          f"{'torch b/s':>9}  streamed/stacked  streamed/torch")
    for case in args.cases.split(","):
        kib, batch = (int(x) for x in case.lower().split("x"))
        nbytes = kib << 10
        timed = max(50, int(args.mib * (1 << 20) / (nbytes * batch)))
        runs = {variant: [] for variant in VARIANTS}
        for repeat in range(args.repeats):
            shift = repeat % len(VARIANTS)  # each variant goes first on its share of repeats
            for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                runs[variant].append(batches_per_s(nbytes, batch, variant, timed))
        s, p, t = (statistics.median(runs[v]) for v in VARIANTS)
        print(f"{kib:>6} KiB x{batch:<3}  {nbytes * batch / (1 << 20):>9.1f}  {s:>12.0f}  "
              f"{p:>11.0f}  {t:>9.0f}  {s / p:>15.2f}x  {s / t:>13.2f}x", flush=True)


if __name__ == "__main__":
    main()
