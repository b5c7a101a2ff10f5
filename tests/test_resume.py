"""Exact mid-epoch resume for map-style datasets: every torch sampler, user samplers,
num_workers 0 and 2, persistent workers, several epochs, in_order=False, elastic
num_workers, and no data loaded to get there."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch
from _resume_helpers import (
    SEED,
    Augmented,
    EagerGlobalSampler,
    EpochSampler,
    Ids,
    PositionSampler,
    SlowFirst,
    check_resume,
    ids,
    uninterrupted,
)
from loader_helpers import both_kinds, needs_in_order
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler, SubsetRandomSampler, WeightedRandomSampler

from torchfeed import DataLoader

N, BS = 11, 3          # 4 batches an epoch, the last one short
L = -(-N // BS)


def ks(length):
    """k values: none, mid-epoch, the last batch, and into the next epoch."""
    return [0, 2, length - 1, length, length + 2]


# -- the samplers, num_workers=0 ------------------------------------------------------
def gen(seed=7):
    return torch.Generator().manual_seed(seed)


SAMPLERS = {
    "shuffle": lambda ds: dict(shuffle=True),
    "shuffle-generator": lambda ds: dict(shuffle=True, generator=gen()),
    "shuffle-drop_last": lambda ds: dict(shuffle=True, generator=gen(), drop_last=True),
    "sequential": lambda ds: dict(sampler=SequentialSampler(ds)),
    "random-replacement": lambda ds: dict(sampler=RandomSampler(ds, replacement=True,
                                                                num_samples=13)),
    "random-num_samples": lambda ds: dict(sampler=RandomSampler(ds, num_samples=2 * N + 3,
                                                                generator=gen(3))),
    "subset-random": lambda ds: dict(sampler=SubsetRandomSampler([1, 3, 4, 6, 8, 9, 10])),
    "weighted-random": lambda ds: dict(sampler=WeightedRandomSampler(
        [float(i + 1) for i in range(N)], num_samples=10, generator=gen(5))),
    "user-with-state": lambda ds: dict(sampler=EpochSampler(N)),
    "user-without-state": lambda ds: dict(sampler=EagerGlobalSampler(N)),
}


def make_for(case, num_workers=0, **extra):
    def make():
        ds = Ids(N)
        kwargs = SAMPLERS[case](ds)
        return DataLoader(ds, batch_size=BS, num_workers=num_workers, **kwargs, **extra)
    return make


@pytest.mark.parametrize("case", SAMPLERS)
def test_samplers_resume_exactly(case):
    make = make_for(case)
    length = len(make())
    for k in ks(length):
        check_resume(make, k, epochs=3)
    check_resume(make, length, epochs=3, finished=True)


def test_batch_sampler_resumes_exactly():
    def make():
        ds = Ids(N)
        bs = BatchSampler(RandomSampler(ds, generator=gen(11)), batch_size=4, drop_last=True)
        return DataLoader(ds, batch_sampler=bs)
    for k in ks(len(make())):
        check_resume(make, k, epochs=3)


def test_no_automatic_batching_resumes_exactly():
    def make():
        return DataLoader(Ids(N), batch_size=None, shuffle=True, generator=gen())

    for k in (0, 5, N, N + 4):
        check_resume(make, k, epochs=2)


def test_position_sampler_is_loaded_not_fast_forwarded():
    """A sampler with state_dict_at() gets its own state back and no skipping."""
    def make():
        return DataLoader(Ids(N), batch_size=BS, sampler=PositionSampler(N, seed=5))

    def set_epoch(loader, e):
        loader.sampler.set_epoch(e)

    for k in ks(L):
        state = check_resume(make, k, epochs=3, before_epoch=set_epoch)
        assert state["sampler_state"]["protocol"] == "position"
    check_resume(make, L, epochs=3, finished=True, before_epoch=set_epoch)
    state = check_resume(make, 2, epochs=2, before_epoch=set_epoch)
    assert state["sampler_state"]["state"] == {"epoch": 0, "position": 2 * BS}


def test_torchfeed_distributed_sampler_if_present():
    import torchfeed.distributed as dist

    def make():
        ds = Ids(N)
        return DataLoader(ds, batch_size=BS,
                          sampler=dist.DistributedSampler(ds, num_replicas=1, rank=0, seed=3))

    def set_epoch(loader, e):
        loader.sampler.set_epoch(e)

    for k in ks(L):
        check_resume(make, k, epochs=2, before_epoch=set_epoch)


def test_current_epoch_is_exact_without_restoring_the_global_rng():
    """Without a generator the next epochs draw from the global RNG, as in torch; the
    epoch in progress is replayed from the state alone."""
    make = make_for("shuffle")
    for k in (1, 3):
        check_resume(make, k, epochs=1, restore_global=False)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers, persistent, worker_method", [
    (0, False, "multiprocessing"), (2, False, "multiprocessing"), (2, True, "multiprocessing"),
    (2, False, "thread"), (2, True, "thread")])
def test_next_epoch_is_exact_after_a_finished_epoch_state_without_restoring_the_global_rng(
        num_workers, persistent, worker_method):
    """The case docs/resume.md describes: a state taken after an epoch's StopIteration, a new process
    whose global RNG is elsewhere (model init drew from it), nothing restored: the next
    epoch's shuffle (and base seed) still come out as in the uninterrupted run."""
    make = make_for("shuffle", num_workers=num_workers, persistent_workers=persistent,
                    worker_method=worker_method)
    check_resume(make, L, epochs=2, finished=True, restore_global=False)


