"""One copy of the dataset per machine: ``share_dataset=True`` against torch's
DataLoader and torchfeed without it, under fork, spawn and forkserver, in one run.

The workload (issue 34): a list of ``--records`` COCO-like annotation dicts
(ids, a 4-float bbox, a 16-float polygon: about 1 KiB of Python objects each)
held by the dataset as ``dataset.records``, read in shuffled order for one
epoch by ``--workers`` persistent workers, ``--batch-size`` samples a batch;
a sample is a tensor of the record's 23 numbers.  Each (start method, loader)
runs in a fresh Python process, so no run inherits another's heap.

Per run, after the epoch, with the workers still alive:

* each worker's private memory: USS (``Private_Clean + Private_Dirty`` of
  ``/proc/<pid>/smaps``), less the pages of ``torchfeed.share``'s buffers,
  which are the one copy every process maps (a page of it that only one
  worker has read counts as that worker's in USS; the raw USS is printed too);
* total: the PSS of the main process and its workers, every mapping but the
  shared buffers, plus each shared buffer's allocated bytes once (its pages
  are held whether or not a process has them mapped), against the
  one-process footprint: the same process's PSS once it has built the
  records, before any loader exists;
* first batch: seconds from ``iter()`` to the first batch, which comes
  ``--setup`` seconds after the loader is built (the training script's own
  setup: building the model, loading a checkpoint; by default as long as
  ``pickle.dumps`` of the records takes, measured first), the same for a
  ``--small``-record dataset with the same loader, and against torchfeed
  without sharing.  ``share_dataset=True`` starts sharing when the loader is
  built, in a thread; the table says how long that took;
* throughput: samples/s from the first batch to the last, and, less moved by
  other jobs on a busy machine, the CPU time the workers and the main process
  spent per sample meanwhile.

Then, in a process of its own, ``torchfeed.share(records)`` against
``pickle.dumps(records)`` (median of ``--cost-runs``).

    python benchmarks/share_dataset.py                       # 1,000,000 records (long on 2 cores)
    python benchmarks/share_dataset.py --records 100000 --methods fork   # a quick look
    python benchmarks/share_dataset.py --report figures.json   # the table of a --json run again
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import statistics
import subprocess
import sys
import time

import torch

import torchfeed

LOADERS = ("torch", "torchfeed", "share")
LABELS = {"torch": "torch", "torchfeed": "torchfeed", "share": "torchfeed share_dataset=True"}
MiB = 2**20
SHARED_BUFFER = "memfd:torchfeed-share"


# -- the workload ----------------------------------------------------------------------
def annotation(i: int) -> dict:
    return {"id": i, "image_id": i // 5, "category_id": i % 80,
            "bbox": [float(i % 640), float(i % 480), 32.0 + i % 7, 24.0 + i % 5],
            "segmentation": [[float((i + j) % 512) for j in range(16)]],
            "area": float(i % 1000), "iscrowd": 0}


class Annotations(torch.utils.data.Dataset):
    """``dataset.records``; a sample is a tensor of its record's 23 numbers."""

    def __init__(self, records):
        self.records = records

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        r = self.records[i]
        return torch.tensor([r["id"], r["image_id"], r["category_id"], *r["bbox"],
                             *r["segmentation"][0]])


# -- memory readings ---------------------------------------------------------------------
def smaps_figures(pid: int, buffers: dict) -> dict:
    """PSS and private bytes of ``pid``, with and without shared buffers; notes
    each shared buffer (inode -> size) in ``buffers``."""
    pss = private = buffer_private = 0
    in_buffer = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if not head.endswith(":"):
                fields = line.split()
                in_buffer = SHARED_BUFFER in line
                if in_buffer:
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    buffers.setdefault(fields[4], end - start)
            elif head == "Pss:" and not in_buffer:
                pss += int(line.split()[1]) * 1024
            elif head in ("Private_Clean:", "Private_Dirty:"):
                kib = int(line.split()[1]) * 1024
                private += kib
                buffer_private += kib if in_buffer else 0
    for fd in os.listdir(f"/proc/{pid}/fd"):  # buffers held by descriptor, mapped or not
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if SHARED_BUFFER in os.readlink(path):
                st = os.stat(path)
                buffers[str(st.st_ino)] = st.st_blocks * 512
        except OSError:
            pass
    return {"pss": pss, "uss": private, "own_private": private - buffer_private}


