"""A huge slot's bytes past its warm part are written through the arena's
file (``pwrite``), not through the worker's mapping (``WorkerSlot.write``).

``WARM_BYTES`` is 1 MiB here, so batches of a few MiB count as huge; forked
workers inherit the patched module.  The batches are checked value by value,
on every path that writes a slot: streamed rows of tensors and numpy arrays,
rows that cannot be written as raw bytes (a transposed tensor, a conjugate),
and the leaves a custom ``collate_fn`` returns.  The second test checks that
the worker does not fault those pages in: that is the point of the path.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

import torchfeed
from torchfeed._transport import _slots

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")

WARM = 1 << 20
ROW = 512 << 10  # bytes per sample and array: 4 samples make a 2 MiB output


class Mixed(Dataset):
    """Sample i: arrays of ``ROW`` bytes whose every value is i, in the
    forms the streaming writes differently."""

    def __len__(self):
        return 48

    def __getitem__(self, i):
        side = int((ROW // 4) ** 0.5)
        return {"tensor": torch.full((ROW // 4,), i, dtype=torch.float32),
                "array": np.full(ROW // 8, i, dtype=np.float64),
                "transposed": torch.full((side, side), i, dtype=torch.float32).t(),
                "conj": torch.full((ROW // 8,), complex(i, i), dtype=torch.complex64).conj(),
                "label": i}


def _check(batch, first):
    ids = torch.arange(first, first + len(batch["label"]))
    assert torch.equal(batch["label"], ids)
    for key in ("tensor", "array", "transposed"):
        values = batch[key].reshape(len(ids), -1)
        assert bool((values == ids[:, None].to(values.dtype)).all()), key
    conj = batch["conj"]
    f = ids.to(torch.float32)
    assert bool((conj == torch.complex(f, -f)[:, None]).all())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("persistent", [False, True])
def test_streamed_rows_past_the_warm_part_carry_every_value(monkeypatch, persistent):
    monkeypatch.setattr(_slots, "WARM_BYTES", WARM)
    loader = torchfeed.DataLoader(Mixed(), batch_size=4, num_workers=2, persistent_workers=persistent,
                                  multiprocessing_context="fork")
    for _ in range(2):  # the second epoch reuses slots that went cold, or makes them anew
        it = iter(loader)
        for k, batch in enumerate(it):
            _check(batch, 4 * k)
            if k == 3:
                table = loader.stats()["shm"]["slot_table"]
                assert any(cap > WARM for _, _, cap, *_ in table), table  # huge slots
        del it


class Big(Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.full((ROW // 4,), i, dtype=torch.float32)


def _concatenate(samples):
    """A collate torch does not know: the packer copies its result into the slot."""
    return torch.cat(samples), torch.tensor([int(s[0]) for s in samples])


@pytest.mark.timeout(120)
def test_a_custom_collates_huge_leaves_carry_every_value(monkeypatch):
    monkeypatch.setattr(_slots, "WARM_BYTES", WARM)
    loader = torchfeed.DataLoader(Big(), batch_size=8, num_workers=2, collate_fn=_concatenate,
                                  multiprocessing_context="fork")
    for k, (values, ids) in enumerate(loader):
        assert torch.equal(ids, torch.arange(8 * k, 8 * k + 8))
        assert torch.equal(values, ids.to(torch.float32).repeat_interleave(ROW // 4))


class Preloaded(Dataset):
    """Samples the parent wrote before the fork: reading them faults no page in."""

    def __init__(self, n, nbytes):
        self.data = torch.arange(n, dtype=torch.float32)[:, None].repeat(1, nbytes // 4)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])  # field 10, minflt


@pytest.mark.timeout(120)
def test_the_worker_faults_in_no_page_it_writes_through_the_file(monkeypatch):
    monkeypatch.setattr(_slots, "WARM_BYTES", WARM)
    batch_bytes = 16 << 20
    loader = torchfeed.DataLoader(Preloaded(4, batch_bytes // 4), batch_size=4, num_workers=1,
                                  persistent_workers=True, multiprocessing_context="fork")
    list(loader)  # the worker is started, its imports and first slot done
    pid = loader._iterator._workers[0].pid
    before = _minor_faults(pid)
    (batch,) = list(loader)
    faults = _minor_faults(pid) - before
    assert torch.equal(batch[:, -1], torch.arange(4, dtype=torch.float32))
    # Written through the mapping, the 15 MiB past the warm part would take
    # 3840 faults of 4 KiB pages: the worker took a fraction of that.
    through_file = (batch_bytes - WARM) // 4096
    assert faults < through_file // 4, (faults, through_file)
