"""A Ctrl-C that CPython would drop, kept for the loop (NOTE [ Ctrl-C in a release ]).

A batch's shared-memory slot goes back to its worker in a weakref callback,
run in whatever thread drops the batch: mostly the main thread, where a Ctrl-C
raises KeyboardInterrupt at the next function call, inside the callback too.
CPython prints an exception raised in a weakref callback and drops it
("Exception ignored in ..."), and the signal delivered again from there
(``_thread.interrupt_main``) raises there again, to be dropped again.  So the
callback keeps it here, and the main thread's next ``__next__`` raises it:
the loop stops at its next batch.  torch's loader runs no Python code when a
batch dies, so it never meets this.

A Ctrl-C can also land on the callback's very first instruction, before its
``try`` (from Python 3.11 a function's entry checks for signals): the whole
release is dropped, the slot stays in flight and the Ctrl-C is lost.  So each
batch is also watched by a second weakref, registered before the release's,
whose callback is ``list.append`` (C: no instruction of Python's, nothing a
signal can cut).  CPython calls a dying object's callbacks newest first, so
when that one runs the release has run or was cut; the release empties the
batch's *token* as its first step.  A death whose token is still full was
cut: ``sweep`` (at the next ``__next__``, and at the next batch unpacked)
runs the release then and keeps the Ctrl-C.  Unless the release itself is
gone: a weakref that dies unfired (in a collected cycle, or with its slot's
mapping) leaves its token full too, and no Ctrl-C was cut there.  Where
callbacks do not run newest first (checked once, at import), nothing is
watched and the hole stays.
"""
from __future__ import annotations

import signal
import threading
import weakref

_kept = [False]
_deaths: list = []  # the watching weakrefs, as their batches die
_watched: dict[int, tuple] = {}  # id(watching weakref) -> (it, its batch's token)


def keep() -> None:
    """Called where a KeyboardInterrupt was caught and would be dropped."""
    _kept[0] = True


def raise_if_kept() -> None:
    """Raise the kept Ctrl-C, once, if this is the main thread (where it belongs)."""
    if _deaths:
        sweep()
    if _kept[0] and threading.current_thread() is threading.main_thread():
        _kept[0] = False
        raise KeyboardInterrupt


def _newest_callback_first() -> bool:
    class Probe:
        pass

    probe, order = Probe(), []
    first = weakref.ref(probe, lambda _ref: order.append("first"))
    second = weakref.ref(probe, lambda _ref: order.append("second"))
    del probe
    return order == ["second", "first"] and first() is None and second() is None


_WATCHABLE = _newest_callback_first()


def watch(owner, token: list) -> None:
    """Watch ``owner``, a batch's memory, before its release's weakref is made.
    ``token`` holds a weakref to the release, which empties it as its first
    step; the release is called as ``release(None)``, and carries ``pending``
    (its slot's current token) and ``unpacker`` (a weakref to its transport)."""
    if not _WATCHABLE:
        return
    if _deaths:
        sweep()
    watcher = weakref.ref(owner, _deaths.append)
    _watched[id(watcher)] = (watcher, token)


def sweep() -> None:
    """Run each release a signal cut before its first step; keep the Ctrl-C."""
    while _deaths:
        try:
            watcher = _deaths.pop()
        except IndexError:  # another thread's sweep took the last one
            return
        _, token = _watched.pop(id(watcher), (None, None))
        if not token:
            continue  # the release ran (or will never run: its transport closed)
        release = token[0]()
        unpacker = None if release is None else release.unpacker()
        if unpacker is None or unpacker.closed or release.pending[0] is not token:
            # No release was due: its weakref died unfired, with the slot's
            # mapping or its transport (a collected cycle, a transport dropped).
            continue
        release(None)
        # Python's own handler raises KeyboardInterrupt: that was what was cut.
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            keep()
