"""Samplers that shuffle with numpy's or Python's global RNG inside ``__iter__``
(bucketing samplers): the epoch records both states when the sampler starts, so a
fresh process with other seeds resumes exactly, and the user's global RNGs are
left alone.  Samplers that cannot be resumed exactly make ``state_dict()`` warn
once, saying why."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from _resume_helpers import BucketSampler, Ids, ids
from torch.utils.data import Sampler

from torchfeed import DataLoader

HERE = os.path.dirname(os.path.abspath(__file__))
N, BS = 23, 4  # 6 batches an epoch


def _bucketed(num_workers=0):
    return DataLoader(Ids(N), batch_sampler=BucketSampler(N, BS), num_workers=num_workers)


def _resume_in_a_fresh_process(cases):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), HERE,
                                         env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, os.path.join(HERE, "_resume_host_child.py")],
                         input=json.dumps(cases), env=env, capture_output=True, text=True,
                         timeout=90)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


CASES = [  # (saved with num_workers, resumed with, batches taken: None = the whole epoch)
    (0, 0, 2),      # inside the epoch
    (2, 2, 6),      # after its last batch, no StopIteration: the next epoch
    (0, 2, None),   # after the for loop: the next epoch
]


@pytest.mark.long
@pytest.mark.timeout(120)
def test_bucketing_sampler_resumes_exactly_in_a_fresh_process():
    cases, expected = [], []
    for saved_workers, resumed_workers, k in CASES:
        np.random.seed(1)
        random.seed(1)
        reference = _bucketed(saved_workers)
        full = [[ids(b) for b in reference] for _ in range(2)]

        np.random.seed(1)
        random.seed(1)
        loader = _bucketed(saved_workers)
        it = iter(loader)
        taken = [ids(b) for b in it] if k is None else [ids(next(it)) for _ in range(k)]
        assert taken == full[0][:len(taken)]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # this sampler resumes exactly: no warning
            state = json.loads(json.dumps(loader.state_dict()))
        del it, loader
        cases.append([state, resumed_workers])
        expected.append(full[0][k:] if k is not None and k < len(full[0]) else full[1])

    got = _resume_in_a_fresh_process(cases)  # one process, seeded otherwise, for all cases
    for case, result, want, (state, _) in zip(CASES, got, expected, cases):
        assert result["epoch"] == want, case
        assert result["untouched"], f"{case}: the resume moved numpy's or Python's global RNG"
        assert set(state["epoch_start_rng"]["host"]) == {"numpy", "python"}


def test_torch_samplers_record_no_host_rngs():
    loader = DataLoader(Ids(N), batch_size=BS, shuffle=True)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert "host" not in state["epoch_start_rng"] and state["next_epoch_host_rng"] is None


class OwnRngSampler(Sampler):
    """Shuffles with a numpy Generator it owns, and has no state_dict()."""

    def __init__(self, n):
        self.n, self.rng = n, np.random.default_rng(0)

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(self.rng.permutation(self.n).tolist())


class LazySampler(Sampler):
    """Draws from Python's global RNG while it yields, batch by batch."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        for i in range(self.n):
            yield (i + random.randrange(3)) % self.n


@pytest.mark.parametrize("sampler, why", [
    (OwnRngSampler(N), r"the sampler's own random generator \(OwnRngSampler.rng\)"),
    (LazySampler(N), r"LazySampler drew from a global RNG .* while it yielded batches"),
])
def test_a_sampler_that_cannot_resume_exactly_warns_once_at_state_dict(sampler, why):
    loader = DataLoader(Ids(N), batch_size=BS, sampler=sampler)
    it = iter(loader)
    for _ in range(3):
        next(it)
    with pytest.warns(UserWarning, match="cannot resume the epoch exactly: " + why):
        loader.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader.state_dict()  # once


def test_a_corrupted_host_rng_state_is_refused():
    loader = _bucketed()
    it = iter(loader)
    next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    bad = dict(state, epoch_start_rng=dict(state["epoch_start_rng"],
                                           host={"numpy": "AAAA", "python": None}))
    with pytest.raises(ValueError, match=r"field 'epoch_start_rng'\['host'\]\['numpy'\] is "
                                         r"not a state numpy can load"):
        _bucketed().load_state_dict(bad)
    torch.manual_seed(0)
