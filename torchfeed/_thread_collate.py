"""torch's ``default_collate`` for a thread worker: the same batch, in ordinary
memory that is used again once the batch is gone.

torch's ``default_collate`` stacks each tensor into a fresh shared-memory
segment whenever ``get_worker_info()`` is set (a worker process hands its
batch to the main process that way).  In a thread worker the batch never
leaves the process, so ``InMemoryCollate`` stacks into ordinary memory, into
a tensor of the first element's dtype as torch's worker path does, so that
batches equal a process worker's.

NOTE [ Fresh pages per batch ]
A fresh large tensor costs a page fault per page as it is first written (25
MiB a batch of 32 float32 crops of 256x256: 44 ms against 7 ms into memory
already touched, in one worker thread on the 2-core machine), as it would in
any loader that allocates each batch; torchfeed's process workers avoid it by
writing into shared-memory slots they reuse.  So a thread worker's stacked
tensors of ``RECYCLE_MIN_BYTES`` or more come from ``RecycledMemory``: a
buffer that a batch has let go of, or a new one.  The batch is handed over by
reference, so a buffer comes back only when nothing refers to it any more: its
tensor's storage holds the one numpy view of it (``torch.from_numpy``), and a
weakref on that view puts the buffer on the worker's queue of free buffers
when it dies, that is when the last tensor, view or ``.numpy()`` array over
that memory is gone, in whichever thread drops it (``queue.SimpleQueue.put``:
no lock of ours, no reliance on the GIL).  A callback cut short (a Ctrl-C
landing in it) loses that buffer to the garbage collector, nothing else.  A
worker keeps at most ``KEEP_FREE`` free buffers of a size.

NOTE [ Streaming in a thread ]
Stacking a batch of big arrays after fetching them all reads each sample back
from memory once it has left the cache: for 32 numpy crops of 768 KiB, the
stack took about half of a thread worker's CPU time, and two threads loaded
0.55x to 0.67x the batches of two processes, which copy each sample into their
slot as it arrives (``_transport/_stream.py``).  So a thread worker streams
too: its fetcher hands ``InMemoryCollate`` a ``SampleStream``, each sample's
big arrays are copied into rows of a recycled buffer while still in the cache,
and the stack finds them in place.  The rules are the process workers': the
same layout, the same sizes worth it, the same fallback to stacking.
"""
from __future__ import annotations

import math
import queue
import sys
import weakref

import numpy as np
import torch
from torch.utils.data._utils import collate as _torch_collate

from ._transport import is_default_collate
from ._transport._stream import SampleStream, stream_samples, streamed_output

RECYCLE_MIN_BYTES = 1 << 20  # smaller tensors: torch's allocator, whose heap is warm anyway
KEEP_FREE = 1                # free buffers a worker keeps per size: the one it fills next


def in_memory_collate(collate_fn):
    """What a thread worker calls for ``collate_fn``: an ``InMemoryCollate``
    of its own for torch's ``default_collate``; any other function as it is."""
    return InMemoryCollate() if is_default_collate(collate_fn) else collate_fn


class InMemoryCollate:
    """``default_collate(samples)``, tensors stacked into ordinary (recycled)
    memory.  A ``torch.Tensor`` entry the user put in ``default_collate_fn_map``
    (torch's documented way to extend it) is honoured as it is."""

    takes_sample_stream = True  # the fetcher may pass a SampleStream: NOTE [ Streaming in a thread ]

    def __init__(self) -> None:
        self.memory = RecycledMemory()
        self.streamed: dict = {}  # id(first row) -> _stream._Leaf, for the batch being collated

    def __call__(self, samples):
        torch_map = _torch_collate.default_collate_fn_map
        if torch_map.get(torch.Tensor) is not _torch_collate.collate_tensor_fn:
            return _torch_collate.collate(list(samples), collate_fn_map=torch_map)
        if type(samples) is SampleStream:
            samples, self.streamed = stream_samples(samples, self._reserve)
        fn_map = dict(torch_map)
        fn_map[torch.Tensor] = self._stack
        try:
            return _torch_collate.collate(samples, collate_fn_map=fn_map)
        finally:
            self.streamed = {}  # the rows are the batch's now, not ours to hold

    def _reserve(self, shape, dtype):
        """An output for ``stream_samples``: ``(tensor, where, offset)``."""
        return self.memory.tensor(shape, dtype), IN_MEMORY, 0

    def _stack(self, batch, *, collate_fn_map=None):
        stacked = streamed_output(self.streamed, batch)
        if stacked is not None:
            return stacked  # streamed: already stacked
        elem = batch[0]
        if elem.is_nested or elem.layout != torch.strided:
            return _torch_collate.collate_tensor_fn(batch, collate_fn_map=collate_fn_map)  # torch's error
        shape = (len(batch), *elem.shape)
        out = (self.memory.tensor(shape, elem.dtype) if elem.device.type == "cpu"
               else elem.new_empty(shape))
        return torch.stack(batch, 0, out=out)


class _InMemory:
    """Where a thread's streamed rows live, for ``_stream._Leaf``: ordinary
    memory, every row written through its tensor (no slot, no file)."""
    file_from = sys.maxsize


IN_MEMORY = _InMemory()


class RecycledMemory:
    """One worker thread's CPU tensors for its batches: NOTE [ Fresh pages per batch ]."""

    def __init__(self) -> None:
        self._given_back: queue.SimpleQueue = queue.SimpleQueue()  # (nbytes, buffer), any thread
        self._free: dict[int, list] = {}  # nbytes -> free buffers; the worker thread's alone

    def tensor(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < RECYCLE_MIN_BYTES:
            return torch.empty(shape, dtype=dtype)
        self._take_back()
        free = self._free.get(nbytes)
        buffer = free.pop() if free else np.empty(nbytes, np.uint8)
        view = buffer[:]  # the one object the tensor's storage holds
        weakref.finalize(view, self._given_back.put, (nbytes, buffer)).atexit = False
        return torch.from_numpy(view).view(dtype).view(shape)

    def _take_back(self) -> None:
        while True:
            try:
                nbytes, buffer = self._given_back.get_nowait()
            except queue.Empty:
                return
            free = self._free.setdefault(nbytes, [])
            if len(free) < KEEP_FREE:
                free.append(buffer)
