"""Resume across an epoch boundary is exact (issue 28; torchdata's own suite:
``TestSnapshotEnd.test_iterable``, ``TestInitialState.test_load_then_state``,
``TestMultiEpochSDL.test_multi_epoch_sdl``).

* A state taken after an epoch ended, with persistent workers: their iterators'
  last states (the worker's global RNG among them) carry into the next epoch as
  the uninterrupted workers carried them.
* A state taken before the first ``iter()``: the epoch then drawn from the global
  RNG is the one the saving loader drew, whatever ran in between.
* ``num_workers=0`` and a dataset whose state holds the global RNG: its state at
  an epoch's end is set before the next epoch's draws, not after them.
"""
from __future__ import annotations

import pytest
import torch
from _resume_helpers import close, disturb_rngs, ids
from stateful_datasets import GlobalRngItems, RandomDraws

from torchfeed import DataLoader


def _flat(loader) -> list:
    return [ids(b) for b in loader]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent", [False, True])
def test_a_state_after_an_epoch_resumes_the_next_one(persistent):
    def make(generator):
        return DataLoader(RandomDraws(24), batch_size=4, num_workers=2, generator=generator,
                          persistent_workers=persistent)

    g = torch.Generator().manual_seed(4)
    loader = make(g)
    _flat(loader)
    state = loader.state_dict()
    expected = _flat(loader)
    close(loader)

    g.manual_seed(4)
    resumed = make(g)
    resumed.load_state_dict(state)
    assert _flat(resumed) == expected
    close(resumed)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent", [False, True])
def test_a_state_before_the_first_iter_fixes_the_epoch_it_starts(persistent):
    def make():
        return DataLoader(GlobalRngItems(16), batch_size=2, num_workers=2,
                          persistent_workers=persistent)

    loader = make()
    state = loader.state_dict()
    expected = _flat(loader)
    close(loader)

    other = make()
    it = iter(other)
    for _ in range(3):
        next(it)  # the workers' base seed and the global RNG have moved on
    other.load_state_dict(state)
    assert other.state_dict() == state
    assert _flat(other) == expected
    close(other)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_two_epochs_then_two_more_equal_four_epochs(num_workers):
    """Saved after two epochs, resumed where every global RNG is elsewhere (a new
    process): the state alone gives the third epoch (its shuffle and base seed).  With
    ``num_workers=0`` the dataset's own state is the global RNG, set at the load, so
    the fourth follows too; with workers, later epochs draw from the live global RNG as
    torch's do, so the training loop seeds it alike in both runs before the fourth."""
    def make():
        return DataLoader(GlobalRngItems(12), batch_size=2, shuffle=True,
                          num_workers=num_workers)

    def fourth(loader) -> list:
        if num_workers:
            torch.manual_seed(5)
        return _flat(loader)

    torch.manual_seed(0)
    loader = make()
    got = [_flat(loader) for _ in range(2)]
    state = loader.state_dict()
    close(loader)
    disturb_rngs()  # only the state can give the third epoch now
    resumed = make()
    resumed.load_state_dict(state)
    got += [_flat(resumed), fourth(resumed)]
    close(resumed)

    torch.manual_seed(0)
    reference = make()
    assert got == [_flat(reference) for _ in range(3)] + [fourth(reference)]
    close(reference)
