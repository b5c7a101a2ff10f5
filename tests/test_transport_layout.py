"""What the shared-memory transport keeps of a batch besides its values:
strides, storage offsets, which tensors share a storage, numpy's memory order,
and the collate function torch would have run. Each case is compared with
torch's own DataLoader, in real worker processes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from torch.utils.data._utils import collate as torch_collate

import torchfeed


class Indices(tud.Dataset):
    def __init__(self, n=8):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def expanded_mask(samples):
    # An attention mask broadcast over batch and heads: 256 KiB of storage.
    base = torch.tril(torch.ones(256, 256)) + samples[0]
    return {"mask": base.expand(len(samples), 16, 256, 256), "ids": torch.tensor(samples)}


def channels_last(samples):
    x = torch.arange(len(samples) * 3 * 4 * 5.0).reshape(len(samples), 3, 4, 5) + samples[0]
    return x.contiguous(memory_format=torch.channels_last)


def token_views(samples):
    tokens = torch.arange(len(samples) * 6).reshape(len(samples), 6) + 100 * samples[0]
    return {"tokens": tokens, "inputs": tokens[:, :-1], "labels": tokens[:, 1:],
            "transposed": tokens.t()}


def views_before_their_base(samples):
    tokens = torch.arange(len(samples) * 6).reshape(len(samples), 6) + 100 * samples[0]
    return [tokens[:, 1:], tokens[:, :-1], tokens, tokens.detach()]


def row_of_big_storage(samples):
    big = torch.arange(1000.0) + samples[0]
    return big[10:20:2], big[500:502]


def numpy_layouts(samples):
    a = np.arange(12.0).reshape(3, 4) + samples[0]
    return {"fortran": np.asfortranarray(a), "view": a[:, :-1], "also_a": a,
            "broadcast": np.broadcast_to(np.arange(4.0), (5, 4)), "reversed": a[::-1]}


class Expanded(tud.Dataset):
    """Samples that are views, for ``batch_size=None`` (no collation)."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i % 2:
            return {"fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3) + i)}
        return {"mask": (torch.ones(64, 64) * i).expand(4, 64, 64),
                "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3) + i)}


def _leaves(x, path="batch"):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, f"{path}[{k!r}]")
    elif isinstance(x, (list, tuple)):
        for k, v in enumerate(x):
            yield from _leaves(v, f"{path}[{k}]")
    else:
        yield path, x


def _values(x: torch.Tensor):
    """A tensor's values: a list (readable in a failed assert), or past a few
    thousand elements its bytes, compared bit for bit (an expanded 16x256x256
    mask as a list of Python floats cost over a second of CPU per loader)."""
    if x.numel() <= 4096:
        return x.tolist()
    return x.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _describe(batch):
    """Every leaf's layout, with storages numbered in order of appearance."""
    storages, out = {}, []
    for path, x in _leaves(batch):
        if isinstance(x, torch.Tensor):
            s = x.untyped_storage()
            out.append((path, "tensor", x.dtype, tuple(x.shape), x.stride(), x.storage_offset(),
                        s.nbytes(), storages.setdefault(s.data_ptr(), len(storages)),
                        _values(x)))
        elif isinstance(x, np.ndarray):
            out.append((path, "ndarray", x.dtype, x.shape, x.strides, x.flags.c_contiguous,
                        x.flags.f_contiguous, x.flags.writeable, x.tolist()))
        else:
            out.append((path, type(x), x))
    return out


def _batches(loader_cls, **kwargs):
    return [_describe(b) for b in loader_cls(num_workers=2, **kwargs)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("collate_fn", [expanded_mask, channels_last, token_views,
                                        views_before_their_base, row_of_big_storage,
                                        numpy_layouts])
def test_collate_fn_output_keeps_torchs_layout_and_aliasing(collate_fn):
    kwargs = dict(dataset=Indices(), batch_size=2, collate_fn=collate_fn)
    want = _batches(tud.DataLoader, **kwargs)
    assert _batches(torchfeed.DataLoader, **kwargs) == want


@pytest.mark.timeout(60)
def test_unbatched_views_keep_torchs_layout():
    kwargs = dict(dataset=Expanded(), batch_size=None)
    want = _batches(tud.DataLoader, **kwargs)
    got = _batches(torchfeed.DataLoader, **kwargs)
    assert got == want
    assert got[0][0][4] == (0, 64, 1) and got[0][0][6] == 64 * 64 * 4  # never materialised


@pytest.mark.timeout(60)
def test_a_write_to_one_view_shows_in_the_other():
    for loader_cls in (tud.DataLoader, torchfeed.DataLoader):
        batch = next(iter(loader_cls(Indices(), batch_size=2, num_workers=1,
                                     collate_fn=token_views)))
        batch["inputs"][0, 1] = -7
        assert batch["tokens"][0, 1] == batch["labels"][0, 0] == -7, loader_cls
        assert batch["transposed"][1, 0] == -7, loader_cls


class RowsOfOneTensor(tud.Dataset):
    """``__getitem__`` returns a view of one 8 MiB tensor, as a dataset held in
    memory as one tensor does."""

    def __init__(self):
        self.data = torch.arange(2048 * 1024, dtype=torch.float32).view(2048, 1024)

    def __len__(self):
        return 6

    def __getitem__(self, i):
        return self.data[300 * i, 1:9:2]


@pytest.mark.timeout(60)
def test_a_small_view_of_a_big_storage_sends_only_what_it_reaches():
    # torch moves the whole 8 MiB storage into shared memory for this; a
    # slot gets only the span the view reaches, so storage_offset() counts
    # from there. Values, shape and strides are torch's.
    want = list(tud.DataLoader(RowsOfOneTensor(), batch_size=None, num_workers=2))
    got = list(torchfeed.DataLoader(RowsOfOneTensor(), batch_size=None, num_workers=2))
    for g, w in zip(got, want):
        assert torch.equal(g, w) and g.stride() == w.stride() == (2,)
        assert w.untyped_storage().nbytes() == 8 << 20
        assert g.untyped_storage().nbytes() <= 128
    assert len(got) == len(want) == 6


def pad_tensors(batch, *, collate_fn_map=None):
    """torch's documented example: pad variable-length tensors, then stack."""
    longest = max(t.shape[0] for t in batch)
    return torch.stack([torch.nn.functional.pad(t, (0, longest - t.shape[0])) for t in batch])


def double_arrays(batch, *, collate_fn_map=None):
    return np.stack(batch) * 2


class VariableLength(tud.Dataset):
    """Tensors of varying length, and numpy arrays big enough to be streamed
    into the slot (256 KiB each, 8 MiB per batch) were the map torch's own."""

    def __init__(self, varying):
        self.varying = varying

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return {"tokens": torch.arange(i % 7 + 1 if self.varying else 7) + i,
                "image": np.full((256, 256), i, dtype=np.float32)}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("entry", [torch.Tensor, np.ndarray])
def test_default_collate_fn_map_override_is_honoured_in_workers(entry, monkeypatch):
    # The Tensor entry once went ignored (the in-slot stack replaced it); the
    # np.ndarray entry guards the streaming path, which rewrites numpy samples.
    monkeypatch.setitem(torch_collate.default_collate_fn_map, entry,
                        pad_tensors if entry is torch.Tensor else double_arrays)
    kwargs = dict(dataset=VariableLength(varying=entry is torch.Tensor), batch_size=32,
                  num_workers=2)
    want = list(tud.DataLoader(**kwargs))
    got = list(torchfeed.DataLoader(**kwargs))
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        assert torch.equal(g["tokens"], w["tokens"]) and g["tokens"].shape[1] == 7
        assert type(g["image"]) is type(w["image"])
        assert (g["image"] == w["image"]).all()
