"""Page-locked slots (CUDA): the main process's slot mappings registered with
CUDA once each, and the process's releaser (``_releaser.py``), which hands a
registered slot back to its worker only once no copy can still read it.

With ``pin_memory=True`` on a CUDA machine, the unpacker gives each slot it
maps to :class:`SlotPins`, which registers the mapping with
``cudaHostRegister`` (portable), once, when the slot is first seen. Views of
the slot are then pinned (``is_pinned()``), the pin step leaves them as they
are, and ``.to("cuda", non_blocking=True)`` is one DMA from the memory the
worker wrote. Batches that do not live in a slot are pinned by copy as before.

NOTE [ No slot reused while a copy may read it ]
torch's caching host allocator records a CUDA event for a ``non_blocking``
copy only from memory it allocated itself; from a registered slot nobody
does, and a slot handed back while a DMA from it is queued is silently wrong
data on the GPU. So the last view of a batch in a registered slot dying does
not free the slot: it queues the slot's release with :data:`releaser`, and the
releaser's thread frees it once a *fence* has passed:

* Every copy from the batch was enqueued before its last view died (a copy
  holds the tensor), so before the release was queued, so before the fence is
  taken. An event recorded on a stream after that covers every copy issued on
  that stream.
* A batch that the device stage (``_device.py``) copied and dropped itself was
  read only on the stage's copy stream: the event the stage recorded after the
  copy is the fence (``copies_done_at``).
* Any other batch was in the user's hands, who may have copied it on any
  stream. The fence is then an event recorded on every stream torch hands out
  on each device that has a context: the default stream and every stream of
  torch's pools (``torch.cuda.Stream()`` returns one of those), skipping the
  idle ones. Streams torch did not create (``torch.cuda.ExternalStream``,
  another library's) are not covered: copy from a batch on such a stream only
  while you hold the batch, then synchronise that stream before dropping it.

The waits are on events created with ``blocking=True``: the thread sleeps in
the driver instead of spinning a core (``cudaDeviceSynchronize`` would spin
under CUDA's default scheduling), and it holds no GIL while it waits. The
training loop never waits: a slot just comes back to its worker a little
later, and the worker makes another slot meanwhile if it needs one. The
releaser's thread queries streams and records events; while another thread
captures a CUDA graph with ``capture_error_mode="global"`` (torch's default)
those calls are forbidden, so capture graphs before iterating, or with
``capture_error_mode="thread_local"``. Should they fail, and
``torch.cuda.synchronize()`` with them, nothing is freed: the releases wait
for a later round, and are at last dropped, their slots kept, with a warning.

A registered mapping is unregistered before its memory is given back
(``_unpacker._punch``), before it is unmapped (the unpacker's close and a
worker's restart hand the still-registered slots to the releaser, which
unregisters them after a fence), and when the main process sees that the
worker retired it: at the next batch from that worker (``SlotPins.sweep``).
At interpreter exit whatever is left is unregistered. A failed
``cudaHostRegister`` also resets CUDA's per-thread last error, which torch
would otherwise raise at the thread's next kernel launch.
"""
from __future__ import annotations

import atexit
import bisect
import ctypes
import os
import threading
import warnings

import torch

from .. import _host
from . import _slots
from ._releaser import Releaser

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context
ENV_DISABLE = "TORCHFEED_PAGE_LOCKED_SLOTS"  # "0": pin slot batches by copy, as before

_lock = threading.RLock()  # RLock: a weakref callback may unregister while this thread holds it
_registered: dict[int, int] = {}  # mapping address -> length, registered with CUDA
_starts: list[int] = []           # the addresses, sorted (``owning_range``)
_warned: list[bool] = [False]
registrations = [0]  # cudaHostRegister calls made by this process (one per slot)


def wanted() -> bool:
    """Whether slots should be page-locked in this process (CUDA present, not disabled)."""
    return os.environ.get(ENV_DISABLE, "1") != "0" and torch.cuda.is_available()


_runtime: list = []  # [the process's libcudart through ctypes, or None], once looked up


def _runtime_library():
    """The CUDA runtime library torch loaded, through ctypes, or None (linked
    statically, or not found): torch binds no ``cudaGetLastError``."""
    if not _runtime:
        found = None
        try:
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "libcudart" in line and "/" in line}
            for path in sorted(paths):
                found = ctypes.CDLL(path)  # the same handle as the copy already loaded
                break
        except (OSError, IndexError):
            found = None
        _runtime.append(found)
    return _runtime[0]


def _clear_last_error() -> None:
    """Reset this thread's CUDA "last error" after a runtime call we failed on
    purpose: torch checks ``cudaGetLastError`` after each kernel launch, and
    would otherwise raise our stale error at the next launch in this thread."""
    library = _runtime_library()
    if library is not None:
        library.cudaGetLastError()


