"""A worker that dies *while it holds* a cross-process primitive never hangs the
main process (issue 25; NOTE [ Cross-process primitives ] in CONTRIBUTING.md).

The instant is made certain by the fault hook only tests turn on
(``torchfeed/_fault_hook.py``): worker 1 SIGKILLs itself the n-th time it has
taken the primitive.  Each case then expects torch's "DataLoader worker (pid(s)
P) exited unexpectedly" for that worker within seconds, on every path of the
main process that can meet it: ``next()`` mid-epoch, a persistent loader's next
``iter()`` (the hook fires in the second epoch), ``next()`` after the worker
died while the iterator was idle, and ``del`` of the iterator.  The autouse
``leaks`` fixture checks that nothing is left behind.  ``test_random_kills``
then kills workers at random instants, many rounds, as the issue's stress test.
"""
from __future__ import annotations

import os
import random
import signal
import tempfile
import threading
import time
import traceback

import psutil
import pytest
import torch
from faults_helpers import SURFACE_WITHIN, children_but_servers
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from torchfeed import DataLoader
from torchfeed._fault_hook import ARMED_ENV
from torchfeed._fault_hook import ENV as HOOK_ENV

SAMPLES = 8        # batch_size 1, 2 workers: 4 tasks each per epoch, sent round-robin
HOOK_WORKER = 1
# The primitive, and the loader options it needs to be taken at all.
PRIMITIVES = {
    "stop-flag": {},                 # the main's stop flag (was an Event: the hang of issue 25)
    "index-lock": {},                # the index queue's read lock, in Queue.get
    "result-sem": {},                # the result queue's size semaphore
    "result-lock": {},               # the result queue's write lock, nothing written yet
    "result-lock-written": {},       # the same, the message written, not yet released
    "feeder-lock": {},               # the same lock, taken by the worker's feeder thread
    "slot": {"transport": "shm"},    # a shared-memory slot, packed and unsent
    "sent": {"transport": "torch"},  # torch's transport: the fds the main has yet to fetch
}
# Each primitive is taken once per task and once per epoch acknowledgement, so
# the 2nd time is mid-epoch 1 and the 5th is the second epoch's iter() (the
# acknowledgement) or its first batch.
SCENARIOS = {"fresh": dict(epochs=1, n=2, persistent=False, pin=False),
             "persistent-pin": dict(epochs=2, n=5, persistent=True, pin=True)}


def exited_unexpectedly(pid: int) -> str:
    return f"DataLoader worker (pid(s) {pid}) exited unexpectedly"


def worker_pid(it, worker_id: int) -> int:
    return it._workers[worker_id].pid


def wait_dead(pid: int, within: float = SURFACE_WITHIN) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        assert time.monotonic() < deadline, f"worker {pid} did not die"
        time.sleep(0.01)


def arm(monkeypatch, what: str, n: int, worker: int = HOOK_WORKER) -> None:
    monkeypatch.setenv(HOOK_ENV, f"{what}:{worker}:{n}")  # forked workers inherit it
    monkeypatch.setenv(ARMED_ENV, "1")  # the second switch, which only tests set


def run_until_error(loader, epochs: int):
    """(error text, pid of worker 1, seconds from the first iter() to the error)."""
    start = time.monotonic()
    pids, it = [], None
    with pytest.raises(RuntimeError) as info:
        for _ in range(epochs):
            it = iter(loader)  # persistent workers: the same processes every epoch
            pids.append(worker_pid(it, HOOK_WORKER))
            for batch in it:
                del batch
            it = None
    elapsed = time.monotonic() - start
    traceback.clear_frames(info.value.__traceback__)
    message = str(info.value)
    del info, it
    return message, pids[0], elapsed


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_worker_dies_holding(scenario, monkeypatch, no_pin_warning, tmp_path):
    """Every primitive in turn (one loop, so the leak check runs once for all)."""
    s = SCENARIOS[scenario]
    # "sent": worker 1 dies serving a batch's descriptors from a socket in
    # multiprocessing's temporary folder (pymp-*), which a killed worker never
    # removes (torch's workers leave theirs): the iterator's folder goes with
    # it. Made under this test's tmp_path, where nothing else is.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    if s["pin"]:
        monkeypatch.setenv("TORCHFEED_PIN_THREAD_WITHOUT_ACCELERATOR", "1")
    for primitive, options in PRIMITIVES.items():
        arm(monkeypatch, primitive, s["n"])
        loader = DataLoader(torch.utils.data.TensorDataset(torch.arange(float(SAMPLES))),
                            batch_size=1, num_workers=2, persistent_workers=s["persistent"],
                            pin_memory=s["pin"], **options)
        message, pid, elapsed = run_until_error(loader, s["epochs"])
        assert message.startswith(exited_unexpectedly(pid)), f"{primitive}: {message}"
        assert f"Worker {HOOK_WORKER} (pid {pid}) was killed by signal SIGKILL (9)" in message, \
            f"{primitive}: {message}"
        assert elapsed < SURFACE_WITHIN, f"{primitive}: the error took {elapsed:.1f} s"
        del loader
        assert list(tmp_path.glob("pymp-*")) == [], primitive


