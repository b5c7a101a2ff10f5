"""Opt-in resilience: ``DataLoader(max_worker_restarts=N)``.

A worker killed by a signal mid-epoch is replaced and sent the batches it
owed again, so the whole epoch equals an undisturbed run's; the budget is
bounded and, once spent, the next death raises the usual error saying so.
"""
import os
import warnings

import pytest
import torch
from faults_datasets import FaultyMap, make_dataset, sample
from faults_helpers import MAP_CONFIGS, iterate_until_failure

from torchfeed import DataLoader


def _epochs(loader, epochs):
    out = []
    for _ in range(epochs):
        out.append([b.clone() for b in loader])
    return out


def _loader(dataset, config=None, **kwargs):
    config_kwargs = config.kwargs() if config is not None else {}
    return DataLoader(dataset, batch_size=4, num_workers=2, shuffle=True,
                      generator=torch.Generator().manual_seed(3), **config_kwargs, **kwargs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", ["sigkill", "segv"])
@pytest.mark.parametrize("loader_config", MAP_CONFIGS, ids=lambda c: c.id, indirect=True)
def test_restarted_epoch_equals_undisturbed_run(fault, loader_config, tmp_path, no_pin_warning):
    epochs = 2 if loader_config.persistent else 1
    expected = _epochs(_loader(FaultyMap(n=64), loader_config), epochs)
    marker = str(tmp_path / "fired")
    # The fault fires in the first epoch; with persistent workers the second
    # epoch then runs on the replacement.
    dataset = FaultyMap(n=64, fault=fault, at=21, marker=marker, once=True)
    loader = _loader(dataset, loader_config, max_worker_restarts=1)
    with pytest.warns(RuntimeWarning, match=r"DataLoader worker \d \(pid \d+\) was killed by "
                      r"signal SIG(KILL|SEGV).*restarted it as pid \d+ \(restart 1 of "
                      r"max_worker_restarts=1\) and re-sent the batches it owed: \d"):
        got = _epochs(loader, epochs)
    assert os.path.exists(marker), "the fault never fired"
    assert [len(e) for e in got] == [len(e) for e in expected] == [16] * epochs
    for got_epoch, expected_epoch in zip(got, expected):
        for a, b in zip(got_epoch, expected_epoch):
            assert torch.equal(a, b)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loader_config", MAP_CONFIGS, ids=lambda c: c.id, indirect=True)
def test_restart_leaves_every_kept_batch_intact(loader_config, tmp_path, no_pin_warning):
    """The user keeps every batch, as ``list(loader)`` does: the replacement
    worker must not write into slots that hold them (it once started over at
    the dead worker's first slot, over batch 0)."""
    epochs = 2 if loader_config.persistent else 1
    kwargs = dict(batch_size=2, num_workers=2, **loader_config.kwargs())
    expected = _epochs(DataLoader(FaultyMap(n=64), **kwargs), epochs)
    marker = str(tmp_path / "fired")
    dataset = FaultyMap(n=64, fault="sigkill", at=21, marker=marker, once=True)
    loader = DataLoader(dataset, max_worker_restarts=1, **kwargs)
    with pytest.warns(RuntimeWarning, match="restarted it as pid"):
        kept = [list(loader) for _ in range(epochs)]  # no copies: the batches themselves
    assert os.path.exists(marker), "the fault never fired"
    assert [len(e) for e in kept] == [len(e) for e in expected] == [32] * epochs
    for got_epoch, expected_epoch in zip(kept, expected):
        for a, b in zip(got_epoch, expected_epoch):
            assert torch.equal(a, b), (a, b)
    del loader, kept


class TwoDeaths(FaultyMap):
    """SIGKILLs its worker at sample 21 and again at sample 45, once each."""

    def __init__(self, markers):
        super().__init__(n=64)
        self.markers = markers

    def __getitem__(self, i):
        for at, marker in zip((21, 45), self.markers):
            if i == at and not os.path.exists(marker):
                from faults_datasets import fire
                fire("sigkill", marker)
        return sample(i)


@pytest.mark.timeout(60)
def test_restart_budget_runs_out(tmp_path):
    markers = [str(tmp_path / "first"), str(tmp_path / "second")]
    loader = DataLoader(TwoDeaths(markers), batch_size=4, num_workers=2, max_worker_restarts=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        failure = iterate_until_failure(loader)
    assert sum("restarted it" in str(w.message) for w in caught) == 1, failure.message
    from faults_datasets import read_marker
    _, first_pid, first_worker = read_marker(markers[0])
    _, pid, worker_id = read_marker(markers[1])
    msg = failure.message
    assert failure.type is RuntimeError
    # torch's sentence first (its iterator's), then torchfeed's line naming the worker
    assert msg.startswith(f"DataLoader worker (pid(s) {pid}) exited unexpectedly\n"), msg
    assert f"\nWorker {worker_id} (pid {pid}) " in msg, msg
    assert "sample indices [44, 45, 46, 47]" in msg, msg
    assert (f"It was not restarted: all max_worker_restarts=1 restarts were used (worker "
            f"{first_worker} (pid {first_pid}) was killed by signal SIGKILL (9))") in msg, msg
    assert failure.batches >= 5  # the epoch went on after the first death
    del loader


@pytest.mark.timeout(60)
def test_exit_code_is_not_restarted(tmp_path):
    loader = DataLoader(FaultyMap(fault="exit3", at=21, marker=str(tmp_path / "m")),
                        batch_size=4, num_workers=2, max_worker_restarts=3)
    failure = iterate_until_failure(loader)
    assert "exited with code 3" in failure.message
    assert "It was not restarted: max_worker_restarts restarts workers killed by a signal" \
        in failure.message
    del loader


def test_iterable_refuses_restarts_at_construction():
    with pytest.raises(ValueError, match="cannot be used with an IterableDataset"):
        DataLoader(make_dataset("iterable"), num_workers=2, max_worker_restarts=1)
    assert DataLoader(make_dataset("iterable"), num_workers=2).max_worker_restarts == 0


@pytest.mark.timeout(60)
def test_restart_with_answers_left_in_the_pipe(tmp_path):
    """A slow training step lets the dead worker's finished batches pile up
    unread in the result pipe.  Those that can still be rebuilt are kept,
    those that cannot (their tensors' file descriptors were to come from the
    dead sender) are sent again; either way each batch arrives once, in order."""
    import time

    expected = torch.stack([sample(i) for i in range(120)])
    dataset = FaultyMap(n=120, fault="sigkill", at=21, marker=str(tmp_path / "m"), once=True)
    loader = DataLoader(dataset, batch_size=4, num_workers=2, prefetch_factor=4,
                        max_worker_restarts=1)
    got = []
    with pytest.warns(RuntimeWarning, match="restarted it"):
        for batch in loader:
            got.append(batch.clone())
            time.sleep(0.02)
    assert torch.equal(torch.cat(got), expected)
