"""Checkpoints written by an earlier torchfeed still load, and resume exactly.

``tests/checkpoints/*.json`` were written by torchfeed at commit 9d57888 (see
``_checkpoint_cases.py``): map-style mid-epoch with a generator and with the
global RNG, a Stateful dataset with persistent workers, a Stateful
IterableDataset, torch's and torchfeed's DistributedSampler, a state at an
epoch's end and one before the first ``iter()``.  Each must load into a fresh
loader of today's torchfeed and yield what the uninterrupted run yielded.
"""
from __future__ import annotations

import base64
import copy
import json
import pathlib

import pytest
import torch
from _checkpoint_cases import CASES, write
from _resume_helpers import close, run_epochs

from torchfeed._checkpoint import _OPTIONAL, FIELDS, Checkpoint

FIXTURES = pathlib.Path(__file__).parent / "checkpoints"


def _load(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def test_every_case_has_a_checkpoint():
    assert sorted(p.stem for p in FIXTURES.glob("*.json")) == sorted(CASES)


def _resume(name: str, state: dict) -> list:
    """What a fresh loader of case ``name`` yields after loading ``state``."""
    saved = _load(name)
    make, _, _, _, before_epoch = CASES[name]
    torch.manual_seed(987654321)  # a new process
    loader = make()
    loader.load_state_dict(state)
    # What was loaded is the loader's state now (a state at an epoch's boundary, with
    # the global RNG put back below, would otherwise yield the same batches unloaded).
    assert loader.state_dict() == Checkpoint.read(state).as_dict()
    # the training loop's checkpoint puts the global RNG back, as Lightning does
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(saved["global_rng"])),
                                         dtype=torch.uint8))
    got = run_epochs(loader, len(saved["rest"]), before_epoch, start=saved["epoch"])
    assert loader.state_dict()["epoch"] == saved["epoch"] + len(saved["rest"]) - 1
    close(loader)
    return got


def _without(state: dict, fields) -> dict:
    """``state`` as a release before ``fields`` were added wrote it."""
    return {k: v for k, v in state.items() if k not in fields}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(CASES))
def test_an_old_checkpoint_resumes_exactly(name):
    saved = _load(name)
    assert _resume(name, saved["state"]) == saved["rest"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_checkpoint_without_a_later_field_resumes_exactly(name):
    """The fields added within version 1, all absent (as the first version-1 release
    wrote its states): the state still loads and resumes exactly."""
    saved = _load(name)
    old = _without(saved["state"], _OPTIONAL)
    assert not set(_OPTIONAL) & set(old)
    assert _resume(name, old) == saved["rest"]


def test_a_checkpoint_without_a_later_field_reads_as_if_it_were_none():
    """Each field added within version 1, absent on its own from each fixture: it
    reads as None, and the state is given back in today's format, with it None."""
    for name in sorted(CASES):
        state = _load(name)["state"]
        for field in (*_OPTIONAL, tuple(_OPTIONAL)):
            fields = field if isinstance(field, tuple) else (field,)
            old = _without(state, fields)
            assert set(old) == set(FIELDS) - set(fields), (name, field)
            back = Checkpoint.read(old).as_dict()
            assert back == {**old, **{f: None for f in fields}}, (name, field)
            assert Checkpoint.read(back) == Checkpoint.read(old), (name, field)


def _scribble(value) -> None:
    """Change every dict and list nested in ``value``, in place."""
    if isinstance(value, dict):
        for v in value.values():
            _scribble(v)
        value["scribbled"] = True
    elif isinstance(value, list):
        for v in value:
            _scribble(v)
        value.append("scribbled")


@pytest.mark.timeout(60)
def test_a_loaded_state_shares_nothing_with_its_dicts():
    """The caller may change the dict it loaded, or the one state_dict() gave back,
    nested values included: the loader's state and its resume stay what was loaded."""
    name = "map_stateful_dataset_nw2_persistent"  # nested dicts: RNGs, sampler, datasets
    saved = _load(name)
    state = saved["state"]
    pristine = copy.deepcopy(state)
    make = CASES[name][0]
    loader = make()
    loader.load_state_dict(state)
    _scribble(state)
    assert loader.state_dict() == pristine
    _scribble(loader.state_dict())
    assert loader.state_dict() == pristine
    close(loader)
    assert _resume(name, pristine) == saved["rest"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["map_shuffle_global_nw2", "iterable_stateful_nw2",
                                  "end_of_epoch_shuffle_global_nw2"])
def test_the_uninterrupted_run_is_what_it_was(name):
    """The fixtures' expected batches are still what an uninterrupted run yields."""
    assert write(name)["rest"] == _load(name)["rest"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_old_checkpoint_reads_into_one_value_and_back(name):
    """The typed value holds every key of the format, and gives the same dict back."""
    state = _load(name)["state"]
    assert set(state) == set(FIELDS)
    assert Checkpoint.read(state).as_dict() == state


@pytest.mark.timeout(60)
def test_state_dict_writes_the_fields_the_value_reads():
    make = CASES["map_shuffle_global_nw2"][0]
    loader = make()
    states = [loader.state_dict()]
    it = iter(loader)
    next(it)
    states.append(loader.state_dict())
    states.append(json.loads(json.dumps(states[-1])))
    del it
    close(loader)
    for state in states:
        assert set(state) == set(FIELDS)
        assert Checkpoint.read(state).as_dict() == state


def test_a_state_holding_a_value_that_cannot_be_copied_is_refused_naming_it():
    """A state holds plain values; one that holds a lock (not what state_dict() or its
    json or torch.save round trip gives) is refused at the reading, with ValueError."""
    import threading

    state = _load("map_stateful_dataset_nw2_persistent")["state"]
    state["worker_states"][0] = {"made": 4, "lock": threading.Lock()}
    loader = CASES["map_stateful_dataset_nw2_persistent"][0]()
    with pytest.raises(ValueError, match="cannot be copied .*lock.*plain values"):
        loader.load_state_dict(state)
    assert loader.state_dict()["epoch_start_rng"] is None  # nothing was loaded
