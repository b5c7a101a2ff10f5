"""The shared-memory transport inside torchfeed.DataLoader: the default path,
the escape hatch, and what it leaves behind."""

from __future__ import annotations

import collections
import gc
import os
import time
import warnings

import numpy as np
import psutil
import pytest
import torch
import transport_helpers as h
from loader_helpers import ROOT
from torch.utils.data import Dataset, IterableDataset

import torchfeed
from torchfeed import _transport
from torchfeed._torch_compat import accelerator_available
from torchfeed._transport import _page_lock, _slots

Pair = collections.namedtuple("Pair", "image label")


class Images(Dataset):
    def __init__(self, n=24, size=16):
        self.n, self.size = n, size

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return Pair(torch.full((3, self.size, self.size), i % 251, dtype=torch.uint8), i)


class Records(Dataset):
    def __len__(self):
        return 20

    def __getitem__(self, i):
        return {"x": np.full(4, i, np.float32), "id": np.int64(i), "name": f"r{i}",
                "t": {f"f{k}": torch.full((2,), float(i + k)) for k in range(8)}}


class Stream(IterableDataset):
    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        for i in range(info.id, 30, info.num_workers):
            yield torch.tensor([i, i * i])


class Failing(Images):
    def __getitem__(self, i):
        if i == 13:
            raise ValueError("sample 13 is broken")
        return super().__getitem__(i)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(_transport.ENV_TRANSPORT, raising=False)
    monkeypatch.delenv("TORCHFEED_SHM_LIMIT", raising=False)


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return type(b) is torch.Tensor and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _in_slot(t):
    ptr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            if h.MEMFD_TAG in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= ptr < hi:
                    return True
    return False


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dataset", [Images(), Records()], ids=["images", "records"])
def test_default_transport_is_shm_and_batches_equal_torch(dataset):
    kw = dict(batch_size=4, shuffle=True, num_workers=2)
    ours = torchfeed.DataLoader(dataset, generator=torch.Generator().manual_seed(3), **kw)
    theirs = torch.utils.data.DataLoader(dataset, generator=torch.Generator().manual_seed(3),
                                         **kw)
    assert ours.transport == "shm"
    it = iter(ours)
    got = list(it)
    want = list(theirs)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert _same(a, b)
    leaf = got[0].image if isinstance(got[0], Pair) else got[0]["t"]["f0"]
    assert _in_slot(leaf)  # zero-copy, in one of the transport's slots


@pytest.mark.long
@pytest.mark.timeout(120)
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_spawn_and_forkserver_workers(context):
    # One worker, a fresh interpreter (or a fork server's child) that packs
    # into its slots as each of two would; two spawned workers fill slots side
    # by side in test_workers.py and test_share_dataset.py.
    loader = torchfeed.DataLoader(Records(), batch_size=4, num_workers=1,
                                  multiprocessing_context=context)
    got = list(loader)
    want = list(torch.utils.data.DataLoader(Records(), batch_size=4))
    assert len(got) == len(want) and all(map(_same, got, want))
    assert _in_slot(got[-1]["t"]["f7"])


@pytest.mark.timeout(120)
def test_independent_of_torch_sharing_strategy():
    old = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        got = list(torchfeed.DataLoader(Images(), batch_size=4, num_workers=2))
    finally:
        torch.multiprocessing.set_sharing_strategy(old)
    assert [b.label[0].item() for b in got] == list(range(0, 24, 4))
    assert _in_slot(got[0].image)


@pytest.mark.timeout(120)
def test_iterable_dataset_and_custom_collate():
    def collate(samples):
        return {"stacked": torch.stack(samples), "n": len(samples)}

    got = list(torchfeed.DataLoader(Stream(), batch_size=4, num_workers=2, collate_fn=collate))
    values = sorted(int(v) for b in got for v in b["stacked"][:, 0])
    assert values == list(range(30)) and all(b["n"] == len(b["stacked"]) for b in got)
    assert _in_slot(got[0]["stacked"])


