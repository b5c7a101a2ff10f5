"""Page-locked slots (CUDA): the main process's slot mappings registered with
CUDA once each, and the releaser that hands a registered slot back to its
worker only once no copy can still read it.

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
``capture_error_mode="thread_local"``.

A registered mapping is unregistered before its memory is given back
(``_unpacker._punch``), before it is unmapped (the unpacker's close and a
worker's restart hand the still-registered slots to the releaser, which
unregisters them after a fence), and when the main process sees that the
worker retired it. At interpreter exit whatever is left is unregistered.
"""
from __future__ import annotations

import atexit
import bisect
import os
import threading
import warnings

import torch

from . import _slots

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context
ENV_DISABLE = "TORCHFEED_PAGE_LOCKED_SLOTS"  # "0": pin slot batches by copy, as before
LINGER = 0.5  # seconds the releaser's thread waits for more work before it ends

_lock = threading.RLock()  # RLock: a weakref callback may unregister while this thread holds it
_registered: dict[int, int] = {}  # mapping address -> length, registered with CUDA
_starts: list[int] = []           # the addresses, sorted (``owning_range``)
_warned: list[bool] = [False]
registrations = [0]  # cudaHostRegister calls made by this process (one per slot)


def wanted() -> bool:
    """Whether slots should be page-locked in this process (CUDA present, not disabled)."""
    return os.environ.get(ENV_DISABLE, "1") != "0" and torch.cuda.is_available()


def register(shared_map) -> bool:
    """Page-lock ``shared_map`` (an ``_arena.SharedMap``); False, with one warning, if CUDA refuses."""
    rc = int(torch.cuda.cudart().cudaHostRegister(shared_map.addr, shared_map.length,
                                                  _HOST_REGISTER_PORTABLE))
    if rc != 0:
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


def _unregister_addr(addr: int, _cuda=torch.cuda) -> None:
    with _lock:
        if _registered.pop(addr, None) is None:
            return
        del _starts[bisect.bisect_left(_starts, addr)]
    try:
        _cuda.cudart().cudaHostUnregister(addr)
    except Exception:  # noqa: BLE001 - interpreter teardown; the process's end unpins anyway
        pass


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


def _has_context(device: int) -> bool:
    check = getattr(torch._C, "_cuda_hasPrimaryContext", None)  # private; absent: assume one
    return True if check is None else bool(check(device))


class _Job:
    __slots__ = ("fn", "event")

    def __init__(self, fn, event):
        self.fn, self.event = fn, event


