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
  - memory: the peak, over the run, of the PSS of the main process plus its
    workers (``psutil``'s ``memory_full_info().pss``), sampled after every
    batch while the consumer holds it (``--memory-runs``, default 5). PSS
    splits a page mapped by several processes between them, so a slot mapped
    by a worker and by the main process counts once. For torchfeed, the
    slots at its peak are printed too (``stats()["shm"]``): how many, and
    how many bytes the free ones kept for reuse (``reuse_bytes``).
    PSS only sees pages some process maps; torch's batches waiting in its
    queues are shared-memory files that only a descriptor holds. The second
    memory figure adds those (``unmapped_shm``), sampled at the same moments.

  A timed run moves ``--run-mib`` of batches (at least 6 batches, at most
  200; a memory run at most 40), so the huge sizes get few batches per run;
  slot creation, paid in each run's first batches, is counted in.
* ``idle`` row: persistent workers, an epoch of batches that swing between
  4 KiB and 64 MiB; then, with the loader idle, the PSS of the main process
  and its workers, and what torchfeed's slots still hold (the arenas'
  resident bytes). At most one slot of at most 1 MiB per worker should stay.

The machine's load (``os.getloadavg``) before and after is printed: timings
on a shared machine move with it, memory much less.

    python benchmarks/transport_memory.py               # the whole sweep (~15 min on 2 cores)
    python benchmarks/transport_memory.py --sizes 256 512 --worker-rows 0 --no-idle
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


def pss_of(p) -> int:
    try:
        return p.memory_full_info().pss
    except (psutil.Error, AttributeError):
        return 0


def tree_pss() -> int:
    me = psutil.Process()
    return sum(pss_of(p) for p in [me, *me.children(recursive=True)])


def unmapped_shm() -> int:
    """Resident bytes of shared-memory files the process tree holds by
    descriptor but no process of it maps: torch's batches waiting in its
    queues (a worker's resource sharer holds their descriptors until the main
    process asks). PSS cannot see them."""
    me = psutil.Process()
    held: dict = {}
    mapped: set = set()
    for p in [me, *me.children(recursive=True)]:
        try:
            for fd in os.listdir(f"/proc/{p.pid}/fd"):
                path = f"/proc/{p.pid}/fd/{fd}"
                target = os.readlink(path)
                if target.startswith(("/dev/shm/", "/memfd:")):
                    st = os.stat(path)
                    held[st.st_ino] = st.st_blocks * 512
            with open(f"/proc/{p.pid}/maps") as f:
                for line in f:
                    fields = line.split(None, 5)
                    if len(fields) > 5 and fields[5].startswith(("/dev/shm/", "/memfd:")):
                        mapped.add(int(fields[4]))
        except OSError:
            continue
    return sum(n for ino, n in held.items() if ino not in mapped)


def batches_per_run(mib: int, run_mib: int) -> int:
    return max(6, min(200, run_mib // mib))


def one_run(cls, mib: int, workers: int, n: int, sample: bool):
    if sample:  # reading PSS takes milliseconds; the peak comes within a few dozen batches
        n = min(n, SAMPLED_BATCHES)
    """(batches/s, peak PSS, peak PSS + unmapped shared memory, torchfeed's
    slots at its PSS peak or None)."""
    loader = cls(Full(4 * n, mib * MIB // 4), batch_size=4, num_workers=workers)
    gc.collect()
    peak, peak_all, at_peak = 0, 0, None
    start = time.perf_counter()
    for batch in loader:
        if sample:
            pss = tree_pss()
            peak_all = max(peak_all, pss + unmapped_shm())
            if pss > peak:
                peak = pss
                if cls is torchfeed.DataLoader:
                    shm = loader.stats()["shm"]
                    at_peak = (shm["slots"], shm["bytes"], shm["reuse_bytes"])
        del batch
    rate = n / (time.perf_counter() - start)
    del loader
    gc.collect()
    return rate, peak, peak_all, at_peak


def measure(mib: int, workers: int, args) -> dict:
    n = batches_per_run(mib, args.run_mib)
    rates = {k: [] for k in LOADERS}
    peaks: dict = {k: [] for k in LOADERS}
    slots: list = []
    names = list(LOADERS)
    for r in range(args.timed_runs + args.memory_runs):
        sample = r >= args.timed_runs
        for name in names[r % 2:] + names[:r % 2]:  # rotate who goes first
            rate, peak, peak_all, at_peak = one_run(LOADERS[name], mib, workers, n, sample)
            if sample:
                peaks[name].append((peak, peak_all))
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
          f"| {ta:.0f} | {fa:.0f} | {(fa - ta) / mib:+.1f} batches | {held} |", flush=True)


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
    ap.add_argument("--no-idle", action="store_true")
    ap.add_argument("--idle-batches", type=int, default=24)
    args = ap.parse_args(argv)
    print(f"# load before: {os.getloadavg()}; {os.cpu_count()} CPUs, torch {torch.__version__}; "
          f"medians of {args.timed_runs} timed and {args.memory_runs} memory runs")
    print("| batch | workers | batches/run | torch batches/s | torchfeed | ratio | torch peak PSS "
          "MiB | torchfeed | difference | torch peak PSS + unmapped shm | torchfeed | difference "
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