def test_finished_epoch_state_leaves_the_live_global_rng_alone_and_its_epoch_resumes():
    """Drawn from the recorded RNG, epoch 1 records that as its start, so a checkpoint
    inside it resumes exactly too."""
    make = make_for("shuffle")
    torch.manual_seed(SEED)
    reference = make()
    full = [[ids(b) for b in reference] for _ in range(2)]
    torch.manual_seed(SEED)
    loader = make()
    assert [ids(b) for b in loader] == full[0]
    state = json.loads(json.dumps(loader.state_dict()))

    torch.manual_seed(99)
    before = torch.get_rng_state()
    resumed = make()
    resumed.load_state_dict(state)
    it = iter(resumed)
    assert torch.equal(torch.get_rng_state(), before)
    taken = [ids(next(it)) for _ in range(2)]
    mid = json.loads(json.dumps(resumed.state_dict()))
    torch.manual_seed(7)
    again = make()
    again.load_state_dict(mid)
    assert taken + [ids(b) for b in again] == full[1]


def test_finished_epoch_state_without_the_recorded_global_rng_still_loads():
    """States saved before the field existed (still version 1) draw from the live RNG."""
    loader = make_for("shuffle")()
    [ids(b) for b in loader]
    state = loader.state_dict()
    assert state["next_epoch_global_rng"] is not None
    old = {k: v for k, v in state.items() if k != "next_epoch_global_rng"}
    resumed = make_for("shuffle")()
    resumed.load_state_dict(old)
    assert len([ids(b) for b in resumed]) == L
    assert resumed.state_dict()["epoch"] == 1  # the epoch after the saved one
    with pytest.raises(ValueError, match="'next_epoch_global_rng'"):
        make_for("shuffle")().load_state_dict(dict(state, next_epoch_global_rng="AAAA"))


def test_resume_does_not_touch_the_callers_global_rng():
    make = make_for("shuffle")
    torch.manual_seed(SEED)
    loader = make()
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    torch.manual_seed(5)
    before = torch.get_rng_state()
    resumed = make()
    resumed.load_state_dict(state)
    rest = [ids(b) for b in resumed]
    assert len(rest) == L - 1
    assert torch.equal(torch.get_rng_state(), before)


# -- processes ---------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case, k, finished", [
    ("shuffle", 0, False), ("shuffle", L, False),
    ("shuffle-generator", 2, False), ("shuffle-generator", L, True)])
@both_kinds
def test_two_workers_resume_exactly(case, k, finished, worker_method):
    check_resume(make_for(case, num_workers=2, worker_method=worker_method), k, epochs=2,
                 finished=finished)


