"""How the loader's costs grow with the job (issue 19): torch vs torchfeed in one run.

Each measurement runs in a fresh Python process (the fork server, the heap and
the memory figures are per process), alternating torch and torchfeed; figures
are medians over ``--repeats`` runs, torchfeed's also as a ratio to torch's.

* ``gc``: the epoch-restart case: 64 samples of ``(torch.full((16,), i), i)``,
  ``batch_size=8``, 2 workers, ``persistent_workers=False``, ``--epochs``
  epochs; the median epoch from epoch 50 on, and the time a worker spent in
  generation-2 collections per epoch (a ``gc.callbacks`` hook the workers
  inherit from the main process).
* ``heap``: the main process holds ``--heap`` annotation dicts (as
  ``json.load`` of a COCO-style file gives them); a fresh loader (2 workers,
  256 small samples a batch) times its first batch; then each worker of
  another runs one full collection (as its GC counters make it do sooner or
  later) and reports its time and the private memory (USS) it added.
* ``start``: seconds per epoch with ``multiprocessing_context`` forkserver and
  spawn (epochs 2 to 6: the first starts the fork server), and fork for scale.
* ``shuffle``: ``shuffle=True`` over ``--shuffle-n`` samples (default 2**26):
  seconds to the first batch, and the main process's RSS growth by then.
* ``cow``: workers that read every record of ``--records`` annotation dicts,
  and the same values as numpy arrays: each worker's USS growth (copy-on-read).

    python benchmarks/scale.py                       # all sections (about 5 min on 2 cores)
    python benchmarks/scale.py --sections gc,start --repeats 5
"""
import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

# Runnable from a checkout without installing torchfeed.
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
import torch.utils.data  # noqa: E402

SECTIONS = ("gc", "heap", "start", "shuffle", "cow")


# -- datasets (module level: spawn and the fork server import them from here) ---------
class Small(torch.utils.data.Dataset):
    def __init__(self, n=64):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((16,), i), i


class FullCollection(Small):
    """The first sample in each worker runs the full collection that the
    worker's GC counters trigger sooner or later, and reports its cost."""

    def __getitem__(self, i):
        if "done" in _BASE:
            return torch.full((16,), i), torch.zeros(2)
        _BASE["done"] = True
        before, t = _uss(), time.perf_counter()
        gc.collect()
        took, grown = time.perf_counter() - t, _uss() - before
        return torch.full((16,), i), torch.tensor([took, grown], dtype=torch.float64)


class Records(torch.utils.data.Dataset):
    """Sample i reads its share of the records; with it, the worker's USS growth."""

    def __init__(self, records, n=16):
        self.records, self.n = records, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        share = len(self.records) // self.n
        part = self.records[i * share:(i + 1) * share]
        total = int(part.sum()) if isinstance(part, np.ndarray) else sum(r["id"] for r in part)
        return total, _uss() - _BASE.get("uss", 0)


_BASE = {}


def _uss():
    return psutil.Process().memory_full_info().uss


def _remember_uss(_worker_id):
    _BASE["uss"] = _uss()


def _time_full_collections():
    """A gc.callbacks hook that forked workers inherit: the seconds each
    process spends in generation-2 collections, from its fork on."""
    parent = os.getpid()

    def hook(phase, info):
        if info["generation"] != 2 or os.getpid() == parent:
            return
        if phase == "start":
            _GEN2[1] = time.perf_counter()
        else:
            _GEN2[0] += time.perf_counter() - _GEN2[1]
    gc.callbacks.append(hook)


_GEN2 = [0.0, 0.0]  # seconds in full collections, start of the current one


class Gen2Timing(Small):
    def __getitem__(self, i):
        return torch.full((16,), i), _GEN2[0]


def _annotations(n):
    return [{"id": i, "image_id": i // 7, "bbox": [1.0, 2.0, 30.0, 40.0], "category_id": i % 80,
             "iscrowd": 0, "area": 1200.0} for i in range(n)]


def _loader_cls(name):
    import torchfeed  # imported for both: the same heap and GC counters in the main process

    return torch.utils.data.DataLoader if name == "torch" else torchfeed.DataLoader


