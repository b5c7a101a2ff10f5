"""torch's own DistributedSampler (no state_dict) under torchfeed.DataLoader: its epoch
travels in the loader state, a resume never silently uses another epoch's order, and
a changed world size is refused.  In-process: the sampler takes num_replicas and rank
as arguments; tests/test_distributed.py runs the same under a real process group."""
from __future__ import annotations

import json

import pytest
from _resume_helpers import Ids, close, ids
from torch.utils.data import BatchSampler
from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler

from torchfeed import DataLoader

N, BS, WORLD = 23, 2, 2  # 12 indices a rank (padded), 6 batches


def make(rank=0, world=WORLD, num_workers=0, batch_sampler=False):
    ds = Ids(N)
    sampler = TorchDistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=5)
    if batch_sampler:
        return DataLoader(ds, batch_sampler=BatchSampler(sampler, BS, drop_last=False),
                          num_workers=num_workers)
    return DataLoader(ds, batch_size=BS, sampler=sampler, num_workers=num_workers)


def dist_sampler(loader):
    if isinstance(loader.sampler, TorchDistributedSampler):
        return loader.sampler
    return loader.batch_sampler.sampler


def epoch_of(loader, epoch):
    dist_sampler(loader).set_epoch(epoch)
    return [ids(b) for b in loader]


def saved_mid_epoch(k=2, epoch=3, **kw):
    """k batches into `epoch`; the state (through json) and the uninterrupted run."""
    loader = make(**kw)
    expected = {e: epoch_of(loader, e) for e in (epoch, epoch + 1)}
    dist_sampler(loader).set_epoch(epoch)
    it = iter(loader)
    taken = [ids(next(it)) for _ in range(k)]
    state = json.loads(json.dumps(loader.state_dict()))
    close(loader)
    del it
    assert taken == expected[epoch][:k]
    return state, expected


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("rank", [0, 1])
def test_resume_without_set_epoch_continues_the_saved_epoch(num_workers, rank):
    """The bug: a fresh sampler is at epoch 0, and the saved epoch's order was lost."""
    state, expected = saved_mid_epoch(rank=rank, num_workers=num_workers)
    assert state["sampler_state"] == {"protocol": "set_epoch",
                                      "state": {"epoch": 3, "num_replicas": WORLD,
                                                "shuffle": True, "seed": 5, "drop_last": False}}
    resumed = make(rank=rank, num_workers=num_workers)
    resumed.load_state_dict(state)  # no set_epoch call
    assert dist_sampler(resumed).epoch == 3
    assert [ids(b) for b in resumed] == expected[3][2:]
    assert epoch_of(resumed, 4) == expected[4]
    close(resumed)


def test_resume_with_the_usual_set_epoch_loop_and_a_batch_sampler():
    state, expected = saved_mid_epoch(k=4, batch_sampler=True)
    assert state["sampler_state"]["protocol"] == "set_epoch"
    resumed = make(batch_sampler=True)
    resumed.load_state_dict(state)
    assert epoch_of(resumed, 3) == expected[3][4:]  # the loop's set_epoch(checkpoint epoch)
    assert epoch_of(resumed, 4) == expected[4]


def test_set_epoch_to_another_epoch_after_loading_a_mid_epoch_state_is_refused():
    state, expected = saved_mid_epoch()
    resumed = make()
    resumed.load_state_dict(state)
    dist_sampler(resumed).set_epoch(0)
    with pytest.raises(ValueError, match=r"epoch 3.*set_epoch\(0\)"):
        iter(resumed)
    # the loaded state is still pending: nothing started from scratch
    assert resumed.state_dict() == state
    dist_sampler(resumed).set_epoch(3)
    assert [ids(b) for b in resumed] == expected[3][2:]


def test_finished_epoch_state_resumes_at_the_next_epoch_unchecked():
    loader = make()
    expected = {e: epoch_of(loader, e) for e in (3, 4)}
    dist_sampler(loader).set_epoch(3)
    assert [ids(b) for b in loader] == expected[3]
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["epoch_finished"]
    resumed = make()
    resumed.load_state_dict(state)
    assert dist_sampler(resumed).epoch == 3
    assert epoch_of(resumed, 4) == expected[4]


@pytest.mark.parametrize("world", [1, 3])
def test_another_world_size_is_refused_at_load(world):
    state, _ = saved_mid_epoch()
    resumed = make(world=world)
    with pytest.raises(ValueError) as e:
        resumed.load_state_dict(state)
    message = str(e.value)
    assert f"world size {WORLD}" in message and f"world size {world}" in message
    assert "torchfeed.DistributedSampler" in message

