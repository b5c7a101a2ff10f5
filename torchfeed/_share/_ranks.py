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
warns. An error on a building rank is raised on every rank of the group.
"""

from __future__ import annotations

import os
import socket
import warnings

import torch

from .. import _host
from ._buffer import SharedBuffer


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
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(open(path).read().strip() if "boot_id" in path
                         else str(os.stat(path).st_ino))
        except OSError:
            parts.append("?")
    return "/".join(parts)


def handle_of(shared):
    """What another process of this host needs to map ``shared``: a picklable
    ``(rebuild, pid, fd, size, rest)``."""
    if isinstance(shared, torch.Tensor):
        storage = shared.untyped_storage()
        fd, size = storage._share_fd_cpu_()
        meta = (shared.dtype, shared.storage_offset(), tuple(shared.shape), shared.stride())
        return "tensor", os.getpid(), fd, size, meta
    rebuild, args = shared.__reduce__()
    buffer = args[0]
    assert isinstance(buffer, SharedBuffer)
    return rebuild, os.getpid(), buffer.fd, buffer.nbytes, args[1:]


def open_handle(handle):
    """The shared object a ``handle_of`` handle names, mapped in this process."""
    rebuild, pid, fd, size, rest = handle
    if not _host.HAS_PROC:
        raise OSError(f"no /proc/<pid>/fd on this host ({_host.PLATFORM})")
    path = f"/proc/{pid}/fd/{fd}"
    if rebuild == "tensor":
        dtype, offset, shape, stride = rest
        opened = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            # torch's own rebuild of a storage sent by descriptor (it keeps a duplicate)
            storage = torch.UntypedStorage._new_shared_fd_cpu(opened, size)  # type: ignore[attr-defined]
        finally:
            os.close(opened)
        return torch.empty((0,), dtype=dtype).set_(storage, offset, shape, stride)
    return rebuild(SharedBuffer.open_path(path), *rest)


def share_across_ranks(obj, name: str, group, share_here):
    dist = torch.distributed
    me, world = dist.get_rank(group), dist.get_world_size(group)
    peers: list = [None] * world
    dist.all_gather_object(peers, (host_key(), name), group=group)
    names = sorted({peer_name for _, peer_name in peers})
    if len(names) > 1:
        raise ValueError(f"torchfeed.share: the ranks called share with different names "
                         f"({', '.join(map(repr, names))}) in the same collective call; "
                         f"every rank of the group calls share with the same name, in the "
                         f"same order")
    host = peers[me][0]
    builder = min(rank for rank, (peer_host, _) in enumerate(peers) if peer_host == host)
    shared, handle, failure = None, None, None
    if me == builder:
        try:
            shared = share_here(obj, name)
            handle = handle_of(shared)
        except Exception as exc:  # every rank of the host raises it, after the gather
            failure = exc
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
