"""End-to-end: torchfeed.DataLoader (shm transport, and transport='torch')
against torch.utils.data.DataLoader on light workloads.

Every loader reads the same in-memory dataset, in the same process, one after
the other, ``--runs`` times; reported are the medians of batches/s, of
main-process CPU per batch (``time.process_time`` in the consuming process)
and of the time to the first batch, and their ratios to torch's DataLoader
with the same ``num_workers``. ``torch w=0`` is torch in-process, the bar
"with 2 workers, at least the throughput of num_workers=0" is measured against.

    python benchmarks/transport_loader.py --help
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import numpy as np
import torch
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torchfeed  # noqa: E402


class Pool(Dataset):
    """``n`` distinct pre-built samples, cycled over ``length`` indices."""

    def __init__(self, make, n, length):
        self.samples = [make(i) for i in range(n)]
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return self.samples[i % len(self.samples)]


WORKLOADS = {
    "image": lambda i: (torch.full((3, 224, 224), i % 251, dtype=torch.uint8), i),
    "dict32": lambda i: {f"f{k}": torch.full((16,), float(i + k)) for k in range(32)},
    "small": lambda i: (torch.full((8,), float(i)), i),
    "numpy-record": lambda i: {"x": np.full(16, i, np.float32), "id": np.int64(i),
                               "label": i % 10},
}


def measure(factory, batches):
    loader = factory()
    t0 = time.perf_counter()
    it = iter(loader)
    first = None
    n = 0
    for b in it:
        if first is None:
            first = time.perf_counter() - t0
            t1, c1 = time.perf_counter(), time.process_time()
        del b
        n += 1
    wall, cpu = time.perf_counter() - t1, time.process_time() - c1
    del it, loader
    gc.collect()
    return (n - 1) / wall, cpu / (n - 1), first


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="image,dict32,small,numpy-record")
    ap.add_argument("--batches", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    bs, w = args.batch_size, args.workers
    print(f"# batch size {bs}, {args.batches} batches, num_workers={w}, median of "
          f"{args.runs} runs, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print(f"{'workload':<14}{'loader':<16}{'batches/s':>10}{'CPU/batch':>12}{'1st batch':>11}"
          f"{'x torch':>9}{'CPU/torch':>11}")
    for name in args.workloads.split(","):
        ds = Pool(WORKLOADS[name], 4 * bs, args.batches * bs)
        loaders = {
            "torch": lambda: TorchLoader(ds, batch_size=bs, num_workers=w),
            "torchfeed shm": lambda: torchfeed.DataLoader(ds, batch_size=bs, num_workers=w),
            "torchfeed torch": lambda: torchfeed.DataLoader(ds, batch_size=bs, num_workers=w,
                                                            transport="torch"),
            "torch w=0": lambda: TorchLoader(ds, batch_size=bs, num_workers=0),
        }
        runs = {k: [] for k in loaders}
        for _ in range(args.runs):
            for k, f in loaders.items():  # interleaved, so drift hits all alike
                runs[k].append(measure(f, args.batches))
        med = {k: [statistics.median(r[i] for r in v) for i in range(3)]
               for k, v in runs.items()}
        base = med["torch"]
        for k, (rate, cpu, first) in med.items():
            print(f"{name:<14}{k:<16}{rate:>10.1f}{cpu * 1e6:>9.0f} us{first * 1e3:>8.0f} ms"
                  f"{rate / base[0]:>9.2f}{cpu / base[1]:>11.3f}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
