"""Which torch release is installed, and what differs between the ones supported.

torch's behaviour is torchfeed's spec, and it changed between releases
(``setup.cfg`` declares the range, from 2.4).  This module is the only place
that asks which release is installed; the rest of the library asks it a named
question ("does the constructor take ``in_order``?") and gets the answer the
installed release gives.  What changed, from each release's
``torch/utils/data/dataloader.py`` and ``_utils/pin_memory.py``:

* 2.6: ``in_order``, an argument and attribute of ``DataLoader``.
* 2.7: without ``pin_memory_device`` the loader pins for the current
  accelerator (``torch.accelerator``), and warns when none is found; before,
  for CUDA only, silently.
* 2.9: ``pin_memory_device`` is deprecated, warned about and ignored; before,
  the loader pinned for the device named, present or not (each tensor's
  ``pin_memory(device)``, the device's module making it current in the pin
  thread).
* 2.10: ``pin_memory()`` keeps a plain tuple a tuple (before: a list); the
  iterators' bare ``assert``s became sentences; a worker whose arguments cannot
  be pickled gets a warning before pickle's error.
* 2.11: ``pin_memory()`` asks an object's own ``pin_memory()`` first, before
  the containers, and pins tensors without passing a device.
* 2.13: ``WorkerInfo`` has ``rng`` and ``worker_method`` fields, and
  ``torch.thread_safe_generator()`` returns a thread worker's own generator.
  No release up to 2.15 has thread workers themselves (pytorch PR 161044:
  ``DataLoader(worker_method="thread")``, ``get_worker_info()`` read from a
  thread-local first); where a release does, the questions below say so.
"""
from __future__ import annotations

import inspect
import re

import torch
import torch.utils.data
import torch.utils.data._utils.worker as _torch_worker


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: "2.4.1+cu121" -> (2, 4)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise RuntimeError(f"torchfeed cannot read torch's version {version!r}")
    return int(match.group(1)), int(match.group(2))


TORCH_RELEASE = _release(torch.__version__)

# The constructor's own signature says whether it takes in_order (2.6 on).
TAKES_IN_ORDER = "in_order" in inspect.signature(torch.utils.data.DataLoader.__init__).parameters

# torch's own thread workers (pytorch PR 161044): the constructor takes
# worker_method, and get_worker_info() reads a thread-local first.  No release
# up to 2.15 has them; torchfeed provides both where torch does not.
TAKES_WORKER_METHOD = "worker_method" in inspect.signature(torch.utils.data.DataLoader.__init__).parameters
THREAD_LOCAL_WORKER_INFO = hasattr(_torch_worker, "_thread_local_worker_info")
# WorkerInfo's rng and worker_method fields (2.13 on; before, WorkerInfo took
# any keyword and kept it as an attribute) and torch's container for a thread
# worker's generators (None before 2.13).
WORKER_INFO_RNG = getattr(_torch_worker, "_RNG", None)

# Without pin_memory_device the loader pins for the current accelerator (2.7 on,
# warning when there is none), before that for CUDA, silently without it.
PINS_FOR_CURRENT_ACCELERATOR = TORCH_RELEASE >= (2, 7)
# Before 2.9 pin_memory_device chose the device; 2.9 deprecated it for the current accelerator.
HONOURS_PIN_MEMORY_DEVICE = TORCH_RELEASE < (2, 9)
# pin_memory() of a batch, by the release's rules
PIN_TUPLE_AS_LIST = TORCH_RELEASE < (2, 10)
PIN_OWN_METHOD_FIRST = TORCH_RELEASE >= (2, 11)
PIN_PASSES_DEVICE = TORCH_RELEASE < (2, 11)  # Tensor.pin_memory(device)
# The iterators' refusals (timeout without workers, prefetch_factor=0) were bare
# asserts, an AssertionError with no message, before 2.10.
ASSERTIONS_HAVE_SENTENCES = TORCH_RELEASE >= (2, 10)
# "Got pickle error when attempting to start a worker Process. ..." (2.10 on)
WARNS_OF_PICKLE_ERROR = TORCH_RELEASE >= (2, 10)


def assertion_message(torchs: str, ours: str) -> str:
    """The message of an ``AssertionError`` one of torch's iterators raises:
    torch's sentence, then ours; ours alone where the release had a bare ``assert``."""
    return f"{torchs}\n{ours}" if ASSERTIONS_HAVE_SENTENCES else ours


def in_order(loader) -> bool:
    """The loader's ``in_order`` (``True`` where torch has no such argument)."""
    return getattr(loader, "in_order", True)


def accelerator_available() -> bool:
    """Whether the release's loader can pin without ``pin_memory_device``:
    any accelerator (2.7 on), CUDA before."""
    if PINS_FOR_CURRENT_ACCELERATOR:
        return torch.accelerator.is_available()
    return torch.cuda.is_available()


def current_accelerator_type() -> str | None:
    """The device type the release's loader pins for without ``pin_memory_device``."""
    if PINS_FOR_CURRENT_ACCELERATOR:
        acc = torch.accelerator.current_accelerator()
        return acc.type if acc is not None else None
    return "cuda" if torch.cuda.is_available() else None


def _privateuse1_name() -> str:
    return torch._C._get_privateuse1_backend_name()


def pin_device_index(device: str | None) -> int:
    """The device index torch's loader hands its pin-memory thread, read in the
    main process when the iterator starts (it raises where torch's raises:
    ``pin_memory_device="cuda"`` without CUDA, for one)."""
    if not HONOURS_PIN_MEMORY_DEVICE:
        return torch.accelerator.current_device_index()
    if device == "xpu":
        return torch.xpu.current_device()
    if device is not None and device != "cuda" and device == _privateuse1_name():
        return getattr(torch, device).current_device()
    if PINS_FOR_CURRENT_ACCELERATOR:  # 2.7, 2.8: an unknown device name gets -1
        if device == "cuda":
            return torch.cuda.current_device()
        return torch.accelerator.current_device_index() if device is None else -1
    return torch.cuda.current_device()  # 2.4 to 2.6: CUDA for anything else


def make_pin_device_current(device: str | None, index: int) -> None:
    """What torch's pin-memory thread does first: make its device current."""
    if not HONOURS_PIN_MEMORY_DEVICE:
        torch.accelerator.set_device_index(index)
    elif device == "cuda":
        torch.cuda.set_device(index)
    elif device == "xpu":
        torch.xpu.set_device(index)
    elif device is not None and device == _privateuse1_name():
        getattr(torch, device).set_device(index)
    elif device is None and PINS_FOR_CURRENT_ACCELERATOR:
        torch.accelerator.set_device_index(index)
