"""``default_collate`` that stacks samples straight into a shared-memory slot.

torch's ``default_collate``, inside a worker, allocates a fresh shared-memory
segment for every stacked tensor and stacks into it: the first touch of each
page of a fresh segment faults, which runs at about 1 GB/s. Here the same
collate runs with one change: the tensor case stacks into a view of a slot the
worker reuses (``torch.stack(..., out=view)``), whose pages are already mapped.
The result has the same types, values, shapes and dtypes as ``default_collate``
(the stacked tensor keeps the first element's dtype, as torch's worker path
does), and the packer then sends those tensors without copying them again.

When there is no slot to stack into (first batch of a worker, or a batch
bigger than the last one), the tensor is stacked into ordinary memory and the
packer copies it: still never a fresh shared-memory segment. A worker's first
batch that streams more than ``_slots.WARM_BYTES`` gets a slot sized from its
first sample instead (``DirectCollate._size_first_batch``).

A user who extends ``default_collate`` the way torch documents, by replacing
the ``torch.Tensor`` entry of ``default_collate_fn_map`` (to pad
variable-length tensors, say), gets torch's ``default_collate`` with that map,
unchanged: nothing is stacked into a slot or streamed, and the packer copies
the result as for any collate function. Other entries (``np.ndarray``, custom
types) are honoured on every path, since the map is copied per batch.

Given a ``SampleStream`` rather than a list, the collate fetches the samples
itself, one by one, and copies their big arrays into the slot as they arrive
(``_stream.py``); the stacks of those arrays are then already done.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch.utils.data._utils import collate as _torch_collate

from . import _layout, _slots
from ._stream import SampleStream, stream_samples, streamable_bytes, streamed_output

_END = object()

# Smaller batches are stacked into ordinary memory and copied: for them the
# copy costs less than stacking into views does.
DIRECT_MIN_BYTES = 1 << 18


class DirectCollate:
    """Stacks into one slot it reserves per batch; the packer then sends that
    slot (``slot``, ``used`` bytes, ``direct`` tensors already in it)."""

    takes_sample_stream = True  # the fetcher may pass a SampleStream

    def __init__(self, pool=None):
        self.pool = pool
        self.expected_nbytes = 0  # what the last batch needed; set by the packer
        self.slot = None
        self.used = 0
        self.direct: dict = {}
        self.streamed: dict = {}

    def reset(self, slot) -> None:
        self.slot = slot
        self.used = 0
        self.direct = {}
        self.streamed = {}

    def _view(self, shape, dtype):
        slot = self.slot
        if slot is None:
            return None
        numel = math.prod(shape)
        itemsize = dtype.itemsize
        off = (self.used + _layout.ALIGN - 1) & ~(_layout.ALIGN - 1)
        if numel == 0 or off + numel * itemsize > slot.cap:
            return None
        self.used = off + numel * itemsize
        out = slot.typed(dtype).as_strided(shape, _layout.contiguous_strides(shape),
                                           off // itemsize)
        self.direct[id(out)] = (out, off)
        return out

    def _reserve(self, shape, dtype):
        """``_view`` for the streaming (``_stream.plan``): the view, its slot and offset."""
        out = self._view(shape, dtype)
        return None if out is None else (out, self.slot, self.direct[id(out)][1])

    def _size_first_batch(self, samples: SampleStream) -> SampleStream:
        """The worker's first batch, whose size no batch has told yet. A huge
        one (its big arrays over ``_slots.WARM_BYTES``) gets a slot sized
        from its first sample, with room for what is not streamed (arrays
        under ``_stream.STREAM_MIN_BYTES`` a sample: 1/64 of it, at least
        1 MiB), and streams into it; else it would be stacked in private
        memory and copied into a new slot, writing fresh pages twice. Every
        byte of the room is allocated and zeroed too, so it is kept small."""
        it = iter(samples)
        first = next(it, _END)
        if first is _END:
            return SampleStream(iter(()), len(samples))
        nbytes = streamable_bytes(first, len(samples))
        if nbytes > _slots.WARM_BYTES:
            self.reset(self.pool.acquire(nbytes + max(nbytes // 64, 1 << 20))[0])
            self.pool.last_nbytes = -1  # a guess, not a batch's size: sizes do not vary yet
        return SampleStream(itertools.chain([first], it), len(samples))

    def collate_tensor(self, batch, *, collate_fn_map=None):
        stacked = streamed_output(self.streamed, batch)
        if stacked is not None:
            return stacked  # streamed: already stacked in the slot
        elem = batch[0]
        if (type(elem) is not torch.Tensor or elem.layout is not torch.strided
                or not elem.is_cpu or elem.is_nested or elem.is_quantized):
            return _torch_collate.collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
        # torch's worker path sums numel() first: a batch mixing in a numpy
        # array fails there with AttributeError, so it must here too.
        sum(x.numel() for x in batch)
        out = self._view((len(batch), *elem.shape), elem.dtype)
        if out is None:  # keep the first element's dtype, as torch's worker does
            out = torch.empty((len(batch), *elem.shape), dtype=elem.dtype)
        return torch.stack(batch, 0, out=out)

    def __call__(self, samples):
        """``default_collate(samples)``, stacked into a slot where one is worth it."""
        self.reset(None)
        torch_map = _torch_collate.default_collate_fn_map
        if torch_map.get(torch.Tensor) is not _torch_collate.collate_tensor_fn:
            # default_collate extended the documented way: run it as torch does.
            return _torch_collate.collate(list(samples), collate_fn_map=torch_map)
        if self.pool is not None and self.expected_nbytes >= DIRECT_MIN_BYTES:
            self.reset(self.pool.acquire(self.expected_nbytes)[0])
        elif self.pool is not None and not self.expected_nbytes and type(samples) is SampleStream:
            samples = self._size_first_batch(samples)
        if type(samples) is SampleStream:
            if self.slot is not None:
                samples, self.streamed = stream_samples(samples, self._reserve)
                if not self.streamed:  # nothing streamed: no sample points into the slot
                    self.reset(self.slot)
            else:
                samples = list(samples)
        fn_map = dict(_torch_collate.default_collate_fn_map)
        fn_map[torch.Tensor] = self.collate_tensor
        return _torch_collate.collate(samples, collate_fn_map=fn_map)


def is_default_collate(fn) -> bool:
    """Whether ``fn`` is torch's ``default_collate`` (or torchfeed's re-export of it)."""
    if fn is _torch_collate.default_collate:
        return True
    try:
        import torch.utils.data as tud
        return fn is tud.default_collate
    except AttributeError:  # pragma: no cover
        return False