@pytest.mark.timeout(30)
@pytest.mark.parametrize("primitive", ["stop-flag", "result-lock-written"])
@pytest.mark.parametrize("then", ["next", "del"])
def test_worker_dies_holding_while_the_iterator_is_idle(primitive, then, monkeypatch):
    """The hang of issue 25: the worker dies while nobody is in next(); the
    next call, or dropping the iterator, must not wait on what it held.

    Worker 1 dies at its third task, which only the second next() sends (tasks
    go round-robin, four with iter(), one more as each batch is handed out): so
    both calls have their batches first, whatever the order the workers run in.
    Killed at its second task (sent with iter()), it could die holding the
    result queue's lock before worker 0 had written batch 0, and the first
    next() would rightly raise: that happened under a loaded machine."""
    arm(monkeypatch, primitive, 3)
    loader = DataLoader(torch.utils.data.TensorDataset(torch.arange(64.0)), batch_size=1,
                        num_workers=2)
    it = iter(loader)
    got = [next(it), next(it)]
    pid = worker_pid(it, HOOK_WORKER)
    wait_dead(pid)
    start = time.monotonic()
    if then == "del":
        del it  # shuts the workers down: sets the stop flag, joins, terminates
        assert time.monotonic() - start < SURFACE_WITHIN
        return
    with pytest.raises(RuntimeError) as info:
        for batch in it:
            got.append(batch)
    traceback.clear_frames(info.value.__traceback__)
    assert time.monotonic() - start < SURFACE_WITHIN
    assert str(info.value).startswith(exited_unexpectedly(pid)), str(info.value)
    assert len(got) < 64
    del it, info, got


class Uneven(IterableDataset):
    """Worker 0 yields 2 samples, worker 1 many more, slowly: worker 0 runs out
    (and says so) long before the epoch ends."""

    def __iter__(self):
        share = 2 if get_worker_info().id == 0 else 100
        for i in range(share):
            if share > 2:
                time.sleep(0.002)
            yield i


@pytest.mark.timeout(30)
@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
def test_worker_out_of_samples_dies_holding_the_write_lock(persistent, monkeypatch):
    """Worker 0's third message is its IterableExhausted: it is written and
    read, so the main process no longer waits on worker 0, and then worker 0
    dies before releasing the write lock that worker 1 needs for each batch."""
    arm(monkeypatch, "result-lock-written", 3, worker=0)
    loader = DataLoader(Uneven(), batch_size=1, num_workers=2, persistent_workers=persistent)
    start = time.monotonic()
    it = iter(loader)
    pid = worker_pid(it, 0)
    with pytest.raises(RuntimeError) as info:
        for batch in it:
            del batch
    traceback.clear_frames(info.value.__traceback__)
    assert time.monotonic() - start < SURFACE_WITHIN
    assert str(info.value).startswith(exited_unexpectedly(pid)), str(info.value)
    del it, info


@pytest.mark.timeout(30)
def test_worker_dies_with_its_index_pipe_full(monkeypatch):
    """Tasks bigger than a pipe go through the main process's feeder thread;
    the worker dies before reading its first, so the feeder is blocked on a
    pipe nobody will read.  The error comes at once, and the feeder thread
    is not left behind (the leak check)."""
    arm(monkeypatch, "index-lock", 1)
    loader = DataLoader(torch.utils.data.TensorDataset(torch.arange(160_000.0)),
                        batch_size=40_000, num_workers=2)
    message, pid, elapsed = run_until_error(loader, 1)
    assert message.startswith(exited_unexpectedly(pid)), message
    assert elapsed < SURFACE_WITHIN