def tree_memory(main_pid: int, worker_pids: list) -> dict:
    buffers: dict = {}
    main = smaps_figures(main_pid, buffers)
    workers = [smaps_figures(pid, buffers) for pid in worker_pids]
    total = main["pss"] + sum(w["pss"] for w in workers) + sum(buffers.values())
    return {"main": main, "workers": workers, "buffers": sum(buffers.values()), "total": total}


def own_pss() -> int:
    return smaps_figures(os.getpid(), {})["pss"]


# -- one run, in a process of its own ----------------------------------------------------------
def child(method: str, loader_name: str, records: int, workers: int, batch_size: int,
          setup: float) -> dict:
    dataset = Annotations([annotation(i) for i in range(records)])
    gc.collect()
    footprint = own_pss()
    common = dict(batch_size=batch_size, shuffle=True, num_workers=workers,
                  persistent_workers=True, multiprocessing_context=method,
                  generator=torch.Generator().manual_seed(0))
    if loader_name == "torch":
        loader = torch.utils.data.DataLoader(dataset, **common)
    else:
        loader = torchfeed.DataLoader(dataset, share_dataset=loader_name == "share", **common)
    time.sleep(setup)  # the script's own setup, after it built the loader
    began = time.perf_counter()
    it = iter(loader)
    next(it)
    first = time.perf_counter() - began
    pids = [w.pid for w in it._workers]
    cpu = cpu_seconds(pids)
    seen = batch_size
    for batch in it:
        seen += len(batch)
    epoch = time.perf_counter() - began
    cpu = cpu_seconds(pids) - cpu
    assert seen == records, (seen, records)
    memory = tree_memory(os.getpid(), pids)
    sharing = (sum(f.get("seconds", 0.0) for f in loader.stats()["large_attributes"] if f["shared"])
               if loader_name == "share" else 0.0)
    del it, loader
    return {"method": method, "loader": loader_name, "records": records,
            "footprint": footprint, "first_batch": first, "sharing": sharing, "epoch": epoch,
            "throughput": (records - batch_size) / max(epoch - first, 1e-9),
            "cpu_per_sample": cpu / max(records - batch_size, 1), **memory}


def cpu_seconds(pids: list) -> float:
    """CPU seconds (user and system) of this process and of ``pids`` so far."""
    import psutil

    total = time.process_time()
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


def cost(records: int, runs: int) -> dict:
    """``torchfeed.share(records)`` against ``pickle.dumps(records)``, medians."""
    data = [annotation(i) for i in range(records)]
    pickled, shared = [], []
    for _ in range(runs):
        began = time.perf_counter()
        blob = pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL)
        pickled.append(time.perf_counter() - began)
        del blob
        began = time.perf_counter()
        copy = torchfeed.share(data)
        shared.append(time.perf_counter() - began)
        del copy
        gc.collect()
    return {"pickle": statistics.median(pickled), "share": statistics.median(shared)}


