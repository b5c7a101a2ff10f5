"""What thread workers (``worker_method="thread"``) add to what both kinds share:
``get_worker_info()`` per thread as torch's thread workers set it (pytorch PR
161044), each worker's own generators, ``worker_init_fn`` in each thread,
batches by reference, the warnings (``share_dataset``, a global RNG drawn from
a thread, a thread left in ``__getitem__`` at shutdown), a thread that ends by
itself, the refusals, ``stats()``.  The behaviours both kinds share (parity,
resume, errors, shutdown) are the core tests', parametrised over
``worker_method``."""
from __future__ import annotations

import random
import sys
import threading
import time
import warnings

import numpy as np
import pytest
import torch
import torch.utils.data
from loader_helpers import Snapshot, warm_up
from sample_datasets import RangeDataset
from torch.utils.data import Dataset, get_worker_info

import torchfeed
from torchfeed import _thread_collate
from torchfeed._seeding import numpy_worker_state
from torchfeed._stats_report import LoaderStats, _cores, thread_gil_share
from torchfeed._torch_compat import TAKES_WORKER_METHOD

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def thread_loader(dataset, **kwargs):
    return torchfeed.DataLoader(dataset, worker_method="thread", **kwargs)


class InfoProbe(Dataset):
    """Each sample: what ``get_worker_info()`` says in the thread that loads it,
    and one draw from each of the worker's own generators."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        info = get_worker_info()
        rng = info.rng
        return {"index": i, "id": info.id, "num_workers": info.num_workers, "seed": info.seed,
                "method": info.worker_method, "dataset_is_ours": info.dataset is self,
                "thread": threading.current_thread().name,
                "random": rng.random_generator.random(),
                "torch": torch.rand(1, generator=rng.torch_generator).item(),
                "numpy": float(rng.numpy_generator.random()),
                "thread_safe": torchfeed.thread_safe_generator() is rng.torch_generator}


@pytest.mark.timeout(30)
def test_worker_info_is_per_thread_with_its_own_generators_seeded_from_base_seed_plus_id():
    dataset = InfoProbe()
    loader = thread_loader(dataset, batch_size=None, num_workers=2,
                           generator=torch.Generator().manual_seed(3))
    samples = list(loader)
    assert get_worker_info() is None  # the main thread is no worker
    base = samples[0]["seed"] - samples[0]["id"]
    for worker_id in (0, 1):
        own = [s for s in samples if s["id"] == worker_id]  # in the order the worker loaded them
        assert [s["index"] for s in own] == [i for i in range(8) if i % 2 == worker_id]
        seed = base + worker_id
        assert {(s["seed"], s["num_workers"], s["method"], s["dataset_is_ours"], s["thread_safe"])
                for s in own} == {(seed, 2, "thread", True, True)}
        assert {s["thread"] for s in own} == {f"torchfeed-worker-{worker_id}"}
        # torch's thread worker's generators: random.Random(seed), a torch.Generator
        # seeded with seed, numpy's default_rng over the process worker's four words.
        py, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        npy = np.random.default_rng(numpy_worker_state(base, worker_id))
        assert [s["random"] for s in own] == [py.random() for _ in own]
        assert [s["torch"] for s in own] == [torch.rand(1, generator=gen).item() for _ in own]
        assert [s["numpy"] for s in own] == [float(npy.random()) for _ in own]
    # the same generator, the same draws: reproducible run to run
    again = list(thread_loader(dataset, batch_size=None, num_workers=2,
                               generator=torch.Generator().manual_seed(3)))
    assert again == samples


@pytest.mark.timeout(30)
@pytest.mark.skipif(not hasattr(torch, "thread_safe_generator"), reason="torch before 2.13")
def test_torchs_thread_safe_generator_returns_the_workers_own():
    class Draw(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.thread_safe_generator() is get_worker_info().rng.torch_generator

    assert all(thread_loader(Draw(), batch_size=None, num_workers=2))
    assert torch.thread_safe_generator() is None  # in the main thread


@pytest.mark.timeout(30)
def test_a_reference_to_torchs_get_worker_info_taken_before_sees_the_thread():
    # `from torch.utils.data import get_worker_info` at import time, as datasets do:
    # the function object is torch's own, so the thread-local must live in it.
    taken = torch.utils.data.get_worker_info

    class Ids(Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return taken().id

    assert [int(b) for b in thread_loader(Ids(), batch_size=None, num_workers=3)] == [0, 1, 2] * 2


@pytest.mark.timeout(30)
def test_worker_init_fn_runs_in_each_thread():
    seen = []

    def init(worker_id):
        info = get_worker_info()
        seen.append((worker_id, info.id, info.worker_method, threading.current_thread().name))

    list(thread_loader(RangeDataset(6), batch_size=2, num_workers=3, worker_init_fn=init))
    assert sorted(seen) == [(k, k, "thread", f"torchfeed-worker-{k}") for k in range(3)]


class Unpicklable:
    """A sample no process worker can send: it holds a lock."""

    def __init__(self, i):
        self.i = i
        self.lock = threading.Lock()


class Objects(Dataset):
    def __init__(self, n):
        self.items = [Unpicklable(i) for i in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


@pytest.mark.timeout(30)
def test_batches_are_handed_over_by_reference():
    dataset = Objects(6)
    batches = list(thread_loader(dataset, batch_size=3, num_workers=2, collate_fn=list))
    # the very objects the dataset returned: nothing pickled, nothing copied
    assert [[id(s) for s in b] for b in batches] == [[id(s) for s in dataset.items[:3]],
                                                     [id(s) for s in dataset.items[3:]]]
    tensor = torch.arange(12.0).view(3, 4)
    out = next(iter(thread_loader([tensor], batch_size=None, num_workers=1,
                                  collate_fn=lambda x: x)))
    assert out is tensor


@pytest.mark.timeout(30)
def test_share_dataset_is_accepted_and_said_to_be_unnecessary():
    with pytest.warns(UserWarning, match="share_dataset=True is not needed with worker_method='thread'"):
        loader = thread_loader(RangeDataset(6), batch_size=2, num_workers=2, share_dataset=True)
    assert [b[1].tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]


class GlobalDraw(Dataset):
    def __init__(self, use_own):
        self.use_own = use_own

    def __len__(self):
        return 16

    def __getitem__(self, i):
        time.sleep(0.002)  # the main thread is surely waiting meanwhile
        generator = get_worker_info().rng.torch_generator if self.use_own else None
        return torch.rand(2, generator=generator)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("use_own", [False, True], ids=["global", "own"])
def test_a_draw_from_a_global_rng_in_a_thread_is_warned_of_once(use_own):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        list(thread_loader(GlobalDraw(use_own), batch_size=2, num_workers=2, prefetch_factor=1))
    drawn = [w for w in record if "drew from a global random number generator" in str(w.message)]
    assert len(drawn) == (0 if use_own else 1), [str(w.message) for w in record]


class Augment(Dataset):
    """A random augmentation drawn from the worker's own generator."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor([i]), torch.randint(0, 10**6, (1,), generator=get_worker_info().rng.torch_generator)


