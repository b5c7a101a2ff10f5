"""What changed between torch releases, compared with torch's own loader on
whichever release is installed (``setup.cfg`` declares the range; CI runs the
core tests on the oldest and the newest, ``.ci/run``).

``torchfeed/_torch_compat.py`` names each difference; here each is checked
against torch's real ``DataLoader``: ``in_order`` (an argument from 2.6),
``pin_memory_device`` (honoured before 2.9, deprecated and ignored after), the
warning that no accelerator is found (2.7 on), and ``pin_memory()``'s rules for
tuples (2.10) and for objects with their own ``pin_memory()`` (2.11).  The
assertion sentences and the pickle warning of 2.10 are checked in
``test_torch_errors.py``."""
from __future__ import annotations

import collections
import re
import warnings

import pytest
import torch
import torch.utils.data
from loader_helpers import rerun_without_accelerator
from sample_datasets import PinnableBatch, Point, RangeDataset
from torch.utils.data._utils.pin_memory import pin_memory as torch_pin_memory

import torchfeed
from torchfeed._pin_memory import pin_memory
from torchfeed._torch_compat import (
    HONOURS_PIN_MEMORY_DEVICE,
    PINS_FOR_CURRENT_ACCELERATOR,
    TAKES_IN_ORDER,
    TORCH_RELEASE,
    accelerator_available,
)

TorchLoader = torch.utils.data.DataLoader
def test_the_release_read_is_the_one_installed():
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    assert TORCH_RELEASE == (major, minor)
    assert TORCH_RELEASE >= (2, 4), "setup.cfg declares torch>=2.4"
    assert TAKES_IN_ORDER == (TORCH_RELEASE >= (2, 6))


# -- in_order ----------------------------------------------------------------------------
def test_in_order_is_an_argument_exactly_where_torchs_loader_takes_it():
    if TAKES_IN_ORDER:
        theirs = TorchLoader(RangeDataset(4), num_workers=1, in_order=False)
        ours = torchfeed.DataLoader(RangeDataset(4), num_workers=1, in_order=False)
        assert ours.in_order is theirs.in_order is False
        assert torchfeed.DataLoader(RangeDataset(4)).in_order is True
        return
    # torch 2.4, 2.5: no such argument, and no attribute
    with pytest.raises(TypeError) as theirs_error:
        TorchLoader(RangeDataset(4), in_order=True)
    with pytest.raises(TypeError) as ours_error:
        torchfeed.DataLoader(RangeDataset(4), in_order=True)
    assert str(ours_error.value) == str(theirs_error.value)
    assert "unexpected keyword argument 'in_order'" in str(ours_error.value)
    assert not hasattr(TorchLoader(RangeDataset(4)), "in_order")
    assert not hasattr(torchfeed.DataLoader(RangeDataset(4)), "in_order")


def test_batches_in_order_without_the_argument():
    """Without ``in_order`` (the default, and all there is before 2.6) a slow
    worker holds later batches back, as in torch."""
    kwargs = dict(batch_size=2, num_workers=2, multiprocessing_context="fork")
    theirs = [b[1].tolist() for b in TorchLoader(RangeDataset(10), **kwargs)]
    ours = [b[1].tolist() for b in torchfeed.DataLoader(RangeDataset(10), **kwargs)]
    assert ours == theirs == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]


# -- pin_memory / pin_memory_device without an accelerator -------------------------------
def _about_the_loader(message: str) -> bool:
    """Not a warning about this process's threads: from Python 3.12, a fork while any
    thread runs warns (a thread an earlier test left, torch's resource sharer) whoever
    forks, so it says nothing about the loader."""
    return not ("This DataLoader will create" in message
                or re.search(r"is multi-threaded, use of fork\(\) may lead to deadlocks", message))