def median_run(runs: list) -> dict:
    """One row from several runs of a setup: the median of each figure; the
    workers' breakdown of the run with the median total."""
    for run in runs:
        run["worker_own"] = max(w["own_private"] for w in run["workers"])
        run["worker_uss"] = max(w["uss"] for w in run["workers"])
    row = dict(sorted(runs, key=lambda r: r["total"])[len(runs) // 2])
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            row[key] = statistics.median(r[key] for r in runs)
    row["runs"] = len(runs)
    return row


def run_child(*args: str, timeout: float) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True,
                         text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"run {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- the table -----------------------------------------------------------------------------
def report(rows: list, small: dict, costs: dict, args) -> str:
    lines = [f"share_dataset benchmark: {args.records:,} COCO-like annotation dicts, "
             f"{args.workers} persistent workers, batch {args.batch_size}, shuffled, one epoch; "
             f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}",
             "",
             f"iter() {args.setup:.1f} s after the loader was built",
             "",
             "| start method | loader | worker private after the epoch (raw USS) | total PSS "
             "(x one process) | first batch (x 1,000 records) | samples/s (x torchfeed) "
             "| CPU per sample (x torchfeed) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        base = next((r for r in rows if r["method"] == row["method"] and r["loader"] == "torchfeed"),
                    None)
        own = row.get("worker_own", max(w["own_private"] for w in row["workers"])) / MiB
        uss = row.get("worker_uss", max(w["uss"] for w in row["workers"])) / MiB
        ratio = row["total"] / row["footprint"]
        tiny = small.get((row["method"], row["loader"]))
        first = (f"{row['first_batch']:.2f} s"
                 + (f" ({row['first_batch'] / tiny['first_batch']:.2f}x)" if tiny else "")
                 + (f", {row['first_batch'] / base['first_batch']:.2f}x unshared"
                    if base and row["loader"] == "share" else "")
                 + (f"; sharing took {row['sharing']:.1f} s before it" if row.get("sharing") else ""))
        speed = (f"{row['throughput']:,.0f}"
                 + (f" ({row['throughput'] / base['throughput']:.2f}x)" if base else ""))
        cpu = row.get("cpu_per_sample")
        cost = ("-" if cpu is None else f"{cpu * 1e6:.1f} us"
                + (f" ({cpu / base['cpu_per_sample']:.2f}x)" if base and base.get("cpu_per_sample")
                   else ""))
        runs = f" ({row['runs']} runs)" if row.get("runs", 1) > 1 else ""
        lines.append(f"| {row['method']} | {LABELS[row['loader']]}{runs} | {own:,.0f} MiB ({uss:,.0f} MiB) "
                     f"| {row['total'] / 2**30:.2f} GiB ({ratio:.2f}x) | {first} | {speed} | {cost} |")
    footprints = [r["footprint"] for r in rows]
    lines += ["", f"one process holding the records: {statistics.median(footprints) / 2**30:.2f} GiB "
              "PSS (median over the runs); 'worker private' is the largest of the workers, "
              "shared buffers left out (raw USS counts a buffer page only one worker has read)"]
    if costs:
        lines.append(f"torchfeed.share(records): {costs['share']:.2f} s; pickle.dumps(records): "
                     f"{costs['pickle']:.2f} s ({costs['share'] / costs['pickle']:.2f}x)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--small", type=int, default=1000,
                        help="records of the dataset the first batch is compared with")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--methods", nargs="+", default=["fork", "spawn", "forkserver"])
    parser.add_argument("--loaders", nargs="+", default=list(LOADERS), choices=LOADERS)
    parser.add_argument("--runs", type=int, default=1,
                        help="runs of each setup, in rotation; the table shows medians")
    parser.add_argument("--cost-runs", type=int, default=3)
    parser.add_argument("--setup", type=float, default=None,
                        help="seconds between building each loader and iter() (default: "
                             "pickle.dumps of the records' time, measured first)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--json", help="also write the raw figures here")
    parser.add_argument("--report", metavar="JSON",
                        help="print the table of an earlier run's --json file, run nothing")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        args.records = saved["rows"][0]["records"]
        args.setup = saved.get("setup", 0.0)
        print(report(saved["rows"], {(r["method"], r["loader"]): r for r in saved["small"]},
                     saved["cost"], args))
        return
    if args.child:
        if args.child[0] == "cost":
            print(json.dumps(cost(int(args.child[1]), int(args.child[2]))))
        else:
            method, loader, records, workers, batch, setup = args.child
            print(json.dumps(child(method, loader, int(records), int(workers), int(batch),
                                   float(setup))))
        return

    costs = run_child("cost", str(args.records), str(args.cost_runs), timeout=args.timeout)
    if args.setup is None:
        args.setup = costs["pickle"]
    runs: dict = {}
    for _ in range(args.runs):
        for method in args.methods:
            for loader in args.loaders:
                for n in (args.small, args.records):
                    result = run_child(method, loader, str(n), str(args.workers),
                                       str(args.batch_size), str(args.setup),
                                       timeout=args.timeout)
                    print(f"# {method} {loader} {n:,} records: first batch "
                          f"{result['first_batch']:.1f} s, epoch {result['epoch']:.1f} s, "
                          f"total {result['total'] / 2**30:.2f} GiB", file=sys.stderr, flush=True)
                    runs.setdefault((method, loader, n), []).append(result)
    rows = [median_run(runs[(m, loader, args.records)])
            for m in args.methods for loader in args.loaders]
    small = {(m, loader): median_run(runs[(m, loader, args.small)])
             for m in args.methods for loader in args.loaders}
    print(report(rows, small, costs, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "small": [{"method": m, "loader": n, **r}
                                              for (m, n), r in small.items()],
                       "cost": costs, "setup": args.setup}, f, indent=1)


if __name__ == "__main__":
    main()
