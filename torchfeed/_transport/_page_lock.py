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
import contextlib
import ctypes
import logging
import os
import threading
import time
import warnings

import torch

from . import _slots

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context
ENV_DISABLE = "TORCHFEED_PAGE_LOCKED_SLOTS"  # "0": pin slot batches by copy, as before
LINGER = 0.5  # seconds the releaser's thread waits for more work before it ends
FENCE_RETRIES = 8  # rounds a fence that cannot be proven is tried again, LINGER apart
logger = logging.getLogger("torchfeed")

_lock = threading.RLock()  # RLock: a weakref callback may unregister while this thread holds it
_registered: dict[int, int] = {}  # mapping address -> length, registered with CUDA
_starts: list[int] = []           # the addresses, sorted (``owning_range``)
_warned: list[bool] = [False]
registrations = [0]  # cudaHostRegister calls made by this process (one per slot)
leaked = [0, 0]  # slots (count, bytes) kept from their workers: no fence could be proven


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


def _has_context(device: int) -> bool:
    check = getattr(torch._C, "_cuda_hasPrimaryContext", None)  # private; absent: assume one
    return True if check is None else bool(check(device))


class _Job:
    __slots__ = ("fn", "event", "tries", "addr")

    def __init__(self, fn, event, addr):
        self.fn, self.event, self.addr = fn, event, addr
        self.tries = 0  # rounds whose fence could not be proven


class Releaser:
    """Runs each queued function once the copies that may read its slot are done
    (NOTE [ No slot reused while a copy may read it ]); one per process, its
    thread started on demand and ended after ``LINGER`` seconds without work.

    A function whose fence cannot be proven (the event query and
    ``torch.cuda.synchronize()`` both raise, as while another thread captures
    a CUDA graph in global mode) is never run: it waits for the next round, up
    to ``FENCE_RETRIES`` rounds, and is then dropped with a warning: its slot
    stays page-locked and never goes back to its worker (``leaked``)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._jobs: list[_Job] = []
        self._pending = 0  # queued or in a round not yet finished
        self._thread: threading.Thread | None = None
        self._local = threading.local()
        self._streams: dict[int, list] = {}  # device index -> the streams torch hands out
        self._quiescing = False  # end the thread as soon as nothing is queued
        self._held = 0  # forks under way (``no_thread``): start no thread
        self._start_failed = False
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
            self._jobs.append(_Job(fn, event, addr))
            self._pending += 1
            self._start_thread()
            self._cond.notify_all()

    def _start_thread(self) -> None:
        """Start the thread if it is needed and allowed; with ``_cond`` held. A
        start that fails (``can't start new thread`` under a pids limit) leaves
        the jobs queued, for the next ``defer`` or the next ``quiesce``."""
        if self._thread is not None or self._held or not self._jobs:
            return
        thread = threading.Thread(target=self._run, name="torchfeed-slot-releaser", daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:
            if not self._start_failed:
                self._start_failed = True
                logger.warning("torchfeed: could not start the thread that gives page-locked "
                               "slots back to their workers (%s); the slots wait for the next "
                               "release, or for the next start of a worker.", exc)
            return
        self._thread = thread

    def deferring(self, fn, addr: int):
        """``fn`` as a weakref callback whose run waits for the fence."""
        def release(ref):
            self.defer(lambda: fn(ref), addr)
        return release

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until every queued function ran (or was dropped, its fence
        unprovable); False on timeout."""
        with self._cond:
            self._start_thread()  # after a failed start
            return self._cond.wait_for(lambda: self._pending == 0, timeout)

    def quiesce(self, timeout: float = 30.0) -> None:
        """Run what is queued and end the thread now, not ``LINGER`` later.

        Called before workers are forked (``no_thread``): torch's loader forks
        them with only the main thread alive, and Python 3.12 warns at a fork
        from a process with threads (a lock another thread holds is held for
        ever in the child).  The wait is for copies already queued on the GPU,
        once per worker start, never per batch.  Where no thread runs and
        jobs are queued (its start failed), they run here, in the caller."""
        with self._cond:
            thread = self._thread
            if thread is None and not self._jobs:
                return
            self._quiescing = True
            if thread is None:  # run the rounds here; a defer meanwhile starts no other thread
                thread = self._thread = threading.current_thread()
            self._cond.notify_all()
        if thread is threading.current_thread():
            self._run()
        else:
            thread.join(timeout)

    def running(self) -> bool:
        """Whether the thread is alive (after ``quiesce``: it did not end in time)."""
        thread = self._thread
        return thread is not None and thread is not threading.current_thread() and thread.is_alive()

    @contextlib.contextmanager
    def no_thread(self, timeout: float = 30.0):
        """For a fork: the thread ended (``quiesce``), and none started until the
        block ends; releases deferred meanwhile wait for the block's end."""
        with self._cond:
            self._held += 1
        try:
            self.quiesce(timeout)
            yield
        finally:
            with self._cond:
                self._held -= 1
                self._start_thread()

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
            kept = self._round(jobs)
            finished = len(jobs) - len(kept)
            del jobs  # no slot's function kept alive while the thread waits
            with self._cond:
                self._jobs[:0] = kept
                self._pending -= finished
                self._cond.notify_all()
            if kept:
                del kept
                time.sleep(LINGER)  # give whatever forbids CUDA calls time to end

    def _round(self, jobs: list[_Job]) -> list[_Job]:
        """Run the jobs once their fence has passed; the jobs kept for the next
        round, their fence not proven (none kept: each has run, or was dropped)."""
        try:
            self._fence(jobs)
        except Exception as fence_error:  # noqa: BLE001 - wait for everything instead
            try:
                torch.cuda.synchronize()
            except Exception as sync_error:  # noqa: BLE001 - nothing proves any copy done
                return self._unfenced(jobs, fence_error, sync_error)
        for job in jobs:
            try:
                job.fn()
            except Exception as exc:  # noqa: BLE001 - a slot's release must not stop the others
                logger.warning("torchfeed: giving a page-locked slot back to its worker "
                               "failed (%s: %s); the slot stays with this process.",
                               type(exc).__name__, exc)
        self.rounds += 1
        return []

    def _unfenced(self, jobs: list[_Job], fence_error, sync_error) -> list[_Job]:
        """No fence could be proven for ``jobs``: none may run. Those tried
        ``FENCE_RETRIES`` times are dropped (their slots stay page-locked and
        out of their workers' hands, for as long as this process lives); the
        others are returned, for the next round."""
        kept: list[_Job] = []
        dropped: list[_Job] = []
        for job in jobs:
            job.tries += 1
            (dropped if job.tries > FENCE_RETRIES else kept).append(job)
        if dropped:
            size = sum(_registered.get(job.addr, 0) for job in dropped if job.addr is not None)
            leaked[0] += len(dropped)
            leaked[1] += size
            warnings.warn(
                f"torchfeed: {len(dropped)} page-locked shared-memory slot(s) ({size} bytes) "
                f"are kept from their workers for good: no CUDA fence could prove that the "
                f"copies from them are done (the event query raised {fence_error!r}, and "
                f"torch.cuda.synchronize() raised {sync_error!r}). This happens while another "
                f"thread captures a CUDA graph with capture_error_mode='global': capture "
                f"before iterating, or with capture_error_mode='thread_local'.",
                RuntimeWarning, stacklevel=2)
        return kept

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
