"""One copy per machine across ``torch.distributed`` ranks.

``share(obj, name=..., group=...)`` under an initialized process group is a
collective call over the group's ranks (torch.distributed's own
``all_gather_object`` and ``barrier``; no other channel):

1. every rank sends its host (hostname, boot id and PID namespace: the ranks
   that can see each other's processes) and the name;
2. the lowest rank of each host builds the shared copy (calling ``obj`` if it
   is a callable, so the others never build the data) and sends its process
   id and the copy's descriptor;
3. the host's other ranks open that descriptor through
   ``/proc/<pid>/fd/<fd>``, which gives them their own descriptor of the same
   memory (the same memfd, or for a tensor the same shared-memory file), and
4. a barrier, so the builder holds its descriptor until all have opened it.

Where ``/proc/<pid>/fd`` cannot be opened (a hardened ``/proc``, ranks in
separate containers that share a hostname), a rank builds its own copy and
warns. An error on a building rank (its data cannot be shared, or its copy's
handle cannot be sent) is raised on every rank of the group, and so is
data that differs between ranks under one name (``fingerprint``: the kind,
the length or shape, and a sample of the items), since every rank but the
builder would silently read the builder's.
"""

from __future__ import annotations

import itertools
import os
import pickle
import socket
import warnings
import zlib

import numpy as np
import torch

from .. import _host
from ._arrays import SharedArray, attach_array
from ._buffer import SharedBuffer
from ._mapping import SharedMapping
from ._sequence import SharedSequence

_FINGERPRINT_SAMPLE = 8


def distributed(group) -> bool:
    """Whether ``share`` is collective here: torch.distributed is initialized."""
    ready = torch.distributed.is_available() and torch.distributed.is_initialized()
    if group is not None and not ready:
        raise RuntimeError("torchfeed.share: group= was given, but torch.distributed is not "
                           "initialized; call torch.distributed.init_process_group() first")
    return ready


