"""How a batch crosses from a worker to the main process.

Two transports share one interface:

* ``"shm"`` (the default): each worker writes every tensor and numpy array of
  a batch into one reusable slot of nameless shared memory (a memfd) and sends
  a message of a few hundred bytes; the main process rebuilds the batch as
  zero-copy views of the slot and hands the slot back to the worker when the
  last view dies. See ``_shm.py`` (the channel), ``_packer.py`` (the worker's
  side), ``_unpacker.py`` (the main process's side), ``_slots.py``
  (control block, pools), ``_arena.py`` (the memfd and its pages at the
  level of system calls), ``_layout.py`` (flatten/rebuild of nested
  batches), ``_collate.py`` (default_collate straight into a slot),
  ``_stream.py`` (big arrays copied into the slot as each sample arrives) and
  ``_space.py`` (how much shared memory the slots may use).
* ``"torch"`` (the escape hatch): pack and unpack are the identity, and the
  result queue pickles tensors with torch's own shared-memory reductions,
  exactly as ``torch.utils.data.DataLoader`` does.

Usage::

    channel = create_channel(num_workers, mp_context, options)  # main, before workers
    # worker process (channel passed as a Process argument):
    packer = channel.packer(worker_id)
    collate_fn = packer.choose_collate(collate_fn)  # default_collate -> into the slot
    payload = packer.pack(collate_fn(samples))
    # main process:
    unpacker = channel.unpacker()
    batch = unpacker.unpack(payload)
    unpacker.stats()
    unpacker.close()                        # when the iterator ends

The transport is chosen by the ``transport`` option, else the environment
variable ``TORCHFEED_TRANSPORT``, else ``"shm"``; where the slots cannot exist
(``_host.SHM_SLOTS``: no memfd, as on macOS and Windows) the default is
``"torch"``, said once, and ``"shm"`` asked for is an error naming the host
(``_options.resolve_transport``). When the slots do not fit the
shared-memory budget (``TORCHFEED_SHM_LIMIT``, or half the available memory),
the batches that do not fit go torch's way and the main process warns once;
nothing raises (see ``_space.py``).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from .. import _host
from .._options import TRANSPORT_ENV as ENV_TRANSPORT
from .._options import TRANSPORTS, resolve_transport  # the loader's: one check, one message
from . import _arena, _space
from ._collate import is_default_collate
from ._packer import Packer, Plain, ShmFallbackWarning
from ._shm import ShmChannel
from ._space import ENV_LIMIT, SpaceCheck, check_space
from ._stream import SampleStream
from ._unpacker import Unpacker

# Below this per-worker budget the slots would not be worth having.
MIN_BYTES_PER_WORKER = 2 * _arena.REGION_ALIGN + _arena.CTRL_BYTES

__all__ = [
    "ENV_LIMIT", "ENV_TRANSPORT", "TRANSPORTS", "Packer", "Plain", "SampleStream", "ShmChannel",
    "ShmFallbackWarning", "SpaceCheck", "TorchChannel", "TransportOptions", "Unpacker",
    "check_space", "create_channel", "fd_exhaustion_error", "is_default_collate",
    "resolve_transport",
]

# torch's DataLoader raises this, word for word, when receiving a batch fails
# near the open-files limit (see torch's NOTE [ DataLoader on Linux and open
# files limit ]).
TOO_MANY_OPEN_FILES = (
    "Too many open files. Communication with the workers is no longer possible. Please "
    "increase the limit using `ulimit -n` in the shell or change the sharing strategy by "
    "calling `torch.multiprocessing.set_sharing_strategy('file_system')` at the beginning "
    "of your code")
FD_MARGIN = 10  # torch's margin: this close to the limit counts as out of descriptors


@dataclass
class TransportOptions:
    """The transport's knobs. ``create_channel`` also accepts a mapping, or any
    object with these attributes (missing ones take these defaults)."""

    transport: str | None = None      # "shm" | "torch" | None (environment, then "shm")
    shm_limit: int | str | None = None  # bytes all slots may use; see _space.py
    max_slots_per_worker: int = 64    # more held batches than this go torch's way
    idle_batches: int = 64            # a slot free for this many batches is given back


def _option(options, name):
    default = getattr(TransportOptions, name)
    if options is None:
        return default
    if isinstance(options, dict):
        return options.get(name, default)
    return getattr(options, name, default)


def create_channel(num_workers: int, mp_context=None, options=None):
    """A channel for ``num_workers`` workers; create it before starting them.

    The channel is picklable and is passed to every worker as a process
    argument (fork, spawn and forkserver all work). ``mp_context`` is accepted
    for symmetry with the loader; the channel needs nothing from it.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be at least 1, got {num_workers}")
    kind = resolve_transport(_option(options, "transport"), num_workers)
    if kind == "torch":
        return TorchChannel(num_workers)
    limit = _option(options, "shm_limit")
    budget, source = _space.shm_budget(limit)
    need = num_workers * MIN_BYTES_PER_WORKER
    disabled = None
    if budget < need:
        check = SpaceCheck(False, need, budget, source, _space.dev_shm_free())
        disabled = check.message(f"{num_workers} workers' slots (at least)")
    return ShmChannel(num_workers, budget, source,
                      int(_option(options, "max_slots_per_worker")),
                      int(_option(options, "idle_batches")), disabled)


