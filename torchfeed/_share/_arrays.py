"""Shared numpy arrays and tensors.

A numpy array becomes a ``SharedArray``: an ``ndarray`` subclass over its
part of a sealed memfd (``_buffer.py``), in the array's own memory order (C,
Fortran, a 0-d array's single element). Each process maps it copy-on-write
(``MAP_PRIVATE``): reading shares the one copy; an in-place write (``x -=
0.5`` on a sample, ``torch.from_numpy(row).sub_(...)``) costs the writer
private pages and changes nothing another process sees, as a write into a
forked worker's or a spawned worker's own copy of an unshared array does.
Computations give plain numpy arrays, reductions numpy scalars
(``__array_wrap__``).

Pickling: by ``multiprocessing`` (a spawned worker's dataset) a whole shared
array travels as its pack's descriptor and is mapped again, unless this
process has written to it: then, like every view (a row returned in a
batch), it travels as its values. Any other pickler writes the values of
what is pickled, never the whole buffer.

A tensor is shared the way ``torch.multiprocessing`` shares tensors: a copy
in memory from ``Tensor.share_memory_()``, whose storage torch's own
reductions send to other processes as a descriptor. torch has no read-only
tensor, so writes are not refused; they show in every process.
"""

from __future__ import annotations

from multiprocessing import reduction

import numpy as np
import torch

from ._buffer import PAGE, SharedBuffer

try:
    from numpy.lib.array_utils import byte_bounds as _byte_bounds
except ImportError:  # numpy < 2
    _byte_bounds = np.byte_bounds  # type: ignore[attr-defined]

_NUMPY_1 = np.lib.NumpyVersion(np.__version__) < "2.0.0"


def check_array(array: np.ndarray) -> None:
    """Refuse what a shared array cannot hold (``TypeError``)."""
    if type(array) not in (np.ndarray, SharedArray):
        raise TypeError(
            f"torchfeed.share: {type(array).__module__}.{type(array).__qualname__} is a numpy "
            f"array subclass, whose own behaviour (a mask, fields, matrix shapes) a shared "
            f"array would lose; share np.asarray(x) if that behaviour is not needed, or leave "
            f"it unshared.")
    if array.dtype.kind == "T":
        raise TypeError("torchfeed.share: a numpy StringDType array keeps its strings outside "
                        "the array's memory; share array.astype(str) (fixed-width) or a "
                        "list of its strings (array.tolist()).")
    if array.dtype.hasobject:
        raise TypeError("torchfeed.share: a numpy array of dtype object holds Python "
                        "objects, not values; share a list of them instead (list(array)).")


def attach_array(buffer: SharedBuffer, part: int) -> "SharedArray":
    """Part ``part`` of ``buffer``, mapped copy-on-write in this process."""
    dtype, shape, strides, data_at, nbytes = buffer.parts[part].extra
    if nbytes:
        mapping, start = buffer.map_private(data_at, nbytes)
    else:
        mapping, start = np.zeros(max(dtype.itemsize, 1), np.uint8), 0
    array = np.ndarray(shape, dtype, buffer=mapping, offset=start,
                       strides=strides if nbytes else None).view(SharedArray)
    array._shared_buffer, array._shared_part, array._shared_mapping = buffer, part, mapping
    return array


class SharedArray(np.ndarray):
    """A numpy array in shared memory, copy-on-write in each process, made by
    :func:`torchfeed.share`."""

    _shared_buffer: SharedBuffer | None = None
    _shared_part: int = -1
    _shared_mapping: np.ndarray | None = None

    def __array_finalize__(self, obj):
        mapping = getattr(obj, "_shared_mapping", None)
        if mapping is not None and _within(self, mapping):
            self._shared_buffer = obj._shared_buffer
            self._shared_part = obj._shared_part
            self._shared_mapping = mapping

    def __array_wrap__(self, array, context=None, return_scalar=False):
        # a ufunc's or a reduction's result: new memory, as numpy gives it for
        # a plain array (a scalar for a reduction), unless it was written into
        # this shared memory (out=)
        if return_scalar or (_NUMPY_1 and array.ndim == 0):
            return array[()]
        if getattr(array, "shared_buffer", None) is not None:
            return array
        return array.view(np.ndarray)

    @property
    def shared_buffer(self) -> SharedBuffer | None:
        """The pack this array's memory lies in (None: ordinary memory)."""
        mapping = self._shared_mapping
        return self._shared_buffer if mapping is not None and _within(self, mapping) else None

    def _whole_and_clean(self) -> bool:
        """This is the whole shared array, as it was written: no view of it,
        no page this process wrote to."""
        buffer = self.shared_buffer
        if buffer is None:
            return False
        dtype, shape, strides, data_at, _ = buffer.parts[self._shared_part].extra
        if (self.dtype, self.shape, self.strides) != (dtype, shape, strides):
            return False
        mapping = self._shared_mapping
        assert mapping is not None
        start = data_at % PAGE
        address = self.__array_interface__["data"][0]
        if address != mapping.ctypes.data + start:
            return False
        return not self.nbytes or not has_private_pages(address, self.nbytes)

    def __reduce_ex__(self, protocol):
        # any pickler but multiprocessing's: the values of this array (a view: its own)
        return self.view(np.ndarray).__reduce_ex__(protocol)

    def _reduce_for_process(self):
        if self._whole_and_clean():
            return attach_array, (self._shared_buffer, self._shared_part)
        return np.asarray, (self.view(np.ndarray),)  # pickled with the pickler's protocol


reduction.ForkingPickler.register(SharedArray, SharedArray._reduce_for_process)


def _within(array: np.ndarray, mapping: np.ndarray) -> bool:
    low, high = _byte_bounds(array)
    start = mapping.ctypes.data
    return start <= low and high <= start + mapping.nbytes


def has_private_pages(address: int, length: int) -> bool:
    """Whether this process has written to any page of a private file mapping
    in ``[address, address + length)``: such a page is anonymous memory now,
    no longer the file's (``/proc/self/pagemap``: present or swapped, and not
    a file page). Where that cannot be read, True: the caller sends values."""
    first, last = address // PAGE, (address + length - 1) // PAGE
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(first * 8)
            entries = np.frombuffer(f.read((last - first + 1) * 8), np.uint64)
    except (OSError, ValueError):
        return True
    if len(entries) != last - first + 1:
        return True
    in_memory = (entries >> np.uint64(62)) != 0          # present (63) or swapped (62)
    file_page = ((entries >> np.uint64(61)) & np.uint64(1)) != 0
    return bool((in_memory & ~file_page).any())


def share_tensor(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type != "cpu":
        raise TypeError(f"torchfeed.share: a tensor on {tensor.device} cannot be shared; "
                        f"share a CPU tensor (tensor.cpu()).")
    if tensor.is_shared():
        return tensor
    shared = torch.empty_like(tensor, requires_grad=False, memory_format=torch.preserve_format)
    shared.share_memory_()
    with torch.no_grad():
        shared.copy_(tensor)
    if tensor.requires_grad:
        shared.requires_grad_(True)
    return shared
