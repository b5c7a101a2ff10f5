"""Shared numpy arrays and tensors.

A numpy array becomes a ``SharedArray``: an ``ndarray`` subclass over a
sealed memfd (``_buffer.py``), read-only (numpy's own ``ValueError``,
"assignment destination is read-only", on a write). Its views (slices,
transposes) stay backed by the same memory and travel as the buffer's handle
plus their offset and strides; arrays computed from it are ordinary memory
and pickle as values.

A tensor is shared the way ``torch.multiprocessing`` shares tensors: a copy
in memory from ``Tensor.share_memory_()``, whose storage torch's own
reductions send to other processes as a descriptor. torch has no read-only
tensor, so writes are not refused; they show in every process.
"""

from __future__ import annotations

import numpy as np
import torch

from ._buffer import BufferWriter, SharedBuffer

try:
    from numpy.lib.array_utils import byte_bounds as _byte_bounds
except ImportError:  # numpy < 2
    _byte_bounds = np.byte_bounds  # type: ignore[attr-defined]

_DATA_ALIGN = 64


def share_array(array: np.ndarray, name: str | None) -> "SharedArray":
    if array.dtype.hasobject:
        raise TypeError("torchfeed.share: a numpy array of dtype object holds Python "
                        "objects, not values; share a list of them instead (list(array)).")
    contiguous = np.ascontiguousarray(array)
    writer = BufferWriter(name)
    try:
        writer.write_records([(contiguous.dtype, contiguous.shape)])
        data_at = writer.append(contiguous.reshape(-1).view(np.uint8), _DATA_ALIGN)
        buffer = writer.finish("ndarray", contiguous.size, index=None)
    except BaseException:
        writer.abandon()
        raise
    return _attach_array(buffer, data_at, contiguous.shape, None, contiguous.dtype)


def _attach_array(buffer: SharedBuffer, offset: int, shape, strides, dtype) -> "SharedArray":
    base = np.frombuffer(buffer.view, np.uint8)
    array = np.ndarray(shape, dtype, buffer=base, offset=offset, strides=strides).view(SharedArray)
    array._shared_buffer = buffer
    return array


class SharedArray(np.ndarray):
    """A read-only numpy array in shared memory, made by :func:`torchfeed.share`."""

    _shared_buffer: SharedBuffer | None = None

    def __array_finalize__(self, obj):
        buffer = getattr(obj, "_shared_buffer", None)
        if buffer is not None and _within(self, buffer):
            self._shared_buffer = buffer

    @property
    def shared_buffer(self) -> SharedBuffer | None:
        """The buffer this array's memory lies in (None: ordinary memory)."""
        buffer = self._shared_buffer
        return buffer if buffer is not None and _within(self, buffer) else None

    def __reduce__(self):
        buffer = self.shared_buffer
        if buffer is None:
            return self.view(np.ndarray).__reduce__()
        offset = self.__array_interface__["data"][0] - buffer.address
        # the buffer travels as a descriptor (ForkingPickler) or as its bytes
        return _attach_array, (buffer, offset, self.shape, self.strides, self.dtype)

    def __reduce_ex__(self, protocol):
        return self.__reduce__()

    def __copy__(self):
        return self if self.shared_buffer is not None else np.ndarray.__copy__(self)

    def __deepcopy__(self, memo):
        return self if self.shared_buffer is not None else np.ndarray.__deepcopy__(self, memo)


def _within(array: np.ndarray, buffer: SharedBuffer) -> bool:
    low, high = _byte_bounds(array)
    return buffer.address <= low and high <= buffer.address + buffer.nbytes


def share_tensor(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type != "cpu":
        raise TypeError(f"torchfeed.share: a tensor on {tensor.device} cannot be shared; "
                        f"share a CPU tensor (tensor.cpu()).")
    if tensor.is_shared():
        return tensor
    shared = torch.empty_like(tensor, requires_grad=False)
    shared.share_memory_()
    with torch.no_grad():
        shared.copy_(tensor)
    return shared
