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
"""
from __future__ import annotations

import threading

_kept = [False]


def keep() -> None:
    """Called where a KeyboardInterrupt was caught and would be dropped."""
    _kept[0] = True


def raise_if_kept() -> None:
    """Raise the kept Ctrl-C, once, if this is the main thread (where it belongs)."""
    if _kept[0] and threading.current_thread() is threading.main_thread():
        _kept[0] = False
        raise KeyboardInterrupt
