"""The shared-memory batch transport, with real worker processes and real
shared memory (torchfeed/_transport)."""

from __future__ import annotations

import gc
import os
import pickle
import signal
import textwrap
import warnings
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
import transport_helpers as h
from torch.utils.data import default_collate

from torchfeed import _transport
from torchfeed._transport import (
    ShmFallbackWarning,
    TorchChannel,
    _slots,
    _space,
    check_space,
    create_channel,
    resolve_transport,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = [
    pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning"),
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning"),
]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(_space.ENV_LIMIT, raising=False)
    monkeypatch.delenv(_transport.ENV_TRANSPORT, raising=False)


# -- comparisons ----------------------------------------------------------------

def _raw(t):
    t = t.resolve_conj().resolve_neg().contiguous().flatten()
    return t.view(torch.uint8) if t.numel() else t


def assert_same(got, want, path="batch"):
    """Same types, dtypes, shapes and bytes, all the way down."""
    assert type(got) is type(want), f"{path}: {type(got)} != {type(want)}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        if want.layout is not torch.strided:
            want, got = want.to_dense(), got.to_dense()
        assert got.requires_grad == want.requires_grad, path
        assert torch.equal(_raw(got.detach()), _raw(want.detach())), path
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        if want.dtype.hasobject:
            assert got.tolist() == want.tolist(), path
        else:
            assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes(), path
    elif isinstance(want, (h.Record, h.Holder)):
        for k in vars(want):
            assert_same(getattr(got, k), getattr(want, k), f"{path}.{k}")
    elif isinstance(want, (dict, h.FrozenMap)):
        assert list(got.keys()) == list(want.keys()), path
        for k in want:
            assert_same(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple, h.Seq)):
        assert len(got) == len(want), path
        for k, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{path}[{k}]")
    else:
        assert got == want, path


