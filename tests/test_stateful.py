"""torchdata's Stateful protocol (issue 17): Stateful map-style datasets saved per worker,
Stateful iterators restored after iter(), the state taken before the first next(), and
what does not count as Stateful (issue 21: a state_dict that needs arguments or raises)."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
from _resume_helpers import Ids, check_resume, close, ids, uninterrupted
from stateful_datasets import ArgsState, Counting, RaisingState, SelfIterating

from torchfeed import DataLoader

# The case uses 3 workers; this machine has 2 cores, and torch says so.
THREE_WORKERS = pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker")


def _values(batches):
    """SelfIterating's samples without their ``iters`` count."""
    return [b[0] for b in batches]


# -- 1. Stateful map-style datasets ----------------------------------------------------
@THREE_WORKERS
@pytest.mark.timeout(90)
@pytest.mark.parametrize("num_workers, persistent", [(0, False), (3, False), (3, True)])
def test_stateful_map_dataset_resumes_its_own_state(num_workers, persistent):
    def make():
        return DataLoader(Counting(20), batch_size=2, num_workers=num_workers,
                          persistent_workers=persistent)
    reference = uninterrupted(make, epochs=2)
    for k in (3, 10):  # inside epoch 0; at the end of epoch 0 (10 batches)
        check_resume(make, k, epochs=2, reference=reference)
    check_resume(make, 10, epochs=2, finished=True, reference=reference)


@THREE_WORKERS
@pytest.mark.timeout(60)
def test_stateful_map_dataset_other_num_workers_refused():
    loader = DataLoader(Counting(20), batch_size=2, num_workers=3)
    it = iter(loader)
    for _ in range(4):
        next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    close(loader)
    del it
    assert len({json.dumps(s) for s in state["worker_states"]}) > 1
    other = DataLoader(Counting(20), batch_size=2, num_workers=2)
    with pytest.raises(ValueError, match=r"per-worker states cannot map onto another number "
                                         r"of workers\. Resume with num_workers=3"):
        other.load_state_dict(state)


def test_stateful_map_dataset_same_state_maps_to_any_num_workers():
    # A state from one process: every new worker starts from that one state.
    loader = DataLoader(Counting(12), batch_size=2)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    assert state["worker_states"] == [{"made": 4}]
    other = DataLoader(Counting(12), batch_size=2, num_workers=2)
    other.load_state_dict(state)
    got = [ids(b) for b in other]
    assert [b[0] for b in got] == [[4, 5], [6, 7], [8, 9], [10, 11]]
    # each worker continued from made=4: worker 0 made batches 2 and 4, worker 1 batch 3 and 5
    assert [b[1] for b in got] == [[5, 6], [5, 6], [7, 8], [7, 8]]


# -- 2. Stateful iterators ------------------------------------------------------------
@pytest.mark.timeout(90)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_iterator_is_restored_after_iter(num_workers):
    def make():
        return DataLoader(SelfIterating(21), batch_size=2, num_workers=num_workers)
    reference = uninterrupted(make, epochs=1)
    for k in (1, 4, 7):
        state = check_resume(make, k, epochs=1, reference=reference)
        assert any(s is not None for s in state["iterator_states"])
        assert state["worker_states"] == [None] * max(1, num_workers)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("num_workers, persistent", [(0, False), (2, False), (2, True)])
def test_iter_dataset_called_once_per_worker_per_epoch(num_workers, persistent):
    loader = DataLoader(SelfIterating(21), batch_size=2, num_workers=num_workers,
                        persistent_workers=persistent)
    for epoch in range(2):
        # the same copy across epochs (0 workers, persistent ones) counts every epoch's call
        calls = epoch + 1 if num_workers == 0 or persistent else 1
        batches = [ids(b) for b in loader]
        assert sorted(x for b in batches for x in b[0]) == list(range(21))
        assert {x for b in batches for x in b[1]} == {calls}
    # a resume calls iter() once too, then loads the iterator's state
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    close(loader)
    del it
    resumed = DataLoader(SelfIterating(21), batch_size=2, num_workers=num_workers,
                         persistent_workers=persistent)
    resumed.load_state_dict(state)
    assert {x for b in resumed for x in ids(b)[1]} == {1}
    close(resumed)


