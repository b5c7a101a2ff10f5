"""Resume for IterableDatasets: per-worker dataset state captured with the batch it
produced, the round-robin position, exhausted workers; and the re-reading fallback."""
from __future__ import annotations

import json
import warnings

import pytest
from _resume_helpers import IteratorStream, StatefulStream, Stream, check_resume, close, ids
from loader_helpers import both_kinds, needs_in_order

from torchfeed import DataLoader


def make(cls=StatefulStream, n=13, num_workers=0, **kwargs):
    return lambda: DataLoader(cls(n), batch_size=2, num_workers=num_workers, **kwargs)


def test_stateful_single_process_several_epochs():
    # 13 items in batches of 2: 7 batches, the last one short (it ends the stream)
    m = make()
    for k in (0, 3, 6, 7, 9):
        check_resume(m, k, epochs=3)
    check_resume(m, 7, epochs=3, finished=True)


def test_stateful_state_is_the_datasets():
    loader = make()()
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    assert state["dataset_kind"] == "iterable" and state["dataset_len"] is None
    assert state["worker_states"] == [{"epoch": 0, "pos": 4}]
    assert state["next_worker"] == 0 and state["exhausted_workers"] == []


@pytest.mark.timeout(60)
def test_stateful_two_workers():
    # worker 0 has 7 items (batches 2,2,2,1), worker 1 has 6 (2,2,2): they end unevenly
    m = make(num_workers=2)
    for k in (3, 7):
        check_resume(m, k, epochs=2)
    check_resume(m, 7, epochs=2, finished=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent", [False, True])
@both_kinds
def test_stateful_iterators_two_workers(worker_method, persistent):
    # The state in each worker's iterator: what thread workers, which share one
    # dataset object, can resume; processes the same way.
    m = make(cls=IteratorStream, num_workers=2, worker_method=worker_method,
             persistent_workers=persistent)
    for k in (3, 7, 9):
        state = check_resume(m, k, epochs=2)
        assert state["worker_states"] == [None, None] and any(state["iterator_states"])
    check_resume(m, 7, epochs=2, finished=True)


@pytest.mark.timeout(60)
def test_stateful_two_workers_state_is_per_worker():
    loader = make(num_workers=2)()
    it = iter(loader)
    got = [ids(next(it)) for _ in range(3)]
    state = loader.state_dict()
    close(loader)
    del it
    assert state["worker_states"] == [{"epoch": 0, "pos": 4}, {"epoch": 0, "pos": 2}]
    assert state["next_worker"] == 1
    assert len(got) == 3


@pytest.mark.timeout(60)
def test_stateful_persistent_workers_several_epochs():
    m = make(num_workers=2, persistent_workers=True)
    for k in (2, 7, 9):
        check_resume(m, k, epochs=3)
    check_resume(m, 7, epochs=3, finished=True)


@pytest.mark.timeout(60)
@needs_in_order
def test_stateful_out_of_order_yields_each_item_once():
    m = make(num_workers=2, in_order=False)
    loader = m()
    it = iter(loader)
    seen = [ids(next(it)) for _ in range(3)]
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    resumed = m()
    resumed.load_state_dict(state)
    rest = [ids(b) for b in resumed]
    items = sorted(x for b in seen + rest for x in b)
    assert items == list(range(13))


def test_stateless_falls_back_to_rereading_with_a_warning():
    m = make(cls=Stream)
    loader = m()
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    resumed = m()
    with pytest.warns(UserWarning, match="reads the 3 batches this epoch already yielded again"):
        resumed.load_state_dict(state)
    assert resumed.state_dict()["batches_yielded"] == 3
    for k in (0, 3, 7):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            check_resume(m, k, epochs=1)


@pytest.mark.timeout(60)
def test_stateless_two_workers_rereads():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_resume(make(cls=Stream, num_workers=2), 4, epochs=2)


def test_iterable_refuses_another_num_workers():
    loader = make(num_workers=0)()
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="'num_workers' is 0 in the state but 2"):
        make(num_workers=2)().load_state_dict(state)


def test_state_from_a_map_style_loader_is_refused():
    from _resume_helpers import Ids
    loader = DataLoader(Ids(13), batch_size=2)
    it = iter(loader)
    next(it)
    with pytest.raises(ValueError, match="'dataset_kind' is 'map' in the state but 'iterable'"):
        make()().load_state_dict(loader.state_dict())


def test_dataset_state_round_trips_through_torch_save(tmp_path):
    check_resume(make(), 4, epochs=2, how="torch", tmp_path=tmp_path)
