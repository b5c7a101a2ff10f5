"""torchfeed.distributed: the sampler against torch's, the elastic-resume rule,
state round-trips, IterableDataset sharding, and real gloo process groups."""
import io
import itertools
import json
import math
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from loader_helpers import needs_in_order
from torch.utils.data import IterableDataset
from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler

import torchfeed
from torchfeed.distributed import (
    DistributedSampler,
    check_iterable_world_size,
    merge_states,
    rank_and_world_size,
    shard_info,
    shard_iterable,
)

HERE = Path(__file__).resolve().parent


def order(n, seed, epoch, shuffle):
    if not shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


def ranks(n, world, *, shuffle=True, seed=7, drop_last=False, epoch=0, state=None):
    samplers = [DistributedSampler(range(n), world, r, shuffle, seed, drop_last) for r in range(world)]
    for s in samplers:
        s.set_epoch(epoch)
        if state is not None:
            s.load_state_dict(state)
    return samplers


def interleave(per_rank):
    """The global slot order a round-robin deal came from."""
    out = []
    for step in itertools.zip_longest(*per_rank):
        assert None not in step, "ranks got different lengths"
        out.extend(step)
    return out


def expected_pass(n, world_after, consumed, *, seed, epoch, shuffle, drop_last):
    """The documented elastic rule, written out independently of the sampler."""
    full = order(n, seed, epoch, shuffle)
    rest = full[consumed:]
    if drop_last:
        return rest[: (len(rest) // world_after) * world_after]
    pad = math.ceil(len(rest) / world_after) * world_after - len(rest)
    return rest + [full[i % n] for i in range(pad)]


# -- equal to torch's ------------------------------------------------------------


@pytest.mark.timeout(60)
def test_same_indices_and_len_as_torch():
    for n, world, drop_last, shuffle, seed, epoch in itertools.product(
        (0, 1, 2, 5, 12, 13, 31), (1, 2, 3, 4, 8), (False, True), (False, True), (0, 42), (0, 3)
    ):
        for r in range(world):
            ours = DistributedSampler(range(n), world, r, shuffle, seed, drop_last)
            theirs = TorchDistributedSampler(range(n), world, r, shuffle, seed, drop_last)
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert len(ours) == len(theirs)
            assert list(ours) == list(theirs), (n, world, r, drop_last, shuffle, seed, epoch)


@pytest.mark.timeout(30)
def test_is_torch_sampler_and_exported():
    assert torchfeed.DistributedSampler is DistributedSampler
    assert isinstance(DistributedSampler(range(4), 2, 0), TorchDistributedSampler)


@pytest.mark.timeout(30)
def test_same_validation_errors_as_torch():
    for kwargs in ({"num_replicas": 2, "rank": 2}, {"num_replicas": 2, "rank": -1}, {"num_replicas": 2}, {}):
        errors = []
        for cls in (TorchDistributedSampler, DistributedSampler):
            with pytest.raises(Exception) as e:
                cls(range(10), **kwargs)
            errors.append((type(e.value), str(e.value)))
        assert errors[0] == errors[1]


# -- elastic resume ----------------------------------------------------------------


def check_elastic(n, w, w2, k, drop_last, shuffle, seed=7, epoch=2):
    before = ranks(n, w, shuffle=shuffle, seed=seed, drop_last=drop_last, epoch=epoch)
    iters = [iter(s) for s in before]
    taken = [[next(it) for _ in range(k)] for it in iters]
    states = [s.state_dict_at(k) for s in before]
    assert all(s == states[0] for s in states), "ranks in lockstep must agree"
    assert [s.state_dict() for s in before] == states, "no prefetch here: own count agrees"
    state = states[0]
    c = state["samples_consumed"]
    assert c == min(k * w, n) and state["world_size"] == w

    after = ranks(n, w2, shuffle=shuffle, seed=seed, drop_last=drop_last, epoch=epoch, state=state)
    lens = [len(s) for s in after]
    rest = [list(s) for s in after]
    assert lens == [len(r) for r in rest]
    got = interleave(rest)
    assert got == expected_pass(n, w2, c, seed=seed, epoch=epoch, shuffle=shuffle, drop_last=drop_last)

    full = order(n, seed, epoch, shuffle)
    remaining = full[c:]
    counts = Counter(got)
    if drop_last:
        # every remaining sample once, except a skipped tail shorter than W'
        assert len(counts) == len(got) and set(got) == set(remaining[: len(got)])
        assert len(remaining) - len(got) < w2
    else:
        # the remaining samples plus < W' padding from the head of the epoch, as torch pads
        padding = got[len(remaining):]
        assert len(padding) < w2 and padding == [full[i % n] for i in range(len(padding))]
        assert counts == Counter(remaining) + Counter(padding)
        if c >= len(padding):  # the padding was consumed before: the rest comes exactly once
            assert all(counts[i] == 1 for i in remaining)
        # nothing of the epoch is lost across the checkpoint
        assert set(itertools.chain(*taken)) | set(got) == set(range(n))

    if w2 == w:  # same world size: exactly what an uninterrupted run yields next
        uninterrupted = ranks(n, w, shuffle=shuffle, seed=seed, drop_last=drop_last, epoch=epoch)
        assert rest == [list(s)[k:] for s in uninterrupted]

    for s in after:  # the next epoch is an uninterrupted W' run's
        s.set_epoch(epoch + 1)
    torch_next = [TorchDistributedSampler(range(n), w2, r, shuffle, seed, drop_last) for r in range(w2)]
    for s in torch_next:
        s.set_epoch(epoch + 1)
    assert [list(s) for s in after] == [list(s) for s in torch_next]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_elastic_resume_covers_remainder_exactly(drop_last, shuffle):
    cases = 0
    for n in (1, 2, 7, 12, 13, 24, 25):
        for w, w2 in itertools.product((1, 2, 3, 4), (1, 2, 3, 4, 5)):
            for k in range(len(DistributedSampler(range(n), w, 0, drop_last=drop_last)) + 1):
                check_elastic(n, w, w2, k, drop_last, shuffle)
                cases += 1
    assert cases > 500


@pytest.mark.timeout(60)
def test_issue_example_2_to_4_loses_nothing():
    # torchdata's StatefulDistributedSampler never yields 8 of 24 samples here
    for k in range(13):
        check_elastic(24, 2, 4, k, drop_last=False, shuffle=True)


@pytest.mark.timeout(60)
def test_chained_resume_2_to_3_to_1():
    n, seed, epoch = 29, 3, 5
    seen = []
    a = ranks(n, 2, seed=seed, epoch=epoch)
    its = [iter(s) for s in a]
    for it in its:
        seen += [next(it) for _ in range(4)]
    state = a[1].state_dict_at(4)
    b = ranks(n, 3, seed=seed, epoch=epoch, state=state)
    its = [iter(s) for s in b]
    for it in its:
        seen += [next(it) for _ in range(2)]
    state = b[2].state_dict_at(2)
    assert state["samples_consumed"] == 8 + 6 and state["world_size"] == 3
    (c,) = ranks(n, 1, seed=seed, epoch=epoch, state=state)
    last = list(c)
    assert last == order(n, seed, epoch, True)[14:]  # one rank takes the remainder in order
    assert sorted(seen + last) == list(range(n))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loader_cls", [torch.utils.data.DataLoader, torchfeed.DataLoader])
def test_state_dict_at_with_prefetching_loader(loader_cls):
    n, bs, k = 40, 3, 2
    sampler = DistributedSampler(range(n), 2, 0, seed=11)
    loader = loader_cls(range(n), batch_size=bs, sampler=sampler, num_workers=2)
    it = iter(loader)
    taken = [int(i) for _ in range(k) for i in next(it)]
    exact = sampler.state_dict_at(k * bs)
    assert sampler.state_dict()["samples_consumed"] > exact["samples_consumed"]  # prefetched
    del it
    resumed = DistributedSampler(range(n), 2, 0, seed=11)
    resumed.load_state_dict(exact)
    assert taken + list(resumed) == list(DistributedSampler(range(n), 2, 0, seed=11))


class _SlowFirst(torch.utils.data.Dataset):
    """Sample ``slow`` takes a second, so later batches overtake its batch (in_order=False)."""

    def __init__(self, n, slow):
        self.n, self.slow = n, slow

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.slow:
            time.sleep(1.0)
        return i


@pytest.mark.timeout(60)
@needs_in_order
def test_loader_in_order_false_state_at_another_world_size():
    n, bs = 48, 2
    sampler = DistributedSampler(range(n), 2, 0, seed=0)
    first = list(sampler)[0]
    loader = torchfeed.DataLoader(_SlowFirst(n, first), batch_size=bs, sampler=sampler,
                                  num_workers=2, in_order=False)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    del it
    assert state["out_of_order_yielded"], "the slow first batch should have been overtaken"
    # Those positions mean other samples once the remainder is re-dealt to 3 ranks.
    resumed = torchfeed.DataLoader(range(n), batch_size=bs,
                                   sampler=DistributedSampler(range(n), 3, 0, seed=0))
    with pytest.raises(ValueError, match="world size"):
        resumed.load_state_dict(state)


# -- state ------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_state_round_trips_json_and_torch_load():
    s = DistributedSampler(range(30), 3, 1, seed=5, drop_last=True)
    s.set_epoch(4)
    it = iter(s)
    next(it), next(it)
    state = s.state_dict()
    assert state == {
        "kind": "torchfeed.DistributedSampler", "version": 1, "epoch": 4, "seed": 5,
        "shuffle": True, "drop_last": True, "dataset_len": 30, "samples_consumed": 6,
        "world_size": 3,
    }
    assert json.loads(json.dumps(state)) == state
    buf = io.BytesIO()
    torch.save({"sampler": state}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["sampler"]
    assert loaded == state
    r = DistributedSampler(range(30), 3, 1, seed=5, drop_last=True)
    r.load_state_dict(loaded)
    assert r.state_dict() == state and r.state_dict_at(0) == state
    assert list(r) == list(it)


@pytest.mark.timeout(30)
def test_len_follows_the_resumed_pass():
    s = DistributedSampler(range(20), 2, 0)
    s.load_state_dict({**s.state_dict(), "samples_consumed": 13, "world_size": 4})
    assert len(s) == 4  # ceil(7 / 2)
    it = iter(s)
    next(it)
    assert len(s) == 4
    assert len(list(it)) == 3
    assert len(s) == 10  # the pass is over: the next is a full epoch
    assert len(list(s)) == 10


@pytest.mark.timeout(30)
def test_set_epoch_keeps_or_discards_pending_position():
    base = DistributedSampler(range(20), 2, 0)
    base.set_epoch(3)
    state = {**base.state_dict(), "samples_consumed": 10}
    keep = DistributedSampler(range(20), 2, 0)
    keep.load_state_dict(state)
    keep.set_epoch(3)
    assert list(keep) == list(base)[5:]
    drop = DistributedSampler(range(20), 2, 0)
    drop.load_state_dict(state)
    with pytest.warns(UserWarning, match="discards the resume position"):
        drop.set_epoch(4)
    base.set_epoch(4)
    assert list(drop) == list(base)
    done = DistributedSampler(range(20), 2, 0)
    done.load_state_dict({**state, "samples_consumed": 20})  # end of epoch: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        done.set_epoch(4)
    assert list(done) == list(base)


@pytest.mark.timeout(30)
def test_load_state_dict_rejects_mismatches_and_corruption():
    s = DistributedSampler(range(10), 2, 0, seed=1)
    good = s.state_dict()
    bad = {
        "dataset_len": 11, "seed": 2, "shuffle": False, "drop_last": True,
        "kind": "torchdata", "version": 99, "samples_consumed": 12, "epoch": -1,
        "world_size": 0,
    }
    for field, value in bad.items():
        with pytest.raises(ValueError, match=field):
            s.load_state_dict({**good, field: value})
    for field in ("dataset_len", "seed", "shuffle", "drop_last"):
        with pytest.raises(ValueError) as e:
            s.load_state_dict({**good, field: bad[field]})
        assert repr(bad[field]) in str(e.value) and repr(good[field]) in str(e.value)
    with pytest.raises(ValueError, match="missing epoch"):
        s.load_state_dict({k: v for k, v in good.items() if k != "epoch"})
    with pytest.raises(ValueError, match="samples_consumed"):
        s.load_state_dict({**good, "samples_consumed": "3"})
    with pytest.raises(ValueError, match="must be a dict"):
        s.load_state_dict([good])
    assert s.state_dict() == good  # a rejected state changes nothing


@pytest.mark.timeout(30)
def test_state_dict_at_rejects_counts_outside_the_pass():
    s = DistributedSampler(range(10), 2, 0)
    assert s.state_dict_at(5)["samples_consumed"] == 10
    with pytest.raises(ValueError, match="consumed=6"):
        s.state_dict_at(6)
    with pytest.raises(ValueError, match="consumed=-1"):
        s.state_dict_at(-1)


@pytest.mark.timeout(30)
def test_merge_states():
    s = ranks(20, 2)
    its = [iter(x) for x in s]
    for _ in range(3):
        next(its[0])
    next(its[1])
    states = [x.state_dict() for x in s]
    merged = merge_states(states)
    assert merged == states[1] and merged["samples_consumed"] == 2
    assert merge_states([states[0]] * 2) == states[0]
    with pytest.raises(ValueError, match="epoch"):
        merge_states([states[0], {**states[1], "epoch": 1}])
    with pytest.raises(ValueError):
        merge_states([])


# -- IterableDatasets ---------------------------------------------------------------


class _Shards(IterableDataset):
    def __init__(self, n, rank, world):
        self.n, self.rank, self.world = n, rank, world

    def __iter__(self):
        return shard_iterable(range(self.n), self.rank, self.world)


@pytest.mark.timeout(60)
def test_shard_iterable_by_rank_and_worker():
    n, world = 23, 2
    seen = []
    for rank in range(world):
        loader = torchfeed.DataLoader(_Shards(n, rank, world), batch_size=None, num_workers=2)
        seen += [int(i) for i in loader]
    assert sorted(seen) == list(range(n))
    assert list(shard_iterable(range(10), 1, 3)) == [1, 4, 7]  # outside a worker


@pytest.mark.timeout(30)
def test_shard_info_and_rank_outside_a_process_group(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert rank_and_world_size() == (0, 1) and shard_info() == (0, 1)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")  # what torchrun sets, and spawned workers inherit
    assert rank_and_world_size() == (2, 3) and shard_info() == (2, 3)
    assert shard_info(1, 4) == (1, 4)
    with pytest.raises(ValueError, match="Invalid rank 4"):
        shard_info(4, 4)


class _Counting(IterableDataset):
    """A stateful IterableDataset (torchdata's Stateful protocol) sharded by rank."""

    def __init__(self):
        self.pos = 0

    def __iter__(self):
        shard_id, num_shards = shard_info()
        for i in range(shard_id + self.pos * num_shards, 40, num_shards):
            self.pos += 1
            yield i

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


@pytest.mark.timeout(60)
def test_loader_iterable_state_at_another_world_size_is_refused(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")  # what rank_and_world_size() reads without a group
    loader = torchfeed.DataLoader(_Counting(), batch_size=2)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="world size 2.*world size 3"):
        torchfeed.DataLoader(_Counting(), batch_size=2).load_state_dict(state)


@pytest.mark.timeout(30)
def test_check_iterable_world_size():
    check_iterable_world_size(2, 2)
    check_iterable_world_size(None, 3)
    with pytest.raises(ValueError, match="saved at world size 2.*world size 3"):
        check_iterable_world_size(2, 3)


# -- real process groups --------------------------------------------------------------
# Each launch is one torchrun job that runs every scenario of tests/_dist_ranks.py
# (tests/dist_launches.py: the world-2 one also runs other modules' two-rank checks).

sys.path.insert(0, str(HERE))
import _dist_ranks as script  # noqa: E402
from dist_launches import LAUNCHES as launches  # noqa: E402
from dist_launches import launch  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """n2 saves; n3 resumes from n2's checkpoints; n1 from n2's and from n3's."""

    def get(name, iterable=False):
        run = launch(tmp_path_factory, name)
        if iterable:
            assert run.returncode == 0 and run.iterable is not None, run.failure("the iterable results")
            return run.iterable
        assert run.results is not None, run.failure("the map-style results")
        nproc = len(run.results)
        assert [r["rank"] for r in run.results] == list(range(nproc))
        assert all(r["world"] == nproc for r in run.results)
        return run.results

    return get


KEYS = [f"nw{nw}/dl{int(dl)}" for nw in script.WORKERS for dl in (False, True)]


def torch_epoch(world, epoch, drop_last):
    out = []
    for r in range(world):
        s = TorchDistributedSampler(range(script.N), world, r, True, script.SEED, drop_last)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", ["n2", "n3"])
@launches
def test_process_group_shards_are_disjoint_and_cover(runs, name):
    results = runs(name)
    world = len(results)
    for key, epoch in itertools.product(KEYS, (0, 1)):
        drop_last = key.endswith("dl1")
        per_rank = [r[f"full/{key}/e{epoch}"] for r in results]
        assert per_rank == torch_epoch(world, epoch, drop_last), key
        flat = list(itertools.chain(*per_rank))
        if drop_last:
            assert len(set(flat)) == len(flat) == (script.N // world) * world
        else:
            assert set(flat) == set(range(script.N))
            assert len(flat) - script.N == (-script.N) % world  # only torch's padding repeats
    assert all(r["loader"] == "torchfeed.dataloader.DataLoader" for r in results)
    for nw, epoch in itertools.product(script.WORKERS, (0, 1)):
        per_rank = [r[f"torch-sampler/nw{nw}/e{epoch}"] for r in results]
        assert per_rank == torch_epoch(world, epoch, False)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", ["n2", "n3"])
@launches
def test_process_group_iterable_shards_by_rank_and_worker(runs, name):
    results = runs(name, iterable=True)
    world = len(results)
    for nw in script.WORKERS:
        per_rank = [r[f"iterable/nw{nw}"] for r in results]
        assert sorted(itertools.chain(*per_rank)) == list(range(script.ITERABLE_N))
        if nw:
            shards = [tuple(s[0]) for r in results for s in r[f"iterable/nw{nw}/shards"]]
            assert sorted(shards) == [(i, world * nw) for i in range(world * nw)]
            ranks_seen = {tuple(s[1]) for r in results for s in r[f"iterable/nw{nw}/shards"]}
            assert ranks_seen == {(r, world) for r in range(world)}


def dealt_order(per_rank, world, drop_last):
    """The epoch's order the ranks were dealt from (round robin), without torch's padding."""
    return interleave(per_rank)[: script.N if not drop_last else (script.N // world) * world]


@pytest.mark.timeout(600)  # alone, it launches all three jobs (each guarded at 180 s)
@launches
def test_process_group_shuffle_reproducible_across_runs(runs):
    """Three separate launches (2, 3 and 1 ranks) deal from one shuffled order per
    epoch: the same seed shuffles alike in every run, whatever its world size."""
    launched = [runs(name) for name in ("n2", "n3", "n1")]
    for key, epoch in itertools.product(KEYS, (0, 1)):
        drop_last = key.endswith("dl1")
        orders = [dealt_order([r[f"full/{key}/e{epoch}"] for r in results], len(results), drop_last)
                  for results in launched]
        shortest = min(len(o) for o in orders)
        assert len({tuple(o[:shortest]) for o in orders}) == 1, (key, epoch)
        assert len(orders[0]) == script.N and orders[0] == orders[2]  # 2 and 1 ranks: all of it
    assert launched[0][0]["full/nw0/dl0/e0"] != launched[0][0]["full/nw0/dl0/e1"]  # epochs do reshuffle


@pytest.mark.timeout(420)
@launches
def test_process_group_save_gives_one_state_for_all_ranks(runs):
    results = runs("n2")
    for key in KEYS:
        saves = [r[f"save/{key}"] for r in results]
        state = saves[0]["state"]
        assert all(s["gathered"] == [state] * 2 for s in saves)
        assert state["samples_consumed"] == script.SAVE_STEP * script.BATCH * 2
        if key.startswith("nw2"):  # the workers prefetched past the checkpoint
            assert saves[0]["ahead"]["samples_consumed"] > state["samples_consumed"]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", ["n3", "n1"])
@launches
def test_process_group_resume_at_another_world_size(runs, name):
    before, after = runs("n2"), runs(name)
    world = len(after)
    for key in KEYS:
        drop_last = key.endswith("dl1")
        state = before[0][f"save/{key}"]["state"]
        c = state["samples_consumed"]
        full = order(script.N, script.SEED, 1, True)
        taken = list(itertools.chain(*(r[f"save/{key}"]["ids"] for r in before)))
        assert sorted(taken) == sorted(full[:c])
        rest = [r[f"resume/{key}/rest"] for r in after]
        assert [r[f"resume/{key}/len"] for r in after] == [math.ceil(len(x) / script.BATCH) for x in rest]
        flat = interleave(rest)
        assert flat == expected_pass(script.N, world, c, seed=script.SEED, epoch=1,
                                     shuffle=True, drop_last=drop_last)
        remaining = Counter(flat)
        if drop_last:
            assert len(remaining) == len(flat) and script.N - c - len(flat) < world
        else:
            assert all(remaining[i] == 1 for i in full[c:]) and len(flat) - (script.N - c) < world
            assert c >= world  # so the padding repeats samples taken before the checkpoint
            assert set(taken) | set(flat) == set(range(script.N))
        assert [r[f"resume/{key}/next"] for r in after] == torch_epoch(world, 2, drop_last)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", ["n3", "n1"])
@launches
def test_process_group_loader_state_resumes_at_another_world_size(runs, name):
    before, after = runs("n2"), runs(name)
    assert before[0]["loader_state"]
    world = len(after)
    full = order(script.N, script.SEED, 1, True)
    c = script.SAVE_STEP * script.BATCH * 2
    for nw in script.WORKERS:
        key = f"loader/nw{nw}"
        taken = list(itertools.chain(*(r[f"{key}/save"]["ids"] for r in before)))
        assert sorted(taken) == sorted(full[:c])
        rest = [r[f"{key}/rest"] for r in after]
        assert interleave(rest) == expected_pass(script.N, world, c, seed=script.SEED, epoch=1,
                                                 shuffle=True, drop_last=False)
        assert set(taken) | set(itertools.chain(*rest)) == set(range(script.N))
        assert [r[f"{key}/next"] for r in after] == torch_epoch(world, 2, False)


@pytest.mark.timeout(420)
@launches
def test_process_group_loader_state_resumes_2_to_3_to_1(runs):
    first, second, third = runs("n2"), runs("n3"), runs("n1")
    assert first[0]["loader_state"]
    full = order(script.N, script.SEED, 1, True)
    c = script.SAVE_STEP * script.BATCH * 2 + script.CHAIN_STEP * script.BATCH * 3
    for nw in script.WORKERS:
        key = f"loader/nw{nw}"
        states = [r[f"{key}/chain-save"]["state"] for r in second]
        assert all(s["sampler_state"] == states[0]["sampler_state"] for s in states)
        assert states[0]["sampler_state"]["state"]["samples_consumed"] == c
        taken = list(itertools.chain(*(r[f"{key}/save"]["ids"] for r in first)))
        taken += list(itertools.chain(*(r[f"{key}/chain-save"]["ids"] for r in second)))
        assert sorted(taken) == sorted(full[:c])
        assert third[0][f"{key}/chain-rest"] == full[c:]


@pytest.mark.timeout(420)
@launches
def test_process_group_torch_sampler_resumes_only_at_the_saved_world_size(runs):
    before, other = runs("n2"), runs("n3")
    c = script.SAVE_STEP * script.BATCH
    expected = torch_epoch(2, 1, False)
    for nw in script.WORKERS:
        key = f"torch-sampler/nw{nw}"
        assert [r[f"{key}/save"]["ids"] for r in before] == [e[:c] for e in expected]
        # rank 0's state on both ranks (fresh samplers and loaders after the save):
        # each rank's own rest of epoch 1, exactly
        assert [r[f"{key}/rest"] for r in before] == [e[c:] for e in expected]
        for r in other:
            message = r[f"{key}/error"]
            assert "world size 2" in message and "world size 3" in message, message
            assert "torchfeed.DistributedSampler" in message
        assert before[0][f"{key}/save"]["state"]["sampler_state"] == {
            "protocol": "set_epoch", "state": {"epoch": 1, "num_replicas": 2, "shuffle": True,
                                               "seed": 1234, "drop_last": False}}
