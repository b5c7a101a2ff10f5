"""Copying each sample's big arrays into the slot as the sample arrives.

torch fetches every sample of a batch, then stacks them. For image-sized
samples that costs memory bandwidth twice over: each sample is decoded into
fresh memory, and by the time the stack reads a batch of them back (64 x
150 KB), they have long left the cache. On a machine whose cores share a
memory bus, two workers doing that run no faster than one.

Here, when a worker collates with ``default_collate`` into a slot, it fetches
the samples one at a time (``SampleStream``). The first sample decides the
layout: every plain tensor or numpy array in it big enough to gain
(``STREAM_MIN_BYTES`` per sample and ``STREAM_MIN_BATCH_BYTES`` per batch),
reached through dicts, lists, tuples and namedtuples, gets a
``(batch_size, *shape)`` output in the slot. Each sample's big arrays are
then copied into their rows while still in the cache, and the sample keeps
the row in their place; its own buffer is freed before the next sample is
fetched, so the allocator hands the same warm memory to the next one. The
collate then finds each output already stacked and returns it as is. A
worker thread streams the same way, into ordinary memory it reuses
(``_thread_collate.py``, NOTE [ Streaming in a thread ]).

A sample that does not fit the layout (another type, shape or dtype, a
missing key, a tensor that requires grad), or an IterableDataset's stream
that ends before the batch is full, ends the streaming for the batch:
the samples already streamed get copies of their arrays back, in the types
they had, the slot is written from its start again, and the collate runs over
all the samples as torch's does in a worker, raising torch's errors (or
clearer ones: a shape that differs is named as such).

One difference from torch, for datasets that return one buffer over and over
and mutate it between calls: torch stacks the last value N times, here each
row holds the value the sample had when it was fetched.
"""

from __future__ import annotations

import numpy as np
import torch

from ._layout import _NUMPY_OF_TORCH, _slot_tensor

# Smaller arrays, or batches of them, stay in the cache until the stack reads
# them back, and copying row by row costs more in calls than it saves.
# One run of ``python benchmarks/stream_threshold.py`` (two workers, 2 cores,
# 32 MiB L3), streaming against stacking, batches/s: 0.85x for 64 KiB x 64,
# 0.86x for 96 KiB x 64, 1.53x for 128 KiB x 64, 1.34x for 192 KiB x 64,
# 0.93x for 150 KiB x 16, 1.25x for 150 KiB x 32, 1.15x for 150 KiB x 64
# (torch's DataLoader, in the same run: 8-15x slower than streaming).
STREAM_MIN_BYTES = 128 << 10        # per array, in one sample
STREAM_MIN_BATCH_BYTES = 4 << 20    # per array, over the batch

_TORCH_OF_NUMPY = {np.dtype(v): k for k, v in _NUMPY_OF_TORCH.items()}


class SampleStream:
    """The samples of one task, fetched as they are iterated: ``items`` is an
    iterator over at most ``n`` of them (fewer only at the end of an
    IterableDataset's stream); iterate once."""

    __slots__ = ("_items", "_n")

    def __init__(self, items, n: int):
        self._items = items
        self._n = n

    def __len__(self) -> int:
        return self._n

    def __iter__(self):
        return iter(self._items)


_END = object()


class _Mismatch(Exception):
    """A sample does not fit the layout the first sample set."""


