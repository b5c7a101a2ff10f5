"""Micro-benchmark: the shared-memory transport against torch's reductions.

Each run starts ``--workers`` worker processes that collate pre-built samples
into batches and send them through a real ``multiprocessing`` queue, with at
most ``--prefetch`` batches outstanding per worker, as a DataLoader would. The
main process receives and rebuilds every batch and drops it. Three paths:

* ``torch``: ``default_collate`` with torch's worker info set (so, as in a
  torch DataLoader worker, it stacks into fresh shared memory), and the batch
  pickled by the queue with torch's reductions;
* ``shm``: ``default_collate`` into ordinary memory, then ``packer.pack``
  copies it into a reused slot;
* ``shm-direct``: ``packer.collate`` stacks straight into the slot.

Reported per workload: main-process CPU per batch (``time.process_time`` in
the consuming process) and batches/s, the median of ``--runs`` runs, and the
ratios against torch measured in the same invocation.

    python benchmarks/transport_micro.py --help
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchfeed._transport import create_channel  # noqa: E402

WORKLOADS = {
    # name: (batch size, sample factory)
    "image": (64, lambda i: (torch.full((3, 224, 224), i % 251, dtype=torch.uint8), i)),
    "dict32": (64, lambda i: {f"f{k}": torch.full((16,), float(i + k)) for k in range(32)}),
    "small": (64, lambda i: (torch.full((8,), float(i)), i)),
    "numpy-record": (64, lambda i: {"x": np.full(16, i, np.float32), "id": np.int64(i),
                                    "label": i % 10}),
}


def _worker(path, workload, wid, channel, task_q, result_q, n_samples):
    from torch.utils.data import default_collate
    from torch.utils.data._utils import worker as tw

    torch.set_num_threads(1)
    bs, make = WORKLOADS[workload]
    pool = [make(i) for i in range(n_samples)]
    packer = channel.packer(wid) if channel is not None else None
    if path == "torch":
        tw._worker_info = tw.WorkerInfo(id=wid, num_workers=1, seed=0, dataset=None)
    while True:
        task = task_q.get()
        if task is None:
            break
        samples = [pool[(task * bs + j) % n_samples] for j in range(bs)]
        if path == "torch":
            result_q.put((task, default_collate(samples)))
        elif path == "shm":
            result_q.put((task, packer.pack(default_collate(samples))))
        else:
            result_q.put((task, packer.pack(packer.collate(samples))))


def run_once(path, workload, n_batches, workers, prefetch, method):
    ctx = mp.get_context(method)
    channel = None if path == "torch" else create_channel(workers, ctx, {"transport": "shm"})
    unpacker = channel.unpacker() if channel is not None else None
    task_qs = [ctx.Queue() for _ in range(workers)]
    result_q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(path, workload, w, channel, task_qs[w],
                                               result_q, 256), daemon=True)
             for w in range(workers)]
    for p in procs:
        p.start()
    # Warm-up: one batch per worker, not timed (start-up and first slot).
    for w in range(workers):
        task_qs[w].put(w)
    for _ in range(workers):
        _, payload = result_q.get()
        b = unpacker.unpack(payload) if unpacker is not None else payload
        del b, payload
    sent = 0
    for _ in range(prefetch):
        for w in range(workers):
            task_qs[w].put(sent)
            sent += 1
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(n_batches):
        task, payload = result_q.get()
        batch = unpacker.unpack(payload) if unpacker is not None else payload
        del batch, payload
        if sent < n_batches:
            task_qs[task % workers].put(sent)
            sent += 1
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    for q in task_qs:
        q.put(None)
    for p in procs:
        p.join(30)
    stats = unpacker.stats() if unpacker is not None else {}
    if unpacker is not None:
        unpacker.close()
    return n_batches / wall, cpu / n_batches, stats


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="image,dict32,small,numpy-record")
    ap.add_argument("--paths", default="torch,shm,shm-direct")
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--start-method", default="fork")
    args = ap.parse_args(argv)
    paths = args.paths.split(",")
    print(f"# {args.workers} workers, prefetch {args.prefetch}, {args.batches} batches, "
          f"median of {args.runs} runs, start method {args.start_method}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}")
    print(f"{'workload':<14}{'path':<12}{'batches/s':>11}{'main CPU/batch':>16}"
          f"{'x torch b/s':>13}{'CPU / torch':>13}  slots(allocs)")
    for workload in args.workloads.split(","):
        res = {}
        for path in paths:
            runs = [run_once(path, workload, args.batches, args.workers, args.prefetch,
                             args.start_method) for _ in range(args.runs)]
            rate = statistics.median(r[0] for r in runs)
            cpu = statistics.median(r[1] for r in runs)
            res[path] = (rate, cpu, runs[-1][2])
        base = res.get("torch")
        for path in paths:
            rate, cpu, st = res[path]
            rel = (f"{rate / base[0]:>13.2f}{cpu / base[1]:>13.3f}" if base else " " * 26)
            slots = f"{st.get('slots', '-')}({st.get('allocations', '-')})" if st else "-"
            print(f"{workload:<14}{path:<12}{rate:>11.1f}{cpu * 1e6:>13.0f} us{rel}  {slots}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
