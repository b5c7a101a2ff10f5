"""Memory of the batch transport: torchfeed.DataLoader against torch's, in one run.

Two rows, each measured for torch's DataLoader and torchfeed's in the same
invocation, alternating, ``--runs`` times (the median is reported):

* ``big``: 64 MiB batches (``--batch-mib``), ``num_workers=2``,
  ``prefetch_factor=2``, a consumer that keeps nothing. Reported: the peak,
  sampled every few milliseconds, of PSS summed over the main process and its
  workers (a page mapped by two processes counts once) plus the machine's
  ``Shmem`` growth over the run (shared memory no process maps any more, such
  as torch's segments in flight, still costs RAM).
* ``idle``: persistent workers, batches that swing between 4 KiB and 64 MiB;
  after the epoch, with the loader idle, the same sum, and the shared memory
  torchfeed's slots still hold (the arenas' resident bytes).

    python benchmarks/transport_memory.py --help
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import threading
import time

import psutil
import torch
import torch.utils.data as tud

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torchfeed  # noqa: E402

MIB = 1 << 20


class Big(tud.Dataset):
    def __init__(self, n, nbytes, swing=False):
        self.n, self.nbytes, self.swing = n, nbytes, swing

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.swing and i % 8:
            return torch.full((1024,), i, dtype=torch.float32)  # 4 KiB
        return torch.full((self.nbytes // 4,), i, dtype=torch.float32)


def shmem() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    return 0


def tree_pss() -> int:
    me = psutil.Process()
    total = 0
    for p in [me, *me.children(recursive=True)]:
        try:
            total += p.memory_full_info().pss
        except (psutil.Error, AttributeError):
            pass
    return total


class Sampler(threading.Thread):
    """Samples PSS + Shmem growth until stopped; keeps the peak."""

    def __init__(self, shmem0):
        super().__init__(daemon=True)
        self.shmem0, self.stop = shmem0, threading.Event()
        self.peak = self.peak_pss = self.peak_shm = 0

    def run(self):
        while not self.stop.is_set():
            pss, shm = tree_pss(), max(0, shmem() - self.shmem0)
            self.peak = max(self.peak, pss + shm)
            self.peak_pss, self.peak_shm = max(self.peak_pss, pss), max(self.peak_shm, shm)
            time.sleep(0.005)


def run_big(cls, args):
    gc.collect()
    base = shmem()
    loader = cls(Big(args.batches, args.batch_mib * MIB), batch_size=None, num_workers=2,
                 prefetch_factor=2)
    sampler = Sampler(base)
    sampler.start()
    for batch in loader:
        del batch
    sampler.stop.set()
    sampler.join()
    del loader
    return sampler.peak, sampler.peak_pss, sampler.peak_shm


def run_idle(cls, args):
    gc.collect()
    base = shmem()
    loader = cls(Big(args.batches * 4, args.batch_mib * MIB, swing=True), batch_size=None,
                 num_workers=2, prefetch_factor=2, persistent_workers=True)
    for batch in loader:
        del batch
    gc.collect()
    time.sleep(0.5)
    held = tree_pss() + max(0, shmem() - base)
    slots = 0
    channel = getattr(getattr(loader, "_iterator", None), "_channel", None)
    for fd in getattr(channel, "_fds", ()):  # what the arenas hold in memory now
        slots += os.fstat(fd).st_blocks * 512
    del loader
    return held, slots


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-mib", type=int, default=64)
    ap.add_argument("--batches", type=int, default=24)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    loaders = {"torch": tud.DataLoader, "torchfeed": torchfeed.DataLoader}
    big = {k: [] for k in loaders}
    idle = {k: [] for k in loaders}
    for _ in range(args.runs):
        for name, cls in loaders.items():
            big[name].append(run_big(cls, args))
            idle[name].append(run_idle(cls, args))
    print(f"# {args.batch_mib} MiB batches, num_workers=2, prefetch_factor=2, median of "
          f"{args.runs} runs, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print(f"{'row':30s} {'torch':>10s} {'torchfeed':>10s} {'diff':>10s}  (MiB; PSS + Shmem)")
    for k, what in enumerate(("big: peak PSS + Shmem", "big: peak PSS", "big: peak Shmem")):
        t = statistics.median(r[k] for r in big["torch"]) / MIB
        f = statistics.median(r[k] for r in big["torchfeed"]) / MIB
        print(f"{what:30s} {t:10.0f} {f:10.0f} {f - t:+10.0f}  "
              f"({(f - t) / args.batch_mib:+.1f} batches)")
    t = statistics.median(h for h, _ in idle["torch"]) / MIB
    f = statistics.median(h for h, _ in idle["torchfeed"]) / MIB
    slots = statistics.median(s for _, s in idle["torchfeed"]) / MIB
    print(f"{'idle after a swinging epoch':30s} {t:10.0f} {f:10.0f} {f - t:+10.0f}  "
          f"(torchfeed's slots hold {slots:.0f} MiB)")


if __name__ == "__main__":
    main()