def _outcome(cls, **kwargs):
    """(warnings, error or None, whether the first tensor came back pinned)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        try:
            batches = list(cls(RangeDataset(4), batch_size=2, **kwargs))
        except Exception as exc:
            # the first line: torch's own, a traceback from its code (or ours) follows
            return ([(w.category, str(w.message)) for w in record
                     if _about_the_loader(str(w.message))],
                    (type(exc), str(exc).splitlines()[0] if str(exc) else ""), None)
    said = [(w.category, str(w.message)) for w in record if _about_the_loader(str(w.message))]
    return said, None, batches[0][0].is_pinned()


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # torch's __del__
@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize("device", ["", "cuda", "no_such_device"])
@pytest.mark.parametrize("pin", [True, False])
def test_pin_memory_device_like_torchs_loader(pin, device, num_workers, request):
    if accelerator_available():  # what torch does when no accelerator is found
        rerun_without_accelerator(request)
        return
    kwargs = dict(pin_memory=pin, pin_memory_device=device, num_workers=num_workers)
    theirs = _outcome(TorchLoader, **kwargs)
    ours = _outcome(torchfeed.DataLoader, **kwargs)
    assert ours == theirs
    said, error, pinned = ours
    messages = " | ".join(message for _, message in said)
    if device and HONOURS_PIN_MEMORY_DEVICE:
        # before torch 2.9: pinned for the device named, which is not there;
        # without pin_memory, a warning that the device is ignored
        assert (error is not None) == pin, ours
        assert ("pin_memory" in messages and "won't be used" in messages) == (not pin)
        return
    assert error is None and pinned is False
    assert ("pin_memory_device is deprecated" in messages) == bool(pin and device)
    assert ("no accelerator is found" in messages) == (pin and PINS_FOR_CURRENT_ACCELERATOR)
    if not pin:
        assert said == []


@pytest.mark.skipif(not HONOURS_PIN_MEMORY_DEVICE,
                    reason="from torch 2.9 nothing is pinned without an accelerator; "
                           "test_pin_memory_rules_like_torchs_function covers the rules")
@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # torch's __del__
@pytest.mark.parametrize("num_workers", [0, 1])
def test_custom_batches_pinned_for_a_named_device_like_torchs_loader(num_workers, request):
    if accelerator_available():  # what torch does when no accelerator is found
        rerun_without_accelerator(request)
        return
    """Before torch 2.9 a named ``pin_memory_device`` is pinned for even with
    no accelerator, so a batch of objects with their own ``pin_memory()`` goes
    through torch's pinning rules here.  With workers torch reads the device's
    index in the main process first: for an unknown device, -1 from 2.7 on;
    before, CUDA's, which fails here (and so must ours)."""
    kwargs = dict(batch_size=2, num_workers=num_workers, pin_memory=True,
                  pin_memory_device="no_such_device", collate_fn=_nested_collate)
    outcomes = []
    for cls in (TorchLoader, torchfeed.DataLoader):
        try:
            outcomes.append([_shape(batch) for batch in cls(RangeDataset(4), **kwargs)])
        except Exception as exc:
            outcomes.append((type(exc), str(exc).splitlines()[0]))
    theirs, ours = outcomes
    assert ours == theirs
    if num_workers == 0 or PINS_FOR_CURRENT_ACCELERATOR:
        assert isinstance(ours, list) and len(ours) == 2, ours
        assert dict(ours[0][1])["tuple"][0] == "list", "before 2.9 a tuple is pinned into a list"


# -- pin_memory() of nested batches, by the release's rules --------------------------------
class PinnableDict(dict):
    """A mapping with its own pin_memory(): 2.11 on calls it, before the items were pinned."""

    def pin_memory(self):
        return PinnableDict(self, own_pin_memory_called=True)


class PinnableList(list):
    """A sequence with its own pin_memory()."""

    def pin_memory(self):
        return PinnableList(["own pin_memory called"])


def _nested(values=(0, 1)):
    return {
        "tuple": tuple(PinnableBatch(v) for v in values),
        "point": Point(PinnableBatch(values[0]), [PinnableBatch(values[1])]),
        "dict_with_method": PinnableDict(a=PinnableBatch(values[0])),
        "list_with_method": PinnableList([PinnableBatch(values[1])]),
        "text": "left alone",
    }


def _nested_collate(samples):
    return _nested(tuple(int(s[1]) for s in samples))


def _shape(x):
    """Types, values and the 'pinned' flags, all the way down."""
    if isinstance(x, PinnableBatch):
        return ("PinnableBatch", x.pinned, x.data)
    if isinstance(x, collections.abc.Mapping):
        return (type(x).__name__, tuple(sorted((k, _shape(v)) for k, v in x.items())))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_shape(v) for v in x))
    return (type(x).__name__, x)


def test_pin_memory_rules_like_torchs_function():
    theirs, ours = _shape(torch_pin_memory(_nested())), _shape(pin_memory(_nested()))
    assert ours == theirs
    by_key = dict(ours[1])
    assert by_key["tuple"][0] == ("list" if TORCH_RELEASE < (2, 10) else "tuple")
    own_method_first = TORCH_RELEASE >= (2, 11)
    assert (("own_pin_memory_called", ("bool", True)) in by_key["dict_with_method"][1]) \
        == own_method_first
    assert (by_key["list_with_method"][1] == (("str", "own pin_memory called"),)) \
        == own_method_first


def test_pin_memory_of_tensors_fails_like_torchs_function():
    """Without an accelerator pinning a tensor raises; with a device named (which
    releases before 2.11 pass on to ``Tensor.pin_memory``), the same error as torch's."""
    if accelerator_available():
        pytest.skip("pinning works here; tests/test_pin_memory.py checks the pinned result")
    for device in (None, "cuda"):
        errors = []
        for fn in (torch_pin_memory, pin_memory):
            with pytest.raises(Exception) as info:
                fn({"x": torch.arange(4)}, device)
            errors.append((type(info.value), str(info.value)))
        assert errors[0] == errors[1], device
