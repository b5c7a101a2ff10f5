"""Memory of the batch transport: torchfeed.DataLoader against torch's, in one run.

Two rows, each measured for torch's DataLoader and torchfeed's in the same
invocation, alternating, ``--runs`` times (the median is reported):

* ``big``: 64 MiB batches (``--batch-mib``), ``num_workers=2``,
  ``prefetch_factor=2``, a consumer that keeps nothing. Reported: the peak,
  sampled every few milliseconds, of PSS summed over the main process and its
  workers (a page mapped by two processes counts once) plus the machine's
  ``Shmem`` growth over the run (shared memory no process maps any more, such
  as torch's segments in flight, still costs RAM). With ``--step-ms``, the
  consumer holds each batch that long first, as a training step would, so
  the workers run ahead up to ``prefetch_factor`` batches each. Also printed:
  where the peak sample's memory was (the main process's PSS, the workers',
  Shmem) and, for torchfeed, the slots alive then (``loader.stats()``).
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


def pss_of(p) -> int:
    try:
        return p.memory_full_info().pss
    except (psutil.Error, AttributeError):
        return 0


def tree_pss() -> int:
    me = psutil.Process()
    return sum(pss_of(p) for p in [me, *me.children(recursive=True)])


class Sampler(threading.Thread):
    """Samples PSS + Shmem growth until stopped; keeps the peak, and where the
    peak sample's memory was: ``(main PSS, workers' PSS, Shmem, slots, slot bytes)``."""

    def __init__(self, shmem0, loader=None):
        super().__init__(daemon=True)
        self.shmem0, self.stop = shmem0, threading.Event()
        self.loader = loader  # torchfeed's, whose stats() count the slots
        self.peak = self.peak_pss = self.peak_shm = 0
        self.at_peak = (0, 0, 0, 0, 0)

    def run(self):
        me = psutil.Process()
        while not self.stop.is_set():
            main = pss_of(me)
            workers = sum(pss_of(p) for p in me.children(recursive=True))
            pss, shm = main + workers, max(0, shmem() - self.shmem0)
            if pss + shm > self.peak:
                slots = self.loader.stats()["shm"] if self.loader is not None else {}
                self.at_peak = (main, workers, shm, slots.get("slots", 0), slots.get("bytes", 0))
            self.peak = max(self.peak, pss + shm)
            self.peak_pss, self.peak_shm = max(self.peak_pss, pss), max(self.peak_shm, shm)
            time.sleep(0.005)


def run_big(cls, args):
    gc.collect()
    base = shmem()
    loader = cls(Big(args.batches, args.batch_mib * MIB), batch_size=None, num_workers=2,
                 prefetch_factor=2)
    sampler = Sampler(base, loader if cls is torchfeed.DataLoader else None)
    sampler.start()
    for batch in loader:
        if args.step_ms:
            time.sleep(args.step_ms / 1000)
        del batch
    sampler.stop.set()
    sampler.join()
    del loader
    return (sampler.peak, sampler.peak_pss, sampler.peak_shm, *sampler.at_peak)


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
    ap.add_argument("--step-ms", type=float, default=0.0,
                    help="the consumer holds each batch this long (a training step)")
    args = ap.parse_args(argv)
    loaders = {"torch": tud.DataLoader, "torchfeed": torchfeed.DataLoader}
    big = {k: [] for k in loaders}
    idle = {k: [] for k in loaders}
    for _ in range(args.runs):
        for name, cls in loaders.items():
            big[name].append(run_big(cls, args))
            idle[name].append(run_idle(cls, args))
    print(f"# {args.batch_mib} MiB batches, num_workers=2, prefetch_factor=2, median of "
          f"{args.runs} runs, {os.cpu_count()} CPUs, torch {torch.__version__}"
          + (f", a {args.step_ms:g} ms step per batch" if args.step_ms else ""))
    print(f"{'row':30s} {'torch':>10s} {'torchfeed':>10s} {'diff':>10s}  (MiB; PSS + Shmem)")
    for k, what in enumerate(("big: peak PSS + Shmem", "big: peak PSS", "big: peak Shmem")):
        t = statistics.median(r[k] for r in big["torch"]) / MIB
        f = statistics.median(r[k] for r in big["torchfeed"]) / MIB
        print(f"{what:30s} {t:10.0f} {f:10.0f} {f - t:+10.0f}  "
              f"({(f - t) / args.batch_mib:+.1f} batches)")
    for name in loaders:
        main, workers, shm, slots, nbytes = (statistics.median(r[k] for r in big[name])
                                             for k in range(3, 8))
        print(f"{'  at the peak, ' + name:30s} main PSS {main / MIB:.0f}, workers' PSS "
              f"{workers / MIB:.0f}, Shmem {shm / MIB:.0f}"
              + (f"; {slots:g} slots alive, {nbytes / MIB:.0f} MiB" if name == "torchfeed" else
                 f" ({shm / MIB / args.batch_mib:.1f} batches' segments)"))
    t = statistics.median(h for h, _ in idle["torch"]) / MIB
    f = statistics.median(h for h, _ in idle["torchfeed"]) / MIB
    slots = statistics.median(s for _, s in idle["torchfeed"]) / MIB
    print(f"{'idle after a swinging epoch':30s} {t:10.0f} {f:10.0f} {f - t:+10.0f}  "
          f"(torchfeed's slots hold {slots:.0f} MiB)")


if __name__ == "__main__":
    main()