def register(shared_map) -> bool:
    """Page-lock ``shared_map`` (an ``_arena.SharedMap``); False, with one warning, if CUDA refuses."""
    rc = int(torch.cuda.cudart().cudaHostRegister(shared_map.addr, shared_map.length,
                                        _HOST_REGISTER_PORTABLE))
    if rc != 0:
        _clear_last_error()
        if not _warned[0]:
            _warned[0] = True
            warnings.warn(
                f"torchfeed: cudaHostRegister of a {shared_map.length}-byte shared-memory slot "
                f"failed with cudaError {rc}, so batches in such slots are pinned by a copy, as "
                f"without page-locked slots. Set {ENV_DISABLE}=0 to silence this.", stacklevel=2)
        return False
    with _lock:
        registrations[0] += 1
        _registered[shared_map.addr] = shared_map.length
        bisect.insort(_starts, shared_map.addr)
    return True


def is_registered(shared_map) -> bool:
    return shared_map.addr in _registered


def unregister(shared_map) -> None:
    """Unregister ``shared_map`` if it is registered; only once no copy can read it."""
    _unregister_addr(shared_map.addr)


def _unregister_addr(addr: int) -> None:
    with _lock:
        if _registered.pop(addr, None) is None:
            return
        del _starts[bisect.bisect_left(_starts, addr)]
    try:
        if int(torch.cuda.cudart().cudaHostUnregister(addr)) != 0:
            _clear_last_error()
    except Exception:  # noqa: BLE001 - interpreter teardown; the process's end unpins anyway
        pass


def locked_bytes(shared_map) -> int:
    """The bytes of ``shared_map`` page-locked now (0: not registered)."""
    return _registered.get(shared_map.addr, 0)


def registered_bytes() -> int:
    """Bytes page-locked by this module now (tests, stats)."""
    return sum(_registered.values())


def owning_range(ptr: int) -> int | None:
    """The address of the registered mapping that holds ``ptr``, or None."""
    with _lock:
        i = bisect.bisect_right(_starts, ptr) - 1
        if i >= 0:
            start = _starts[i]
            if ptr < start + _registered[start]:
                return start
    return None


def _new_releaser() -> Releaser:
    return Releaser(lambda addr: _registered.get(addr, 0))


releaser = _new_releaser()


class SlotPins:
    """What an unpacker's slots owe CUDA: registered when mapped, released after a fence."""

    def adopt(self, entry, replaced, cache: dict, states) -> None:
        """``entry`` (a new ``MainSlot``) was mapped, in place of ``replaced`` (or None)."""
        if replaced is not None:
            unregister(replaced.map)  # its worker retired it, after it was freed: no copy reads it
        self.sweep(cache, states)
        if register(entry.map):
            entry.release = releaser.deferring(entry.release, entry.map.addr)

    @staticmethod
    def sweep(cache: dict, states) -> None:
        """Unregister the slots of ``cache`` that their worker retired: called at
        each batch from that worker, so a retired slot's pages, which the worker
        punched out of its arena, are not held locked until the next slot or
        the close. A retired slot was free first, so its fence has passed."""
        for idx, other in tuple(cache.items()):
            if states[idx] == _slots.RETIRED and other.map.addr in _registered:
                unregister(other.map)

    def let_go(self, entry, held: bool, callback):
        """At close or renewal: the weakref callback for a batch still ``held`` (deferred
        when ``entry`` is registered); for one not held, True if the releaser
        unregisters and gives back the slot later (keep its pages until then)."""
        if not is_registered(entry.map):
            return callback if held else False
        if held:
            return releaser.deferring(callback, entry.map.addr)
        shared_map = entry.map

        def give_back():
            unregister(shared_map)
            try:
                shared_map.remove()
            except OSError:
                pass
        releaser.defer(give_back, shared_map.addr)
        return True


def enable(channel) -> None:
    """Page-lock the slots of ``channel``'s unpacker (an shm channel; others have none)."""
    unpacker = channel.unpacker()
    if hasattr(unpacker, "pins"):
        unpacker.pins = SlotPins()
    elif not _host.SHM_SLOTS:
        _host.tell_once("page-locked slots", "pin_memory=True copies each batch into page-locked "
                        "memory, as torch's DataLoader does: page-locking batches where they "
                        "arrive needs torchfeed's shared-memory slots, which need Linux's "
                        "memfd_create.", stacklevel=4)


def _forget_in_child() -> None:
    """A forked child shares none of the parent's registrations, nor its thread."""
    global releaser, _lock
    _lock = threading.RLock()  # another thread may have held it at the fork
    _registered.clear()
    _starts.clear()
    releaser = _new_releaser()


if _host.HAS_REGISTER_AT_FORK:  # elsewhere no process is forked (Windows)
    os.register_at_fork(after_in_child=_forget_in_child)


@atexit.register
def _unregister_all() -> None:
    if not _registered:
        return
    releaser.drain(timeout=5.0)
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - CUDA already gone: the process's end unpins
        pass
    for addr in list(_registered):
        _unregister_addr(addr)
