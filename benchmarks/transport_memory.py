"""Speed and memory of the batch transport, 1 MiB to 512 MiB batches:
torchfeed.DataLoader against torch's, in one run.

Every setup builds batches of 4 float32 samples made by ``torch.full`` (a
batch of B MiB is 4 samples of B/4 MiB), ``batch_size=4``, the default
collate, the default ``prefetch_factor`` (2), and a consumer that keeps
nothing: it drops each batch as soon as it has it. torch's loader and
torchfeed's run in one invocation, alternating, the first of each pair
rotating from run to run; the medians are reported.

* ``sweep`` rows: batches of 1, 16, 64, 128, 256 and 512 MiB (``--sizes``)
  at ``num_workers=2``, then 256 MiB at 1 and 4 workers (``--worker-rows``).
  Each row measures two things, in separate runs:

  - speed: batches/s from ``iter()`` to the last batch, in runs that sample
    nothing (``--timed-runs``, default 3);
  - memory: the peak, over the run, of two figures for the main process
    plus its workers, both sampled after every batch while the consumer
    holds it (``--memory-runs``, default 5):

    * PSS (``/proc/<pid>/smaps``): a page mapped by several processes is
      split between them, so a slot mapped by a worker and by the main
      process counts once. But PSS counts only pages some process has in
      its page tables. It misses a batch torch's worker has sent and
      unmapped (only a descriptor holds it until the main process asks
      for it), a batch the main process has mapped but not read, and
      shared memory allocated but not yet written (``posix_fallocate``).
    * held: what the loader holds in memory, each thing once. The PSS of
      every mapping that is not shared memory, plus the allocated bytes
      (``st_blocks``) of every shared-memory object (``/dev/shm`` file,
      memfd) a process of the tree holds by descriptor or by mapping,
      whether any page of it is mapped or not. This is the figure that
      compares the two loaders like for like.

    For torchfeed, the slots at its PSS peak are printed too
    (``stats()["shm"]``): how many, how many bytes, and how many of them
    the free ones kept for reuse (``reuse_bytes``).

  A timed run moves ``--run-mib`` of batches (at least ``--min-batches``,
  default 6, at most 200; a memory run at most 40), so the huge sizes get
  few batches per run and each worker's first batches, which make its
  slots, weigh in the rate as they do in a short epoch. ``--min-batches
  24`` measures the rate a long epoch settles at.
* ``idle`` row: persistent workers, an epoch of batches that swing between
  4 KiB and 64 MiB; then, with the loader idle, the PSS of the main process
  and its workers, and what torchfeed's slots still hold (the arenas'
  resident bytes). At most one slot of at most 1 MiB per worker should stay.

The machine's load (``os.getloadavg``) before and after is printed: timings
on a shared machine move with it, memory much less.

    python benchmarks/transport_memory.py               # the whole sweep (~15 min on 2 cores)
    python benchmarks/transport_memory.py --sizes 256 512 --worker-rows 0 --no-idle
    python benchmarks/transport_memory.py --sizes 128 256 512 --min-batches 24 --memory-runs 0 --no-idle
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import psutil
import torch
import torch.utils.data as tud

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torchfeed  # noqa: E402

MIB = 1 << 20
SAMPLED_BATCHES = 40  # at most, in a memory run
LOADERS = {"torch": tud.DataLoader, "torchfeed": torchfeed.DataLoader}


class Full(tud.Dataset):
    """``n`` float32 samples of ``nbytes`` each (``torch.full``)."""

    def __init__(self, n, nbytes):
        self.n, self.numel = n, nbytes // 4

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((self.numel,), float(i), dtype=torch.float32)


class Swing(Full):
    """Every 8th batch of 4 is big, the others 4 KiB a sample."""

    def __getitem__(self, i):
        if (i // 4) % 8:
            return torch.full((1024,), float(i), dtype=torch.float32)  # 4 KiB
        return super().__getitem__(i)


SHARED_MEMORY = ("/dev/shm/", "/memfd:")


def _segment(path: str, held: dict) -> None:
    """Note the shared-memory object at ``path`` (a /proc link) and its allocated bytes."""
    try:
        st = os.stat(path)
    except OSError:
        return
    held[(st.st_dev, st.st_ino)] = st.st_blocks * 512


def tree_memory() -> tuple[int, int]:
    """``(PSS, held)`` of this process and its children, in bytes (see the
    module docstring)."""
    me = psutil.Process()
    pss = private = 0
    segments: dict = {}
    for p in [me, *me.children(recursive=True)]:
        pid = p.pid
        try:
            with open(f"/proc/{pid}/smaps") as f:
                shared = False
                for line in f:
                    first = line.split(None, 1)[0]
                    if not first.endswith(":"):  # a mapping's header line
                        fields = line.split(None, 5)
                        shared = len(fields) > 5 and fields[5].startswith(SHARED_MEMORY)
                        if shared:
                            _segment(f"/proc/{pid}/map_files/{first}", segments)
                    elif first == "Pss:":
                        n = int(line.split()[1]) * 1024
                        pss += n
                        private += 0 if shared else n
            for fd in os.listdir(f"/proc/{pid}/fd"):
                path = f"/proc/{pid}/fd/{fd}"
                try:
                    if os.readlink(path).startswith(SHARED_MEMORY):
                        _segment(path, segments)
                except OSError:
                    continue
        except OSError:  # a worker that just exited
            continue
    return pss, private + sum(segments.values())


def tree_pss() -> int:
    return tree_memory()[0]


def batches_per_run(mib: int, run_mib: int, min_batches: int = 6) -> int:
    return max(min_batches, min(200, run_mib // mib))


def one_run(cls, mib: int, workers: int, n: int, sample: bool):
    """(batches/s, peak PSS, peak held, torchfeed's slots at its PSS peak or None)."""
    if sample:  # reading smaps takes milliseconds; the peak comes within a few dozen batches
        n = min(n, SAMPLED_BATCHES)
    loader = cls(Full(4 * n, mib * MIB // 4), batch_size=4, num_workers=workers)
    gc.collect()
    peak, peak_held, at_peak = 0, 0, None
    start = time.perf_counter()
    for batch in loader:
        if sample:
            pss, held = tree_memory()
            peak_held = max(peak_held, held)
            if pss > peak:
                peak = pss
                if cls is torchfeed.DataLoader:
                    shm = loader.stats()["shm"]
                    at_peak = (shm["slots"], shm["bytes"], shm["reuse_bytes"])
        del batch
    rate = n / (time.perf_counter() - start)
    del loader
    gc.collect()
    return rate, peak, peak_held, at_peak


def measure(mib: int, workers: int, args) -> dict:
    n = batches_per_run(mib, args.run_mib, args.min_batches)
    rates = {k: [] for k in LOADERS}
    peaks: dict = {k: [] for k in LOADERS}
    slots: list = []
    names = list(LOADERS)
    for r in range(args.timed_runs + args.memory_runs):
        sample = r >= args.timed_runs
        for name in names[r % 2:] + names[:r % 2]:  # rotate who goes first
            rate, peak, peak_held, at_peak = one_run(LOADERS[name], mib, workers, n, sample)
            if sample:
                peaks[name].append((peak, peak_held))
            else:
                rates[name].append(rate)
            if sample and at_peak is not None:
                slots.append(at_peak)
    out = {"mib": mib, "workers": workers, "batches": n}
    nan = float("nan")
    for name in LOADERS:
        p = peaks[name]
        out[name] = (statistics.median(rates[name]) if rates[name] else nan,
                     statistics.median(a for a, _ in p) / MIB if p else nan,
                     statistics.median(b for _, b in p) / MIB if p else nan)
    out["slots"] = tuple(statistics.median(s[k] for s in slots) for k in range(3)) if slots else None
    return out


def print_row(row: dict) -> None:
    (tr, tp, ta), (fr, fp, fa) = row["torch"], row["torchfeed"]
    mib = row["mib"]
    slots = row["slots"]
    held = (f"{slots[0]:g} slots, {slots[1] / MIB:.0f} MiB, {slots[2] / MIB:.0f} MiB for reuse"
            if slots else "-")
    print(f"| {mib} MiB | {row['workers']} | {row['batches']} | {tr:.2f} | {fr:.2f} | "
          f"{fr / tr:.2f}x | {tp:.0f} | {fp:.0f} | {fp - tp:+.0f} ({(fp - tp) / mib:+.1f} batches) "
          f"| {ta:.0f} | {fa:.0f} | {fa - ta:+.0f} ({(fa - ta) / mib:+.1f} batches) | {held} |",
          flush=True)


def run_idle(cls, args):
    gc.collect()
    loader = cls(Swing(args.idle_batches * 4, 64 * MIB // 4), batch_size=4, num_workers=2,
                 persistent_workers=True)
    for batch in loader:
        del batch
    gc.collect()
    time.sleep(0.5)
    held = tree_pss()
    slots = 0
    channel = getattr(getattr(loader, "_iterator", None), "_channel", None)
    for fd in getattr(channel, "_fds", ()):  # what the arenas hold in memory now
        slots += os.fstat(fd).st_blocks * 512
    del loader
    return held, slots


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[1, 16, 64, 128, 256, 512],
                    help="batch sizes in MiB at num_workers=2")
    ap.add_argument("--worker-rows", type=int, nargs="*", default=[1, 4],
                    help="numbers of workers for the 256 MiB rows (0: none)")
    ap.add_argument("--worker-rows-mib", type=int, default=256)
    ap.add_argument("--timed-runs", type=int, default=3)
    ap.add_argument("--memory-runs", type=int, default=5)
    ap.add_argument("--run-mib", type=int, default=1536, help="MiB of batches per run")
    ap.add_argument("--min-batches", type=int, default=6, help="batches per run, at least")
    ap.add_argument("--no-idle", action="store_true")
    ap.add_argument("--idle-batches", type=int, default=24)
    args = ap.parse_args(argv)
    print(f"# load before: {os.getloadavg()}; {os.cpu_count()} CPUs, torch {torch.__version__}; "
          f"medians of {args.timed_runs} timed and {args.memory_runs} memory runs")
    print("| batch | workers | batches/run | torch batches/s | torchfeed | ratio | torch peak PSS "
          "MiB | torchfeed | difference | torch peak held MiB | torchfeed | difference "
          "| torchfeed at its PSS peak |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    setups = [(mib, 2) for mib in args.sizes]
    setups += [(args.worker_rows_mib, w) for w in args.worker_rows if w > 0]
    for mib, workers in setups:
        print_row(measure(mib, workers, args))
    if not args.no_idle:
        idle = {k: [] for k in LOADERS}
        for _ in range(args.memory_runs):
            for name, cls in LOADERS.items():
                idle[name].append(run_idle(cls, args))
        t = statistics.median(h for h, _ in idle["torch"]) / MIB
        f = statistics.median(h for h, _ in idle["torchfeed"]) / MIB
        slots = statistics.median(s for _, s in idle["torchfeed"]) / MIB
        print(f"idle after a swinging epoch (persistent workers): PSS torch {t:.0f} MiB, "
              f"torchfeed {f:.0f} MiB ({f - t:+.0f}); torchfeed's slots hold {slots:.1f} MiB")
    print(f"# load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
