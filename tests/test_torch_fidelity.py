"""Drop-in details where torchfeed once differed from torch: what ``iter()``
asks of the dataset, the exception type of a batch torch cannot collate,
``DataLoader[int]``, and IterDataPipe datasets (seeded and sharded per worker
as torch's iterators do).  Each test runs torch's loader on the same case."""
from __future__ import annotations

import traceback

import numpy as np
import pytest
import torch
import torch.utils.data
from dist_launches import LAUNCHES, ranks_of
from torch.utils.data import Dataset

import torchfeed

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


class NoLength(Dataset):
    """A dataset whose ``__len__`` raises, as a lazily indexed one may: torch
    never calls it when a batch_sampler says what to load."""

    len_calls = 0

    def __getitem__(self, i):
        return torch.tensor([i])

    def __len__(self):
        type(self).len_calls += 1
        raise NotImplementedError("the length is not known until the index is built")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_len_is_not_called_where_torch_does_not_call_it(num_workers):
    out = {}
    for cls in (torch.utils.data.DataLoader, torchfeed.DataLoader):
        NoLength.len_calls = 0
        loader = cls(NoLength(), batch_sampler=[[0, 1], [2, 3], [4]], num_workers=num_workers)
        out[cls] = [b.tolist() for b in loader]
        assert NoLength.len_calls == 0, cls  # iter() and the epoch never asked
    assert out[torchfeed.DataLoader] == out[torch.utils.data.DataLoader] == \
        [[[0], [1]], [[2], [3]], [[4]]]


def test_state_dict_of_a_dataset_without_length():
    loader = torchfeed.DataLoader(NoLength(), batch_sampler=[[0, 1], [2, 3]])
    it = iter(loader)
    next(it)
    state = loader.state_dict()  # our own feature: len() asked, its failure handled
    assert state["dataset_len"] is None and state["batches_yielded"] == 1


class TensorThenArray(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.zeros(3) if i % 2 == 0 else np.zeros(3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_batch_mixing_tensor_and_array_raises_torchs_type(num_workers):
    """torch's default_collate stacks in the main process (TypeError from
    torch.stack) but, in a worker, sums numel() first (AttributeError)."""
    raised = []
    for cls in (torch.utils.data.DataLoader, torchfeed.DataLoader):
        with pytest.raises(Exception) as info:
            list(cls(TensorThenArray(), batch_size=2, num_workers=num_workers))
        traceback.clear_frames(info.value.__traceback__)  # torch's iterator is in them
        raised.append((type(info.value), str(info.value).splitlines()[-1]))
    assert raised[0] == raised[1]
    assert raised[0][0] is (AttributeError if num_workers else TypeError)


def test_dataloader_is_generic_like_torchs():
    alias = torchfeed.DataLoader[int]
    assert alias.__origin__ is torchfeed.DataLoader
    assert torch.utils.data.DataLoader[int].__origin__ is torch.utils.data.DataLoader
    loader = alias(list(range(4)), batch_size=2)
    assert isinstance(loader, torchfeed.DataLoader)
    assert isinstance(loader, torch.utils.data.DataLoader)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]


def shuffled_and_sharded():
    from torch.utils.data.datapipes.iter import IterableWrapper

    return IterableWrapper(range(10)).shuffle().sharding_filter()


def datapipe_epochs(loader_cls, num_workers, persistent, use_generator, epochs=2):
    """Each epoch's batches, and the RNG the shared seeds were drawn from, after."""
    torch.manual_seed(7)
    generator = None
    if use_generator:
        generator = torch.Generator()
        generator.manual_seed(0)
    loader = loader_cls(shuffled_and_sharded(), batch_size=2, num_workers=num_workers,
                        generator=generator, persistent_workers=persistent)
    out = [[b.tolist() for b in loader] for _ in range(epochs)]
    rng = generator.get_state() if use_generator else torch.get_rng_state()
    return out, rng


@pytest.mark.timeout(90)
@pytest.mark.parametrize("num_workers, persistent, use_generator",
                         [(0, False, True), (2, False, True), (2, True, True), (2, False, False)])
def test_iter_datapipe_is_seeded_and_sharded_like_torch(num_workers, persistent, use_generator):
    """torch seeds every shuffle() from a shared seed drawn from the loader's
    generator (apply_random_seed) and shards per worker (apply_sharding):
    each sample comes once per epoch, in torch's batches, and the generator
    (or the global RNG) ends where torch's does."""
    theirs, theirs_rng = datapipe_epochs(torch.utils.data.DataLoader, num_workers, persistent,
                                         use_generator)
    ours, ours_rng = datapipe_epochs(torchfeed.DataLoader, num_workers, persistent,
                                     use_generator)
    for epoch in ours:
        assert sorted(x for batch in epoch for x in batch) == list(range(10)), ours
    assert ours[0] != ours[1]  # the shuffle is reseeded each epoch
    assert ours == theirs
    assert torch.equal(ours_rng, theirs_rng)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_iter_datapipe_resumes_into_the_same_shuffle(num_workers):
    def loader():
        generator = torch.Generator()
        generator.manual_seed(3)
        return torchfeed.DataLoader(shuffled_and_sharded(), batch_size=2,
                                    num_workers=num_workers, generator=generator)

    whole = [b.tolist() for b in loader()]
    first = loader()
    it = iter(first)
    head = [next(it).tolist() for _ in range(2)]
    state = first.state_dict()
    del it
    resumed = loader()
    # A datapipe keeps no state: the resume reads the 2 batches again (same seed, same
    # shuffle) and drops them, and says so.
    with pytest.warns(UserWarning, match="reads the 2 batches this epoch already yielded again"):
        resumed.load_state_dict(state)
        rest = [b.tolist() for b in resumed]
    assert head + rest == whole


@pytest.mark.long
@pytest.mark.timeout(420)  # the shared world-2 torchrun job runs other modules' scenarios too
@LAUNCHES
def test_iter_datapipe_is_sharded_across_ranks_like_torch(tmp_path_factory):
    """Two ranks of a real gloo group (torchrun), each with a generator seeded
    differently: the shared seed is rank 0's, broadcast as torch does, so both
    ranks shuffle alike, and sharding by rank and worker gives every sample to
    exactly one rank, in torch's batches.  tests/_dist_datapipes.py, run by both
    ranks of tests/dist_launches.py's world-2 job."""
    ranks = ranks_of(tmp_path_factory, "datapipes")
    for num_workers in ("0", "2"):
        for rank in ranks:
            assert rank["torchfeed"][num_workers] == rank["torch"][num_workers]
        seen = [x for rank in ranks for batch in rank["torchfeed"][num_workers] for x in batch]
        assert sorted(seen) == list(range(20)), (num_workers, ranks)
