"""torch's and torchfeed's DataLoader with ``pin_memory=True``, feeding a CUDA device.

The side-by-side bench runs on CPU-only machines, where nothing can be pinned.
This script needs CUDA: every batch goes through the loader's pin-memory
thread, then to the GPU with ``non_blocking=True``, as a training loop does.
Both loaders get the same arguments and run in rotated order; each figure is
the median of ``--repeats`` runs, and the ratio is taken within this one run.

It also checks what a user relies on: every tensor the loader hands over is
pinned, and the batches equal torch's, byte for byte (checksums of the first
batches of one run of each).

    python benchmarks/pin_memory_cuda.py --workloads image,numpy --num-workers 2,4
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# Runnable from a checkout without installing torchfeed.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import torch  # noqa: E402
import torch.utils.data  # noqa: E402

import torchfeed  # noqa: E402
from torchfeed.bench.workloads import WORKLOADS  # noqa: E402

LOADERS = {"torch": torch.utils.data.DataLoader, "torchfeed": torchfeed.DataLoader}
CHECKED_BATCHES = 4


def _tensors(batch):
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from _tensors(value)


def _checksum(batch) -> list[tuple]:
    return [(tuple(t.shape), str(t.dtype), float(t.double().sum()), float(t.double().square().sum()))
            for t in _tensors(batch)]


def one_run(name: str, workload, num_workers: int, batches: int, check: bool):
    """Seconds per batch after the first, main-process CPU per batch, checksums."""
    dataset = workload.dataset((batches + 1) * workload.batch_size)
    loader = LOADERS[name](dataset, batch_size=workload.batch_size, num_workers=num_workers,
                           collate_fn=workload.collate_fn, pin_memory=True)
    sums, unpinned = [], 0
    it = iter(loader)
    first = next(it)
    torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    count = 0
    for i, batch in enumerate(it):
        if check and i < CHECKED_BATCHES:
            sums.append(_checksum(batch))
            unpinned += sum(not t.is_pinned() for t in _tensors(batch))
        on_gpu = [t.to("cuda", non_blocking=True) for t in _tensors(batch)]
        del on_gpu, batch
        count += 1
    torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    unpinned += sum(not t.is_pinned() for t in _tensors(first))
    del first, it, loader
    return count / wall, cpu / count * 1e6, sums, unpinned


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="image,numpy,small",
                        help="comma-separated names from torchfeed.bench's workloads")
    parser.add_argument("--num-workers", default="2,4", help="comma-separated (default 2,4)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per cell; medians (default 5)")
    parser.add_argument("--batches", type=int, default=None,
                        help="timed batches per run (default: half the workload's own)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("pin_memory_cuda.py needs a CUDA device; this machine has none", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
          f"{os.cpu_count()} CPUs; median of {args.repeats} rotated runs per cell")
    print(f"{'workload':<10} {'workers':>7} | {'torch b/s':>10} {'tf b/s':>10} {'tf/torch':>8} | "
          f"{'torch CPU us/b':>14} {'tf CPU us/b':>12} {'tf/torch':>8} | checks")
    failures = 0
    for wname in args.workloads.split(","):
        workload = WORKLOADS[wname]
        batches = args.batches or max(50, workload.batches // 2)
        for num_workers in (int(n) for n in args.num_workers.split(",")):
            rates: dict[str, list] = {n: [] for n in LOADERS}
            cpus: dict[str, list] = {n: [] for n in LOADERS}
            sums: dict[str, list] = {}
            unpinned = 0
            order = list(LOADERS)
            for r in range(args.repeats):
                for name in order[r % 2:] + order[:r % 2]:
                    rate, cpu, s, u = one_run(name, workload, num_workers, batches, check=r == 0)
                    rates[name].append(rate)
                    cpus[name].append(cpu)
                    if r == 0:
                        sums[name] = s
                        unpinned += u if name == "torchfeed" else 0
            same = sums["torch"] == sums["torchfeed"]
            checks = f"{'same batches' if same else 'BATCHES DIFFER'}, " \
                     f"{'all pinned' if not unpinned else f'{unpinned} UNPINNED'}"
            failures += (not same) + (unpinned > 0)
            t, f = statistics.median(rates["torch"]), statistics.median(rates["torchfeed"])
            tc, fc = statistics.median(cpus["torch"]), statistics.median(cpus["torchfeed"])
            print(f"{wname:<10} {num_workers:>7} | {t:>10.1f} {f:>10.1f} {f / t:>7.2f}x | "
                  f"{tc:>14.0f} {fc:>12.0f} {fc / tc:>7.2f}x | {checks}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
