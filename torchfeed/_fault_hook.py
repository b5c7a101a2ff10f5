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

The hook is armed only when a second variable, ``TORCHFEED_TEST_FAULTS_ARMED=1``,
which only the test suite sets, is set as well: a worker that kills itself
reads exactly like one the OOM killer took, and uses up
``max_worker_restarts``, so a stray ``TORCHFEED_TEST_DIE_HOLDING`` in a user's
environment must do nothing.  The main process says so once, in words
(``report_misuse``, called where workers are forked): the variable set without
the switch, or set in a malformed way.  An armed hook writes a line to stderr
naming itself just before it kills.

The variables are read once, when the worker starts (``worker_loop``); unset,
the hook costs nothing per task.  Installing wraps the worker's own copies of the
objects, so the main process is never touched.  To put a lock that kills in
the place of the real one, it assigns the queues' private ``_rlock``, ``_sem``
and ``_wlock``: besides ``_ipc/_mp_queue.py``, the only code that names them.
"""
from __future__ import annotations

import os
import signal
import threading
import warnings

from . import _host

ENV = "TORCHFEED_TEST_DIE_HOLDING"
ARMED_ENV = "TORCHFEED_TEST_FAULTS_ARMED"  # "1": the test suite's second switch
KINDS = ("stop-flag", "index-lock", "result-sem", "result-lock", "result-lock-written",
         "feeder-lock", "slot", "sent", "stack-dump")

_reported = [False]


class Fault:
    """A parsed ``ENV`` value: kill worker ``worker_id`` the ``n``-th time it reaches ``what``."""

    __slots__ = ("what", "worker_id", "n")

    def __init__(self, what: str, worker_id: int, n: int) -> None:
        self.what, self.worker_id, self.n = what, worker_id, n


def parse(value: str) -> Fault | str:
    """The fault ``value`` names, or why it is malformed (a sentence)."""
    what, _, rest = value.partition(":")
    target, _, n = rest.partition(":")
    if what not in KINDS:
        return f"the fault {what!r} is not one of {', '.join(KINDS)}"
    if not target.strip().isdigit():
        return f"the worker id {target!r} is not a number"
    if n and not (n.strip().isdigit() and int(n) > 0):
        return f"the count {n!r} is not a positive number"
    return Fault(what, int(target), int(n or 1))


def armed() -> Fault | None:
    """The fault to install in a worker: None unless both variables are set and well formed."""
    value = os.environ.get(ENV)
    if value is None or os.environ.get(ARMED_ENV) != "1":
        return None
    fault = parse(value)
    return fault if isinstance(fault, Fault) else None


def report_misuse() -> None:
    """In the main process, once: a warning when ``ENV`` is set but does nothing."""
    value = os.environ.get(ENV)
    if value is None or _reported[0]:
        return
    if os.environ.get(ARMED_ENV) != "1":
        why = (f"it is a fault hook of torchfeed's test suite, armed only together with "
               f"{ARMED_ENV}=1, so workers are not killed. Unset {ENV}")
    else:
        problem = parse(value)
        if isinstance(problem, Fault):
            return
        why = (f"{problem}, so no fault is armed. The form is <fault>:<worker id>[:<n>], "
               f"e.g. {ENV}=slot:1:2")
    _reported[0] = True
    warnings.warn(f"torchfeed: {ENV}={value!r} is ignored: {why}.", RuntimeWarning, stacklevel=2)


def _die(what: str = "") -> None:
    # os.write, not print: the process may be inside a lock of sys.stderr's
    os.write(2, (f"torchfeed: worker pid {os.getpid()} kills itself with SIGKILL: the "
                 f"test-only fault hook {ENV}={os.environ.get(ENV, '')!r} "
                 f"({ARMED_ENV}=1) fired at {what!r}.\n").encode())
    if not _host.HAS_POSIX_SIGNALS:
        os._exit(137)  # no SIGKILL here: the closest end
    os.kill(os.getpid(), signal.SIGKILL)


class _Countdown:
    """Kills this process the ``n``-th time ``tick`` is called (from any thread)."""

    def __init__(self, n: int, what: str) -> None:
        self._left, self._what = n, what
        self._lock = threading.Lock()  # the feeder thread and the main thread may both tick

    def tick(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left == 0:
                _die(self._what)


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
    """Arm the fault named by ``ENV`` in this worker, if the tests armed it
    (``ARMED_ENV``) and it names this worker; else nothing (the main process
    reports a stray or malformed value, ``report_misuse``)."""
    fault = armed()
    if fault is None or fault.worker_id != worker_id:
        return
    what = fault.what
    countdown = _Countdown(fault.n, what)
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
        if _host.HAS_STACK_DUMPS:
            signal.signal(signal.SIGUSR1, half_a_dump)
