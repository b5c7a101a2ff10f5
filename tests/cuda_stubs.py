"""Stand-ins for CUDA on a machine without it (the developers' guide allows
stubbing CUDA, never what torchfeed itself does): enough of torch's CUDA runtime
bindings for the page-locked slots of ``torchfeed/_transport/_page_lock.py``,
and of the pin-memory thread's device calls, for their real plumbing (slots
registered, releases deferred to the releaser's thread, fences, unregistered)
to run on CPU. The fences find no CUDA device (``torch.cuda.device_count()``
is 0), so each passes at once.

A module of its own so that a fresh interpreter (``_fork_threads_child.py``)
can install the same stubs.
"""
from __future__ import annotations

import threading

import torch

import torchfeed._iterator_base
import torchfeed._pin_memory
import torchfeed._worker_iterator
from torchfeed._transport import _page_lock


class FakeRuntime:
    """``torch.cuda.cudart()`` for page-locking: what is locked, and who asked.

    ``register_rc``: what ``cudaHostRegister`` returns (0: success; 2: out of
    memory, as a driver refusing to lock more)."""

    def __init__(self, register_rc: int = 0) -> None:
        self.register_rc = register_rc
        self.locked: dict[int, int] = {}  # address -> length, locked now
        self.calls: list[tuple[str, str]] = []  # (call, the thread's name)
        self.last_error = 0  # CUDA's per-thread "last error", as one value
        self.last_error_cleared_in: list[str] = []

    def _call(self, name: str) -> None:
        self.calls.append((name, threading.current_thread().name))

    def cudaHostRegister(self, addr: int, length: int, flags: int) -> int:
        self._call("cudaHostRegister")
        if self.register_rc == 0:
            self.locked[addr] = length
        else:
            self.last_error = self.register_rc
        return self.register_rc

    def cudaHostUnregister(self, addr: int) -> int:
        self._call("cudaHostUnregister")
        self.locked.pop(addr, None)
        return 0

    def cudaGetLastError(self) -> int:  # the libcudart function, through ctypes
        self.last_error_cleared_in.append(threading.current_thread().name)
        error, self.last_error = self.last_error, 0
        return error


def page_lock_slots(set_attr, runtime: FakeRuntime) -> None:
    """Page-lock slots with ``runtime`` in place of CUDA. ``set_attr`` is
    ``monkeypatch.setattr`` in a test, or ``setattr`` in a process of its own."""
    set_attr(torch.cuda, "cudart", lambda: runtime)
    _set_new(set_attr, _page_lock, "_runtime_library", lambda: runtime)
    set_attr(_page_lock, "wanted", lambda: True)


def _set_new(set_attr, obj, name: str, value) -> None:
    """``set_attr`` for an attribute that older torchfeeds lack (so that a test
    can be run against them, to see it fail for the right reason)."""
    try:
        set_attr(obj, name, value, raising=False)
    except TypeError:  # the builtin setattr
        set_attr(obj, name, value)


def pin_thread_on_cpu(set_attr) -> None:
    """``pin_memory=True`` runs the pin thread as on an accelerator, its pinning
    the identity (slot batches are pinned by their registration anyway)."""
    set_attr(torchfeed._iterator_base, "pin_memory_plan",
             lambda loader: (bool(loader.pin_memory), None))
    set_attr(torchfeed._worker_iterator, "pin_device_index", lambda device: 0)
    set_attr(torchfeed._pin_memory, "make_pin_device_current", lambda device, index: None)
    set_attr(torchfeed._pin_memory, "pin_memory", lambda data, device=None: data)
