"""``torchfeed.share``: one read-only copy of a dataset's data per machine,
whatever the start method and however many workers and ranks read it.

    records = torchfeed.share(records)   # a list of dicts -> SharedSequence

A list or tuple becomes a :class:`SharedSequence`, a dict a
:class:`SharedMapping` (``_sequence.py``, ``_mapping.py``), both stored as
pickled records in a sealed memfd (``_buffer.py``, written by ``_writer.py``);
a numpy array becomes a copy-on-write :class:`SharedArray` and a CPU tensor a
shared-memory copy (``_arrays.py``). ``share_all`` puts several in one memfd
(``share_dataset=True``: one per loader). Under ``torch.distributed`` with a
``name``, the ranks on one host hold one copy between them (``_ranks.py``).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from .. import _host
from . import _buffer, _ranks
from ._arrays import SharedArray, attach_array, check_array, share_tensor
from ._mapping import SharedMapping
from ._sequence import SharedSequence
from ._writer import Unpicklable, write_pack

SHAREABLE = "a list, tuple, dict, numpy array or CPU tensor"


def share(obj, *, name: str | None = None, group=None):
    """A read-only equivalent of ``obj`` whose data is stored once, in shared
    memory every process on the machine maps.

    Reading an item builds a fresh object in the reader; writes to a container
    raise ``TypeError``; a write to an array stays in the process that makes
    it (copy-on-write).  Sent to another process by ``multiprocessing`` (a
    DataLoader worker under spawn or forkserver, a queue), the result travels
    as a file descriptor; ``pickle.dumps`` writes its plain values.  The memory
    is freed when the last process holding it lets go, and nothing is left in
    ``/dev/shm``.  ``obj`` already shared is returned as it is.  Where the host
    has no memfd and seals (macOS, Windows), ``obj`` is returned unshared, with
    a ``PlatformFallbackWarning`` once.

    Args:
        obj: a ``list`` or ``tuple`` (gives a `SharedSequence`), a ``dict`` or
            ``defaultdict`` (a `SharedMapping`), a numpy array (a copy-on-write
            ``SharedArray``) or a CPU tensor (a copy in shared memory), or a
            callable that takes no argument and returns one of these.
        name (str): labels the memory (``/proc/<pid>/fd`` shows
            ``torchfeed-share-<name>``).  With a ``name``, under an
            initialized ``torch.distributed`` process group, this is a
            collective call: every rank of ``group`` calls it, in the same
            order, with the same name and the same data, and the ranks on one
            host share one copy, built by the lowest of them; pass a callable
            so that the other ranks never build the data at all.
        group: the ``torch.distributed`` process group of a named share
            (default: the world).

    Returns:
        The shared equivalent of ``obj``.

    Raises:
        TypeError: ``obj`` is none of the kinds above (a subclass of list,
            tuple or dict other than ``defaultdict``, an ndarray subclass
            such as a masked array or ``np.matrix``, an object array, a tensor
            not on the CPU), an item cannot be pickled, a dict key has no
            hash that is the same in every process (keys must be str, bytes,
            numbers, numpy bools, ``None`` or tuples of them), an item holds
            a shared container already; ``name`` is not a str; ``group``
            without ``name``.
        ValueError: the ranks of a named share called it with different
            names, or with different data under one name.
        RuntimeError: ``group`` given without an initialized
            ``torch.distributed``; the rank that builds a named copy failed
            (every rank raises).
    """
    if is_shared(obj) and not isinstance(obj, torch.Tensor):
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
    if isinstance(obj, torch.Tensor):
        return share_tensor(obj)
    if is_shared(obj):
        return obj
    if not _host.SHARED_CONTAINERS:  # macOS, Windows: as without torchfeed.share
        _host.tell_once("share", f"torchfeed.share returns what it is given, unshared: "
                                 f"{_buffer.supported()}. Each process that gets it keeps its "
                                 "own copy, as without torchfeed.share (CPU tensors are still "
                                 "shared, by torch).")
        return obj
    try:
        [shared] = share_all([obj], name).shared
    except ShareError as exc:  # one object: a plain TypeError, as for any bad input
        raise TypeError(str(exc)) from exc.__cause__
    return shared


class ShareError(TypeError):
    """``objects[index]`` of a ``share_all`` call cannot be shared; the message says why."""

    def __init__(self, message: str, index: int):
        super().__init__(message)
        self.index = index


class Shared:
    """What ``share_all`` made: ``shared[i]`` for ``objects[i]``, and the seconds each took."""

    def __init__(self, shared: list, seconds: list, nbytes: int):
        self.shared, self.seconds, self.nbytes = shared, seconds, nbytes


def share_all(objects: list, name: str | None = None) -> Shared:
    """Share each of ``objects`` (no callables, no tensors) in one memfd: one
    descriptor however many there are, and an object that several of them hold
    stored once. Raises ``TypeError`` naming the first that cannot be shared."""
    why = _buffer.supported()
    if why is not None:
        raise RuntimeError(why)
    for index, obj in enumerate(objects):
        try:
            check_shareable(obj)
        except TypeError as exc:
            raise ShareError(str(exc), index) from None
    try:
        written = write_pack(objects, name)
    except Unpicklable as exc:
        raise ShareError(_unpicklable_message(objects[exc.part], exc), exc.part) \
            from exc.__cause__
    buffer = written.buffer
    shared = [_attach(buffer, i, obj) for i, obj in enumerate(objects)]
    return Shared(shared, written.seconds, buffer.nbytes)


def _attach(buffer, part: int, original):
    if isinstance(original, np.ndarray):
        return attach_array(buffer, part)
    if isinstance(original, dict):
        factory = original.default_factory if isinstance(original, defaultdict) else None
        return SharedMapping._attach(buffer, part, factory)
    return SharedSequence._attach(buffer, part)


def check_shareable(obj) -> None:
    """Refuse what ``share_all`` cannot take (``TypeError``); keys are
    checked as they are hashed."""
    kind = type(obj)
    if kind in (list, tuple, dict, defaultdict):
        return
    if isinstance(obj, np.ndarray):
        check_array(obj)
        return
    if isinstance(obj, (list, tuple, dict)):
        base = next(t.__name__ for t in (list, tuple, dict) if isinstance(obj, t))
        raise TypeError(
            f"torchfeed.share: {kind.__name__} is a {base} subclass, whose own "
            f"behaviour a shared {base} would lose; share {base}(x) "
            f"if that behaviour is not needed, or leave it unshared.")
    raise TypeError(f"torchfeed.share takes {SHAREABLE} (or a callable returning one), "
                    f"not a {kind.__name__}")


def _unpicklable_message(obj, exc: Unpicklable) -> str:
    if exc.position < 0:
        return str(exc)
    kind = type(obj).__name__
    if isinstance(obj, dict):
        what = "key" if exc.position % 2 == 0 else "value"
        where = f"the {what} of the dict's item {exc.position // 2}"
        kind = "dict"
    else:
        where = f"item {exc.position} of the {kind}"
    return (f"torchfeed.share: {where} cannot be pickled: {exc}. Shared items are stored "
            f"pickled; leave this {kind} unshared, or make its items picklable.")


def is_shared(obj) -> bool:
    """Whether ``obj`` is already stored in shared memory: a container made by
    ``share``, a shared array or a view of one, or a tensor in shared memory."""
    if isinstance(obj, (SharedSequence, SharedMapping)):
        return True
    if isinstance(obj, SharedArray):
        return obj.shared_buffer is not None
    return isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.is_shared()


def shared_nbytes(obj) -> int:
    """Bytes of shared memory behind ``obj`` (0 if it is not shared), held
    once per machine however many processes map it."""
    if isinstance(obj, (SharedSequence, SharedMapping)):
        return obj.nbytes
    if isinstance(obj, SharedArray) and obj.shared_buffer is not None:
        return obj.shared_buffer.parts[obj._shared_part].extra[4]
    if is_shared(obj):
        return obj.untyped_storage().nbytes()
    return 0


__all__ = ["ShareError", "SharedArray", "SharedMapping", "SharedSequence", "is_shared", "share",
           "share_all", "shared_nbytes"]
