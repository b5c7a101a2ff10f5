"""Seeding matches torch's: per-worker seeds for torch, random and numpy, the
base seed's source, and how far iterating advances the caller's RNGs."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.utils.data
from loader_helpers import assert_same, torch_and_ours
from sample_datasets import RandomAugment, RangeDataset, SeedProbe, ShardedIterable
from torch.utils.data._utils.worker import _generate_state

import torchfeed

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def first_draw(gen_seed: int) -> int:
    """The base seed a loader with a fresh generator(gen_seed) and no shuffle draws."""
    g = torch.Generator().manual_seed(gen_seed)
    return int(torch.empty((), dtype=torch.int64).random_(generator=g).item())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [1, 3])
def test_worker_seeds_are_base_seed_plus_id(num_workers):
    base = first_draw(77)
    loader = torchfeed.DataLoader(SeedProbe(6), batch_size=None, num_workers=num_workers,
                                  generator=torch.Generator().manual_seed(77))
    seen = set()
    for sample in loader:
        k = sample["id"]
        seen.add(k)
        assert sample["seed"] == sample["initial_seed"] == base + k
        # What each RNG gave first after seeding, against fresh RNGs seeded as torch does.
        expected_random = random.Random(base + k).random()
        expected_torch = torch.rand((), generator=torch.Generator().manual_seed(base + k)).item()
        expected_numpy = np.random.RandomState(_generate_state(base, k)).rand()
        assert sample["first"].tolist() == [expected_random, expected_torch, expected_numpy]
    assert seen == set(range(num_workers))


@pytest.mark.timeout(60)
def test_numpy_differs_across_workers():
    loader = torchfeed.DataLoader(SeedProbe(4), batch_size=None, num_workers=2,
                                  generator=torch.Generator().manual_seed(1))
    firsts = {s["id"]: s["first"][2].item() for s in loader}
    assert firsts[0] != firsts[1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kwargs", [
    dict(num_workers=2, generator=123),
    dict(num_workers=3, generator=9, batch_size=2),
    dict(num_workers=2, seed=5),                      # base seed from the global RNG
    dict(num_workers=2, seed=6, shuffle=True, batch_size=3),
    dict(num_workers=2, generator=8, persistent_workers=True, epochs=2),
    dict(num_workers=2, seed=4, persistent_workers=True, shuffle=True, epochs=3),
    dict(num_workers=0, seed=3, shuffle=True, batch_size=2, epochs=2),
], ids=["gen", "gen-3w", "global", "global-shuffle", "persistent", "persistent-shuffle",
        "no-workers"])
def test_values_drawn_in_workers_equal_torchs(kwargs):
    kwargs.setdefault("batch_size", None)
    theirs, ours = torch_and_ours(RandomAugment(), **kwargs)
    assert_same(theirs, ours)


@pytest.mark.timeout(60)
def test_probe_values_equal_torchs():
    theirs, ours = torch_and_ours(SeedProbe(8), batch_size=None, num_workers=2, generator=31)
    assert_same(theirs, ours)


def _rng_after(cls, dataset, seed, epochs, partial, **kwargs):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    if "generator" in kwargs:
        kwargs["generator"] = torch.Generator().manual_seed(kwargs["generator"])
    loader = cls(dataset, **kwargs)
    for _ in range(epochs):
        list(loader)
    if partial:  # start one more epoch, take one batch, abandon it
        it = iter(loader)
        next(it)
        del it
    state = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    gen_state = kwargs["generator"].get_state() if "generator" in kwargs else None
    del loader
    return state, gen_state


@pytest.mark.timeout(60)
@pytest.mark.parametrize("config", [
    dict(num_workers=0),
    dict(num_workers=0, shuffle=True, batch_size=3),
    dict(num_workers=2),
    dict(num_workers=2, shuffle=True, batch_size=3),
    dict(num_workers=2, shuffle=True, generator=17, batch_size=3),
    dict(num_workers=2, shuffle=True, persistent_workers=True, batch_size=3),
    dict(num_workers=3, persistent_workers=True, generator=3),
    dict(num_workers=2, iterable=True, batch_size=4),
], ids=["single", "single-shuffle", "workers", "workers-shuffle", "generator",
        "persistent-shuffle", "persistent-generator", "iterable"])
def test_global_rng_advances_exactly_as_torchs(config):
    config = dict(config)
    dataset = ShardedIterable(0, 10) if config.pop("iterable", False) else RangeDataset(10)
    theirs = _rng_after(torch.utils.data.DataLoader, dataset, 1234, 2, True, **config)
    ours = _rng_after(torchfeed.DataLoader, dataset, 1234, 2, True, **config)
    assert torch.equal(theirs[0][0], ours[0][0]), "global torch RNG"
    assert theirs[0][1] == ours[0][1], "random's global RNG"
    assert np.array_equal(theirs[0][2], ours[0][2]), "numpy's global RNG"
    if theirs[1] is not None:
        assert torch.equal(theirs[1], ours[1]), "the loader's generator"
    # And iterating did draw something, so the comparison is not vacuous.
    torch.manual_seed(1234)
    assert not torch.equal(torch.get_rng_state(), ours[0][0]) or "generator" in config


def test_generator_leaves_global_rng_alone():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    list(torchfeed.DataLoader(RangeDataset(6), shuffle=True,
                              generator=torch.Generator().manual_seed(1)))
    assert torch.equal(before, torch.get_rng_state())


@pytest.mark.timeout(60)
def test_base_seed_comes_from_global_rng_without_generator():
    torch.manual_seed(42)
    expected = int(torch.empty((), dtype=torch.int64).random_().item())
    torch.manual_seed(42)
    seeds = {s["id"]: s["seed"] for s in torchfeed.DataLoader(SeedProbe(4), batch_size=None,
                                                              num_workers=2)}
    assert seeds == {0: expected, 1: expected + 1}


@pytest.mark.timeout(60)
def test_each_epoch_draws_a_new_base_seed_without_persistent_workers():
    loader = torchfeed.DataLoader(SeedProbe(2), batch_size=None, num_workers=1,
                                  generator=torch.Generator().manual_seed(0))
    first, second = list(loader), list(loader)
    assert first[0]["seed"] != second[0]["seed"]
    persistent = torchfeed.DataLoader(SeedProbe(2), batch_size=None, num_workers=1,
                                      persistent_workers=True,
                                      generator=torch.Generator().manual_seed(0))
    first, second = list(persistent), list(persistent)
    assert first[0]["seed"] == second[0]["seed"]  # the workers, and their seeds, are kept


# -- seed_per_batch in the main process ----------------------------------------------------
def _per_batch(num_workers):
    loader = torchfeed.DataLoader(RandomAugment(), batch_size=3, shuffle=True,
                                  num_workers=num_workers, seed_per_batch=True,
                                  generator=torch.Generator().manual_seed(5))
    return [[t.tolist() for t in batch] for _ in range(2) for batch in loader]


def _all_global_rngs():
    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()


@pytest.mark.timeout(60)
def test_seed_per_batch_in_the_main_process_leaves_the_callers_rngs_alone():
    """num_workers=0 reseeds for each batch in the training process itself: the caller's
    CPU generator, random and numpy come back, and the augmentations are the workers'."""
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    before = _all_global_rngs()
    main = _per_batch(0)
    after = _all_global_rngs()
    assert torch.equal(before[0], after[0]) and before[1] == after[1]
    assert np.array_equal(before[2], after[2])
    assert main == _per_batch(2)


def test_seed_per_batch_in_the_main_process_does_not_reseed_every_device(monkeypatch):
    """torch.manual_seed also reseeds every CUDA (and other accelerator) generator, which
    belong to the training loop and are not put back; in the main process only the CPU
    generator is seeded.  Observed everywhere by counting torch.manual_seed calls (it
    still runs), and on a machine with CUDA by the CUDA generators' states themselves."""
    calls = []
    real = torch.manual_seed
    monkeypatch.setattr(torch, "manual_seed", lambda seed: calls.append(seed) or real(seed))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.manual_seed_all(11)
        before = torch.cuda.get_rng_state_all()
    assert len(_per_batch(0)) == 8
    assert calls == []
    if cuda:
        assert all(torch.equal(a, b) for a, b in zip(before, torch.cuda.get_rng_state_all()))