@pytest.mark.timeout(120)
def test_escape_hatch_argument_and_environment(monkeypatch):
    loader = torchfeed.DataLoader(Images(), batch_size=4, num_workers=2, transport="torch")
    it = iter(loader)
    assert isinstance(it._channel, _transport.TorchChannel)
    batch = next(it)
    assert not _in_slot(batch.image)
    del it, batch
    monkeypatch.setenv(_transport.ENV_TRANSPORT, "torch")
    loader = torchfeed.DataLoader(Images(), batch_size=4, num_workers=2)
    assert loader.transport == "torch"
    assert all(not _in_slot(b.image) for b in loader)


class MixedDtypes(Dataset):
    """Small float32 tensors, and one float64 among them in each batch."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.full((3,), i + 0.25, dtype=torch.float64 if i % 4 == 1 else torch.float32)


def _as_tuple(samples):
    return tuple(torch.utils.data.default_collate(samples))


@pytest.mark.timeout(120)
def test_stacking_keeps_the_first_samples_dtype_as_torchs_workers_do():
    # torch's default_collate in a worker stacks into a tensor of the first
    # element's dtype; in the main process it would promote to float64.
    kw = dict(batch_size=4, num_workers=2)
    ours = list(torchfeed.DataLoader(MixedDtypes(), **kw))
    theirs = list(torch.utils.data.DataLoader(MixedDtypes(), **kw))
    assert all(b.dtype == torch.float32 for b in theirs)
    for a, b in zip(ours, theirs):
        assert _same(a, b)


@pytest.mark.timeout(120)
def test_escape_hatch_sends_tuple_batches_through_torchs_reductions():
    # A plain tuple is also the shape of the shm transport's own message; with
    # transport="torch" it is the user's batch and must cross as torch sends it.
    kw = dict(batch_size=4, num_workers=1, collate_fn=_as_tuple)
    theirs = next(iter(torch.utils.data.DataLoader(Images(), **kw)))
    ours = next(iter(torchfeed.DataLoader(Images(), transport="torch", **kw)))
    assert type(ours) is type(theirs) is tuple
    assert ours[0].is_shared() and theirs[0].is_shared()
    assert _same(ours[0], theirs[0])


@pytest.mark.timeout(120)
def test_holding_every_batch_and_slot_reuse_across_epochs():
    loader = torchfeed.DataLoader(Images(n=64), batch_size=4, num_workers=2,
                                  persistent_workers=True)
    held = list(loader)  # the pool grows to hold them all
    for k, b in enumerate(held):
        assert b.label.tolist() == list(range(4 * k, 4 * k + 4))
        assert int(b.image[0, 0, 0, 0]) == 4 * k
    del held, b
    gc.collect()
    it = iter(loader)
    for _ in range(2):
        for b in loader:
            del b
    st = it._unpacker.stats()  # what DataLoader.stats() reads
    before = st["allocations"]
    for _ in range(3):
        for b in loader:
            del b
    # Between epochs each worker keeps one slot (an idle loader holds no
    # more); within an epoch of 16 batches the slots are reused, so it
    # allocates at most prefetch_factor slots per worker again.
    assert it._unpacker.stats()["allocations"] - before <= 3 * 2 * 2


def _leftovers(shm_before, refs_before):
    gc.collect()
    assert h.added_memfd_refs(refs_before) == []  # earlier tests' batches may map some
    assert h.leftover_shm(shm_before, [os.getpid()]) == set()


@pytest.mark.timeout(120)
def test_nothing_left_after_normal_end_early_break_and_worker_error():
    before, refs = h.dev_shm(), h.memfd_refs_now()
    for b in torchfeed.DataLoader(Images(), batch_size=4, num_workers=2):
        pass
    del b
    _leftovers(before, refs)

    it = iter(torchfeed.DataLoader(Images(), batch_size=4, num_workers=2))
    kept = next(it)
    del it
    gc.collect()
    assert int(kept.image[0, 0, 0, 0]) == 0  # a batch kept past the iterator stays valid
    del kept
    _leftovers(before, refs)

    with pytest.raises(ValueError, match="sample 13 is broken"):
        for b in torchfeed.DataLoader(Failing(), batch_size=4, num_workers=2):
            pass
    del b
    _leftovers(before, refs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sharing_strategy", ["file_descriptor", "file_system"])
def test_small_shm_limit_still_loads_with_one_warning(monkeypatch, sharing_strategy):
    """Batches too big for the budget go torch's way, which does use /dev/shm: they
    arrive, warn once, and leave no segment behind, named after any of our processes,
    with either of torch's sharing strategies (file_system keeps named segments)."""
    monkeypatch.setenv("TORCHFEED_SHM_LIMIT", "1m")
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy(sharing_strategy)
    try:
        before = h.dev_shm()
        # earlier tests may have left a forkserver or resource tracker as our child
        others = {c.pid for c in psutil.Process().children()}
        loader = torchfeed.DataLoader(Images(n=16, size=224), batch_size=8, num_workers=2)
        with pytest.warns(_transport.ShmFallbackWarning, match="TORCHFEED_SHM_LIMIT=1m") as rec:
            it = iter(loader)
            batches = [next(it)]
            workers = [c.pid for c in psutil.Process().children() if c.pid not in others]
            batches += list(it)
        del it
        assert len([w for w in rec if w.category is _transport.ShmFallbackWarning]) == 1
        assert batches[0].image.shape == (8, 3, 224, 224)
        assert batches[0].label.tolist() == list(range(8))
        assert batches[1].label.tolist() == list(range(8, 16))
        assert len(workers) == 2
        del batches
        gc.collect()
        assert h.leftover_shm(before, [os.getpid()] + workers) == set()
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)


