"""Feeding a CUDA device (issue 26): page-locked slots, no slot reused while a
copy from it may still run, and the device stage (``device=``). Runs wherever
CUDA is present; skipped on CPU-only machines.

The hazard under test: a batch in a page-locked slot copied with
``non_blocking=True`` is read by the DMA engine later, when the copy's turn on
its stream comes. If the slot went back to its worker when the CPU batch died,
the worker would write the next batch into it first and the GPU would get the
wrong data, silently. So the GPU is kept busy (a matmul per batch on the
stream the copy waits behind, up to ``DEPTH`` batches queued), every CPU batch
is dropped right after its copy is issued, and every batch that lands on the
GPU is checked there against the checksum its worker computed and against
what the sampler's order says it must hold.
"""
from __future__ import annotations

import collections
import functools
import gc
import os
import signal

import pytest
import torch
from doc_examples import doc_python_block
from loader_helpers import ROOT, env_with_path
from torch.utils.data import Dataset

import torchfeed
from torchfeed._transport import _page_lock

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device: page-locked slots and the device stage exist only there")

N = 1 << 16   # int32 per row: 256 KiB
B = 4         # rows per batch: 1 MiB
BASE = N * (N - 1) // 2
DEPTH = 16    # batches of GPU work the training loop may run ahead of the GPU
BATCHES = 8000


class Rows(Dataset):
    """Row i is ``arange(N) + i``: sums to ``BASE + i * N``, which the worker computes too.

    With ``die_at`` and ``marker``, fetching row ``die_at`` kills the worker
    once (SIGKILL), for the restart test."""

    def __init__(self, n: int, die_at: int = -1, marker: str = ""):
        self.n, self.die_at, self.marker = n, die_at, marker

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.die_at and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.arange(N, dtype=torch.int32) + i
        return {"x": x, "sum": x.sum(dtype=torch.int64), "i": i}


def _drained():
    gc.collect()
    assert _page_lock.releaser.drain(timeout=30)
    return _page_lock.registered_bytes()


class Checker:
    """Checks batches on the GPU, on the current stream, without a sync per batch."""

    def __init__(self):
        self.bad = torch.zeros((), dtype=torch.int64, device="cuda")
        self.a = torch.randn(2048, 2048, device="cuda")
        self.marks: collections.deque = collections.deque()
        self.count = 0

    def busy(self):
        for _ in range(2):
            torch.mm(self.a, self.a)

    def check(self, k, g):
        idx = torch.arange(k * B, k * B + B, device="cuda")
        expected = BASE + idx * N
        self.bad += (g["x"].sum(1, dtype=torch.int64) != expected).sum()
        self.bad += (g["sum"] != expected).sum() + (g["i"] != idx).sum()
        event = torch.cuda.Event()
        event.record()
        self.marks.append(event)
        if len(self.marks) > DEPTH:  # keep DEPTH batches of work queued, no more
            self.marks.popleft().synchronize()
        self.count += 1

    def wrong(self):
        torch.cuda.synchronize()
        return int(self.bad.item())


def _to_gpu(batch):
    return {k: v.to("cuda", non_blocking=True) for k, v in batch.items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["current", "side"])
def test_every_batch_right_when_cpu_batches_die_right_after_their_copy(where):
    loader = torchfeed.DataLoader(Rows(BATCHES * B), batch_size=B, num_workers=4,
                                  pin_memory=True)
    checker = Checker()
    cur, side = torch.cuda.current_stream(), torch.cuda.Stream()
    unpinned = copied = 0
    for k, batch in enumerate(loader):
        unpinned += not batch["x"].is_pinned()
        copied += _page_lock.owning_range(batch["x"].data_ptr()) is None  # not a view of a slot
        checker.busy()
        if where == "current":
            g = _to_gpu(batch)  # queued behind the matmuls
            del batch
        else:
            side.wait_stream(cur)  # the side stream's copy waits for the matmuls
            with torch.cuda.stream(side):
                g = _to_gpu(batch)
            del batch  # dropped while the current stream is the default one again
            cur.wait_stream(side)
            for v in g.values():
                v.record_stream(cur)
        checker.check(k, g)
        del g
        if k == 100:
            assert _page_lock.registered_bytes() > 0  # the slots are page-locked
    assert checker.count == BATCHES
    assert checker.wrong() == 0
    assert unpinned == 0 and copied == 0  # pinned by the slot's registration, not by a copy
    stats = loader.stats()
    assert stats["batches_yielded"] == BATCHES
    assert _drained() == 0  # the iterator ended: nothing left registered


