"""Page-locked slots (``torchfeed/_transport/_page_lock.py``) on a machine
without CUDA: the CUDA runtime is stubbed (``cuda_stubs.FakeRuntime``), and
the transport, the unpacker's slot book-keeping and the releaser's thread are
the real ones, in one process (a channel's packer and unpacker side by side).
The fences find no device, so each passes at once; the GPU side is
``test_gpu_feed.py``'s.
"""
from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from cuda_stubs import FakeRuntime, page_lock_slots

from torchfeed._transport import _page_lock, create_channel


@pytest.fixture
def runtime(monkeypatch):
    runtime = FakeRuntime()
    page_lock_slots(monkeypatch.setattr, runtime)
    yield runtime
    gc.collect()
    assert _page_lock.releaser.drain(timeout=10)


def _locked_channel():
    channel = create_channel(1, None, None)
    _page_lock.enable(channel)
    return channel, channel.packer(0), channel.unpacker()


def _batch():
    return {"x": torch.arange(4096)}


@pytest.mark.timeout(60)
def test_a_slot_its_worker_retires_is_unregistered_at_its_next_batch(runtime):
    """A slot free for more than ``idle_batches`` (64) batches is retired by its
    worker, which punches its pages out of the arena; the main process
    unregisters it at the next batch from that worker, not only when it next
    maps a slot of that worker or closes (issue 35, finding 5)."""
    channel, packer, unpacker = _locked_channel()
    held = [unpacker.unpack(packer.pack(_batch())) for _ in range(2)]  # two slots
    del held
    assert _page_lock.releaser.drain(timeout=10)
    assert len(runtime.locked) == 2
    assert unpacker.stats()["page_locked_bytes"] == sum(runtime.locked.values()) > 0
    for _ in range(80):  # one slot is reused, the other sits free, then is retired
        batch = unpacker.unpack(packer.pack(_batch()))
        del batch
        assert _page_lock.releaser.drain(timeout=10)
    stats = unpacker.stats()
    assert stats["retired"] == 1 and stats["allocations"] == 2, stats
    assert len(runtime.locked) == 1, runtime.locked  # the retired one is unlocked
    assert stats["page_locked_bytes"] == sum(runtime.locked.values()) > 0
    packer.close()
    unpacker.close()
    assert _page_lock.releaser.drain(timeout=10)
    assert runtime.locked == {}


@pytest.mark.timeout(60)
def test_a_failed_registration_leaves_no_cuda_error_in_the_thread(monkeypatch, runtime):
    """``cudaHostRegister`` refused: the slot's batches are pinned by copy, with
    one warning, and CUDA's last error is reset in the thread that asked, or
    torch would raise it at that thread's next kernel launch."""
    runtime.register_rc = 2  # cudaErrorMemoryAllocation
    monkeypatch.setattr(_page_lock, "_warned", [False])
    channel, packer, unpacker = _locked_channel()
    registered_in = []

    def unpack():
        with pytest.warns(UserWarning, match="cudaHostRegister of a .* failed with cudaError 2"):
            batch = unpacker.unpack(packer.pack(_batch()))
        registered_in.append(threading.current_thread().name)
        assert torch.equal(batch["x"], torch.arange(4096))

    thread = threading.Thread(target=unpack, name="pin-thread-stand-in")
    thread.start()
    thread.join()
    assert registered_in == ["pin-thread-stand-in"]
    assert runtime.last_error == 0
    assert runtime.last_error_cleared_in == ["pin-thread-stand-in"]
    assert runtime.locked == {}
    packer.close()
    unpacker.close()


class _SlowInt(int):
    """A slot size whose arithmetic lets other threads run in the middle of
    ``counter += size``, as a free-threaded Python may at any point: a counter
    updated from several threads without a lock then loses updates."""

    def __radd__(self, other):
        time.sleep(0.002)
        return int(other) + int(self)

    def __rsub__(self, other):
        time.sleep(0.002)
        return int(other) - int(self)


@pytest.mark.timeout(60)
def test_batches_in_use_are_counted_right_when_three_threads_drop_them():
    """``in_use``/``in_use_bytes`` go up where batches are unpacked (the pin
    thread) and down wherever a batch dies (the training loop, the releaser's
    thread, anyone's): under a lock (issue 35, finding 7)."""
    channel = create_channel(1, None, None)
    packer, unpacker = channel.packer(0), channel.unpacker()
    n = 24
    batches = []
    for _ in range(n):
        payload = packer.pack(_batch())
        payload = (*payload[:4], _SlowInt(payload[4]), *payload[5:])  # the slot's size
        batches.append(unpacker.unpack(payload))
    assert unpacker.stats()["in_use"] == n
    shares = [batches[i::3] for i in range(3)]
    del batches
    go = threading.Barrier(4)

    def drop(share):
        go.wait()
        while share:
            share.pop()

    threads = [threading.Thread(target=drop, args=(share,)) for share in shares]
    for t in threads:
        t.start()
    go.wait()
    more = unpacker.unpack(packer.pack(_batch()))  # and one unpacked meanwhile
    for t in threads:
        t.join()
    del shares
    stats = unpacker.stats()
    assert stats["in_use"] == 1 and stats["in_use_bytes"] > 0, stats
    del more
    stats = unpacker.stats()
    assert (stats["in_use"], stats["in_use_bytes"]) == (0, 0), stats
    packer.close()
    unpacker.close()



@pytest.mark.timeout(60)
def test_stats_show_the_bytes_a_loader_keeps_page_locked(monkeypatch, runtime):
    """Through a real loader, the pin thread run without an accelerator
    (``cuda_stubs.pin_thread_on_cpu``): what its slots hold locked now."""
    from cuda_stubs import pin_thread_on_cpu
    from sample_datasets import RangeDataset

    import torchfeed

    pin_thread_on_cpu(monkeypatch.setattr)
    loader = torchfeed.DataLoader(RangeDataset(64), batch_size=8, num_workers=1,
                                  pin_memory=True, persistent_workers=True)
    it = iter(loader)
    # Every batch of the epoch, held: the pin thread has nothing left to lock
    # while the two counts are read (after one batch it was still locking the next).
    held = list(it)
    assert runtime.calls[0] == ("cudaHostRegister", "torchfeed-pin-memory")
    shm = loader.stats()["shm"]
    assert shm["page_locked_bytes"] == sum(runtime.locked.values()) > 0, (shm, runtime.locked)
    assert "page-locked" in str(loader.stats())
    del held, it, loader
    gc.collect()
    assert _page_lock.releaser.drain(timeout=10)
    assert runtime.locked == {}  # all unlocked once the loader is gone