# -- one measurement, in a fresh process ---------------------------------------------------
def child_gc(loader, epochs):
    cls = _loader_cls(loader)
    _time_full_collections()
    dl = cls(Gen2Timing(), batch_size=8, num_workers=2)
    times, gen2 = [], []
    for _ in range(epochs):
        t = time.perf_counter()
        seconds = [float(s.max()) for _, s in dl]  # each worker's total so far, per batch
        times.append(time.perf_counter() - t)
        gen2.append(max(seconds))
    late = slice(50, None) if len(times) > 55 else slice(len(times) // 2, None)
    return {"epoch_ms": 1000 * statistics.median(times[late]),
            "gen2_ms": 1000 * statistics.median(gen2[late])}


def child_heap(loader, heap):
    records = _annotations(heap)  # noqa: F841 (held: the parent's heap)
    cls = _loader_cls(loader)
    # A fresh loader, as the GC counters leave it: its first batch.
    dl = cls(Small(512), batch_size=256, num_workers=2)
    t = time.perf_counter()
    it = iter(dl)  # held: a temporary iterator would be torn down inside the timing
    next(it)
    first = time.perf_counter() - t
    t = time.perf_counter()
    del it  # the workers stop here, mid-epoch
    teardown = time.perf_counter() - t
    del dl
    dl = cls(FullCollection(512), batch_size=256, num_workers=2)
    costs = torch.stack([b[1].max(dim=0).values for b in dl]).max(dim=0).values
    return {"first_batch_ms": 1000 * first, "teardown_ms": 1000 * teardown, "collect_ms": 1000 * float(costs[0]),
            "collect_uss_mib": float(costs[1]) / 2**20}


def child_start(loader, method):
    cls = _loader_cls(loader)
    dl = cls(Small(), batch_size=8, num_workers=2, multiprocessing_context=method)
    times = []
    for _ in range(6):
        t = time.perf_counter()
        for _ in dl:
            pass
        times.append(time.perf_counter() - t)
    out = {"epoch_ms": 1000 * statistics.median(times[1:])}
    if loader == "torchfeed":
        out["worker_start_ms"] = 1000 * (dl.stats()["worker_start_seconds"] or 0.0)
    return out


def child_shuffle(loader, n):
    cls = _loader_cls(loader)
    me = psutil.Process()
    before = me.memory_info().rss
    dl = cls(Small(n), batch_size=256, shuffle=True)
    t = time.perf_counter()
    it = iter(dl)
    next(it)
    first = time.perf_counter() - t
    grown = me.memory_info().rss - before
    t = time.perf_counter()
    torch.randperm(n)
    randperm = time.perf_counter() - t
    return {"first_batch_s": first, "rss_growth_mib": grown / 2**20, "randperm_s": randperm,
            "bytes_per_sample": grown / n}


def child_cow(loader, records, storage):
    data = _annotations(records)
    if storage == "numpy":
        data = np.array([r["id"] for r in data], dtype=np.int64)
    cls = _loader_cls(loader)
    dl = cls(Records(data), batch_size=None, num_workers=2, worker_init_fn=_remember_uss)
    growth = max(g for _, g in dl)
    return {"worker_uss_growth_mib": growth / 2**20}


CHILDREN = {"gc": child_gc, "heap": child_heap, "start": child_start, "shuffle": child_shuffle,
            "cow": child_cow}


def run_child(section, loader, *args):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", section, loader,
           *map(str, args)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.abspath(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{section} {loader} {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(section, variants, repeats):
    """{variant: {figure: median}} with the variants alternating in each repeat."""
    runs = {v: [] for v in variants}
    keys = list(variants)
    for r in range(repeats):
        for v in keys[r % len(keys):] + keys[:r % len(keys)]:
            runs[v].append(run_child(section, *v))
    return {v: {k: statistics.median(run[k] for run in rs) for k in rs[0]}
            for v, rs in runs.items()}


def ratio(ours, theirs):
    return f"{ours / theirs:.2f}x" if theirs else "-"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, of {', '.join(SECTIONS)} (default: all)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant; medians")
    parser.add_argument("--epochs", type=int, default=80, help="epochs in the gc section")
    parser.add_argument("--heap", type=int, default=1_000_000,
                        help="annotation dicts the main process holds in the heap section")
    parser.add_argument("--shuffle-n", type=int, default=1 << 26, help="samples to shuffle")
    parser.add_argument("--records", type=int, default=1_000_000,
                        help="annotation dicts the workers read in the cow section")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        section, loader, *rest = args.child
        rest = [int(x) if x.isdigit() else x for x in rest]
        print(json.dumps(CHILDREN[section](loader, *rest)))
        return
    sections = args.sections.split(",")
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, median of {args.repeats}; "
          "ratio = torchfeed / torch (lower is better)")
    if "gc" in sections:
        m = measure("gc", [("torch", args.epochs), ("torchfeed", args.epochs)], args.repeats)
        t, f = m[("torch", args.epochs)], m[("torchfeed", args.epochs)]
        print(f"gc       epoch restart, epochs 50-{args.epochs}: torch {t['epoch_ms']:.1f} ms, "
              f"torchfeed {f['epoch_ms']:.1f} ms ({ratio(f['epoch_ms'], t['epoch_ms'])}); "
              f"per epoch, a worker's time in full collections: torch {t['gen2_ms']:.1f} ms, "
              f"torchfeed {f['gen2_ms']:.1f} ms", flush=True)
    if "heap" in sections:
        m = measure("heap", [("torch", args.heap), ("torchfeed", args.heap)], args.repeats)
        t, f = m[("torch", args.heap)], m[("torchfeed", args.heap)]
        print(f"heap     {args.heap} dicts in the main process: a full collection in a worker "
              f"torch {t['collect_ms']:.0f} ms / +{t['collect_uss_mib']:.0f} MiB private, "
              f"torchfeed {f['collect_ms']:.0f} ms / +{f['collect_uss_mib']:.0f} MiB; first "
              f"batch torch {t['first_batch_ms']:.0f} ms, torchfeed {f['first_batch_ms']:.0f} ms "
              f"({ratio(f['first_batch_ms'], t['first_batch_ms'])}); then dropping the iterator "
              f"torch {t['teardown_ms']:.0f} ms, torchfeed {f['teardown_ms']:.0f} ms "
              f"({ratio(f['teardown_ms'], t['teardown_ms'])})", flush=True)
    if "start" in sections:
        for method in ("forkserver", "spawn", "fork"):
            m = measure("start", [("torch", method), ("torchfeed", method)], args.repeats)
            t, f = m[("torch", method)], m[("torchfeed", method)]
            print(f"start    {method:<10} epoch (2-6): torch {t['epoch_ms']:.0f} ms, torchfeed "
                  f"{f['epoch_ms']:.0f} ms ({ratio(f['epoch_ms'], t['epoch_ms'])}); "
                  f"stats() worker start {f['worker_start_ms']:.0f} ms", flush=True)
    if "shuffle" in sections:
        n = args.shuffle_n
        m = measure("shuffle", [("torch", n), ("torchfeed", n)], args.repeats)
        t, f = m[("torch", n)], m[("torchfeed", n)]
        print(f"shuffle  {n} samples: first batch torch {t['first_batch_s']:.2f} s, torchfeed "
              f"{f['first_batch_s']:.2f} s ({ratio(f['first_batch_s'], t['first_batch_s'])}; "
              f"randperm alone {f['randperm_s']:.2f} s); main RSS growth torch "
              f"{t['rss_growth_mib']:.0f} MiB ({t['bytes_per_sample']:.1f} B/sample), torchfeed "
              f"{f['rss_growth_mib']:.0f} MiB ({f['bytes_per_sample']:.1f} B/sample)", flush=True)
    if "cow" in sections:
        r = args.records
        m = measure("cow", [("torch", r, "list"), ("torchfeed", r, "list"),
                            ("torchfeed", r, "numpy")], args.repeats)
        print(f"cow      {r} records read by each worker: USS growth per worker: torch (dicts) "
              f"{m[('torch', r, 'list')]['worker_uss_growth_mib']:.0f} MiB, torchfeed (dicts) "
              f"{m[('torchfeed', r, 'list')]['worker_uss_growth_mib']:.0f} MiB, torchfeed "
              f"(numpy) {m[('torchfeed', r, 'numpy')]['worker_uss_growth_mib']:.0f} MiB",
              flush=True)


if __name__ == "__main__":
    main()