@pytest.mark.timeout(120)
def test_device_stage_every_batch_right_and_state_counts_what_the_user_got():
    loader = torchfeed.DataLoader(Rows(BATCHES * B), batch_size=B, num_workers=4,
                                  pin_memory=True, device="cuda")
    checker = Checker()
    for k, g in enumerate(loader):
        assert g["x"].device.type == "cuda"
        checker.busy()
        checker.check(k, g)
        if k == 50:
            assert loader.state_dict()["batches_yielded"] == 51  # delivered, not prefetched
        del g
    assert checker.count == BATCHES
    assert checker.wrong() == 0
    assert loader.stats()["batches_yielded"] == BATCHES
    assert _drained() == 0


class RowsBatch:
    """A user's batch class: its own ``to()``, no ``record_stream`` (issue 35,
    finding 1). The stage cannot mark its tensors as used on the user's stream,
    so it must not allocate them on its copy stream."""

    def __init__(self, x, sums, i):
        self.x, self.sum, self.i = x, sums, i

    def to(self, device, non_blocking=False):
        return type(self)(*(t.to(device, non_blocking=non_blocking)
                            for t in (self.x, self.sum, self.i)))

    def as_dict(self):
        return {"x": self.x, "sum": self.sum, "i": self.i}


class RecordedRowsBatch(RowsBatch):
    """The same with ``record_stream``, as a TensorDict or a PyG ``Data`` has."""

    def record_stream(self, stream):
        for t in (self.x, self.sum, self.i):
            t.record_stream(stream)


