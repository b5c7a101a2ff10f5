"""``torchfeed.share``: one read-only copy of a dataset's data per machine,
whatever the start method and however many workers and ranks read it.

    records = torchfeed.share(records)   # a list of dicts -> SharedSequence

A list or tuple becomes a :class:`SharedSequence`, a dict a
:class:`SharedMapping` (``_sequence.py``, ``_mapping.py``), both stored as
pickled records in one sealed memfd (``_buffer.py``); a numpy array becomes a
read-only :class:`SharedArray` and a CPU tensor a shared-memory copy
(``_arrays.py``). Under ``torch.distributed`` with a ``name``, the ranks on
one host hold one copy between them (``_ranks.py``).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from .. import _host
from . import _buffer, _ranks
from ._arrays import SharedArray, share_array, share_tensor
from ._mapping import SharedMapping, build_mapping
from ._sequence import SharedSequence, build_sequence

SHAREABLE = "a list, tuple, dict, numpy array or CPU tensor"


def share(obj, *, name: str | None = None, group=None):
    """A read-only equivalent of ``obj`` whose data is stored once, in shared
    memory every process on the machine maps.

    Reading an item builds a fresh object in the reader; writes raise
    ``TypeError``.  Sent to another process by ``multiprocessing`` (a
    DataLoader worker under spawn or forkserver, a queue), the result travels
    as a file descriptor; ``pickle.dumps`` writes its values. The memory is
    freed when the last process holding it lets go, and nothing is left in
    ``/dev/shm``.  ``obj`` already shared is returned as it is.

    Args:
        obj: a ``list`` or ``tuple`` (gives a `SharedSequence`), a ``dict`` or
            ``defaultdict`` (a `SharedMapping`), a numpy array (a read-only
            array in shared memory) or a CPU tensor (a copy in shared memory),
            or a callable that takes no argument and returns one of these.
        name (str): labels the memory (``/proc/<pid>/fd`` shows
            ``torchfeed-share-<name>``).  With a ``name``, under an
            initialized ``torch.distributed`` process group, this is a
            collective call: every rank of ``group`` calls it, in the same
            order, with the same name, and the ranks on one host share one
            copy, built by the lowest of them; pass a callable so that the
            other ranks never build the data at all.
        group: the ``torch.distributed`` process group of a named share
            (default: the world).

    Returns:
        The shared equivalent of ``obj``.

    Raises:
        TypeError: ``obj`` is none of the kinds above (a subclass of list,
            tuple or dict other than ``defaultdict``, an object array, a tensor
            not on the CPU), an item cannot be pickled, a dict key has no
            hash that is the same in every process (keys must be str, bytes,
            numbers, ``None`` or tuples of them), an item holds a shared
            container already; ``name`` is not a str; ``group`` without
            ``name``.
        ValueError: the ranks of a named share called it with different
            names.
        RuntimeError: this system cannot make sealed anonymous shared memory
            (memfd); ``group`` given without an initialized
            ``torch.distributed``; the rank that builds a named copy failed.
    """
    if isinstance(obj, (SharedSequence, SharedMapping)) or _is_shared_array(obj):
        return obj
    if name is not None and not isinstance(name, str):
        raise TypeError(f"torchfeed.share: name must be a str or None, not {type(name).__name__}")
    if group is not None and name is None:
        raise TypeError("torchfeed.share: group= shares across ranks under a name; pass "
                        "name= too (the same on every rank)")
    if name is not None and _host.SHARED_CONTAINERS and _ranks.distributed(group):
        return _ranks.share_across_ranks(obj, name, group, share_here)
    return share_here(obj, name)


def share_here(obj, name: str | None):
    """``share`` in this process alone."""
    if callable(obj) and not isinstance(obj, (np.ndarray, torch.Tensor)):
        made = obj()
        if callable(made) and not isinstance(made, (np.ndarray, torch.Tensor)):
            raise TypeError(f"torchfeed.share: the callable returned a {type(made).__name__}; "
                            f"it should return {SHAREABLE}")
        return share_here(made, name)
    why = _buffer.supported()
    if why is not None and not isinstance(obj, torch.Tensor):
        if not _host.SHARED_CONTAINERS:  # macOS, Windows: as without torchfeed.share
            _host.tell_once("share", f"torchfeed.share returns what it is given, unshared: {why}. "
                                     "Each process that gets it keeps its own copy, as without "
                                     "torchfeed.share (CPU tensors are still shared, by torch).")
            return obj
        raise RuntimeError(why)
    kind = type(obj)
    if kind is list or kind is tuple:
        return build_sequence(obj, name)
    if kind is dict or kind is defaultdict:
        return build_mapping(obj, name)
    if isinstance(obj, (SharedSequence, SharedMapping)) or _is_shared_array(obj):
        return obj
    if isinstance(obj, np.ndarray):
        return share_array(obj, name)
    if isinstance(obj, torch.Tensor):
        return share_tensor(obj)
    if isinstance(obj, (list, tuple, dict)):
        raise TypeError(
            f"torchfeed.share: {kind.__name__} is a {_base_name(obj)} subclass, whose own "
            f"behaviour a shared {_base_name(obj)} would lose; share {_base_name(obj)}(x) "
            f"if that behaviour is not needed, or leave it unshared.")
    raise TypeError(f"torchfeed.share takes {SHAREABLE} (or a callable returning one), "
                    f"not a {kind.__name__}")


def _base_name(obj) -> str:
    return next(t.__name__ for t in (list, tuple, dict) if isinstance(obj, t))


def _is_shared_array(obj) -> bool:
    return isinstance(obj, SharedArray) and obj.shared_buffer is not None


def is_shared(obj) -> bool:
    """Whether ``obj`` is already stored in shared memory: a container made by
    ``share``, a view of a shared array, or a tensor in shared memory."""
    if isinstance(obj, (SharedSequence, SharedMapping)) or _is_shared_array(obj):
        return True
    return isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.is_shared()


def shared_nbytes(obj) -> int:
    """Bytes of shared memory behind ``obj`` (0 if it is not shared): the
    whole buffer, held once per machine however many processes map it."""
    if isinstance(obj, (SharedSequence, SharedMapping)):
        return obj.nbytes
    if _is_shared_array(obj):
        return obj.shared_buffer.nbytes
    if is_shared(obj):
        return obj.untyped_storage().nbytes()
    return 0


__all__ = ["SharedArray", "SharedMapping", "SharedSequence", "is_shared", "share",
           "shared_nbytes"]