def fd_exhaustion_error(exc: BaseException):
    """torch's "Too many open files" RuntimeError, with what ran out and why, if
    receiving a batch failed with ``exc`` because this process is out of file
    descriptors; else None.

    Only batches that go through torch's reductions pass descriptors: the
    shared-memory slots hold one per worker, and batches kept beyond the slots
    travel inline."""
    if not _host.HAS_RESOURCE:
        return None  # Windows: no descriptor limit of this kind
    import resource

    try:
        open_fds = len(os.listdir("/proc/self/fd"))
    except OSError:
        open_fds = None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    out = (getattr(exc, "errno", None) in (errno.EMFILE, errno.ENFILE)
           or "ancdata" in str(exc)
           or (open_fds is not None and soft != resource.RLIM_INFINITY
               and open_fds + FD_MARGIN >= soft))
    if not out:
        return None
    held = f"{open_fds} of its limit of {soft}" if open_fds is not None else f"its limit of {soft}"
    return RuntimeError(
        f"{TOO_MANY_OPEN_FILES}\ntorchfeed: the main process holds {held} open file "
        f"descriptors (RLIMIT_NOFILE), so the file descriptor of a batch's shared memory "
        f"could not be received ({type(exc).__name__}: {exc}). Batches that go through "
        f"torch's transport (transport='torch', tensors that cannot live in torchfeed's "
        f"slots such as ones that require grad, or batches that did not fit the "
        f"shared-memory budget) keep one descriptor open per tensor storage while they "
        f"live. Keep fewer of them, raise the limit (`ulimit -n`), or call "
        f"torch.multiprocessing.set_sharing_strategy('file_system').")


class _IdentityPacker:
    plain_tuples = False  # pack() returns the user's batch: torch's reductions must see it

    def __init__(self, worker_id):
        self.worker_id = worker_id

    def choose_collate(self, collate_fn):
        return collate_fn

    def pack(self, batch):
        return batch

    def close(self):
        pass


class _IdentityUnpacker:
    closed = False

    def __init__(self):
        self.unpacked = 0

    def unpack(self, payload):
        self.unpacked += 1
        return payload

    def stats(self):
        return {"transport": "torch", "slots": 0, "bytes": 0, "allocations": 0,
                "retired": 0, "packed": 0, "worker_fallbacks": 0, "direct_bytes": 0, "in_use": 0,
                "in_use_bytes": 0,
                "unpacked": self.unpacked, "fallbacks": 0, "closed": self.closed}

    def close(self):
        self.closed = True


class TorchChannel:
    """The escape hatch: batches travel through torch's own reductions."""

    kind = "torch"

    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        self._unpacker: _IdentityUnpacker | None = None

    def packer(self, worker_id: int):
        return _IdentityPacker(worker_id)

    def unpacker(self):
        if self._unpacker is None:
            self._unpacker = _IdentityUnpacker()
        return self._unpacker

    def renew(self, worker_id: int) -> None:
        pass  # torch's reductions hold no slots a replacement could overwrite
