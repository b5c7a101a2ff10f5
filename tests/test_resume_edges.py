"""The edges of a resumable state: a batch that raised, an IterableDataset's short
last batch, a state taken right after an epoch's last batch, set_epoch after a
load, and states that cannot apply (refused at load_state_dict, naming the field,
leaving the loader as it was)."""
from __future__ import annotations

import json

import pytest
import torch
from _resume_helpers import Ids, close, ids
from torch.utils.data import BatchSampler, IterableDataset, get_worker_info
from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler

import torchfeed
from torchfeed import DataLoader

N, BS = 40, 2  # 20 batches an epoch
BAD = 6        # sample 6 raises: batch 3 of an unshuffled epoch


class Flaky(Ids):
    """Sample BAD raises, as a corrupt file would; counts every fetch of it."""

    def __getitem__(self, i):
        if i == BAD:
            raise OSError(f"sample {i} is corrupt")
        return super().__getitem__(i)


def take(it, k):
    """k batches, a caught error counting as one (a loop that skips bad batches)."""
    out = []
    for _ in range(k):
        try:
            out.append(ids(next(it)))
        except OSError:
            out.append("error")
    return out


# -- a batch that raised counts as consumed ------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_caught_batch_error_keeps_the_state_small_and_is_not_fetched_again(num_workers):
    loader = DataLoader(Flaky(N), batch_size=BS, num_workers=num_workers)
    it = iter(loader)
    assert take(it, 4) == [[0, 1], [2, 3], [4, 5], "error"]
    at_error = json.loads(json.dumps(loader.state_dict()))
    rest = take(it, 16)
    assert rest == [[2 * b, 2 * b + 1] for b in range(4, 20)]
    state = loader.state_dict()
    # O(num_workers): the failed batch moved the frontier like any other.
    assert state["out_of_order_yielded"] == [] and state["batches_yielded"] == 20
    assert (at_error["batches_yielded"], at_error["out_of_order_yielded"]) == (4, [])
    close(loader)
    del it

    # Resumed right after the error: the next batch is the one after it, and the
    # bad sample is not read again.
    dataset = Flaky(N)
    resumed = DataLoader(dataset, batch_size=BS)
    resumed.load_state_dict(at_error)
    assert [ids(b) for b in resumed] == rest
    assert dataset.calls == len(rest) * BS


# -- an IterableDataset's short last batch ------------------------------------------
class Range(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(wid, self.n, nw))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterable_samples_yielded_counts_no_padding(num_workers):
    loader = DataLoader(Range(5), batch_size=2, num_workers=num_workers)
    batches = [ids(b) for b in loader]
    assert sorted(sum(batches, [])) == [0, 1, 2, 3, 4]
    state = loader.state_dict()
    assert (state["batches_yielded"], state["samples_yielded"]) == (3, 5)


# -- set_epoch after loading a mid-epoch state ---------------------------------------
def _dist_loader(sampler_cls, batch_sampler=False):
    ds = Ids(23)
    sampler = sampler_cls(ds, num_replicas=2, rank=0, shuffle=True, seed=5)
    if batch_sampler:
        return DataLoader(ds, batch_sampler=BatchSampler(sampler, BS, drop_last=False)), sampler
    return DataLoader(ds, batch_size=BS, sampler=sampler), sampler


@pytest.mark.parametrize("batch_sampler", [False, True])
def test_torchfeed_distributed_sampler_set_epoch_after_a_mid_epoch_load_is_refused(
        batch_sampler):
    loader, sampler = _dist_loader(torchfeed.DistributedSampler, batch_sampler)
    sampler.set_epoch(1)
    epoch1 = [ids(b) for b in loader]
    it = iter(loader)
    next(it), next(it)
    state = json.loads(json.dumps(loader.state_dict()))

    resumed, sampler = _dist_loader(torchfeed.DistributedSampler, batch_sampler)
    resumed.load_state_dict(state)
    assert sampler.epoch == 1  # as with torch's sampler: the saved epoch, set at load
    sampler.set_epoch(2)
    with pytest.raises(ValueError, match=r"epoch 1 of its DistributedSampler, but "
                                         r"set_epoch\(2\) was called after load_state_dict"):
        iter(resumed)
    assert resumed.state_dict() == state  # still pending: nothing started from scratch
    sampler.set_epoch(1)
    assert [ids(b) for b in resumed] == epoch1[2:]


# -- a state taken right after an epoch's last batch ---------------------------------
def _shuffled(generator=True):
    g = torch.Generator().manual_seed(3) if generator else None
    return DataLoader(Ids(11), batch_size=3, shuffle=True, generator=g)


