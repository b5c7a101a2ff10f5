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
import json
import pathlib

import pytest
import torch
from _checkpoint_cases import CASES, write
from _resume_helpers import close, run_epochs

from torchfeed._checkpoint import FIELDS, Checkpoint

FIXTURES = pathlib.Path(__file__).parent / "checkpoints"


def _load(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def test_every_case_has_a_checkpoint():
    assert sorted(p.stem for p in FIXTURES.glob("*.json")) == sorted(CASES)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(CASES))
def test_an_old_checkpoint_resumes_exactly(name):
    saved = _load(name)
    make, _, _, _, before_epoch = CASES[name]
    torch.manual_seed(987654321)  # a new process
    loader = make()
    loader.load_state_dict(saved["state"])
    # the training loop's checkpoint puts the global RNG back, as Lightning does
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(saved["global_rng"])),
                                         dtype=torch.uint8))
    got = run_epochs(loader, len(saved["rest"]), before_epoch, start=saved["epoch"])
    close(loader)
    assert got == saved["rest"]


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
