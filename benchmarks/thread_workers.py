"""Thread workers against process workers (issue 53): batches/s as a multiple of
torch's DataLoader with ``num_workers=0``, measured in the same run.

Columns: torch at ``num_workers=0`` (the baseline) and at ``--workers``; torchfeed
with worker processes; torchfeed with ``worker_method="thread"``; dataloader-rs
(a loader with a Rust core and worker threads) where it imports, which needs
Python 3.13 or later (its column is skipped, with a note, elsewhere).
Workloads, as issue 53 defines them:

- ``numpy`` (batch 32): a 256x256 crop of a 3-channel uint8 image, as float32,
  normalised per channel: numpy, which releases the GIL for its array work;
- ``jpeg`` (batch 16): PIL decodes a 480x360 JPEG and resizes it to 224x224:
  decoding and resizing release the GIL;
- ``python`` (batch 64): ``json.loads`` of a record and a walk over its fields in
  Python, which holds the GIL throughout.

Each cell is the median of ``--repeats`` runs of ``--seconds`` each, the
columns' order rotated from one repeat to the next, so that a machine whose speed
drifts does not favour one column.  A run times the batches after the first;
the first is timed on its own (``iter()`` to the first batch: worker start
included).  ``PSS`` is the proportional set size of the loading process and its
children, read once at the end of the timed window.

    PYTHONPATH=. python benchmarks/thread_workers.py               # about 4 min on 2 cores
    PYTHONPATH=. python benchmarks/thread_workers.py --seconds 1 --repeats 1   # smoke run
    PYTHONPATH=. python benchmarks/thread_workers.py --torch-threads 1         # on a busy machine
    PYTHONPATH=. /path/to/python3.13 benchmarks/thread_workers.py  # with dataloader-rs installed
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import psutil
import torch
import torch.utils.data
from torch.utils.data import Dataset, default_collate

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import torchfeed  # noqa: E402

LENGTH = 10**7  # indices: no run reaches an epoch's end


# -- workloads ----------------------------------------------------------------------------
class NumpyCrops(Dataset):
    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.images = [rng.integers(0, 256, (3, 288, 288), dtype=np.uint8) for _ in range(8)]
        self.mean = np.array([123.7, 116.3, 103.5], np.float32).reshape(3, 1, 1)
        self.inv_std = 1 / np.array([58.4, 57.1, 57.4], np.float32).reshape(3, 1, 1)

    def __len__(self) -> int:
        return LENGTH

    def __getitem__(self, i: int):
        image = self.images[i % len(self.images)]
        y, x = (i * 7) % 32, (i * 13) % 32
        crop = image[:, y:y + 256, x:x + 256].astype(np.float32)
        return (crop - self.mean) * self.inv_std


class Jpegs(Dataset):
    def __init__(self) -> None:
        from PIL import Image

        rng = np.random.default_rng(0)
        self.files = []
        for _ in range(8):
            # a smooth image with noise, which JPEG compresses as it does a photo
            base = np.linspace(0, 255, 480 * 360 * 3).reshape(360, 480, 3)
            pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
            out = io.BytesIO()
            Image.fromarray(pixels).save(out, format="JPEG", quality=90)
            self.files.append(out.getvalue())

    def __len__(self) -> int:
        return LENGTH

    def __getitem__(self, i: int):
        from PIL import Image

        with Image.open(io.BytesIO(self.files[i % len(self.files)])) as image:
            resized = image.convert("RGB").resize((224, 224), Image.BILINEAR)
        return np.array(resized)  # writable, as a tensor needs


class JsonRecords(Dataset):
    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.records = [json.dumps({
            "id": k, "tokens": rng.integers(0, 30000, 96).tolist(),
            "spans": [{"start": int(s), "end": int(s) + 3, "label": f"L{int(s) % 7}"}
                      for s in rng.integers(0, 90, 12)],
            "score": float(rng.random())}) for k in range(256)]

    def __len__(self) -> int:
        return LENGTH

    def __getitem__(self, i: int):
        record = json.loads(self.records[i % len(self.records)])
        labels = sum(1 for span in record["spans"] if span["label"] in ("L1", "L3"))
        return len(record["tokens"]), sum(record["tokens"][:32]), labels, record["score"]


WORKLOADS = {"numpy": (NumpyCrops, 32), "jpeg": (Jpegs, 16), "python": (JsonRecords, 64)}


# -- columns ------------------------------------------------------------------------------
def _rs_problem() -> str | None:
    if sys.version_info < (3, 13):
        return (f"needs Python 3.13 or later (this is {platform.python_version()}): run this "
                "script with a Python 3.13 that has torch, pillow and dataloader-rs")
    try:
        import dataloader_rs  # noqa: F401
    except ImportError:
        return "not installed (pip install dataloader-rs)"
    return None


def _rs_loader(dataset, batch_size: int, workers: int, prefetch: int):
    from dataloader_rs import PyDataloader, PyDataset

    class Wrapped(PyDataset):  # it takes its own base class only
        def __init__(self, inner) -> None:
            super().__init__()
            self.inner = inner

        def __len__(self) -> int:
            return len(self.inner)

        def __getitem__(self, index: int):
            return self.inner[index]

    # prefetch_depth: batches ahead of the ones in progress, so workers + it in
    # flight, against prefetch_factor x workers for the others.
    return PyDataloader(Wrapped(dataset), batch_size=batch_size, num_workers=workers,
                        collate_fn=default_collate, prefetch_depth=max(0, prefetch * workers - workers))


def columns(workers: int, prefetch: int) -> dict:
    made = {
        "torch@0": lambda ds, bs: torch.utils.data.DataLoader(ds, batch_size=bs),
        f"torch@{workers}": lambda ds, bs: torch.utils.data.DataLoader(
            ds, batch_size=bs, num_workers=workers, prefetch_factor=prefetch),
        "torchfeed processes": lambda ds, bs: torchfeed.DataLoader(
            ds, batch_size=bs, num_workers=workers, prefetch_factor=prefetch),
        "torchfeed threads": lambda ds, bs: torchfeed.DataLoader(
            ds, batch_size=bs, num_workers=workers, prefetch_factor=prefetch,
            worker_method="thread"),
    }
    if _rs_problem() is None:
        made["dataloader-rs threads"] = lambda ds, bs: _rs_loader(ds, bs, workers, prefetch)
    return made


# -- one run ------------------------------------------------------------------------------
def _pss() -> int | None:
    me = psutil.Process()
    total = 0
    try:
        for proc in [me, *me.children(recursive=True)]:
            total += proc.memory_full_info().pss
    except (psutil.Error, AttributeError):
        return None
    return total


def run(make, dataset, batch_size: int, seconds: float) -> dict:
    loader = make(dataset, batch_size)
    start = time.perf_counter()
    it = iter(loader)
    next(it)
    first = time.perf_counter() - start
    batches, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        next(it)
        batches += 1
    elapsed = time.perf_counter() - t0
    pss = _pss()
    del it, loader
    return {"batches_per_s": batches / elapsed, "first_batch_s": first, "pss": pss}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated, from {', '.join(WORKLOADS)} (default: all)")
    parser.add_argument("--workers", type=int, default=2, help="num_workers (default 2)")
    parser.add_argument("--prefetch-factor", type=int, default=2, help="(default 2)")
    parser.add_argument("--seconds", type=float, default=4.0, help="timed seconds per run (default 4)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell, rotated; medians (default 3)")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch.set_num_threads() in this process first: torch@0 collates in "
                             "this process, and on a busy machine torch's intra-op threads make "
                             "that baseline crawl (default: torch's own choice)")
    parser.add_argument("--json", help="write every run's figures here too")
    args = parser.parse_args(argv)
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    names = [w for w in args.workloads.split(",") if w]
    cols = columns(args.workers, args.prefetch_factor)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"Python {platform.python_version()}, torch {torch.__version__}, "
          f"{psutil.cpu_count()} cores, load average {load:.1f} at the start, "
          f"torch.get_num_threads() {torch.get_num_threads()}; "
          f"{args.workers} workers, prefetch_factor {args.prefetch_factor}, "
          f"median of {args.repeats} rotated {args.seconds:g}-second runs", flush=True)
    problem = _rs_problem()
    if problem is not None:
        print(f"dataloader-rs: column skipped, {problem}", flush=True)
    results: dict = {}
    for name in names:
        cls, batch_size = WORKLOADS[name]
        dataset = cls()
        order = list(cols)
        runs: dict = {c: [] for c in order}
        for r in range(args.repeats):
            rotated = order[r % len(order):] + order[:r % len(order)]
            for column in rotated:
                runs[column].append(run(cols[column], dataset, batch_size, args.seconds))
        results[name] = runs
        base = statistics.median(x["batches_per_s"] for x in runs["torch@0"])
        print(f"\n{name} (batch {batch_size}): torch@0 {base:.1f} batches/s, "
              f"{1000 / base:.1f} ms per batch in-process", flush=True)
        for column in order:
            rate = statistics.median(x["batches_per_s"] for x in runs[column])
            first = statistics.median(x["first_batch_s"] for x in runs[column])
            pss = [x["pss"] for x in runs[column] if x["pss"] is not None]
            mem = f"{statistics.median(pss) / 2**20:7.0f} MiB" if pss else "      -"
            print(f"  {column:<24}{rate:8.1f} batches/s  {rate / base:5.2f}x   first batch "
                  f"{1000 * first:7.1f} ms   PSS {mem}", flush=True)
    print("\nbatches/s as a multiple of torch@0's; last column: threads over processes")
    print("\n| workload | " + " | ".join(c for c in cols if c != "torch@0")
          + " | threads / processes |")
    print("|---|" + "---|" * len(cols))
    for name in names:
        runs = results[name]
        rate = {c: statistics.median(x["batches_per_s"] for x in runs[c]) for c in cols}
        cells = [f"{rate[c] / rate['torch@0']:.2f}x" for c in cols if c != "torch@0"]
        cells.append(f"{rate['torchfeed threads'] / rate['torchfeed processes']:.2f}x")
        print(f"| {name}, b{WORKLOADS[name][1]} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "python": platform.python_version(),
                       "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
