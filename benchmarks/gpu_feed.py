"""Feeding a CUDA GPU (issue 26): torch, torchdata's StatefulDataLoader and
torchfeed in one run, rotated, against the limits measured in the same run.

The data: 256x256x3 uint8 images held in memory; each sample is a random
224x224 crop with a random horizontal flip. ``float32`` batches are normalised
in the worker (as torchvision's ToTensor + Normalize do), 128x3x224x224 = 77 MB;
``uint8`` batches are the crops as they are, 19 MB (normalised on the GPU in
the ResNet runs).

Loaders (every one with ``pin_memory=True``):

* ``torch``: ``torch.utils.data.DataLoader``; ``sdl``: torchdata's
  ``StatefulDataLoader``, where installed;
* ``tf-copy``: torchfeed with its slots pinned by a copy in the pin thread
  (``TORCHFEED_PAGE_LOCKED_SLOTS=0``: torchfeed before page-locked slots);
* ``torchfeed``: torchfeed as it ships: page-locked slots, the user's loop
  does ``.to("cuda", non_blocking=True)``;
* ``tf-device``: torchfeed with ``device="cuda"``: batches arrive on the GPU.

What is measured:

* feed only: each batch goes to the GPU (``non_blocking=True``) and the CPU
  batch is dropped; GB/s of batch bytes over wall time, after a warm-up.
  Beside it: the pinned-copy limit (one pinned buffer of the batch's size
  copied to the device again and again), the pageable copy, ``made``: what
  the same workers produce when the batch is sent nowhere (a torchfeed loader
  whose collate builds the batch with ``default_collate``, into fresh memory,
  and returns a scalar), and ``to-main``: torchfeed's batches reaching the
  main process, which drops them (``pin_memory=False``, nothing sent to the
  GPU): the rate of the workers and the transport, the most any GPU feed of
  theirs can reach. The warm-up covers the slots' creation (and, page-locked,
  their registration): ``2 x workers`` batches more than ``--quick``'s 4;
* ``first ms``: from ``iter()`` to the first batch on the GPU (with
  page-locked slots, the first batch pays the slot's registration);
* ``CPU us/b``: CPU time of the whole main process (every thread: pin thread,
  releaser) per batch;
* ResNet-50 training (torchvision, bf16 autocast, channels_last, SGD): img/s,
  and as a fraction of the rate with one batch already on the GPU (``none``).

    python benchmarks/gpu_feed.py            # the full run (about 10 minutes on an H200)
    python benchmarks/gpu_feed.py --quick    # one run per cell, fewer batches (~2 minutes)
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

# Runnable from a checkout without installing torchfeed.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import torch  # noqa: E402
import torch.utils.data  # noqa: E402

import torchfeed  # noqa: E402
from torchfeed._transport import _page_lock  # noqa: E402

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
BATCH = 128


class Crops(torch.utils.data.Dataset):
    """Random 224x224 crops with flips of 256x256 uint8 images held in memory."""

    def __init__(self, length: int, images: int, dtype: str) -> None:
        gen = torch.Generator().manual_seed(0)
        self.pool = torch.randint(0, 256, (images, 256, 256, 3), dtype=torch.uint8, generator=gen)
        self.labels = torch.randint(0, 1000, (images,), generator=gen)
        self.length, self.float = length, dtype == "float32"

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        k = i % len(self.pool)
        y, x = torch.randint(0, 33, (2,)).tolist()
        crop = self.pool[k, y:y + 224, x:x + 224]
        if torch.rand(()) < 0.5:
            crop = crop.flip(1)
        chw = crop.permute(2, 0, 1)
        out = chw.float().div_(255).sub_(MEAN).div_(STD) if self.float else chw.contiguous()
        return out, self.labels[k]


def sent_nowhere(samples):
    """Builds the batch as default_collate does, then sends a scalar instead."""
    batch = torch.utils.data.default_collate(samples)
    return torch.tensor(batch[0].shape[0])


def _sdl():
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return None
    return StatefulDataLoader


@contextlib.contextmanager
def _env(name, value):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def make_loader(name, dataset, workers):
    kw = dict(batch_size=BATCH, num_workers=workers, pin_memory=True, prefetch_factor=2,
              persistent_workers=False)
    if name == "torch":
        return torch.utils.data.DataLoader(dataset, **kw)
    if name == "sdl":
        return _sdl()(dataset, **kw)
    if name == "made":
        return torchfeed.DataLoader(dataset, collate_fn=sent_nowhere, **kw)
    if name == "to-main":
        return torchfeed.DataLoader(dataset, **{**kw, "pin_memory": False})
    if name == "tf-device":
        return torchfeed.DataLoader(dataset, device="cuda", **kw)
    return torchfeed.DataLoader(dataset, **kw)


def feed_run(name, dataset, workers, warmup, batches):
    """(GB/s, first-batch ms, main CPU us per batch)."""
    env = _env(_page_lock.ENV_DISABLE, "0") if name == "tf-copy" else contextlib.nullcontext()
    with env:
        loader = make_loader(name, dataset, workers)
        t0 = time.perf_counter()
        it = iter(loader)
        nbytes = 0
        for k in range(warmup + batches):
            if k == warmup:
                torch.cuda.synchronize()
                wall, cpu, nbytes = time.perf_counter(), time.process_time(), 0
            batch = next(it)
            if name in ("made", "to-main"):
                nbytes += batch_bytes(dataset)
                del batch
                continue
            x, y = batch
            if not x.is_cuda:
                x, y = x.to("cuda", non_blocking=True), y.to("cuda", non_blocking=True)
            del batch
            if k == 0:
                torch.cuda.synchronize()
                first = (time.perf_counter() - t0) * 1e3
            nbytes += x.numel() * x.element_size()
            del x, y
        torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        del it, loader
    first = first if name not in ("made", "to-main") else float("nan")
    return nbytes / wall / 1e9, first, cpu / batches * 1e6


def batch_bytes(dataset) -> int:
    return BATCH * 3 * 224 * 224 * (4 if dataset.float else 1)


def registration_ms(nbytes: int) -> tuple[float, float, float]:
    """(register ms, unregister ms, GB/s of a copy from it): one slot-sized memfd
    mapping registered with CUDA as torchfeed's main process does."""
    from torchfeed._transport import _arena

    fd = os.memfd_create("gpu-feed-probe")
    try:
        os.posix_fallocate(fd, 0, nbytes)
        shared = _arena.SharedMap(fd, nbytes, 0, populate=True)
        t = time.perf_counter()
        assert _page_lock.register(shared)
        reg = (time.perf_counter() - t) * 1e3
        src = torch.from_numpy(shared.array)
        assert src.is_pinned()
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        rate = nbytes * 10 / (time.perf_counter() - t) / 1e9
        t = time.perf_counter()
        _page_lock.unregister(shared)
        unreg = (time.perf_counter() - t) * 1e3
        del src, shared
    finally:
        os.close(fd)
    return reg, unreg, rate


