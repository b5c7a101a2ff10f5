"""A fault that only tests turn on: a worker SIGKILLs itself at a chosen instant.

"Never hangs" means the main process must survive a worker that dies *while it
holds* a cross-process primitive (NOTE [ Cross-process primitives ] in
CONTRIBUTING.md).  A kill from outside lands at a random instant, which proves
little; this hook makes the instant certain.  The environment variable
``TORCHFEED_TEST_DIE_HOLDING=<what>:<worker_id>:<n>`` makes worker
``worker_id`` kill itself the ``n``-th time it reaches ``<what>``:

* ``stop-flag``: inside its check of the main process's stop flag;
* ``index-lock``: right after taking its index queue's read lock (``Queue.get``);
* ``result-sem``: right after taking a unit of the result queue's size semaphore;
* ``result-lock``: right after taking the result queue's write lock, before writing;
* ``result-lock-written``: with the message written, just before releasing that lock;
* ``feeder-lock``: the same lock, taken by the queue's feeder thread (every
  result of that worker goes through the feeder);
* ``slot``: with a batch packed into a shared-memory slot (marked in flight), unsent;
* ``sent``: right after a result is written (torch's transport: before the main
  process has fetched the batch's file descriptors from the worker);
* ``stack-dump``: on the main process's request for its stacks (a timeout),
  after writing the start of a dump.

The variable is read once, when the worker starts (``worker_loop``); unset, the
hook costs nothing per task.  Installing wraps the worker's own copies of the
objects, so the main process is never touched.  To put a lock that kills in
the place of the real one, it assigns the queues' private ``_rlock``, ``_sem``
and ``_wlock``: besides ``_ipc/_mp_queue.py``, the only code that names them.
"""
from __future__ import annotations

import os
import signal
import threading

ENV = "TORCHFEED_TEST_DIE_HOLDING"
KINDS = ("stop-flag", "index-lock", "result-sem", "result-lock", "result-lock-written",
         "feeder-lock", "slot", "sent", "stack-dump")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _Countdown:
    """Kills this process the ``n``-th time ``tick`` is called (from any thread)."""

    def __init__(self, n: int) -> None:
        self._left = n
        self._lock = threading.Lock()  # the feeder thread and the main thread may both tick

    def tick(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left == 0:
                _die()


class _DyingLock:
    """A lock (or semaphore) that kills the process right after it is taken
    (``at_release=False``) or right before it is given back."""

    def __init__(self, real, countdown: _Countdown, at_release: bool = False) -> None:
        self._real, self._countdown, self._at_release = real, countdown, at_release

    def acquire(self, *args, **kwargs):
        got = self._real.acquire(*args, **kwargs)
        if got and not self._at_release:
            self._countdown.tick()
        return got

    def release(self) -> None:
        if self._at_release:
            self._countdown.tick()
        self._real.release()

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class _DyingFlag:
    """The stop flag, whose ``is_set`` kills the process in the middle.  The
    flag has no lock to die holding; were it a ``multiprocessing.Event`` (as
    before issue 25), this takes the Event's lock first, as ``Event.is_set``
    does, so the test keeps meaning "died inside the check"."""

    def __init__(self, real, countdown: _Countdown) -> None:
        self._real, self._countdown = real, countdown

    def is_set(self) -> bool:
        inner_lock = getattr(self._real, "_cond", None)
        if inner_lock is None:
            value = self._real.is_set()
            self._countdown.tick()
            return value
        with inner_lock:
            self._countdown.tick()
            return self._real._flag.get_value() == 1


def install(spec, worker_id: int, index_queue, result_queue, results, packer) -> None:
    """Arm the fault named by ``ENV`` in this worker, if it names this worker."""
    what, _, rest = os.environ[ENV].partition(":")
    target, _, n = rest.partition(":")
    if what not in KINDS:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: the fault must be one of {', '.join(KINDS)}")
    if int(target) != worker_id:
        return
    countdown = _Countdown(int(n or 1))
    if what == "stop-flag":
        spec.stopping = _DyingFlag(spec.stopping, countdown)
    elif what == "index-lock":
        index_queue._rlock = _DyingLock(index_queue._rlock, countdown)
    elif what == "result-sem":
        results._take_slot = _DyingLock(result_queue._sem, countdown).acquire
    elif what in ("result-lock", "result-lock-written"):
        results._lock = _DyingLock(result_queue._wlock, countdown, what == "result-lock-written")
    elif what == "feeder-lock":
        results._direct = False  # every message goes through the feeder thread
        result_queue._wlock = _DyingLock(result_queue._wlock, countdown)
    elif what == "slot":
        pack = packer.pack

        def pack_then_die(batch):
            payload = pack(batch)
            countdown.tick()
            return payload
        packer.pack = pack_then_die
    elif what == "sent":
        put = results.put

        def put_then_die(obj):
            put(obj)
            countdown.tick()
        results.put = put_then_die
    elif what == "stack-dump":
        def half_a_dump(signum, frame):
            from . import _stack_dump
            if _stack_dump._installed is not None:
                os.write(_stack_dump._installed.fileno(), b"Thread 0x0001 (most recent call first):\n")
            countdown.tick()
        signal.signal(signal.SIGUSR1, half_a_dump)