def slot_ranges(pid=None):
    """Address ranges of torchfeed arenas mapped in this process."""
    out = []
    with open(f"/proc/{pid or os.getpid()}/maps") as f:
        for line in f:
            if h.MEMFD_TAG in line:
                lo, hi = line.split()[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


def in_slot(ptr, ranges):
    return any(lo <= ptr < hi for lo, hi in ranges)


def leaves(x):
    """Everything in ``x`` that is not a dict, list or tuple (namedtuples included)."""
    if isinstance(x, dict):
        for v in x.values():
            yield from leaves(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from leaves(v)
    else:
        yield x


def tensor_leaves(x):
    return (v for v in leaves(x) if isinstance(v, torch.Tensor))


# -- round trips ------------------------------------------------------------------

@pytest.mark.long
@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_round_trip_every_leaf_type_and_nesting(method):
    # One worker where each starts a fresh interpreter: it packs as each of two
    # would, and two alternate under fork.
    with h.Pipeline(2 if method == "fork" else 1, method) as p:
        for _ in range(4):
            i, batch = p.get("every_leaf")
            assert_same(batch, h.every_leaf(i))
            # Identity inside a batch survives, as with pickle.
            assert batch["same_twice"][0] is batch["same_twice"][1]
            # Slot leaves are zero-copy views of shared memory, each with a
            # storage of its own (as a collated tensor has).
            ranges = slot_ranges()
            img = batch["torch"]["torch.float32"]
            assert in_slot(img.data_ptr(), ranges)
            assert img.untyped_storage().nbytes() == img.nbytes
            assert in_slot(batch["torch"]["torch.bfloat16"].data_ptr(), ranges)
            assert in_slot(batch["numpy"][0].__array_interface__["data"][0], ranges)
            # Layout and aliasing as torch's reductions keep them: strides and
            # offsets, one storage for two views of it, Fortran order for numpy.
            nc, want = batch["noncontig"], h.every_leaf(i)["noncontig"]
            for got_t, want_t in zip(nc[:3], want[:3]):
                assert got_t.stride() == want_t.stride(), got_t
                assert got_t.storage_offset() == want_t.storage_offset(), got_t
            assert nc[0].untyped_storage().data_ptr() == nc[1].untyped_storage().data_ptr()
            assert nc[2].untyped_storage().nbytes() == 16  # expand() stays small
            assert nc[4].flags.f_contiguous and not nc[4].flags.c_contiguous
            # Tensors that cannot live in a slot keep torch's semantics.
            assert type(batch["special"][1]) is torch.nn.Parameter
            assert batch["special"][2].requires_grad
        st = p.unpacker.stats()
        assert st["packed"] == 4 and st["unpacked"] == 4 and st["fallbacks"] == 0


@pytest.mark.timeout(60)
def test_leaves_are_writable_and_independent():
    with h.Pipeline(1) as p:
        _, (img, labels) = p.get("image")
        img += 1
        labels.mul_(2)
        arr = img.numpy()
        assert arr.flags.writeable and arr.base is not None
        _, (img2, _) = p.get("image")
        assert int(img2[0, 0, 0, 0]) == 1 and int(img[0, 0, 0, 0]) == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("as_torch_worker", [False, True])
def test_direct_collate_matches_default_collate(as_torch_worker):
    # as_torch_worker: torch's get_worker_info() is set, as in a DataLoader
    # worker, where torch's default_collate would allocate shared memory itself.
    side = 1 << 14  # batches of 1.5 MiB: big enough to be stacked straight into a slot
    with h.Pipeline(1, direct=True, as_torch_worker=as_torch_worker) as p:
        held = []
        for _ in range(6):
            i, batch = p.get("collate", side=side)
            want = default_collate(h.samples_for(i, side=side))
            assert_same(batch, want)
            ranges = slot_ranges()
            assert all(in_slot(t.data_ptr(), ranges) for t in tensor_leaves(batch))
            held.append((i, batch))
        for i, batch in held:  # batches held meanwhile were not overwritten
            assert_same(batch, default_collate(h.samples_for(i, side=side)))
        st = p.unpacker.stats()
        assert st["fallbacks"] == 0
        assert st["direct_bytes"] >= 5 * 8 * 3 * side * 4  # all but the first batch


@pytest.mark.timeout(60)
def test_direct_collate_batch_bigger_than_reserved_slot():
    with h.Pipeline(1, direct=True) as p:
        for n in [4, 4, 64, 64, 8, 1, 64]:
            i, batch = p.get("collate", n=n, side=1 << 13)
            assert_same(batch, default_collate(h.samples_for(i, n=n, side=1 << 13)))
            del batch
        assert p.unpacker.stats()["direct_bytes"] > 0


@pytest.mark.timeout(60)
def test_direct_collate_falls_back_cleanly_when_no_bigger_slot_can_be_had():
    # One slot only: the second batch starts stacking into it, outgrows it, and
    # cannot have another, so it must leave through torch's path intact.
    with h.Pipeline(1, direct=True, options={"max_slots_per_worker": 1}) as p:
        for extra in (1, 1, 1 << 18, 1):
            i, batch = p.get("collate2", extra=extra)
            assert_same(batch, default_collate(h.two_tensor_samples(i, extra=extra)))
            del batch
        assert p.unpacker.stats()["fallbacks"] == 1


# -- recycling, growth, bounds -----------------------------------------------------

@pytest.mark.timeout(180)
def test_slots_reused_allocation_counter_flat_over_1000_batches():
    with h.Pipeline(2) as p:
        for _ in range(50):
            _, b = p.get("image")
            del b
        warm = p.unpacker.stats()
        for _ in range(1000):
            i, b = p.get("image")
            assert int(b[1][0]) == i
            del b
        st = p.unpacker.stats()
        assert st["allocations"] == warm["allocations"] <= 4
        assert st["retired"] == warm["retired"]
        assert st["packed"] == 1050 and st["in_use"] == 0


@pytest.mark.timeout(120)
def test_pool_grows_while_batches_are_held_then_shrinks():
    opts = {"idle_batches": 8}
    with h.Pipeline(1, options=opts) as p:
        held = [p.get("image", size=64) for _ in range(20)]
        st = p.unpacker.stats()
        assert st["slots"] >= 20 and st["in_use"] == 20
        for i, (img, labels) in held:  # nothing held was overwritten
            assert int(img.min()) == int(img.max()) == i and int(labels[0]) == i
        arena = p.channel._fds[0]
        grown = os.fstat(arena).st_blocks
        del held, img, labels
        gc.collect()
        assert p.unpacker.stats()["in_use"] == 0
        for _ in range(30):
            _, b = p.get("image", size=64)
            del b
        st = p.unpacker.stats()
        assert st["retired"] >= 15 and st["slots"] <= 4
        assert os.fstat(arena).st_blocks < grown / 3  # the memory went back


@pytest.mark.timeout(60)
def test_slot_grows_for_a_bigger_batch():
    with h.Pipeline(1) as p:
        for n in (1, 2, 8, 32, 4):
            i, b = p.get("sized", n=n)
            assert b["i"] == i and float(b["data"][-1]) == float(i)
            assert b["data"].shape == (n * 16384,)
            del b
            if n == 1:
                first = p.unpacker.stats()["bytes"]
        st = p.unpacker.stats()
        assert st["allocations"] >= 3 and st["retired"] >= 2
        assert st["bytes"] >= 32 * 65536 > first


@pytest.mark.timeout(60)
def test_slot_grown_for_a_rare_huge_batch_shrinks_when_batches_are_small_again():
    with h.Pipeline(1) as p:
        i, b = p.get("sized", n=128)  # 8 MiB
        assert b["data"].shape == (128 * 16384,)
        del b
        arena = p.channel._fds[0]
        assert os.fstat(arena).st_blocks * 512 >= 8 << 20
        for _ in range(_slots.SHRINK_AFTER + 2):
            i, b = p.get("sized", n=1)  # 64 KiB
            assert float(b["data"][-1]) == float(i)
            del b
        assert os.fstat(arena).st_blocks * 512 < 1 << 20


@pytest.mark.timeout(60)
def test_pool_cap_bounds_slots_and_the_rest_travel_inline_quietly():
    with h.Pipeline(1, options={"max_slots_per_worker": 3}) as p:
        fds = len(os.listdir("/proc/self/fd"))
        with warnings.catch_warnings():
            warnings.simplefilter("error", ShmFallbackWarning)
            held = [p.get("image") for _ in range(8)]
        for i, (img, labels) in held:
            assert int(img[0, 0, 0, 0]) == i % 251 and int(labels[0]) == i
        st = p.unpacker.stats()
        assert st["slots"] == 3 and st["fallbacks"] == 5
        # The five beyond the slots live in this process's own memory: no
        # shared memory, no file descriptor each (torch's way would hold one).
        ranges = slot_ranges()
        for _, (img, _labels) in held[3:]:
            assert not in_slot(img.data_ptr(), ranges) and not img.is_shared()
        # Not equal: an earlier test's object, freed meanwhile, may close one of its own.
        assert len(os.listdir("/proc/self/fd")) <= fds


# -- space check and limit -----------------------------------------------------

@pytest.mark.timeout(60)
def test_small_shm_limit_falls_back_with_one_clear_warning(monkeypatch):
    monkeypatch.setenv(_space.ENV_LIMIT, "1m")  # fits the minimum, not an 8 MiB batch
    with h.Pipeline(2) as p:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for _ in range(4):
                i, b = p.get("big", mib=8)
                assert b.shape == (8 << 18,) and float(b[0]) == float(i)
                del b
        msgs = [str(x.message) for x in w if issubclass(x.category, ShmFallbackWarning)]
        assert len(msgs) == 1
        assert "TORCHFEED_SHM_LIMIT=1m" in msgs[0] and "--shm-size" in msgs[0]
        assert "8.0 MiB" in msgs[0] or "8.5 MiB" in msgs[0]
        st = p.unpacker.stats()
        assert st["fallbacks"] == 4 and st["allocations"] == 0
        # Small batches still fit under the limit and take the fast path.
        _, b = p.get("image")
        assert p.unpacker.stats()["allocations"] == 1


@pytest.mark.timeout(60)
def test_limit_below_minimum_disables_shm_at_iterator_start():
    with pytest.warns(ShmFallbackWarning, match="shm_limit=1000"):
        ch = create_channel(2, None, {"shm_limit": 1000})
    assert ch.disabled_warning is not None and ch._fds == []
    packer = ch.packer(0)
    batch = (torch.ones(3), "x")
    got = ch.unpacker().unpack(packer.pack(batch))
    assert got is batch
    ch.unpacker().close()  # what the loader's shutdown closes


@pytest.mark.timeout(30)
def test_check_space_and_limit_parsing(monkeypatch):
    assert _space.parse_bytes("64m") == 64 << 20 and _space.parse_bytes(4096) == 4096
    with pytest.raises(ValueError, match="TORCHFEED_SHM_LIMIT"):
        _space.parse_bytes("lots")
    monkeypatch.setenv(_space.ENV_LIMIT, "2m")
    ok = check_space(1 << 20)
    assert ok.ok and ok.budget <= 2 << 20
    bad = check_space(3 << 20)
    assert not bad.ok and "TORCHFEED_SHM_LIMIT=2m" in bad.message()
    assert check_space(3 << 20, option="1m").budget == 1 << 20  # the smaller wins
    monkeypatch.delenv(_space.ENV_LIMIT)
    assert check_space(1 << 20).ok  # half the available memory is plenty


# -- escape hatch -----------------------------------------------------------------

@pytest.mark.timeout(60)
def test_torch_transport_escape_hatch(monkeypatch):
    gc.collect()
    earlier = set(slot_ranges())  # an earlier test's batches, still alive, may map some
    assert resolve_transport() == "shm"
    assert isinstance(create_channel(1, None, {"transport": "torch"}), TorchChannel)
    monkeypatch.setenv(_transport.ENV_TRANSPORT, "torch")
    assert resolve_transport() == "torch"
    with pytest.raises(ValueError, match="'shm', 'torch'"):
        resolve_transport("fast")
    with h.Pipeline(1) as p:
        assert isinstance(p.channel, TorchChannel)
        i, batch = p.get("every_leaf")
        # Exactly what torch's reductions make of it (numpy's pickle, for one,
        # drops a non-native byte order; the shm transport keeps it).
        assert_same(batch, pickle.loads(ForkingPickler.dumps(h.every_leaf(i))))
        assert p.unpacker.stats()["transport"] == "torch"
        assert not set(slot_ranges()) - earlier  # torch's transport maps no arena


# -- nothing leaks -------------------------------------------------------------------

def _no_leftovers(pids, shm_before, refs_before, used=()):
    """Nothing left of the test's own: its processes gone, none of their arenas
    held by them or by this process (``refs_before``: what earlier tests in this
    pytest worker still held), no /dev/shm entry of theirs."""
    assert h.wait_until(lambda: not any(h.alive(pid) for pid in pids)), "process left behind"
    for pid in pids:
        assert h.memfd_refs(pid) == []
    assert h.added_memfd_refs(refs_before) == []
    assert h.leftover_shm(shm_before, pids + [os.getpid()], used) == set()


@pytest.mark.timeout(60)
def test_close_returns_memory_and_held_batches_stay_valid():
    before, refs = h.dev_shm(), h.memfd_refs_now()
    p = h.Pipeline(1)
    _, keep = p.get("image")
    for _ in range(5):
        _, b = p.get("image")
    del b
    pids = [x.pid for x in p.procs]
    p.close()
    gc.collect()
    # The held batch is still readable; only its own slot stays mapped, and no
    # descriptor of the arena stays open.
    assert int(keep[0][0, 0, 0, 0]) == 0 and int(keep[1][0]) == 0
    assert [kind for kind, *_ in h.added_memfd_refs(refs)] == ["map"]
    del keep
    gc.collect()
    _no_leftovers(pids, before, refs)


@pytest.mark.timeout(60)
def test_no_leak_after_exception_in_consumer():
    before, refs = h.dev_shm(), h.memfd_refs_now()
    with pytest.raises(ZeroDivisionError):
        with h.Pipeline(2) as p:
            pids = [x.pid for x in p.procs]
            for _ in range(5):
                _, b = p.get("image")
            1 / 0
    del b
    gc.collect()
    _no_leftovers(pids, before, refs)


@pytest.mark.timeout(60)
def test_no_leak_after_worker_sigkill():
    before, refs = h.dev_shm(), h.memfd_refs_now()
    p = h.Pipeline(2)
    held = [p.get("image") for _ in range(4)]
    pids = [x.pid for x in p.procs]
    os.kill(pids[0], signal.SIGKILL)
    p.procs[0].join(10)
    for i, (img, labels) in held:  # what the dead worker sent is still intact
        assert int(img[0, 0, 0, 0]) == i % 251 and int(labels[0]) == i
    p.close()
    del held, img, labels
    gc.collect()
    _no_leftovers(pids, before, refs)


MAIN_SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path[:0] = [{root!r}, {tests!r}]
    import transport_helpers as h
    p = h.Pipeline({workers}, {method!r})
    held = [p.get("image", size=128) for _ in range(6)]
    print(" ".join(str(x.pid) for x in p.procs), flush=True)
    time.sleep(60)
""")


@pytest.mark.long
@pytest.mark.timeout(90)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_no_leak_after_main_process_sigkill(method):
    # One spawned worker (a fresh interpreter each) finds itself orphaned as
    # each of two would; two under fork.
    workers = 2 if method == "fork" else 1
    script = MAIN_SCRIPT.format(root=ROOT, tests=os.path.join(ROOT, "tests"), method=method,
                                workers=workers)
    refs = h.memfd_refs_now()
    pids, before, used = h.sigkill_main_process(script, workers)
    _no_leftovers(pids, before, refs, used)


# -- the channel itself ----------------------------------------------------------------

@pytest.mark.timeout(30)
def test_channel_in_one_process_and_stats():
    refs = h.memfd_refs_now()
    ch = create_channel(1, None, None)
    packer, unpacker = ch.packer(0), ch.unpacker()
    x = torch.arange(10)
    got = unpacker.unpack(packer.pack({"x": x}))
    assert torch.equal(got["x"], x)
    st = unpacker.stats()
    assert {"slots", "bytes", "allocations", "in_use", "retired", "fallbacks"} <= set(st)
    assert st["slots"] == 1 and st["allocations"] == 1 and st["in_use"] == 1
    assert st["bytes"] % _slots.REGION_ALIGN == 0
    del got
    assert unpacker.stats()["in_use"] == 0
    packer.close()
    unpacker.close()
    with pytest.raises(RuntimeError, match="closed"):
        unpacker.unpack(("x",) * 7)
    assert h.added_memfd_refs(refs) == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("key", ["f32", "bf16", "np", "np_struct", "sub", "as_numpy"])
def test_slot_stays_in_use_while_any_view_of_the_batch_lives(key):
    ch = create_channel(1, None, None)
    packer, unpacker = ch.packer(0), ch.unpacker()
    batch = {"f32": torch.arange(6.0).view(2, 3), "bf16": torch.ones(4, dtype=torch.bfloat16),
             "np": np.arange(5), "np_struct": np.zeros(3, [("a", "<i4"), ("b", "<f8")])}
    got = unpacker.unpack(packer.pack(batch))
    if key == "sub":
        keep = got["f32"][1, ::2]
    elif key == "as_numpy":
        keep = got["f32"].numpy()[0]
    else:
        keep = got[key]
    del got
    gc.collect()
    assert unpacker.stats()["in_use"] == 1
    # The worker may not take the slot back: a new batch gets another slot.
    again = unpacker.unpack(packer.pack(batch))
    assert unpacker.stats()["slots"] == 2
    del again, keep
    gc.collect()
    assert unpacker.stats()["in_use"] == 0
    packer.close()
    unpacker.close()


@pytest.mark.timeout(30)
def test_one_small_message_per_batch_with_no_tensor_inside():
    """What crosses the result queue is the slot, offsets, dtypes and shapes: a few
    hundred bytes for a 9.6 MB image batch or 32 tensors, and nothing torch's
    reductions would send as a shared-memory segment with its own descriptor."""
    ch = create_channel(1, None, None)
    packer, unpacker = ch.packer(0), ch.unpacker()
    image = {"image": torch.zeros(64, 3, 224, 224, dtype=torch.uint8),
             "label": torch.arange(64), "path": [f"img_{i}.jpg" for i in range(4)]}
    many = {f"t{i}": torch.full((64, 8), float(i)) for i in range(32)}

    for batch, bound in ((image, 1024), (many, 4096)):
        message = packer.pack(batch)
        pickled = ForkingPickler.dumps(message)
        assert len(pickled) < bound, len(pickled)
        assert not any(isinstance(x, (torch.Tensor, torch.UntypedStorage, np.ndarray))
                       for x in leaves(message))
        got = unpacker.unpack(message)
        assert all(torch.equal(got[k], batch[k]) for k in batch if k != "path")
        del got
    packer.close()
    unpacker.close()