@pytest.mark.timeout(30)
def test_seed_per_batch_reseeds_the_threads_own_generators_for_any_num_workers():
    runs = []
    for workers in (1, 2, 3):
        loader = thread_loader(Augment(), batch_size=2, num_workers=workers, seed_per_batch=True,
                               shuffle=True, generator=torch.Generator().manual_seed(5))
        runs.append([(b[0].tolist(), b[1].tolist()) for b in loader])
    assert runs[0] == runs[1] == runs[2]
    assert len({tuple(map(tuple, b[1])) for b in runs[0]}) == 4  # really random


class Stuck(Dataset):
    """Sample 1 blocks until the test lets it go."""

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 1:
            self.entered.set()
            self.release.wait(8)  # a bound, should the shutdown wrongly wait for it
        return i


@pytest.mark.waits
@pytest.mark.timeout(30)
def test_a_thread_stuck_in_getitem_does_not_hold_up_the_shutdown():
    warm_up(num_workers=2, worker_method="thread")
    before = Snapshot()
    dataset = Stuck()
    it = iter(thread_loader(dataset, batch_size=1, num_workers=2))
    assert int(next(it)) == 0
    assert dataset.entered.wait(10)
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match=r"worker thread\(s\) 1 did not end within 1 s"):
        del it
    assert time.monotonic() - start < 2.5, "the shutdown waits one second of grace, no more"
    assert before.leftovers() == {"threads": ["torchfeed-worker-1"]}
    dataset.release.set()  # the call returns: the thread sees the stop flag and ends
    before.wait_clean(3)