@pytest.mark.parametrize("generator", [True, False])
def test_a_state_after_the_last_batch_starts_the_next_epoch(generator):
    torch.manual_seed(0)
    loader = _shuffled(generator)
    it = iter(loader)
    epoch0 = [ids(next(it)) for _ in range(len(loader))]  # no next() after the last
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["batches_yielded"] == len(loader) and not state["epoch_finished"]
    epoch1 = [ids(b) for b in loader]
    assert sorted(sum(epoch0, [])) == sorted(sum(epoch1, [])) == list(range(11))

    torch.manual_seed(99)  # a new process
    resumed = _shuffled(generator)
    resumed.load_state_dict(state)
    assert [ids(b) for b in resumed] == epoch1  # the whole next epoch, its own shuffle
    assert resumed.state_dict()["epoch"] == 1


def test_a_state_after_the_last_batch_follows_the_loops_set_epoch():
    """A sampler with set_epoch says which epoch the loop wants: set_epoch(e + 1), as
    Lightning calls it, starts the next epoch; left at e (a loop that resumes its own
    epoch count), epoch e goes on with nothing left, and then e + 1 follows."""
    loader, sampler = _dist_loader(TorchDistributedSampler)
    sampler.set_epoch(1)
    epoch1 = [ids(b) for b in loader]
    sampler.set_epoch(2)
    epoch2 = [ids(b) for b in loader]
    sampler.set_epoch(1)
    it = iter(loader)
    assert [ids(next(it)) for _ in range(len(loader))] == epoch1
    state = loader.state_dict()

    resumed, sampler = _dist_loader(TorchDistributedSampler)
    resumed.load_state_dict(state)
    sampler.set_epoch(2)
    assert [ids(b) for b in resumed] == epoch2

    resumed, sampler = _dist_loader(TorchDistributedSampler)
    resumed.load_state_dict(state)
    sampler.set_epoch(1)
    assert [ids(b) for b in resumed] == []
    sampler.set_epoch(2)
    assert [ids(b) for b in resumed] == epoch2


# -- states that cannot apply --------------------------------------------------------
def _mid_epoch_state(make, k=2):
    loader = make()
    it = iter(loader)
    for _ in range(k):
        next(it)
    return json.loads(json.dumps(loader.state_dict()))


def _refused(make, state, match):
    """load_state_dict refuses ``state``, and the loader goes on as if never asked."""
    torch.manual_seed(7)
    expected = [ids(b) for b in make()]
    torch.manual_seed(7)
    loader = make()
    before = loader.state_dict()
    with pytest.raises(ValueError, match=match):
        loader.load_state_dict(state)
    assert loader.state_dict() == before
    assert [ids(b) for b in loader] == expected


def _shuffle_gen():
    return DataLoader(Ids(11), batch_size=3, shuffle=True,
                      generator=torch.Generator().manual_seed(3))


def test_batches_yielded_past_the_end_of_the_epoch_is_refused():
    state = _mid_epoch_state(_shuffle_gen)
    _refused(_shuffle_gen, dict(state, batches_yielded=5),
             r"field 'batches_yielded' is 5 but this DataLoader's epoch 0 has only 4 batches")
    _refused(_shuffle_gen, dict(state, batches_yielded=4, out_of_order_yielded=[[4, 3]]),
             r"field 'out_of_order_yielded' names batch 4 .* only 4 batches")
    loader = _shuffle_gen()
    list(loader)
    finished = loader.state_dict()
    _refused(_shuffle_gen, dict(finished, batches_yielded=6),
             r"field 'batches_yielded' is 6 but .* only 4 batches")


def test_a_sampler_with_fewer_batches_than_the_state_is_refused():
    def fewer():
        ds = Ids(11)
        return DataLoader(ds, batch_size=3,
                          sampler=torch.utils.data.RandomSampler(ds, num_samples=5))
    state = _mid_epoch_state(_shuffle_gen, k=3)
    state["epoch_start_rng"]["generator"] = None
    _refused(fewer, state, r"field 'batches_yielded' is 3 but .* only 2 batches")