def copy_limit(nbytes: int, pinned: bool, repeats: int = 20) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8)
    if pinned:
        src = src.pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=pinned)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src, non_blocking=pinned)
    torch.cuda.synchronize()
    return nbytes * repeats / (time.perf_counter() - t) / 1e9


class Trainer:
    def __init__(self):
        import torchvision

        self.model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.loss = torch.nn.CrossEntropyLoss()
        self.mean, self.std = MEAN.cuda(), STD.cuda()

    def step(self, x, y):
        if not x.is_cuda:
            x, y = x.to("cuda", non_blocking=True), y.to("cuda", non_blocking=True)
        if x.dtype == torch.uint8:
            x = x.float().div_(255).sub_(self.mean).div_(self.std)
        x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = self.loss(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()


def train_run(trainer, name, dataset, workers, warmup, steps):
    """img/s of ResNet-50 training fed by loader ``name`` ("none": one batch on the GPU)."""
    if name == "none":
        x, y = next(iter(torch.utils.data.DataLoader(dataset, batch_size=BATCH)))
        batches = iter([(x.cuda(), y.cuda())] * (warmup + steps))
        loader = None
    else:
        env = _env(_page_lock.ENV_DISABLE, "0") if name == "tf-copy" else contextlib.nullcontext()
        with env:
            loader = make_loader(name, dataset, workers)
            batches = iter(loader)
    for k in range(warmup + steps):
        if k == warmup:
            torch.cuda.synchronize()
            wall = time.perf_counter()
        x, y = next(batches)
        trainer.step(x, y)
        del x, y
    torch.cuda.synchronize()
    wall = time.perf_counter() - wall
    del batches, loader
    return steps * BATCH / wall


def rotated(names, r):
    return names[r % len(names):] + names[:r % len(names)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="one run per cell, fewer batches, ResNet float32 at 12 workers only")
    parser.add_argument("--workers", default="4,12")
    parser.add_argument("--dtypes", default="float32,uint8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--images", type=int, default=512, help="images held in memory")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_feed.py needs a CUDA device; this machine has none", file=sys.stderr)
        return 2
    repeats = 1 if args.quick else args.repeats
    warmup, batches = (4, 24) if args.quick else (8, 80)
    workers = [int(w) for w in args.workers.split(",")]
    dtypes = args.dtypes.split(",")
    loaders = ["torch"] + (["sdl"] if _sdl() is not None else []) + \
        ["tf-copy", "torchfeed", "tf-device"]
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
          f"{os.cpu_count()} CPUs; batches of {BATCH}; median of {repeats} rotated runs; "
          f"columns: {', '.join(loaders)}" + ("" if _sdl() else " (torchdata not installed: no sdl)"),
          flush=True)

    print("\nfeed only: GB/s | first batch ms | main-process CPU us per batch")
    for dtype in dtypes:
        dataset = Crops(1 << 20, args.images, dtype)
        nbytes = batch_bytes(dataset)
        limit, pageable = copy_limit(nbytes, True), copy_limit(nbytes, False, repeats=5)
        reg, unreg, registered = registration_ms(nbytes)
        print(f"{dtype} ({nbytes / 1e6:.0f} MB): pinned-copy limit {limit:.1f} GB/s, "
              f"pageable {pageable:.1f} GB/s; a registered slot: {registered:.1f} GB/s, "
              f"register {reg:.1f} ms, unregister {unreg:.1f} ms", flush=True)
        for w in workers:
            refs = ["made", "to-main"]
            res: dict[str, list] = {n: [] for n in loaders + refs}
            for r in range(repeats):
                for name in rotated(loaders + refs, r):
                    res[name].append(feed_run(name, dataset, w, warmup + 2 * w, batches))
            made = statistics.median(x[0] for x in res["made"])
            to_main = statistics.median(x[0] for x in res["to-main"])
            cells = []
            for name in loaders:
                gbs = statistics.median(x[0] for x in res[name])
                first = statistics.median(x[1] for x in res[name])
                cpu = statistics.median(x[2] for x in res[name])
                cells.append(f"{name} {gbs:5.1f} GB/s {first:5.0f} ms {cpu:6.0f} us")
            print(f"  {dtype} {w:>2} workers | made {made:5.1f} GB/s | to-main {to_main:5.1f} GB/s | "
                  + " | ".join(cells),
                  flush=True)

    print("\nResNet-50 training (bf16 autocast, channels_last, SGD): img/s (fraction of 'none')")
    trainer = Trainer()
    train_cells = [("float32", 12)] if args.quick else [(d, w) for d in dtypes for w in workers]
    t_warm, t_steps = (8, 20) if args.quick else (15, 60)
    for dtype, w in train_cells:
        dataset = Crops(1 << 20, args.images, dtype)
        res = {n: [] for n in ["none"] + loaders}
        for r in range(repeats):
            for name in rotated(["none"] + loaders, r):
                res[name].append(train_run(trainer, name, dataset, w, t_warm + w, t_steps))
        none = statistics.median(res["none"])
        cells = [f"{n} {statistics.median(res[n]):6.0f} ({statistics.median(res[n]) / none:4.0%})"
                 for n in loaders]
        print(f"  {dtype} {w:>2} workers | none {none:6.0f} | " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