def _pin_warnings(caught):
    return [(w.category, str(w.message)) for w in caught if "pin_memory" in str(w.message)]


@pytest.mark.timeout(120)
def test_pin_memory_pins_and_frees_slots_early_or_behaves_as_torch_without_an_accelerator():
    kwargs = dict(batch_size=4, num_workers=2, pin_memory=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        expected = list(torch.utils.data.DataLoader(Images(n=32), **kwargs))
    torch_warnings = _pin_warnings(caught)
    loader = torchfeed.DataLoader(Images(n=32), **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        it = iter(loader)
        held = [next(it) for _ in range(6)]
    assert _pin_warnings(caught) == torch_warnings
    for b, e in zip(held, expected):
        assert torch.equal(b.image, e.image) and torch.equal(b.label, e.label)
    if accelerator_available() and _page_lock.wanted():
        # CUDA: the slots themselves are page-locked, so the batches are pinned
        # views of them, no copy; a slot goes back once its batch is dropped and
        # no copy can read it any more (the releaser's fence).
        assert torch_warnings == []
        assert all(b.image.is_pinned() and b.label.is_pinned() for b in held)
        assert all(_in_slot(b.image) for b in held)
        deadline = time.monotonic() + 5  # every batch sent for has arrived: in_use settles
        while loader.stats()["queues"]["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.02)
        in_use = loader.stats()["shm"]["in_use"]
        assert in_use >= len(held)
        del held, b
        deadline = time.monotonic() + 5
        while loader.stats()["shm"]["in_use"] > in_use - 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert loader.stats()["shm"]["in_use"] <= in_use - 6
    elif accelerator_available():
        assert torch_warnings == []
        assert all(b.image.is_pinned() and b.label.is_pinned() for b in held)
        assert not _in_slot(held[0].image)
        # The pin thread copies each batch out of its slot, so the slots go back
        # while we still hold all six batches (it may be mid-copy for a moment).
        deadline = time.monotonic() + 5
        while loader.stats()["shm"]["in_use"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert loader.stats()["shm"]["in_use"] == 0
    else:
        # torch warns once and pins nothing; so do we, and the batches stay
        # zero-copy views of their slots until they are dropped.
        assert torch_warnings == [(UserWarning, "'pin_memory' argument is set as true but no "
                                   "accelerator is found, then device pinned memory won't be "
                                   "used.")]
        assert not any(b.image.is_pinned() or b.label.is_pinned() for b in held)
        assert _in_slot(held[0].image)
        # Nothing reads results between next() calls (no pin thread), so only
        # dropping the batches can change the count: by one slot per batch.
        in_use = loader.stats()["shm"]["in_use"]
        assert in_use >= len(held)
        del held, b
        assert loader.stats()["shm"]["in_use"] == in_use - 6
    del it


LOADER_MAIN = """
import glob, os, sys, tempfile, time
sys.path[:0] = [{root!r}, {tests!r}]
import torchfeed
from test_transport_loader import Images, RequiresGrad
it = iter(torchfeed.DataLoader(Images(n=64, size=64), batch_size=4, num_workers=2))
held = [next(it) for _ in range(5)]
# A worker that sends tensors torch's way serves their file descriptors from a
# socket in multiprocessing's temporary folder (pymp-*): on torch's transport
# the iterator's own folder, and for a tensor the slots cannot carry (one that
# requires grad) one the worker made. The premise: both are there, in use,
# when the main process dies.
torchs = iter(torchfeed.DataLoader(Images(n=16, size=8), batch_size=4, num_workers=1,
                                   transport="torch"))
graded = iter(torchfeed.DataLoader(RequiresGrad(), batch_size=None, num_workers=1))
held += [next(torchs), next(torchs), next(graded), next(graded)]
listening = [d for d in glob.glob(os.path.join(tempfile.gettempdir(), "pymp-*"))
             if any(f.startswith("listener-") for f in os.listdir(d))]
assert len(listening) == 2, listening
print(" ".join(str(w.pid) for w in it._workers + torchs._workers + graded._workers), flush=True)
time.sleep(60)
"""


@pytest.mark.long
@pytest.mark.timeout(90)
def test_nothing_left_after_main_process_sigkill(tmp_path):
    """Neither shared memory nor multiprocessing's folder, which the workers,
    left on their own, remove only when they exit normally (TMPDIR: the test's
    tmp_path, where nothing else is made)."""
    script = LOADER_MAIN.format(root=ROOT, tests=os.path.join(ROOT, "tests"))
    pids, before, used = h.sigkill_main_process(script, env={"TMPDIR": str(tmp_path)})
    assert h.wait_until(lambda: not any(h.alive(p) for p in pids), 10)
    assert all(h.memfd_refs(p) == [] for p in pids)
    assert h.leftover_shm(before, pids, used) == set()
    assert list(tmp_path.glob("pymp-*")) == []


KEEP_UNDER_FD_LIMIT = """
import gc, json, os, resource, sys
sys.path[:0] = [{root!r}, {tests!r}]  # the checkout's torchfeed, not an installed one
resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
import torch
import torch.utils.data as tud
import torchfeed
from test_transport_loader import Numbers


def keep_every_batch(how):
    loader_cls = tud.DataLoader if how == "torch-loader" else torchfeed.DataLoader
    kwargs = {{}} if how != "torch-transport" else {{"transport": "torch"}}
    kept = []
    try:
        for batch in loader_cls(Numbers(), batch_size=2, num_workers=1, **kwargs):
            kept.append(batch)
    except RuntimeError as exc:
        return {{"kept": len(kept), "error": str(exc)}}, []
    assert len(kept) == 2000, len(kept)
    assert all(torch.equal(b, torch.tensor([[2 * i] * 4, [2 * i + 1] * 4]))
               for i, b in enumerate(kept))
    return {{"kept": len(kept), "fds": len(os.listdir("/proc/self/fd"))}}, kept


# One interpreter for several runs, one after the other: a failed run's
# batches and loader are gone (and collected) before the next starts; a run
# that kept every batch keeps them to the very end, interpreter exit included.
KEPT_TO_THE_END = []
for how in sys.argv[1:]:
    result, kept = keep_every_batch(how)
    KEPT_TO_THE_END.append(kept)
    del kept
    gc.collect()
    print(json.dumps(result), flush=True)
"""


class RequiresGrad(Dataset):
    """Samples the shared-memory slots cannot carry: they go torch's way."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.full((4,), float(i), requires_grad=True)


class Numbers(Dataset):
    def __len__(self):
        return 4000

    def __getitem__(self, i):
        return torch.full((4,), i)


@pytest.fixture(scope="module")
def kept_under_fd_limit():
    """One fresh interpreter limited to 128 open files keeps every batch of a
    2,000-batch epoch, once per loader: torch's, ours on torch's transport, then
    ours on its own (last: its batches stay to the end).  What each run came to,
    and the interpreter's stderr.  One interpreter for the three runs: each
    would cost a fresh import of torch, seconds of CPU."""
    import json
    import subprocess
    import sys

    tests = os.path.join(ROOT, "tests")
    script = KEEP_UNDER_FD_LIMIT.format(root=ROOT, tests=tests)
    hows = ["torch-loader", "torch-transport", "shm"]
    run = subprocess.run([sys.executable, "-c", script, *hows], capture_output=True, text=True,
                         timeout=100, cwd=tests)
    assert run.returncode == 0, run.stdout + run.stderr
    return dict(zip(hows, map(json.loads, run.stdout.splitlines()), strict=True)), run.stderr


kept_under_fd_limit_once = pytest.mark.xdist_group("kept_under_fd_limit")


@pytest.mark.long
@kept_under_fd_limit_once
@pytest.mark.timeout(120)
def test_thousands_of_kept_batches_need_no_file_descriptor_each(kept_under_fd_limit):
    # 2,000 batches kept under a limit of 128 open files: the slots hold one
    # descriptor per worker, and the batches beyond them travel inline.
    runs, stderr = kept_under_fd_limit
    assert "error" not in runs["shm"] and runs["shm"]["fds"] < 64, runs["shm"]
    assert "Exception ignored" not in stderr, stderr  # batches kept to the very end


@pytest.mark.long
@kept_under_fd_limit_once
@pytest.mark.timeout(120)
def test_out_of_file_descriptors_on_torchs_transport_says_so_in_torchs_words(kept_under_fd_limit):
    # torch's transport holds a descriptor per kept batch, in torch's loader
    # as here: both fail, with torch's sentence first, then what ran out.
    runs, _ = kept_under_fd_limit
    want, got = runs["torch-loader"], runs["torch-transport"]
    assert "error" in want and "error" in got, (want, got)
    first = "Too many open files. Communication with the workers is no longer possible."
    assert want["error"].startswith(first), want
    assert got["error"].startswith(want["error"].splitlines()[0]), got
    assert "torchfeed: the main process holds 1" in got["error"] and "of its limit of 128" \
        in got["error"] and "set_sharing_strategy('file_system')" in got["error"], got


class Swinging(Dataset):
    """Mostly 4 KiB samples, and an 8 MiB one every eighth."""

    def __len__(self):
        return 48

    def __getitem__(self, i):
        return torch.full((2 << 20,) if i % 8 == 0 else (1024,), i, dtype=torch.float32)


def _arena_bytes(loader):
    return [os.fstat(fd).st_blocks * 512 for fd in loader._iterator._channel._fds]


@pytest.mark.timeout(90)
def test_idle_persistent_loader_keeps_one_small_slot_per_worker():
    loader = torchfeed.DataLoader(Swinging(), batch_size=None, num_workers=2,
                                  prefetch_factor=2, persistent_workers=True)
    for epoch in range(2):
        got = []
        for batch in loader:
            got.append(int(batch[0]))
            del batch
        assert got == list(range(48)), epoch
        # Idle: every slot that grew for an 8 MiB batch has given its memory
        # back; what stays is one small slot per worker and the control page.
        gc.collect()
        held = _arena_bytes(loader)
        assert all(b <= 4 * 65536 for b in held), held
    del loader


class Fixed(Dataset):
    """Samples of ``nbytes`` each, every one the same size."""

    def __init__(self, n, nbytes):
        self.n, self.nbytes = n, nbytes

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((self.nbytes // 4,), i, dtype=torch.float32)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("batch_size", [None, 4])  # copied into the slot; stacked into it
def test_slots_alive_at_the_peak_are_what_prefetch_needs_and_no_bigger(batch_size):
    # A consumer that holds each batch for a step lets the workers run ahead
    # to prefetch_factor batches each. Every slot then holds exactly one
    # batch: a fixed-size stream needs no headroom, which would be memory
    # that no batch ever uses, in every slot.
    batch = 4 << 20
    sample = batch if batch_size is None else batch // batch_size
    loader = torchfeed.DataLoader(Fixed(24 * (batch_size or 1), sample), batch_size=batch_size,
                                  num_workers=2, prefetch_factor=2)
    peak = 0
    for i, b in enumerate(loader):
        time.sleep(0.01)
        shm = loader.stats()["shm"]
        assert shm["bytes"] % batch == 0, (i, shm)
        peak = max(peak, shm["bytes"])
        assert float(b.flatten()[-1]) == i * (batch_size or 1) + (batch_size or 1) - 1
        del b
    assert batch <= peak <= 2 * (2 + 1) * batch, peak


@pytest.mark.timeout(90)
def test_free_huge_slots_keep_only_the_reuse_rule_and_slots_stay_the_same(monkeypatch):
    # The rule with a 1 MiB budget, so 4 MiB batches count as huge; the forked
    # workers inherit the patched module.
    warm = 1 << 20
    monkeypatch.setattr(_slots, "WARM_BYTES", warm)
    batch_bytes = 4 << 20
    loader = torchfeed.DataLoader(Fixed(4 * 24, batch_bytes // 4), batch_size=4, num_workers=2,
                                  multiprocessing_context="fork")
    it = iter(loader)
    fds = it._channel.fds
    peak_reuse = cold_seen = 0
    for k, batch in enumerate(it):
        # A slot refilled after its pages went carries its batch whole.
        assert torch.equal(batch[:, 0], torch.arange(4 * k, 4 * k + 4, dtype=torch.float32))
        assert torch.equal(batch[:, -1], batch[:, 0]) and float(batch.sum()) == float(
            batch[:, 0].sum()) * (batch_bytes // 16)
        resident = sum(os.fstat(fd).st_blocks * 512 for fd in fds)  # before stats(): see below
        shm = loader.stats()["shm"]
        free = [row for row in shm["slot_table"] if row[3] in ("free", "cold")]
        # Every free slot of a huge batch has given back all but its first `warm` bytes.
        assert all(state == "cold" and kept == warm for _, _, cap, state, kept in free
                   if cap > warm), shm["slot_table"]
        assert shm["reuse_bytes"] == sum(kept for *_, kept in free) <= warm * len(free)
        # And the arenas really hold no more: the workers' slots, less what the
        # cold ones gave back (only this thread releases slots, and a slot the
        # worker refills or makes after the fstat only adds to the right side).
        gone = sum(cap - kept for _, _, cap, state, kept in free if state == "cold")
        assert resident <= shm["bytes"] - gone + len(fds) * _slots.CTRL_BYTES, (resident, shm)
        peak_reuse = max(peak_reuse, shm["reuse_bytes"])
        cold_seen += len(free)
        raw = it._unpacker.stats()  # the last before the iterator closes the transport
        del batch
    assert cold_seen and raw["released_bytes"] > 0, raw
    # Slots keep their identity: no more were ever made than a worker has
    # batches alive at once (prefetch_factor + 1), however often they went cold.
    assert raw["allocations"] <= 2 * (loader.prefetch_factor + 1), raw
    assert peak_reuse <= warm * 2 * (loader.prefetch_factor + 1)


def _slot_bytes(fds) -> int:
    """What the slots of these arenas hold in memory now, their control pages aside."""
    return sum(os.fstat(fd).st_blocks * 512 for fd in fds) - len(fds) * _slots.CTRL_BYTES


@pytest.mark.timeout(90)
@pytest.mark.parametrize("persistent", [False, True])
def test_a_worker_done_for_the_epoch_gives_its_slots_back_before_the_epoch_ends(persistent):
    # 4 MiB batches (over IDLE_KEEP_BYTES). Once a worker has built its last
    # batch of the epoch, its free slots go at once, and its last batch's slot
    # goes when that batch is dropped: before the iterator ends, not when it
    # closes or trims.
    batch_bytes = 4 << 20
    loader = torchfeed.DataLoader(Fixed(4 * 8, batch_bytes // 4), batch_size=4, num_workers=2,
                                  multiprocessing_context="fork", persistent_workers=persistent)
    for epoch in range(2 if persistent else 1):
        it = iter(loader)
        fds = it._channel.fds
        for k in range(8):
            batch = next(it)
            assert torch.equal(batch[:, 0], torch.arange(4 * k, 4 * k + 4, dtype=torch.float32))
            if k == 6:  # worker 0's last batch: all it holds is this batch's slot
                assert _slot_bytes(fds[:1]) <= batch.numel() * 4 + (1 << 16), it._unpacker.stats()
            del batch
        # Both workers are done and every batch is dropped: nothing is left,
        # and the iterator has not ended yet.
        assert _slot_bytes(fds) == 0, it._unpacker.stats()
        with pytest.raises(StopIteration):
            next(it)
    del it, loader


def _worker_rss_in_slots(pid: int) -> int:
    """The bytes of torchfeed's arenas that worker ``pid`` has in its page tables."""
    rss, in_arena = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if not first.endswith(":"):
                in_arena = "/memfd:torchfeed-transport" in line
            elif first == "Rss:" and in_arena:
                rss += int(line.split()[1]) * 1024
    return rss


@pytest.mark.timeout(90)
def test_the_worker_lets_go_of_the_cold_part_of_a_huge_slot_unless_the_slot_keeps_its_pages(
        monkeypatch):
    # WARM_BYTES is 1 MiB here, so an 8 MiB batch's slot is huge; the forked
    # worker inherits the patched module. One worker, one batch an epoch: once
    # the batch is here, the worker builds nothing.
    warm = 1 << 20
    monkeypatch.setattr(_slots, "WARM_BYTES", warm)
    batch_bytes = 8 << 20
    loader = torchfeed.DataLoader(Fixed(4, batch_bytes // 4), batch_size=4, num_workers=1,
                                  multiprocessing_context="fork", persistent_workers=True)
    it = iter(loader)
    batch = next(it)
    pid = it._workers[0].pid
    # The batch is whole in the main process; the worker maps only the warm part.
    assert float(batch.sum()) == sum(range(4)) * batch_bytes // 16
    assert _worker_rss_in_slots(pid) <= warm + _slots.CTRL_BYTES, _worker_rss_in_slots(pid)
    del batch
    assert list(it) == []
    # Page-locked slots keep every page (the main process sets the flag): the
    # worker keeps its mapping of all of it, so its next batch takes no fault.
    it._unpacker._ctrl[0].keeps_pages = True
    it = iter(loader)
    batch = next(it)
    assert float(batch.sum()) == sum(range(4)) * batch_bytes // 16
    assert _worker_rss_in_slots(pid) >= batch_bytes, _worker_rss_in_slots(pid)
    del batch, it, loader


@pytest.mark.timeout(90)
def test_a_workers_first_huge_batch_gets_a_slot_with_little_room(monkeypatch):
    # WARM_BYTES is 1 MiB here, so a 64 MiB batch is huge and streams into a
    # slot sized from its first sample: the batch plus 1/64 of it, at least
    # 1 MiB, for what is not streamed. Every byte of that room is allocated.
    monkeypatch.setattr(_slots, "WARM_BYTES", 1 << 20)
    batch_bytes = 64 << 20
    loader = torchfeed.DataLoader(Fixed(4, batch_bytes // 4), batch_size=4, num_workers=1,
                                  multiprocessing_context="fork")
    it = iter(loader)
    batch = next(it)
    assert float(batch[:, 0].sum()) == 6.0
    caps = [cap for _, _, cap, *_ in loader.stats()["shm"]["slot_table"]]
    assert caps == [batch_bytes + (1 << 20)], caps
    del batch, it, loader