def test_a_state_saved_with_another_sampler_is_refused():
    state = _mid_epoch_state(_shuffle_gen)
    plain = lambda: DataLoader(Ids(11), batch_size=3, generator=torch.Generator())  # noqa: E731
    _refused(plain, state, r"field 'sampler' is 'BatchSampler\(RandomSampler\)' in the state "
                           r"but 'BatchSampler\(SequentialSampler\)'")
    with_replacement = lambda: DataLoader(  # noqa: E731
        Ids(11), batch_size=3, generator=torch.Generator(),
        sampler=torch.utils.data.RandomSampler(Ids(11), replacement=True, num_samples=11))
    _refused(with_replacement, state, r"field 'sampler' is .*RandomSampler\(replacement=True\)")

    def torch_dist(shuffle):
        ds = Ids(23)
        return lambda: DataLoader(ds, batch_size=BS, sampler=TorchDistributedSampler(
            ds, num_replicas=2, rank=0, shuffle=shuffle, seed=5))
    state = _mid_epoch_state(torch_dist(True))
    _refused(torch_dist(False), state, r"field 'sampler_state' .* shuffle=True but this one "
                                       r"has shuffle=False")


@pytest.mark.parametrize("seed", [-1, 2 ** 63])
def test_a_base_seed_out_of_range_is_refused(seed):
    state = _mid_epoch_state(_shuffle_gen)
    _refused(_shuffle_gen, dict(state, base_seed=seed), r"field 'base_seed' is -?\d+, outside")


@pytest.mark.parametrize("which", ["global", "generator"])
def test_rng_bytes_torch_cannot_load_are_refused(which):
    import base64
    state = _mid_epoch_state(_shuffle_gen)
    size = len(base64.b64decode(state["epoch_start_rng"][which]))
    zeros = base64.b64encode(bytes(size)).decode()  # the right length, not an mt19937 state
    bad = dict(state, epoch_start_rng=dict(state["epoch_start_rng"], **{which: zeros}))
    _refused(_shuffle_gen, bad, rf"field 'epoch_start_rng'\['{which}'\] is not a state torch "
                                r"can load")


def test_a_state_that_never_started_cannot_claim_batches():
    state = _mid_epoch_state(_shuffle_gen)
    _refused(_shuffle_gen, dict(state, epoch_start_rng=None),
             r"field 'epoch_start_rng' is None \(the epoch never started\)")


class FailingStateSampler(torch.utils.data.Sampler):
    """A sampler whose load_state_dict fails once: the state stays pending."""

    def __init__(self, n):
        self.n, self.epoch, self.fail = n, 0, False

    def __len__(self):
        return self.n

    def __iter__(self):
        self.epoch += 1
        return iter(range(self.n))

    def state_dict(self):
        return {"epoch": self.epoch}

    def load_state_dict(self, state):
        if self.fail:
            self.fail = False
            raise RuntimeError("storage unavailable")
        self.epoch = state["epoch"]


def test_a_resume_that_fails_at_iter_stays_pending():
    make = lambda: DataLoader(Ids(12), batch_size=3, sampler=FailingStateSampler(12))  # noqa
    state = _mid_epoch_state(make)
    loader = make()
    loader.load_state_dict(state)
    loader.sampler.fail = True
    with pytest.raises(RuntimeError, match="storage unavailable"):
        iter(loader)
    assert loader.state_dict() == state  # not a new epoch from scratch
    assert [ids(b) for b in loader] == [[6, 7, 8], [9, 10, 11]]


class FailsOnce(Range):
    """An IterableDataset whose first __iter__ raises (a storage hiccup)."""

    def __init__(self, n):
        super().__init__(n)
        self.failed = False

    def __iter__(self):
        if not self.failed:
            self.failed = True
            raise ConnectionError("storage unavailable")
        return super().__iter__()


def test_an_iterator_that_fails_to_start_leaves_the_loaded_state_pending():
    loader = DataLoader(Range(10), batch_size=2)
    it = iter(loader)
    next(it), next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = DataLoader(FailsOnce(10), batch_size=2)
    with pytest.warns(UserWarning, match="has no state_dict"):
        resumed.load_state_dict(state)
    with pytest.raises(ConnectionError):
        iter(resumed)  # torch calls the dataset's __iter__ here
    assert resumed.state_dict() == state
    assert [ids(b) for b in resumed] == [[4, 5], [6, 7], [8, 9]]


def test_a_distributed_sampler_state_for_another_seed_is_refused_naming_the_field():
    def make(seed):
        ds = Ids(23)
        return lambda: DataLoader(ds, batch_size=BS, sampler=torchfeed.DistributedSampler(
            ds, num_replicas=2, rank=0, seed=seed))
    state = _mid_epoch_state(make(5))
    _refused(make(6), state, r"field 'sampler_state': DistributedSampler state has seed=5 "
                             r"but this sampler has seed=6")