class Releaser:
    """Runs each queued function once the copies that may read its slot are done
    (NOTE [ No slot reused while a copy may read it ]); one per process, its
    thread started on demand and ended after ``LINGER`` seconds without work."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._jobs: list[_Job] = []
        self._pending = 0  # queued or in a round not yet finished
        self._thread: threading.Thread | None = None
        self._local = threading.local()
        self._streams: dict[int, list] = {}  # device index -> the streams torch hands out
        self._quiescing = False  # end the thread as soon as nothing is queued
        self.rounds = 0

    # -- producers ------------------------------------------------------------
    def copies_done_at(self, event, addrs) -> None:
        """In this thread, from now until the next call, a slot at one of ``addrs``
        released here was read only by copies that ``event`` follows."""
        self._local.events = dict.fromkeys(addrs, event)

    def forget_copies(self) -> None:
        self._local.events = None

    def defer(self, fn, addr: int | None = None) -> None:
        """Run ``fn()`` in the releaser's thread once no copy can read the slot at ``addr``."""
        events = getattr(self._local, "events", None)
        event = events.get(addr) if events else None
        with self._cond:
            self._jobs.append(_Job(fn, event))
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="torchfeed-slot-releaser",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def deferring(self, fn, addr: int):
        """``fn`` as a weakref callback whose run waits for the fence."""
        def release(ref):
            self.defer(lambda: fn(ref), addr)
        return release

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until every queued function ran; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout)

    def quiesce(self, timeout: float = 30.0) -> None:
        """Run what is queued and end the thread now, not ``LINGER`` later.

        Called before workers are forked: torch's loader forks them with only
        the main thread alive, and Python 3.12 warns at a fork from a process
        with threads (a lock another thread holds is held for ever in the
        child).  The wait is for copies already queued on the GPU, once per
        ``iter()`` that starts workers, never per batch."""
        with self._cond:
            thread = self._thread
            if thread is None:
                return
            self._quiescing = True
            self._cond.notify_all()
        thread.join(timeout)

    # -- the thread -------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._jobs:
                    if not self._quiescing:
                        self._cond.wait(LINGER)
                    if not self._jobs:
                        self._thread = None
                        self._quiescing = False
                        return
                jobs, self._jobs = self._jobs, []
            done = self._round(jobs)
            del jobs  # no slot's function kept alive while the thread waits
            with self._cond:
                self._pending -= done
                self._cond.notify_all()

    def _round(self, jobs: list[_Job]) -> int:
        try:
            self._fence(jobs)
        except Exception:  # noqa: BLE001 - never free on a failed fence: wait for everything
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - CUDA is gone: nothing can read the slots
                pass
        for job in jobs:
            try:
                job.fn()
            except Exception:  # noqa: BLE001 - a slot's release must not stop the others
                pass
        self.rounds += 1
        return len(jobs)

    def _fence(self, jobs) -> None:
        events = [job.event for job in jobs if job.event is not None]
        if any(job.event is None for job in jobs):
            events.extend(self._stream_events())
        for event in events:
            event.synchronize()  # a blocking event: sleeps, without the GIL

    def _stream_events(self) -> list:
        events = []
        for device in range(torch.cuda.device_count()):
            if not _has_context(device):
                continue  # no context: nothing was ever copied there
            for stream in self._known_streams(device):
                if stream.query():
                    continue  # idle: everything enqueued on it is done
                event = torch.cuda.Event(blocking=True)
                event.record(stream)
                events.append(event)
        return events

    def _known_streams(self, device: int) -> list:
        """The default stream and every pooled stream torch hands out on ``device``."""
        streams = self._streams.get(device)
        if streams is None:
            seen: dict[int, object] = {}
            default = torch.cuda.default_stream(device)
            seen[default.cuda_stream] = default
            least, greatest = default.priority_range()
            for priority in range(min(least, greatest), max(least, greatest) + 1):
                # The pool is handed out round-robin: go round it twice, so that
                # streams another thread takes meanwhile are still seen once.
                first, size, calls = None, 0, 0
                while calls < 1024 and (size == 0 or calls < 2 * size):
                    stream = torch.cuda.Stream(device=device, priority=priority)
                    calls += 1
                    if first is None:
                        first = stream.cuda_stream
                    elif stream.cuda_stream == first and size == 0:
                        size = calls - 1
                    seen.setdefault(stream.cuda_stream, stream)
            streams = self._streams[device] = list(seen.values())
        return streams


releaser = Releaser()


class SlotPins:
    """What an unpacker's slots owe CUDA: registered when mapped, released after a fence."""

    def adopt(self, entry, replaced, cache: dict, states) -> None:
        """``entry`` (a new ``MainSlot``) was mapped, in place of ``replaced`` (or None)."""
        if replaced is not None:
            unregister(replaced.map)  # its worker retired it, after it was freed: no copy reads it
        for idx, other in cache.items():
            if states[idx] == _slots.RETIRED:
                unregister(other.map)
        if register(entry.map):
            entry.release = releaser.deferring(entry.release, entry.map.addr)

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


def _forget_in_child() -> None:
    """A forked child shares none of the parent's registrations, nor its thread."""
    global releaser, _lock
    _lock = threading.RLock()  # another thread may have held it at the fork
    _registered.clear()
    _starts.clear()
    releaser = Releaser()


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
