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

NOTE [ Objects with their own to() ]
Memory the copy stream allocated and the user drops goes back to the copy
stream's pool at once, and the next batch's copy may overwrite it while
kernels on the user's stream still read it, unless it was marked used on the
user's stream. The stage can mark only what it can name: a tensor, and an
object that has ``record_stream(stream)`` as well as ``to()`` (a TensorDict,
a PyG ``Data``/``Batch``), which is copied ahead like a tensor and marked as a
whole. An object with a ``to()`` method and no ``record_stream`` (a user's batch
class) holds tensors the stage cannot see; a batch holding one is therefore
copied when it is handed over, on the user's current stream, as with
``num_workers=0``: its memory then belongs to the user's stream, and the copy
(``non_blocking``, from pinned memory) is not overlapped with the work queued
before it. A dataclass (or any other object) without ``to()`` stays on the
CPU, as torch's pin step leaves it unpinned; one warning says so.

``num_workers=0``: the batch is copied on the current stream in the calling
thread. ``pin_memory=False``: nothing is page-locked or pinned; the copy reads
pageable memory, which CUDA stages through its own pinned buffer before the
copy call returns (slower, still off the training loop). Leaves without a
``to`` method (numpy arrays, strings) stay where they are.
"""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence

import torch

from ._pin_memory import PinMemoryThread, pin_memory, rebuild_mapping, rebuild_sequence
from ._protocol import StatefulResult
from ._transport import _page_lock

MAX_AHEAD = 2
_left_on_cpu_warned: list[bool] = [False]


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
        out = to(device, non_blocking=True)
        if out is not data:  # marked used at hand-over (its record_stream), see below
            tensors.append(out)
        return out
    return data


def copied_at_hand_over(data) -> bool:
    """Whether ``data`` holds an object with its own ``to()`` and no
    ``record_stream``, whose memory the stage could not mark as used on the
    user's stream (NOTE [ Objects with their own to() ]). Warns, once, of a
    dataclass holding tensors that stays on the CPU."""
    if isinstance(data, (torch.Tensor, str, bytes)):
        return False
    if isinstance(data, Mapping):
        return any([copied_at_hand_over(v) for v in data.values()])
    if isinstance(data, Sequence):  # tuples and named tuples too
        return any([copied_at_hand_over(v) for v in data])
    to = getattr(data, "to", None)
    if callable(to) and not isinstance(data, type):
        return not callable(getattr(data, "record_stream", None))
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        _warn_left_on_cpu(data)
    return False


def _warn_left_on_cpu(data) -> None:
    if _left_on_cpu_warned[0]:
        return
    fields = [f.name for f in dataclasses.fields(data)
              if isinstance(getattr(data, f.name, None), torch.Tensor)]
    if fields:
        _left_on_cpu_warned[0] = True
        name = type(data).__qualname__
        warnings.warn(
            f"DataLoader(device=...): the batch holds a {name} (a dataclass without a to() "
            f"method), whose tensors ({', '.join(fields)}) stay on the CPU, as torch's "
            f"pin_memory leaves them unpinned. Give {name} a to(device, non_blocking=False) "
            "method that returns a copy with its tensors moved, or return a dict or tuple "
            "from collate_fn. (Warned once.)", RuntimeWarning, stacklevel=2)


class DeviceBatch:
    """A batch on the device, and the event its copy finishes at; or (``event``
    None) a pinned CPU batch to copy at hand-over, on the user's stream."""

    __slots__ = ("batch", "event", "tensors")

    def __init__(self, batch, event, tensors) -> None:
        self.batch, self.event, self.tensors = batch, event, tensors


def hand_over(item, device: torch.device):
    """The user's batch: their current stream waits for its copy, on the GPU,
    and every tensor (or object with ``record_stream``) the copy made is
    marked as used on that stream."""
    if type(item) is not DeviceBatch:
        return item
    if item.event is None:  # NOTE [ Objects with their own to() ]
        return move(item.batch, device, [], [])
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
        if copied_at_hand_over(value):
            later = DeviceBatch(value, None, None)
            return StatefulResult(later, batch.state, batch.exhausted, batch.samples) if stateful \
                else later
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
