"""The device stage, ``DataLoader(device="cuda")``: batches reach the training
loop already on the GPU, each copied on a stream of the loader's own while the
loop computes on the one before.

With workers, the loader's background thread (the pin-memory thread of
``_pin_memory.py``, run as :class:`DeviceFeedThread`) takes each batch as it
arrives, pins it (nothing to do for a page-locked slot, see
``_transport/_page_lock.py``), enqueues its copy to the device on its copy
stream, records an event after the copy, and drops the CPU batch; a
page-locked slot goes back to its worker once that event has passed. At most
``MAX_AHEAD`` copied batches wait for the main thread, which bounds the GPU
memory the stage holds beyond the batches being reordered.

When the main thread hands a batch to the user (:func:`hand_over`), the user's
current stream waits for the copy's event on the GPU (the CPU does not wait),
and each tensor is marked as used on that stream (``record_stream``), so that
the caching allocator does not give its memory back to the copy stream while
the user's stream may still read it.

``num_workers=0``: the batch is copied on the current stream in the calling
thread. ``pin_memory=False``: nothing is page-locked or pinned; the copy reads
pageable memory, which CUDA stages through its own pinned buffer before the
copy call returns (slower, still off the training loop). Leaves without a
``to`` method (numpy arrays, strings) stay where they are.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ._pin_memory import PinMemoryThread, pin_memory, rebuild_mapping, rebuild_sequence
from ._protocol import StatefulResult
from ._transport import _page_lock

MAX_AHEAD = 2


def _parse(device) -> torch.device:
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cuda", device)  # a bare index names a CUDA device, as in .to(0)
    return torch.device(device)


def validate_device(device) -> None:
    """The constructor's check of ``device=``: None, a CUDA device, or ``"cpu"`` (no stage)."""
    if device is None:
        return
    try:
        parsed = _parse(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"DataLoader(device={device!r}): not a device ({exc}). Pass a CUDA "
                         "device such as 'cuda' or 'cuda:1', or None to keep batches on the "
                         "CPU.") from None
    if parsed.type not in ("cuda", "cpu"):
        raise ValueError(f"DataLoader(device={device!r}): the device stage copies batches to "
                         f"CUDA devices only, not {parsed.type!r}. Pass device=None and move "
                         "each batch with .to() in the training loop.")


def resolve_device(device) -> torch.device | None:
    """At ``iter()``: the CUDA device the stage copies to, or None for no stage."""
    if device is None:
        return None
    parsed = _parse(device)
    if parsed.type != "cuda":
        return None
    if not torch.cuda.is_available():
        raise RuntimeError(f"DataLoader(device={device!r}): CUDA is not available here "
                           "(torch.cuda.is_available() is False). Pass device=None to keep "
                           "the batches on the CPU.")
    if parsed.index is None:  # the current device when iterating starts (one per rank)
        parsed = torch.device("cuda", torch.cuda.current_device())
    return parsed


def move(data, device, tensors: list, sources: list):
    """``data`` with every tensor (and object with a ``to`` method) sent to ``device``,
    ``non_blocking``; the device tensors made go in ``tensors``, the data
    pointers of the CPU tensors read in ``sources``. Containers are rebuilt as
    the pin step rebuilds them."""
    if isinstance(data, torch.Tensor):
        out = data.to(device, non_blocking=True)
        if out is not data:
            tensors.append(out)
            sources.append(data.data_ptr())
        return out
    if isinstance(data, (str, bytes)):
        return data
    if isinstance(data, Mapping):
        return rebuild_mapping(data, {k: move(v, device, tensors, sources) for k, v in data.items()})
    if isinstance(data, tuple):
        moved = [move(v, device, tensors, sources) for v in data]
        return type(data)(*moved) if hasattr(data, "_fields") else type(data)(moved)
    if isinstance(data, Sequence):
        return rebuild_sequence(data, [move(v, device, tensors, sources) for v in data])
    to = getattr(data, "to", None)
    if callable(to) and not isinstance(data, type):
        return to(device, non_blocking=True)
    return data


class DeviceBatch:
    """A batch on the device, and the event its copy finishes at."""

    __slots__ = ("batch", "event", "tensors")

    def __init__(self, batch, event, tensors) -> None:
        self.batch, self.event, self.tensors = batch, event, tensors


def hand_over(item, device: torch.device):
    """The user's batch: their current stream waits for its copy, on the GPU."""
    if type(item) is not DeviceBatch:
        return item
    stream = torch.cuda.current_stream(device)
    stream.wait_event(item.event)
    for tensor in item.tensors:
        tensor.record_stream(stream)
    return item.batch


def to_device_now(data, device: torch.device):
    """``num_workers=0``: the batch copied on the current stream."""
    return move(data, device, [], [])


class DeviceFeedThread(PinMemoryThread):
    """The pin-memory thread, which also copies each batch to the device."""

    max_ahead = MAX_AHEAD

    def __init__(self, receive, pin_device, device_index, pin: bool, target: torch.device):
        self._target = target
        self._copy_stream: torch.cuda.Stream | None = None
        super().__init__(receive, pin_device, device_index, pin)

    def _processes(self) -> bool:
        return True

    def _dropped(self) -> None:
        _page_lock.releaser.forget_copies()

    def _process(self, batch):
        releaser = _page_lock.releaser
        releaser.forget_copies()  # until this batch's copy is enqueued, no event covers anything
        if self._copy_stream is None:
            torch.cuda.set_device(self._target)
            self._copy_stream = torch.cuda.Stream(self._target)
        if self._pin:
            batch = pin_memory(batch, self._device)
        stateful = type(batch) is StatefulResult
        value = batch.value if stateful else batch
        tensors: list = []
        sources: list = []
        with torch.cuda.stream(self._copy_stream):
            moved = move(value, self._target, tensors, sources)
            event = torch.cuda.Event(blocking=True)  # waiters sleep rather than spin
            event.record(self._copy_stream)
        slots = {_page_lock.owning_range(ptr) for ptr in sources}
        slots.discard(None)
        # Released in this thread (by the loop's drop of the CPU batch), its
        # slots need only this event; released anywhere later, a full fence.
        releaser.copies_done_at(event, slots)
        out = DeviceBatch(moved, event, tensors)
        if stateful:
            return StatefulResult(out, batch.state, batch.exhausted, batch.samples)
        return out