class _Leaf:
    """One big array of the sample: its output in the slot and that output's rows."""

    __slots__ = ("is_numpy", "shape", "dtype", "out", "rows", "np_rows", "slot", "at",
                 "row_bytes", "file_row")

    def __init__(self, x, out, slot, at: int):
        self.is_numpy = type(x) is np.ndarray
        self.shape = x.shape
        self.dtype = x.dtype
        self.out = out
        self.rows = out.unbind(0)
        self.np_rows = out.numpy() if self.is_numpy else None
        # Rows from ``file_row`` on reach past the slot's ``file_from``: they
        # are written with ``slot.write``, through the file, instead of
        # through this process's mapping (``_slots.WorkerSlot.write``).
        self.slot, self.at, self.row_bytes = slot, at, x.nbytes
        self.file_row = max(0, (slot.file_from - at) // x.nbytes)

    def put(self, x, i: int):
        """Copy ``x`` into row ``i``; the row takes its place in the sample."""
        if self.is_numpy:
            if (type(x) is not np.ndarray or x.dtype != self.dtype or x.shape != self.shape
                    or _negative_strides(x)):
                raise _Mismatch
            if i >= self.file_row and x.flags.c_contiguous:
                self.slot.write(self.at + i * self.row_bytes, x.reshape(-1).view(np.uint8))
            else:
                np.copyto(self.np_rows[i], x, casting="no")
        else:
            if (type(x) is not torch.Tensor or x.dtype != self.dtype or x.shape != self.shape
                    or not _slot_tensor(x)):
                raise _Mismatch
            if (i >= self.file_row and x.is_contiguous() and not x.is_conj()
                    and not x.is_neg()):
                self.slot.write(self.at + i * self.row_bytes,
                                x.reshape(-1).view(torch.uint8).numpy())
            else:
                self.rows[i].copy_(x)
        return self.rows[i]

    def give_back(self, row):
        """What the sample had in this place, as far as the collate can tell: a
        copy, so that the slot can be written from its start again."""
        return row.numpy().copy() if self.is_numpy else row.clone()


def _negative_strides(a) -> bool:
    # torch.as_tensor refuses these, so default_collate raises for them.
    return any(s < 0 for s in a.strides)


def _is_namedtuple(tp) -> bool:
    return issubclass(tp, tuple) and hasattr(tp, "_fields")


def _children(x):
    tp = type(x)
    if tp is dict:
        return x.items()
    if tp is list or tp is tuple or _is_namedtuple(tp):
        return enumerate(x)
    return None


def _output_dtype(x, n: int):
    """The torch dtype of the output for array ``x`` of ``n`` in a batch, or
    None when it is not worth streaming (too small) or cannot be (not a plain
    tensor or a numpy array torch takes as it is)."""
    if x.nbytes < STREAM_MIN_BYTES or x.nbytes * n < STREAM_MIN_BATCH_BYTES:
        return None
    if type(x) is torch.Tensor:
        return x.dtype if _slot_tensor(x) else None
    return None if _negative_strides(x) else _TORCH_OF_NUMPY.get(x.dtype)


def streamable_bytes(x, n: int) -> int:
    """The bytes that ``plan`` would reserve for the outputs of ``x``, the
    first of ``n`` samples (before alignment)."""
    tp = type(x)
    if tp is torch.Tensor or tp is np.ndarray:
        return x.nbytes * n if _output_dtype(x, n) is not None else 0
    items = _children(x)
    return 0 if items is None else sum(streamable_bytes(v, n) for _, v in items)


def plan(x, n: int, reserve):
    """The layout of ``x``, the first of ``n`` samples: a ``_Leaf``, or
    ``(type, [(key, node), ...])``, or None when nothing in ``x`` is worth
    streaming. ``reserve(shape, dtype)`` returns the ``(n, *shape)`` output
    with the slot it is in and its byte offset there, or None when the slot
    is full."""
    tp = type(x)
    if tp is torch.Tensor or tp is np.ndarray:
        dtype = _output_dtype(x, n)
        got = None if dtype is None else reserve((n, *x.shape), dtype)
        return None if got is None else _Leaf(x, *got)
    items = _children(x)
    if items is None:
        return None
    nodes = [(k, node) for k, v in items if (node := plan(v, n, reserve)) is not None]
    return (tp, nodes) if nodes else None


def _rebuild(x, node, leaf_fn):
    """``x`` with every array the layout names replaced by ``leaf_fn(leaf, array)``."""
    if type(node) is _Leaf:
        return leaf_fn(node, x)
    tp, nodes = node
    if type(x) is not tp:
        raise _Mismatch
    if tp is dict:
        y = dict(x)
        for k, child in nodes:
            if k not in y:
                raise _Mismatch
            y[k] = _rebuild(y[k], child, leaf_fn)
        return y
    items = list(x)
    for k, child in nodes:
        if k >= len(items):
            raise _Mismatch
        items[k] = _rebuild(items[k], child, leaf_fn)
    if tp is list:
        return items
    return tuple(items) if tp is tuple else tp(*items)


def _leaves(node):
    if type(node) is _Leaf:
        yield node
    else:
        for _, child in node[1]:
            yield from _leaves(child)


def stream_samples(samples, reserve):
    """Fetch ``samples`` (a ``SampleStream``) one by one, streaming their big
    arrays into the slot. ``reserve(shape, dtype)`` returns ``(view, slot,
    offset)``, or None when the slot is full (see ``plan``). Returns the samples, to collate, and
    ``{id(first row): leaf}`` for every output whose rows are all in place."""
    n = len(samples)
    it = iter(samples)
    first = next(it, _END)
    if first is _END:
        return [], {}
    layout = plan(first, n, reserve)
    if layout is None:
        return [first, *it], {}
    out = []
    x, first = first, None
    try:
        for i in range(n):
            if i:
                x = next(it, _END)
                if x is _END:  # the stream ended short: rows to spare
                    raise _Mismatch
            out.append(_rebuild(x, layout, lambda leaf, a: leaf.put(a, i)))
            # Its big arrays are in the slot now: drop them before the next
            # fetch, so the allocator hands their warm memory to it.
            x = None
    except _Mismatch:
        # ``x`` is untouched: only the streamed samples need their arrays back.
        restored = [_rebuild(s, layout, _Leaf.give_back) for s in out]
        return [*restored, *([] if x is _END else [x, *it])], {}
    leaves = list(_leaves(layout))
    return out, {id(leaf.rows[0]): leaf for leaf in leaves}


def streamed_output(streamed: dict, batch):
    """The output ``stream_samples`` already stacked ``batch`` into (its rows,
    in order, are the batch), or None: ``streamed`` is what it returned."""
    leaf = streamed.get(id(batch[0]))
    if (leaf is not None and len(batch) == len(leaf.rows)
            and all(a is b for a, b in zip(batch, leaf.rows))):
        return leaf.out
    return None
