"""Page-locking batches, and the thread that does it off the training loop.

``pin_memory`` follows the installed torch's rules for nested batches exactly
(``_torch_compat.py`` says where releases differ): a tensor or any object with
its own ``pin_memory()`` method is pinned by that method; mappings and
sequences are rebuilt as their own type when they can be, and as a dict or
list when they cannot; strings and other leaves pass through.

``PinMemoryThread`` sits between the result queue and the reorder step: it
takes each message the workers sent, decodes it, pins the batch and hands it
on through an in-process queue.  Decoding here, not in the training loop, is
what lets a shared-memory slot return to its worker as soon as the pinned copy
exists.
"""
from __future__ import annotations

import copy
import os
import queue
import threading
from collections.abc import Mapping, MutableMapping, MutableSequence, Sequence

import torch

from ._errors import WorkerFailure
from ._ipc import WAIT_SLICE
from ._torch_compat import PIN_OWN_METHOD_FIRST, PIN_PASSES_DEVICE, PIN_TUPLE_AS_LIST, make_pin_device_current

# Lets the thread's plumbing run (and be tested) on a machine with no
# accelerator: batches pass through it unpinned.  A debugging aid only.
PASS_THROUGH_ENV = "TORCHFEED_PIN_THREAD_WITHOUT_ACCELERATOR"


def pin_memory(data, device=None):
    if isinstance(data, torch.Tensor):
        # before torch 2.11 the device is passed on (None: the default one)
        return data.pin_memory(device) if PIN_PASSES_DEVICE else data.pin_memory()
    if PIN_OWN_METHOD_FIRST and hasattr(data, "pin_memory"):
        return data.pin_memory()
    if isinstance(data, (str, bytes)):
        return data
    if isinstance(data, Mapping):
        return rebuild_mapping(data, {k: pin_memory(v, device) for k, v in data.items()})
    if isinstance(data, tuple):
        items = (pin_memory(v, device) for v in data)
        if hasattr(data, "_fields"):
            return type(data)(*items)
        return list(items) if PIN_TUPLE_AS_LIST else type(data)(items)
    if isinstance(data, Sequence):
        return rebuild_sequence(data, [pin_memory(v, device) for v in data])
    if hasattr(data, "pin_memory"):  # before torch 2.11: asked after the containers
        return data.pin_memory()
    return data


def rebuild_mapping(data, items: dict):
    """``data`` holding ``items`` instead of its values, as torch rebuilds a
    mapping it pins: a copy of a mutable one (so a ``defaultdict``'s factory or
    a subclass's attributes stay), the user's class built from ``items`` for
    any other, and a plain dict where that class cannot be built so."""
    try:
        if isinstance(data, MutableMapping):
            clone = copy.copy(data)
            clone.update(items)
            return clone
        return type(data)(items)  # the user's class, as torch builds it
    except TypeError:
        return items


def rebuild_sequence(data, items: list):
    """``data`` holding ``items`` instead of its elements, by the same rules
    as ``rebuild_mapping``; a plain list where the class cannot be built so."""
    try:
        if isinstance(data, MutableSequence):
            clone = copy.copy(data)
            for i, item in enumerate(items):
                clone[i] = item
            return clone
        return type(data)(items)  # the user's class, as torch builds it
    except TypeError:
        return items


def pass_through_requested() -> bool:
    return os.environ.get(PASS_THROUGH_ENV, "") not in ("", "0")


class PinMemoryThread:
    """Reads ``receive()`` results, pins them, and queues them for the reorder step.

    ``_process`` is what is done to each batch (the device stage, ``_device.py``,
    also copies it to the device); ``max_ahead`` bounds the results queued
    ahead of the consumer (0: no bound beyond the loader's prefetch)."""

    max_ahead = 0

    def __init__(self, receive, device, device_index: int | None, pin: bool = True):
        self.out: queue.Queue = queue.Queue(self.max_ahead)
        # callable(timeout) -> (ok, (send_idx, batch)).  It must not keep the
        # iterator alive, not even for a moment (see _receive.py): a running
        # thread is a GC root, and a dropped iterator must still be collected.
        self._receive = receive
        self._device = device
        self._device_index = device_index
        self._pin = pin
        self._done = threading.Event()
        self.busy_seconds = 0.0
        self.thread = threading.Thread(target=self._run, name="torchfeed-pin-memory",
                                       daemon=True)
        try:
            self.thread.start()
        except RuntimeError as exc:  # "can't start new thread": Python's sentence first
            raise RuntimeError(
                f"{exc}\nDataLoader could not start its pin-memory thread (pin_memory=True "
                "or device=...): this process has reached its limit of threads (ulimit -u, "
                "or a container's pids limit). Raise the "
                "limit, use fewer workers or loaders at once, or pass pin_memory=False and "
                "device=None.") from None

    def _run(self) -> None:
        import time

        torch.set_num_threads(1)
        if self._pin and self._device_index is not None:
            make_pin_device_current(self._device, self._device_index)
        while not self._done.is_set():
            try:
                ok, item = self._receive(WAIT_SLICE)
            except Exception as exc:  # the main thread re-raises it
                self._put(("error", exc))
                return
            if not ok:
                continue
            send_idx, batch = item
            if self._processes() and not isinstance(batch, WorkerFailure) and send_idx is not None:
                start = time.perf_counter()
                try:
                    batch = self._process(batch)
                except Exception as exc:
                    batch = WorkerFailure(  # torch's words: "Caught X in pin memory thread for device 0."
                        exc, -1, f"pin memory thread for device {self._device_index}")
                self.busy_seconds += time.perf_counter() - start
            self._put(("data", (send_idx, batch)))
            del batch, item
            self._dropped()

    def _processes(self) -> bool:
        return self._pin

    def _process(self, batch):
        return pin_memory(batch, self._device)

    def _dropped(self) -> None:
        """This thread's reference to the last batch is gone."""

    def _put(self, item) -> None:
        while True:
            try:
                self.out.put(item, timeout=WAIT_SLICE)
                return
            except queue.Full:  # the consumer is max_ahead behind
                if self._done.is_set():
                    return

    def stop(self) -> None:
        self._done.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=5)