def _collate_as(cls, samples):
    batch = torch.utils.data.default_collate(samples)
    return cls(batch["x"], batch["sum"], batch["i"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cls", [RowsBatch, RecordedRowsBatch])
def test_device_stage_batch_class_with_its_own_to_dropped_right_after_use(cls):
    """Each batch is read by kernels queued behind a busy stream and dropped at
    once: were its memory the copy stream's, unmarked, the next batch's copy
    would overwrite it before those kernels read it."""
    loader = torchfeed.DataLoader(Rows(BATCHES * B), batch_size=B, num_workers=4,
                                  pin_memory=True, device="cuda",
                                  collate_fn=functools.partial(_collate_as, cls))
    checker = Checker()
    for k, g in enumerate(loader):
        assert type(g) is cls and g.x.device.type == "cuda"
        checker.busy()
        checker.check(k, g.as_dict())
        del g
    assert checker.count == BATCHES
    assert checker.wrong() == 0
    assert _drained() == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pin_memory", [True, False])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_device_stage_resumes_where_the_user_was(pin_memory, num_workers):
    n = 64
    loader = torchfeed.DataLoader(Rows(n * B), batch_size=B, num_workers=num_workers,
                                  pin_memory=pin_memory, device="cuda")
    it = iter(loader)
    for _ in range(5):
        g = next(it)
    assert g["i"].device.type == "cuda" and g["i"].tolist() == list(range(4 * B, 5 * B))
    state = loader.state_dict()
    assert state["batches_yielded"] == 5
    del it, g
    resumed = torchfeed.DataLoader(Rows(n * B), batch_size=B, num_workers=num_workers,
                                   pin_memory=pin_memory, device="cuda")
    resumed.load_state_dict(state)
    checker = Checker()
    for k, g in enumerate(resumed, start=5):
        checker.check(k, g)
    assert checker.count == n - 5 and checker.wrong() == 0
    assert _drained() == 0


@pytest.mark.timeout(120)
def test_registration_once_per_slot_and_nothing_left_after_shutdown_or_del():
    made = _page_lock.registrations[0]
    loader = torchfeed.DataLoader(Rows(400 * B), batch_size=B, num_workers=2, pin_memory=True,
                                  persistent_workers=True)
    for _ in range(2):  # two epochs; between them the idle loader gives its big slots back
        for batch in loader:
            assert batch["x"].is_pinned()
        del batch
    made = _page_lock.registrations[0] - made
    allocations = loader._iterator._unpacker.stats()["allocations"]  # slots the workers made
    assert 0 < made <= allocations  # once per slot, never per batch
    del loader
    assert _drained() == 0

    # A batch the user keeps stays registered until it dies, after shutdown too.
    loader = torchfeed.DataLoader(Rows(40 * B), batch_size=B, num_workers=2, pin_memory=True)
    kept = [b for i, b in enumerate(loader) if i == 3]
    assert _drained() > 0 and kept[0]["x"].is_pinned()
    g = _to_gpu(kept[0])
    del kept
    assert _drained() == 0
    assert g["i"].tolist() == list(range(3 * B, 4 * B))


@pytest.mark.timeout(120)
def test_nothing_left_registered_after_a_worker_restart(tmp_path):
    marker = str(tmp_path / "died")
    loader = torchfeed.DataLoader(Rows(200 * B, die_at=100 * B, marker=marker), batch_size=B,
                                  num_workers=2, pin_memory=True, max_worker_restarts=1)
    checker = Checker()
    with pytest.warns(RuntimeWarning):
        for k, batch in enumerate(loader):
            g = _to_gpu(batch)
            del batch
            checker.check(k, g)
    assert os.path.exists(marker)
    assert checker.count == 200 and checker.wrong() == 0
    assert _drained() == 0


@pytest.mark.timeout(120)
def test_batches_not_in_a_slot_are_pinned_by_copy_as_before():
    loader = torchfeed.DataLoader(Rows(20 * B), batch_size=B, num_workers=2, pin_memory=True,
                                  transport="torch")
    for batch in loader:
        assert batch["x"].is_pinned()
        assert _page_lock.registered_bytes() == 0


@pytest.mark.timeout(120)
def test_readme_device_stage_example_runs_as_written(tmp_path):
    import subprocess
    import sys

    (tmp_path / "feed_gpu.py").write_text(doc_python_block("# feed_gpu.py"))
    proc = subprocess.run([sys.executable, "feed_gpu.py"], cwd=tmp_path, env=env_with_path(ROOT),
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("batches on cuda:0 stats: 8"), proc.stdout


@pytest.mark.timeout(60)
def test_a_failed_registration_leaves_no_error_for_the_next_kernel(monkeypatch):
    """Issue 35, finding 7: ``cudaHostRegister`` failing (here: the range is
    registered already) sets CUDA's per-thread last error, which torch checks
    after each kernel launch; torchfeed resets it, so the next kernel in the
    same thread does not raise it."""
    from torchfeed._transport._arena import SharedMap

    fd = os.memfd_create("torchfeed-test-register")
    try:
        os.ftruncate(fd, 1 << 20)
        shared = SharedMap(fd, 1 << 20, populate=True)
    finally:
        os.close(fd)
    monkeypatch.setattr(_page_lock, "_warned", [False])
    assert _page_lock.register(shared)
    try:
        with pytest.warns(UserWarning, match="cudaHostRegister of a 1048576-byte"):
            assert not _page_lock.register(shared)  # cudaErrorHostMemoryAlreadyRegistered
        x = torch.ones(8, device="cuda")
        x.add_(1)  # a kernel launch: torch checks cudaGetLastError after it
        assert x.sum().item() == 16
    finally:
        _page_lock.unregister(shared)
    assert not _page_lock.is_registered(shared)