class Exits(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 3:
            sys.exit(5)
        return i


@pytest.mark.timeout(15)
def test_a_thread_that_ends_by_itself_is_reported_not_waited_for():
    warm_up(num_workers=2, worker_method="thread")
    before = Snapshot()
    got = []
    with pytest.raises(RuntimeError) as info:
        for batch in thread_loader(Exits(), batch_size=1, num_workers=2):
            got.append(int(batch))
    message = str(info.value)
    assert message.startswith("DataLoader worker thread 1 exited unexpectedly\n"), message
    assert "SystemExit: 5" in message and "in __getitem__" in message
    assert got == [0, 1, 2]
    del info
    before.wait_clean(3)


def test_datapipes_are_refused_with_the_way_out():
    from torch.utils.data.datapipes.iter import IterableWrapper

    before = set(threading.enumerate())  # a stuck thread of an earlier test may still run
    loader = thread_loader(IterableWrapper(range(4)), num_workers=2)
    with pytest.raises(ValueError, match="worker_method='thread' does not take a DataPipe.*"
                                         "worker_method='multiprocessing'"):
        iter(loader)
    assert not [t for t in set(threading.enumerate()) - before
                if t.name.startswith("torchfeed-worker-")]


@pytest.mark.skipif(TAKES_WORKER_METHOD, reason="the installed torch checks it in its own words")
def test_an_unknown_worker_method_is_a_value_error_naming_both():
    with pytest.raises(ValueError, match=r"worker_method must be one of 'multiprocessing', 'thread', "
                                         r"but got 'threads'"):
        torchfeed.DataLoader(RangeDataset(4), num_workers=2, worker_method="threads")


def test_worker_method_is_an_attribute_a_rebuilt_loader_keeps():
    loader = thread_loader(RangeDataset(4), batch_size=2, num_workers=2)
    assert loader.worker_method == "thread"
    assert torchfeed.DataLoader(RangeDataset(4)).worker_method == "multiprocessing"
    # what Lightning does to inject a sampler: read the attributes named in the signature
    import inspect
    names = inspect.signature(torchfeed.DataLoader.__init__).parameters
    rebuilt = torchfeed.DataLoader(**{n: getattr(loader, n) for n in names
                                      if n not in ("self", "batch_sampler", "sampler")
                                      and hasattr(loader, n)})
    assert rebuilt.worker_method == "thread"


@pytest.mark.timeout(30)
def test_stats_name_the_threads_and_their_cpu_time():
    loader = thread_loader(RangeDataset(12), batch_size=2, num_workers=2)
    list(loader)
    stats = loader.stats()
    assert stats["worker_method"] == "thread" and stats["transport"] is None
    assert [w["pid"] for w in stats["workers"]] == [None, None]
    assert [w["batches"] for w in stats["workers"]] == [3, 3]
    assert all(w["cpu_seconds"] >= 0 for w in stats["workers"])
    assert "2 worker threads" in str(stats)


@pytest.mark.timeout(30)
def test_default_collate_stacks_in_ordinary_memory_not_shared_memory():
    # torch's default_collate stacks into a fresh shared-memory segment whenever
    # get_worker_info() is set; a thread worker's batch never leaves the process.
    dataset = [(torch.full((4, 4), float(i)), np.full(3, i, np.int16), i) for i in range(8)]
    ours = list(thread_loader(dataset, batch_size=4, num_workers=2))
    theirs = list(torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=2))
    for mine, torchs in zip(ours, theirs):
        assert not mine[0].is_shared() and not mine[1].is_shared()
        assert torchs[0].is_shared()  # the process worker's path, which ours must equal
        for a, b in zip(mine, torchs):
            assert a.dtype == b.dtype and torch.equal(a, b)


def _thread_stats(busy, cpu, wall=10.0, stall=0.6):
    workers = [{"id": i, "pid": None, "batches": 10, "busy_seconds": b * wall, "busy_fraction": b,
                "mean_fetch_seconds": 0.1, "start_seconds": 0.0, "uss_bytes": None,
                "uss_growth_bytes": None, "cpu_seconds": c * wall} for i, (b, c) in enumerate(zip(busy, cpu))]
    return LoaderStats(state="running", epoch=0, num_workers=len(busy), worker_method="thread",
                       transport=None, batches_yielded=100, wall_seconds=wall,
                       wait_seconds=stall * wall, stall_fraction=stall, workers=workers,
                       queues={"in_flight": 4, "ready": 0, "limit": 4}, shm={"slots": 0},
                       pin_thread_busy_seconds=None, persistent_workers=False,
                       worker_start_seconds=None, worker_start_fraction=None, large_attributes=[])