def host_key() -> str:
    """What ranks that can open each other's ``/proc/<pid>/fd`` have in common."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        parts.append("?")
    try:
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:
        parts.append("?")
    return "/".join(parts)


def fingerprint(obj) -> str | None:
    """What every rank must agree on about the data it passes under one name
    (None for a callable: only the builder calls it)."""
    if callable(obj) and not isinstance(obj, (np.ndarray, torch.Tensor)):
        return None
    if isinstance(obj, (np.ndarray, torch.Tensor)):
        flat = obj.reshape(-1)
        step = max(1, len(flat) // _FINGERPRINT_SAMPLE)
        sample = flat[::step][:_FINGERPRINT_SAMPLE]
        values = sample.tolist()
        return f"a {obj.dtype} {type(obj).__name__} of shape {tuple(obj.shape)}, " \
               f"sample {zlib.crc32(repr(values).encode()):08x}"
    if isinstance(obj, (list, tuple, dict)):
        items = list(obj.items()) if isinstance(obj, dict) else obj
        step = max(1, len(items) // _FINGERPRINT_SAMPLE)
        crc = 0
        for item in itertools.islice(items, 0, None, step):
            if _plain(item):
                crc = zlib.crc32(pickle.dumps(item, protocol=4), crc)
        return f"a {type(obj).__name__} of {len(obj)} items, sample {crc:08x}"
    return f"a {type(obj).__name__}"


def _plain(item, depth: int = 0) -> bool:
    """Pickles to the same bytes in every process (no set of strings, whose
    order is salted per process; no objects of their own)."""
    if item is None or type(item) in (bool, int, float, str, bytes):
        return True
    if depth > 3:
        return False
    if type(item) in (list, tuple):
        return all(_plain(x, depth + 1) for x in item)
    if type(item) is dict:
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in item.items())
    return False


def handle_of(shared):
    """What another process of this host needs to map ``shared``: a picklable
    ``(kind, pid, fd, size, rest)``."""
    if isinstance(shared, torch.Tensor):
        storage = shared.untyped_storage()
        fd, size = storage._share_fd_cpu_()
        meta = (shared.dtype, shared.storage_offset(), tuple(shared.shape), shared.stride(),
                shared.requires_grad)
        return "tensor", os.getpid(), fd, size, meta
    rest: tuple
    if isinstance(shared, SharedArray):
        buffer, rest = shared._shared_buffer, (shared._shared_part,)
        kind = "array"
    elif isinstance(shared, SharedMapping):
        buffer, rest = shared._buffer, (shared._part, shared.default_factory)
        kind = "map"
    else:
        buffer, rest = shared._buffer, (shared._part,)
        kind = "seq"
    assert isinstance(buffer, SharedBuffer)
    return kind, os.getpid(), buffer.fd, buffer.nbytes, rest


def open_handle(handle):
    """The shared object a ``handle_of`` handle names, mapped in this process."""
    kind, pid, fd, size, rest = handle
    if not _host.HAS_PROC:
        raise OSError(f"no /proc/<pid>/fd on this host ({_host.PLATFORM})")
    path = f"/proc/{pid}/fd/{fd}"
    if kind == "tensor":
        dtype, offset, shape, stride, requires_grad = rest
        opened = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            # torch's own rebuild of a storage sent by descriptor (it keeps a duplicate)
            storage = torch.UntypedStorage._new_shared_fd_cpu(opened, size)  # type: ignore[attr-defined]
        finally:
            os.close(opened)
        tensor = torch.empty((0,), dtype=dtype).set_(storage, offset, shape, stride)
        return tensor.requires_grad_(True) if requires_grad else tensor
    buffer = SharedBuffer.open_path(path)
    if kind == "array":
        return attach_array(buffer, *rest)
    if kind == "map":
        return SharedMapping._attach(buffer, *rest)
    return SharedSequence._attach(buffer, *rest)


def sendable(handle, name: str):
    """``handle``, once it is known to pickle: ``all_gather_object`` pickles it,
    and a failure there would leave the other ranks waiting in the collective."""
    try:
        pickle.dumps(handle)
    except Exception as exc:
        what = "its data"
        if handle[0] == "map" and handle[4][1] is not None:
            what = f"its defaultdict's default_factory ({handle[4][1]!r})"
        raise TypeError(f"torchfeed.share(name={name!r}): {what} cannot be sent to the other "
                        f"ranks: {exc}. Use a default_factory that pickles (a module-level "
                        f"function, or a type such as list).") from exc
    return handle


def share_across_ranks(obj, name: str, group, share_here):
    dist = torch.distributed
    me, world = dist.get_rank(group), dist.get_world_size(group)
    peers: list = [None] * world
    dist.all_gather_object(peers, (host_key(), name, fingerprint(obj)), group=group)
    names = sorted({peer[1] for peer in peers})
    if len(names) > 1:
        raise ValueError(f"torchfeed.share: the ranks called share with different names "
                         f"({', '.join(map(repr, names))}) in the same collective call; "
                         f"every rank of the group calls share with the same name, in the "
                         f"same order")
    datas = {rank: peer[2] for rank, peer in enumerate(peers) if peer[2] is not None}
    if len(set(datas.values())) > 1:
        said = "; ".join(f"rank {rank}: {what}" for rank, what in sorted(datas.items()))
        raise ValueError(f"torchfeed.share(name={name!r}): the ranks passed different data "
                         f"({said}). Every rank passes the same data under one name, or a "
                         f"callable, which only the rank that builds its host's copy calls")
    host = peers[me][0]
    builder = min(rank for rank, peer in enumerate(peers) if peer[0] == host)
    shared, handle, failure = None, None, None
    if me == builder:
        try:
            shared = share_here(obj, name)
            handle = sendable(handle_of(shared), name)
        except Exception as exc:  # every rank of the host raises it, after the gather
            failure = exc
            handle = None
    handles: list = [None] * world
    sent = (handle, None if failure is None else f"{type(failure).__name__}: {failure}")
    dist.all_gather_object(handles, sent, group=group)
    builder_handle = handles[builder][0]
    failed = [(rank, error) for rank, (_, error) in enumerate(handles) if error is not None]
    if failed:  # every rank raises, so that none goes on to a collective the others skip
        dist.barrier(group=group)
        if failure is not None:
            raise failure
        rank, error = failed[0]
        raise RuntimeError(f"torchfeed.share(name={name!r}): rank {rank} of the group, which "
                           f"builds its host's copy, failed: {error}")
    if me != builder:
        try:
            shared = open_handle(builder_handle)
        except OSError as exc:
            warnings.warn(f"torchfeed.share(name={name!r}): cannot map rank {builder}'s copy "
                          f"through /proc ({exc}); this rank builds its own copy",
                          RuntimeWarning, stacklevel=3)
            shared = share_here(obj, name)
    dist.barrier(group=group)
    return shared


__all__ = ["distributed", "handle_of", "open_handle", "share_across_ranks"]