@pytest.mark.timeout(60)
@both_kinds
def test_persistent_workers_several_epochs(worker_method):
    make = make_for("shuffle", num_workers=2, persistent_workers=True, worker_method=worker_method)
    reference = uninterrupted(make, epochs=3)
    for k in (1, L, 2 * L + 1):
        check_resume(make, k, epochs=3, reference=reference)
    state = check_resume(make, L, epochs=3, finished=True, reference=reference)
    assert state["epoch_finished"] and state["epoch"] == 0


@pytest.mark.timeout(60)
@both_kinds
def test_user_sampler_with_state_and_workers(worker_method):
    make = make_for("user-with-state", num_workers=2, worker_method=worker_method)
    check_resume(make, L + 1, epochs=2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("saved, resumed", [
    (2, 0), (0, 2), (2, 1),
    # a state taken under one kind of worker resumes under the other
    ((2, "multiprocessing"), (2, "thread")), ((2, "thread"), (2, "multiprocessing")),
    ((2, "thread"), (1, "multiprocessing")), ((0, "multiprocessing"), (2, "thread"))])
def test_elastic_num_workers(saved, resumed):
    def make_with(workers):
        count, kind = workers if isinstance(workers, tuple) else (workers, "multiprocessing")
        return make_for("shuffle-generator", num_workers=count, worker_method=kind)

    make = make_with(saved)
    reference = uninterrupted(make, epochs=2)
    for k in (2, L + 1):
        check_resume(make, k, epochs=2, reference=reference, make_resumed=make_with(resumed))


@pytest.mark.timeout(60)
def test_elastic_persistent_to_plain():
    """Persistent workers draw one base seed per iterator, plain ones one per epoch (as in
    torch), so the RNG streams part after the epoch in progress; that epoch is exact."""
    check_resume(make_for("shuffle-generator", num_workers=2, persistent_workers=True), L + 2,
                 epochs=3, make_resumed=make_for("shuffle-generator", num_workers=0),
                 current_epoch_only=True)


class FetchLog(Ids):
    """Ids that leaves an empty file named i in ``log_dir`` when sample i is
    fetched, so the test sees what the workers fetched."""

    def __init__(self, n: int, log_dir: str) -> None:
        super().__init__(n)
        self.log_dir = log_dir

    def __getitem__(self, i):
        open(os.path.join(self.log_dir, str(i)), "w").close()
        return super().__getitem__(i)


@pytest.mark.timeout(60)
@both_kinds
def test_prefetched_batches_are_not_consumed(tmp_path, worker_method):
    """Two workers prefetch 4 batches, the whole epoch; a state after 1 batch counts 1."""
    ds = FetchLog(N, str(tmp_path))
    loader = DataLoader(ds, batch_size=BS, num_workers=2, prefetch_factor=2,
                        sampler=SequentialSampler(ds), worker_method=worker_method)
    it = iter(loader)
    first = ids(next(it))
    deadline = time.monotonic() + 10
    while len(os.listdir(tmp_path)) < N and time.monotonic() < deadline:
        time.sleep(0.02)
    # Every sample of the epoch was fetched, though only batch 0 reached us.
    assert sorted(int(name) for name in os.listdir(tmp_path)) == list(range(N))
    state = loader.state_dict()
    del it
    assert state["batches_yielded"] == 1 and state["samples_yielded"] == BS
    resumed = make_for("sequential", num_workers=2, prefetch_factor=2,
                       worker_method=worker_method)()
    resumed.load_state_dict(state)
    assert first == [0, 1, 2]
    assert [ids(b) for b in resumed] == [[3, 4, 5], [6, 7, 8], [9, 10]]


@pytest.mark.timeout(60)
@needs_in_order
@both_kinds
def test_out_of_order_resume_yields_each_sample_once(worker_method):
    """in_order=False: batch 0 is slow, so later ones are yielded first; the state
    remembers them and the resumed run yields exactly the rest."""
    n = 12

    def make(num_workers=2):
        return DataLoader(SlowFirst(n), batch_size=2, num_workers=num_workers, in_order=False,
                          worker_method=worker_method)

    loader = make()
    it = iter(loader)
    seen = [ids(next(it)) for _ in range(3)]
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    assert state["batches_yielded"] == 3
    assert state["out_of_order_yielded"], "batch 0 should still be pending"
    assert [0, 1] not in seen
    for resumed_workers in (2, 0):
        resumed = make(resumed_workers)
        resumed.load_state_dict(state)
        rest = [ids(b) for b in resumed]
        assert sorted(seen + rest) == [[2 * i, 2 * i + 1] for i in range(n // 2)]


@pytest.mark.timeout(60)
@needs_in_order
def test_out_of_order_state_after_the_frontier_catches_up():
    loader = DataLoader(SlowFirst(12), batch_size=2, num_workers=2, in_order=False)
    got = [ids(b) for b in loader]
    state = loader.state_dict()
    assert len(got) == 6 and state["batches_yielded"] == 6
    assert state["out_of_order_yielded"] == [] and state["epoch_finished"]


# -- seed_per_batch ---------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_seed_per_batch_augmentations_same_for_any_num_workers_and_after_resume():
    def make(num_workers):
        return lambda: DataLoader(Augmented(8), batch_size=2, shuffle=True, generator=gen(),
                                  num_workers=num_workers, seed_per_batch=True)

    runs = []
    for w in (0, 1, 2):
        torch.manual_seed(SEED)
        loader = make(w)()
        runs.append([ids(b) for _ in range(2) for b in loader])
    assert runs[0] == runs[1] == runs[2]
    assert len({tuple(map(tuple, b[1:])) for b in runs[0]}) == len(runs[0])  # really random
    # resume (also elastic): the augmentations after resume are the uninterrupted ones
    check_resume(make(2), 3, epochs=2, make_resumed=make(0))
    check_resume(make(0), 5, epochs=2, make_resumed=make(2))
    def persistent():
        return DataLoader(Augmented(8), batch_size=2, shuffle=True, generator=gen(),
                          num_workers=2, persistent_workers=True, seed_per_batch=True)

    check_resume(persistent, 5, epochs=2)


@pytest.mark.timeout(60)
def test_shuffle_order_does_not_depend_on_num_workers():
    for use_generator in (True, False):
        runs = []
        for w in (0, 1, 2):
            torch.manual_seed(SEED)
            loader = DataLoader(Ids(N), batch_size=BS, shuffle=True, num_workers=w,
                                generator=gen() if use_generator else None)
            runs.append([ids(b) for _ in range(2) for b in loader])
        assert runs[0] == runs[1] == runs[2]


# -- cost -------------------------------------------------------------------------------------
def test_resume_loads_no_data():
    """num_workers=0: resuming after k batches calls __getitem__ only for what is yielded."""
    ds = Ids(1000)
    loader = DataLoader(ds, batch_size=10, shuffle=True, generator=gen())
    it = iter(loader)
    for _ in range(57):
        next(it)
    state = loader.state_dict()
    ds2 = Ids(1000)
    resumed = DataLoader(ds2, batch_size=10, shuffle=True, generator=gen())
    resumed.load_state_dict(state)
    it2 = iter(resumed)
    assert ds2.calls == 0
    assert ids(next(it2)) == ids(next(it))
    assert ds2.calls == 10


def test_state_size_does_not_grow_with_the_dataset():
    sizes = []
    for n in (10, 100_000):
        loader = DataLoader(Ids(n), batch_size=5, shuffle=True)
        it = iter(loader)
        next(it)
        sizes.append(len(json.dumps(loader.state_dict())))
    assert abs(sizes[0] - sizes[1]) < 16, sizes


# -- the API ---------------------------------------------------------------------------------
def test_state_round_trips_through_torch_save(tmp_path):
    check_resume(make_for("shuffle-generator"), 5, epochs=2, how="torch", tmp_path=tmp_path)


def test_load_then_state_dict_returns_the_loaded_state_until_iter():
    make = make_for("shuffle-generator")
    loader = make()
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    next(iter(resumed))
    assert resumed.state_dict()["batches_yielded"] == 3


def test_state_before_any_iteration_starts_at_the_beginning():
    make = make_for("shuffle-generator")
    state = make().state_dict()
    assert state["batches_yielded"] == 0 and state["epoch"] == 0
    check_resume(make, 0, epochs=2)
    torch.manual_seed(SEED)
    expected = [ids(b) for b in make()]
    torch.manual_seed(SEED)
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert [ids(b) for b in resumed] == expected


def test_load_state_dict_replaces_a_live_persistent_iterator():
    make = make_for("sequential", num_workers=1, persistent_workers=True)
    loader = make()
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    next(it)
    loader.load_state_dict(state)
    assert [ids(b) for b in loader] == [[3, 4, 5], [6, 7, 8], [9, 10]]


def test_snapshot_every_n_steps_is_accepted():
    loader = DataLoader(Ids(N), batch_size=BS, snapshot_every_n_steps=5)
    assert loader.state_dict()["kind"] == "torchfeed.DataLoader"


def test_empty_state_restores_nothing():
    loader = DataLoader(Ids(N), batch_size=BS)
    loader.load_state_dict({})
    assert len([ids(b) for b in loader]) == L


@pytest.mark.parametrize("field, value, message", [
    ("batch_size", 4, "'batch_size' is 4 in the state but 3"),
    ("drop_last", True, "'drop_last' is True in the state but False"),
    ("dataset_len", 12, "'dataset_len' is 12 in the state but 11"),
    ("kind", "torchdata.StatefulDataLoader", "'kind' is 'torchdata.StatefulDataLoader'"),
    ("version", 99, "'version' is 99"),
    ("batches_yielded", "two", "'batches_yielded' must be int"),
    ("out_of_order_yielded", [[1, 3]], "'out_of_order_yielded'"),
    ("dataset_kind", "iterable", "'dataset_kind' is 'iterable' in the state but 'map'"),
])
def test_mismatched_states_are_refused(field, value, message):
    loader = make_for("shuffle")()
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    state[field] = value
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        make_for("shuffle")().load_state_dict(state)


def test_corrupted_states_are_refused():
    loader = make_for("shuffle")()
    it = iter(loader)
    next(it)
    good = loader.state_dict()
    with pytest.raises(ValueError, match="missing field"):
        make_for("shuffle")().load_state_dict({k: v for k, v in good.items() if k != "epoch"})
    with pytest.raises(ValueError, match="expected a dict"):
        make_for("shuffle")().load_state_dict([1, 2])
    bad = dict(good, epoch_start_rng=dict(good["epoch_start_rng"], **{"global": "!!"}))
    with pytest.raises(ValueError, match="base64"):
        make_for("shuffle")().load_state_dict(bad)
    bad = dict(good, epoch_start_rng=dict(good["epoch_start_rng"], **{"global": "AAAA"}))
    with pytest.raises(ValueError, match="holds 3 bytes"):
        make_for("shuffle")().load_state_dict(bad)
    torchdata_like = {"_snapshot": {}, "_steps_since_snapshot": 0}
    with pytest.raises(ValueError, match="torchdata"):
        make_for("shuffle")().load_state_dict(torchdata_like)


def test_generator_mismatch_and_sampler_mismatch_are_refused():
    loader = make_for("shuffle-generator")()
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="generator"):
        make_for("shuffle")().load_state_dict(state)
    loader = make_for("user-with-state")()
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    with pytest.raises(ValueError, match=r"'sampler' is 'BatchSampler\(EpochSampler\)' in the "
                                         r"state but 'BatchSampler\(EagerGlobalSampler\)'"):
        make_for("user-without-state")().load_state_dict(state)
    older = {k: v for k, v in state.items() if k != "sampler"}  # saved before the field
    with pytest.raises(ValueError, match="sampler_state"):
        make_for("user-without-state")().load_state_dict(older)


def test_a_copied_loader_keeps_its_epoch_count_and_a_loaded_state():
    import copy
    import pickle
    make = make_for("shuffle-generator")
    loader = make()
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    clone = pickle.loads(pickle.dumps(loader))
    assert clone.state_dict()["epoch"] == 1  # its next iter() starts the next epoch
    resumed = make()
    resumed.load_state_dict(state)
    for twin in (copy.deepcopy(resumed), pickle.loads(pickle.dumps(resumed))):
        assert twin.state_dict() == state
        assert len([ids(b) for b in twin]) == L - 1