class SlowSample(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 3:
            time.sleep(30)
        return i


@pytest.mark.timeout(30)
def test_worker_dies_while_dumping_its_stacks(monkeypatch):
    """The timeout's stack dump: worker 1 writes half a dump into its pipe
    and dies; the main process still raises torch's timeout error at once."""
    arm(monkeypatch, "stack-dump", 1)
    loader = DataLoader(SlowSample(), batch_size=1, num_workers=2, timeout=1)
    message, pid, elapsed = run_until_error(loader, 1)
    assert message.startswith("DataLoader timed out after 1 seconds"), message
    assert f"Python stacks of worker 1 (pid {pid})" in message
    assert elapsed < 1 + SURFACE_WITHIN


@pytest.mark.timeout(30)
def test_restart_frees_the_write_lock_of_the_dead(monkeypatch):
    """max_worker_restarts: the replacement, and worker 0, can still send."""
    arm(monkeypatch, "result-lock-written", 2)
    data = torch.arange(32.0)
    loader = DataLoader(torch.utils.data.TensorDataset(data), batch_size=1, num_workers=2,
                        max_worker_restarts=1)
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match="restarted it as pid"):
        it = iter(loader)
        monkeypatch.delenv(HOOK_ENV)  # the replacement is left alone
        got = [batch[0].item() for batch in it]
    assert got == data.tolist()
    assert time.monotonic() - start < SURFACE_WITHIN


# -- stress: a kill at a random instant -----------------------------------------------------------
class Tiny(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


class Large(Tiny):
    """A large, pickled-inline leaf (bytes) beside a tensor: the messages are
    bigger than the pipe, so a kill can land in the middle of one."""

    def __getitem__(self, i):
        return torch.full((64,), float(i)), bytes(96 << 10)


ROUNDS = 40
KILL_WITHIN = 0.08  # seconds after the loop starts: workers starting, first batches, later


def _kill_one_worker(me: psutil.Process, delay: float, rng: random.Random, killed: list) -> None:
    time.sleep(delay)
    deadline = time.monotonic() + SURFACE_WITHIN
    while time.monotonic() < deadline:
        workers = children_but_servers(me)
        if len(workers) >= 2:  # both started: one of the two, at random
            victim = rng.choice(workers)
            try:
                os.kill(victim.pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            killed.append((victim.pid, time.monotonic()))
            return
        time.sleep(0.002)


@pytest.mark.long
@pytest.mark.timeout(120)
def test_random_kills(no_pin_warning):
    """ROUNDS rounds, each killing one of 2 workers at a random instant (while
    they start, while the main process waits in next() or is busy between
    batches, and for persistent workers, whose epochs are short, between
    epochs and in the next iter()), with tiny and large batches.  Every round
    must raise torch's error for the killed worker within seconds."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    me = psutil.Process()
    for round_ in range(ROUNDS):
        large, persistent = rng.random() < 0.5, rng.random() < 0.5
        samples = 24 if persistent else 100_000  # fresh: one epoch, longer than KILL_WITHIN
        loader = DataLoader(Large(samples) if large else Tiny(samples), batch_size=2,
                            num_workers=2, persistent_workers=persistent)
        killed: list = []
        killer = threading.Thread(target=_kill_one_worker, args=(
            me, rng.uniform(0, KILL_WITHIN), random.Random(rng.random()), killed))
        context = f"round {round_} (seed {seed}, large={large}, persistent={persistent})"
        pause = rng.choice((0, 0.001))  # sometimes busy between batches
        killer.start()
        try:
            with pytest.raises(RuntimeError) as info:
                for _ in range(10_000):
                    for batch in loader:
                        del batch
                        time.sleep(pause)
        finally:
            killer.join()
        raised_at = time.monotonic()
        traceback.clear_frames(info.value.__traceback__)
        message = str(info.value)
        del info, loader
        assert killed, f"{context}: no worker was killed"
        pid, at = killed[0]
        assert message.startswith(exited_unexpectedly(pid)), f"{context}: {message}"
        assert raised_at - at < SURFACE_WITHIN, f"{context}: {raised_at - at:.1f} s"