# -- 3. a state taken right after iter() replays the whole epoch -------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers, persistent", [(0, False), (2, False), (2, True)])
@pytest.mark.parametrize("dataset", ["ids", "counting", "self_iterating"])
def test_state_before_first_next_replays_the_epoch(num_workers, persistent, dataset):
    # torchdata's own scenario: s0 right after iter(), s1 after 4 batches; load s1 and
    # drain, then load s0 into the same loader: the whole epoch again.
    torch.manual_seed(0)
    data = {"ids": Ids(30), "counting": Counting(30), "self_iterating": SelfIterating(30)}
    shuffle = dataset != "self_iterating"
    loader = DataLoader(data[dataset], batch_size=3, shuffle=shuffle, num_workers=num_workers,
                        persistent_workers=persistent)
    key = _values if dataset == "self_iterating" else (lambda bs: bs)
    it = iter(loader)
    s0 = loader.state_dict()
    first = [ids(next(it)) for _ in range(4)]
    s1 = loader.state_dict()
    loader.load_state_dict(s1)
    rest = [ids(b) for b in loader]
    loader.load_state_dict(s0)
    again = [ids(b) for b in loader]
    close(loader)
    assert len(first + rest) == 10
    assert key(again) == key(first + rest)


# -- 4. snapshot_every_n_steps ----------------------------------------------------------
@pytest.mark.parametrize("n", [None, 0, 1, 5, 1000])
def test_snapshot_every_n_steps_as_torchdata_accepts(n):
    loader = DataLoader(Ids(6), batch_size=2, snapshot_every_n_steps=n)
    it = iter(loader)
    next(it)
    assert loader.state_dict()["batches_yielded"] == 1
    assert loader.snapshot_every_n_steps == n


# -- what is not Stateful, and a state_dict() that raises -------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_dict_with_arguments_is_never_called(num_workers):
    expected = [ids(b) for b in torch.utils.data.DataLoader(ArgsState(11), batch_size=2,
                                                            num_workers=num_workers)]
    loader = DataLoader(ArgsState(11), batch_size=2, num_workers=num_workers)
    assert [ids(b) for b in loader] == expected
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert state["worker_states"] == [None] * max(1, num_workers)
    close(loader)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_dict_that_raises_does_not_break_iteration(num_workers):
    loader = DataLoader(RaisingState(7), batch_size=2, num_workers=num_workers)
    assert [ids(b) for b in loader] == [[0, 1], [2, 3], [4, 5], [6]]
    with pytest.raises(RuntimeError, match=r"cannot include the state of dataset RaisingState: "
                                           r"its state_dict\(\) raised ValueError: no state here"):
        loader.state_dict()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_iter_returning_self_is_not_called_again_per_batch(num_workers):
    # torch calls iter(dataset) once and then only next(): a per-batch iter() would
    # restart an __iter__ that returns self (litdata's StreamingDataset does that).
    expected = [ids(b) for b in torch.utils.data.DataLoader(
        SelfIterating(21), batch_size=4, num_workers=num_workers)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = [ids(b) for b in DataLoader(SelfIterating(21), batch_size=4,
                                          num_workers=num_workers)]
    assert got == expected


# -- the generic fallback tells the truth (issue 21) -------------------------------------
def test_stateless_iterable_resumed_in_a_later_epoch_warns_once():
    from _resume_helpers import Stream  # keeps its own epoch counter, and no state

    loader = DataLoader(Stream(10), batch_size=2)
    list(loader)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    resumed = DataLoader(Stream(10), batch_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.load_state_dict(state)
        list(resumed)
    assert len(caught) == 1
    text = str(caught[0].message)
    assert "Resuming reads the 2 batches this epoch already yielded again" in text
    assert "resumes in epoch 1: a dataset that keeps its own epoch counter or shuffle state " \
           "restarts it" in text
    assert "state_dict() and load_state_dict(state) with no arguments" in text


def test_stateless_warning_points_at_the_callers_line():
    from _resume_helpers import Stream

    loader = DataLoader(Stream(10), batch_size=2)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DataLoader(Stream(10), batch_size=2).load_state_dict(state)
    assert [w.filename for w in caught] == [__file__]


@pytest.mark.big_imports
@pytest.mark.xdist_group("hf_datasets")  # with test_bench_pipelines': datasets imported once
@pytest.mark.timeout(90)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_hugging_face_iterable_dataset_still_resumes_exactly(num_workers):
    # HF datasets' IterableDataset is Stateful (state_dict() with no arguments) and its
    # __iter__ is a generator: its own state, per worker, as before.
    HFDataset = pytest.importorskip(
        "datasets", reason="Hugging Face datasets is not installed (the [test] extra has it)").Dataset

    def make():
        ds = HFDataset.from_dict({"x": list(range(60))}).to_iterable_dataset(num_shards=4)
        return DataLoader(ds, batch_size=4, num_workers=num_workers)
    check_resume(make, 5, epochs=1)