@pytest.mark.skipif(_cores() < 2, reason="the reading needs 2 cores")
def test_the_verdict_reads_a_gil_bound_dataset_off_the_threads_cpu_time():
    # two threads busy 95% of the time each, computing on one CPU between them:
    # they took turns, Amdahl's serialised share (1.9 / 1.0 - 1) / 0.9 = 1.0
    held = _thread_stats(busy=[0.95, 0.95], cpu=[0.5, 0.5])
    assert thread_gil_share(held) == pytest.approx(1.0)
    assert "`__getitem__` holds the GIL about 100% of its time" in str(held)
    assert "worker_method='multiprocessing'" in str(held)
    # the same busy threads on two CPUs: nothing serialised
    free = _thread_stats(busy=[0.95, 0.95], cpu=[0.95, 0.95])
    assert thread_gil_share(free) == 0.0 and "GIL" not in str(free)
    # threads waiting on I/O compute on little, which says nothing of the GIL
    io_bound = _thread_stats(busy=[0.95, 0.95], cpu=[0.05, 0.05])
    assert thread_gil_share(io_bound) is None and "GIL" not in str(io_bound)
    # process workers: no such reading
    assert thread_gil_share({**held, "worker_method": "multiprocessing"}) is None


def test_a_slow_worker_start_names_threads_only_to_a_process_loader():
    # starting workers took 8 of a 10 s epoch the loop mostly waited on
    slow = {"worker_start_seconds": 8.0, "worker_start_fraction": 0.8}
    threads = LoaderStats({**_thread_stats(busy=[0.2, 0.2], cpu=[0.2, 0.2]), **slow})
    processes = LoaderStats({**threads, "worker_method": "multiprocessing", "transport": "shm"})
    for s in (threads, processes):
        assert "starting workers took 8.00 s, 80% of this epoch" in str(s)
    assert "worker_method='thread'" not in str(threads)
    assert ("or worker_method='thread', whose workers start at once, where __getitem__ "
            "releases the GIL (python -m torchfeed.tune measures both)") in str(processes)


@pytest.mark.timeout(30)
def test_stats_read_the_threads_cpu_time_of_a_python_bound_dataset():
    class Spins(Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            start = time.thread_time()
            while time.thread_time() - start < 0.01:  # 10 ms of this thread's CPU, in Python
                pass
            return i

    loader = thread_loader(Spins(), batch_size=1, num_workers=2)
    list(loader)
    workers = loader.stats()["workers"]
    # each task's CPU time is the thread's own: at least the 10 ms it spun
    assert all(w["cpu_seconds"] >= 0.01 * w["batches"] for w in workers), workers
    assert all(w["cpu_seconds"] <= w["busy_seconds"] + 0.05 for w in workers), workers


class Big(Dataset):
    """Samples of 64 KiB (float32 128x128): a batch of 16 is 1 MiB, whose memory
    a thread worker takes from the buffers earlier batches let go of."""

    def __len__(self):
        return 160

    def __getitem__(self, i):
        return torch.full((128, 128), float(i))


class CountingNumpy:
    """numpy, counting the buffers the recycler makes (np.empty)."""

    def __init__(self):
        self.made = 0

    def __getattr__(self, name):
        return getattr(np, name)

    def empty(self, *args, **kwargs):
        self.made += 1
        return np.empty(*args, **kwargs)


@pytest.mark.timeout(30)
def test_a_batchs_memory_is_used_again_only_once_nothing_refers_to_it(monkeypatch):
    counting = CountingNumpy()
    monkeypatch.setattr(_thread_collate, "np", counting)
    it = iter(thread_loader(Big(), batch_size=16, num_workers=1, prefetch_factor=1))
    first = next(it)
    kept_view = first[3]                  # a view keeps the memory
    kept_array = next(it)[5].numpy()      # and so does a numpy array over it
    del first
    for k, batch in enumerate(it, start=2):
        assert torch.equal(batch[:, 0, 0], torch.arange(16 * k, 16 * k + 16, dtype=torch.float32))
        del batch
    # what was held was never written by a later batch
    assert torch.equal(kept_view, torch.full((128, 128), 3.0))
    assert (kept_array == 16 + 5).all()
    # the 8 batches dropped at once took turns in a few buffers (one the worker fills
    # while the loop holds another), besides the two held: not one buffer per batch
    assert counting.made <= 6, counting.made
    # the premise: a worker that keeps no free buffer makes one for every batch
    monkeypatch.setattr(_thread_collate, "KEEP_FREE", 0)
    counting.made = 0
    assert len([b.clone() for b in thread_loader(Big(), batch_size=16, num_workers=1)]) == 10
    assert counting.made == 10


@pytest.mark.timeout(30)
def test_recycled_batches_equal_torchs_whatever_the_consumer_keeps():
    theirs = list(torch.utils.data.DataLoader(Big(), batch_size=16, num_workers=2))
    kept = []
    for k, batch in enumerate(thread_loader(Big(), batch_size=16, num_workers=2)):
        if k % 2:
            kept.append((k, batch))  # every other batch held to the end
        else:
            assert torch.equal(batch, theirs[k])
            del batch
    assert all(torch.equal(batch, theirs[k]) for k, batch in kept)
