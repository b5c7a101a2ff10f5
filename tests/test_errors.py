"""Errors from workers reach the main process: the original type (or torch's
RuntimeError fallback), the worker's traceback, the worker id and the sample
indices; timeouts and dead workers raise RuntimeError and never hang."""
from __future__ import annotations

import errno
import multiprocessing
import os
import re
import signal
import sys
import time
import traceback

import psutil
import pytest
import torch
import torch.utils.data
from loader_helpers import Snapshot, assert_same, both_kinds, live_children, torch_kwargs, warm_up, workers
from sample_datasets import (
    BadIndexError,
    DyingDataset,
    FailingDataset,
    FailingIterIterable,
    LockDataset,
    RangeDataset,
    ShardedIterable,
    SlowIndexDataset,
    failing_collate,
    failing_worker_init,
)
from transport_helpers import wait_until

import torchfeed
from torchfeed import _errors
from torchfeed._worker import _explain_send_error

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def worker_words(worker_method: str) -> str:
    """How torch's sentences name a worker of this kind: "worker process", or
    "worker thread" (the words of torch's thread workers, pytorch PR 161044)."""
    return "worker thread" if worker_method == "thread" else "worker process"


def raised(loader_cls, dataset, **kwargs):
    """(exception, batches yielded before it).

    The exception's frames are cleared, so it no longer holds the iterator:
    torch's ExceptionWrapper.reraise leaves the iterator in a reference cycle,
    and a cycle collected later shuts torch's workers down slowly (seconds)."""
    got = []
    with pytest.raises(Exception) as info:
        for batch in loader_cls(dataset, **kwargs):
            got.append(batch)
    traceback.clear_frames(info.value.__traceback__)
    return info.value, got


# -- exceptions from user code ------------------------------------------------------------
@pytest.mark.timeout(60)
@both_kinds
def test_getitem_error_type_traceback_worker_and_indices(worker_method):
    error, got = raised(torchfeed.DataLoader, FailingDataset(12, bad=5), batch_size=2,
                        num_workers=2, worker_method=worker_method)
    assert type(error) is BadIndexError
    message = str(error)
    # torch's wording, so code matching on it keeps working, plus the batch.
    assert message.startswith(f"Caught BadIndexError in DataLoader {worker_words(worker_method)} 0")
    assert "batch 2" in message and "sample indices [4, 5]" in message
    assert "Traceback (most recent call last)" in message
    assert 'raise BadIndexError(f"sample {i} is broken")' in message
    assert "BadIndexError: sample 5 is broken" in message
    assert len(got) == 2


@pytest.mark.timeout(60)
@both_kinds
def test_getitem_error_type_same_as_torchs_and_iteration_can_go_on(worker_method):
    # torch re-raises and keeps the iterator usable: the failed batch is skipped.
    results = []
    kwargs = dict(batch_size=2, num_workers=2, worker_method=worker_method)
    for cls, cls_kwargs in ((torch.utils.data.DataLoader, torch_kwargs(kwargs)),
                            (torchfeed.DataLoader, kwargs)):
        it = iter(cls(FailingDataset(10, bad=3), **cls_kwargs))
        out, errors = [], []
        while True:
            try:
                out.append(next(it))
            except StopIteration:
                break
            except BadIndexError as exc:
                errors.append(type(exc))
        results.append((out, errors))
        del it
    assert_same(results[0][0], results[1][0])
    assert results[0][1] == results[1][1] == [BadIndexError]


def test_getitem_error_without_workers_is_the_original():
    error, _ = raised(torchfeed.DataLoader, FailingDataset(8, bad=2), batch_size=2)
    assert type(error) is BadIndexError and str(error) == "sample 2 is broken"


@pytest.mark.timeout(60)
@both_kinds
def test_key_error_message_is_readable(worker_method):
    error, _ = raised(torchfeed.DataLoader, FailingDataset(8, bad=1, error="KeyError"),
                      batch_size=2, num_workers=1, worker_method=worker_method)
    assert type(error) is KeyError
    text = str(error)
    assert "\\n" not in text and "\n" in text  # not a quoted one-liner
    assert "KeyError: 'no sample 1'" in text and "sample indices [0, 1]" in text


@pytest.mark.timeout(60)
@both_kinds
def test_exception_that_cannot_be_rebuilt_falls_back_to_runtime_error(worker_method):
    theirs, _ = raised(torch.utils.data.DataLoader, FailingDataset(6, bad=2, error="TwoArgError"),
                       batch_size=2, num_workers=1)
    ours, _ = raised(torchfeed.DataLoader, FailingDataset(6, bad=2, error="TwoArgError"),
                     batch_size=2, num_workers=1, worker_method=worker_method)
    assert type(theirs) is type(ours) is RuntimeError
    assert f"Caught TwoArgError in DataLoader {worker_words(worker_method)} 0" in str(ours)
    assert "TwoArgError: 7: needs two arguments" in str(ours)
    assert "sample indices [2, 3]" in str(ours)


@pytest.mark.timeout(60)
@workers(0, 2)
def test_iter_error(num_workers, worker_method):
    error, got = raised(torchfeed.DataLoader, FailingIterIterable(), num_workers=num_workers,
                        worker_method=worker_method)
    assert type(error) is ValueError and not got
    if num_workers:
        assert f"Caught ValueError in DataLoader {worker_words(worker_method)} 0" in str(error)
        assert 'raise ValueError("cannot open the stream")' in str(error)


def test_iter_error_without_workers_raised_by_iter_like_torch():
    # torch builds the fetcher, and so calls the dataset's __iter__, in iter(loader).
    with pytest.raises(ValueError):
        iter(torch.utils.data.DataLoader(FailingIterIterable()))
    with pytest.raises(ValueError):
        iter(torchfeed.DataLoader(FailingIterIterable()))


class StopsAt(torch.utils.data.Dataset):
    """Raises StopIteration from __getitem__ at one index: small samples, or
    big ones that the shared-memory transport streams into its slot."""

    def __init__(self, at, big):
        self.at, self.big = at, big

    def __len__(self):
        return 96

    def __getitem__(self, i):
        if i == self.at:
            raise StopIteration
        return torch.full((3, 192, 192) if self.big else (2,), float(i))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers, big, worker_method", [
    (0, False, "multiprocessing"), (2, False, "multiprocessing"), (2, True, "multiprocessing"),
    (2, False, "thread")])
def test_stop_iteration_from_getitem_is_an_error_not_a_short_batch_or_epoch(num_workers, big,
                                                                             worker_method):
    # torch with num_workers=0 ends the epoch there without a word; a batch
    # fetched sample by sample must not come out short either.
    at = 3 * 16 + 5  # worker 1's second batch: streamed when the samples are big
    error, got = raised(torchfeed.DataLoader, StopsAt(at, big), batch_size=16,
                        num_workers=num_workers, worker_method=worker_method)
    assert type(error) is RuntimeError
    assert f"dataset[{at}] raised StopIteration" in str(error)
    assert "should raise IndexError" in str(error)
    assert [len(b) for b in got] == [16, 16, 16]


@pytest.mark.timeout(60)
@both_kinds
def test_collate_error(worker_method):
    error, got = raised(torchfeed.DataLoader, RangeDataset(12), batch_size=2, num_workers=2,
                        collate_fn=failing_collate, worker_method=worker_method)
    assert type(error) is ZeroDivisionError
    assert f"{worker_words(worker_method)} 0" in str(error) and "sample indices [4, 5]" in str(error)
    assert "collate cannot handle sample 4" in str(error)
    assert "in failing_collate" in str(error)  # the traceback reaches the collate_fn


@pytest.mark.timeout(60)
@both_kinds
def test_worker_init_fn_error(worker_method):
    theirs, _ = raised(torch.utils.data.DataLoader, RangeDataset(8), batch_size=2, num_workers=2,
                       worker_init_fn=failing_worker_init)
    ours, got = raised(torchfeed.DataLoader, RangeDataset(8), batch_size=2, num_workers=2,
                       worker_init_fn=failing_worker_init, worker_method=worker_method)
    assert type(ours) is type(theirs) is OSError
    assert f"Caught OSError in DataLoader {worker_words(worker_method)} 1" in str(ours)
    assert "worker_init_fn failed in worker 1" in str(ours)
    # Worker 1's failure answers its first task, batch 1: the error names that batch's samples.
    assert "in worker_init_fn, so it could not load batch 1 (sample indices [2, 3])" in str(ours)
    assert "in failing_worker_init" in str(ours)
    assert len(got) == 1  # worker 0's batch came first, in order


# -- explanatory notes without BaseException.add_note (Python 3.10) ------------------------
SHM_FULL = ("unable to allocate shared memory(shm) for file </torch_1_2_3>: "
            "No space left on device (28)")


@pytest.mark.parametrize("exc,shown", [
    (IndexError("list index out of range"), "list index out of range"),
    (KeyError("img_7"), "'img_7'"),  # KeyError shows the repr of its key
    (IndexError(), ""),
    (OSError(errno.ENOSPC, "No space left on device"), "[Errno 28] No space left on device"),
], ids=["IndexError", "KeyError", "no-message", "OSError"])
def test_note_goes_under_the_message_where_add_note_is_missing(monkeypatch, exc, shown):
    # Python 3.10's BaseException has no add_note: what its traceback prints is
    # type and str(exc), and the note must be there, on a line of its own.
    monkeypatch.setattr(_errors, "_NATIVE_NOTES", False)
    _errors.add_note(exc, "the note")
    printed = "".join(traceback.format_exception_only(type(exc), exc))
    expected = f"{shown}\nthe note" if shown else "the note"
    assert printed == f"{type(exc).__name__}: {expected}\n", printed
    assert not getattr(exc, "__notes__", None)  # carried by the message itself


def test_note_is_native_where_add_note_exists():
    """Python 3.11 on: BaseException.add_note's note; 3.10 has none, and the note goes
    under the message (the test above)."""
    native = sys.version_info >= (3, 11)
    assert hasattr(BaseException, "add_note") is native is _errors._NATIVE_NOTES
    exc = IndexError("list index out of range")
    _errors.add_note(exc, "the note")
    printed = "".join(traceback.format_exception_only(type(exc), exc))
    assert printed.startswith("IndexError: list index out of range\n") and "the note" in printed
    if native:
        assert exc.args == ("list index out of range",) and exc.__notes__ == ["the note"]
    else:
        assert str(exc) == "list index out of range\nthe note", str(exc)
        assert not hasattr(exc, "__notes__")


def test_full_dev_shm_note_shows_where_add_note_is_missing(monkeypatch):
    monkeypatch.setattr(_errors, "_NATIVE_NOTES", False)
    exc = RuntimeError(SHM_FULL)
    _explain_send_error(exc)
    assert str(exc).startswith(SHM_FULL + "\n"), str(exc)
    assert "/dev/shm is full" in str(exc) and "--shm-size" in str(exc), str(exc)


# -- unpicklable samples -------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_unpicklable_sample_names_its_path_when_the_batch_falls_back(monkeypatch):
    # Slots that do not fit the shared-memory budget send batches torch's way
    # inside a wrapper: the error still names the user's leaf, not the wrapper.
    monkeypatch.setenv("TORCHFEED_SHM_LIMIT", "64k")
    with pytest.warns(UserWarning, match="shared memory"):
        error, got = raised(torchfeed.DataLoader, LockDataset(), batch_size=None,
                            num_workers=2)
    assert "batch['meta'][2] is a _thread.lock" in str(error), str(error)
    assert len(got) == 2


@pytest.mark.timeout(60)
def test_unpicklable_sample_names_its_path():
    start = time.monotonic()
    error, got = raised(torchfeed.DataLoader, LockDataset(), batch_size=None, num_workers=2)
    assert time.monotonic() - start < 10, "must not hang (torch does, pytorch#142884)"
    message = str(error)
    assert "batch['meta'][2]" in message and "lock" in message
    assert "worker process 0" in message and "cannot be sent to the main process" in message
    assert len(got) == 2


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:Got pickle error")  # torch warns too; we explain in the error
def test_spawn_with_unpicklable_collate_fn_names_it():
    def local_collate(batch):  # a local function: spawn cannot pickle it
        return batch

    kwargs = dict(num_workers=2, multiprocessing_context="spawn", collate_fn=local_collate)
    theirs, _ = raised(torch.utils.data.DataLoader, RangeDataset(4), **kwargs)
    ours, _ = raised(torchfeed.DataLoader, RangeDataset(4), **kwargs)
    assert type(ours) is type(theirs)
    assert "could not start worker 0 with the 'spawn' start method" in str(ours)
    assert "collate_fn" in str(ours) and "module level" in str(ours)


# -- timeout ---------------------------------------------------------------------------------
@pytest.fixture
def fork_server_running():
    """Where forkserver is the default start method (TORCHFEED_TEST_START_METHOD),
    the first loader of a process starts the fork server, which imports torch
    first: seconds on a loaded machine, under torch's loader as under ours, and
    a timeout of 2 s can expire before the first batch.  Started here, out of
    the test's timing; nothing to do under fork."""
    if multiprocessing.get_start_method() == "forkserver":
        list(torchfeed.DataLoader(SlowIndexDataset(2), num_workers=1))


@pytest.mark.waits
@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout, worker_method", [
    (1, "multiprocessing"), (0.5, "multiprocessing"), (0.5, "thread")])
def test_timeout_message_is_torchs(timeout, worker_method, tmp_path):
    """Timed from the last batch before the stuck one, once the worker is in
    it: how long a worker takes to start (a fork server's, under forkserver:
    seconds on a loaded machine, under torch's loader too) is not the test's."""
    # A thread cannot be killed: its sleep ends by itself 2.5 s later (the shutdown does
    # not wait for it; test_thread_workers.py checks what it leaves and when).
    stuck = tmp_path / "stuck"
    dataset = SlowIndexDataset(8, slow=2, delay=5 if worker_method != "thread" else 3,
                               mark=str(stuck))
    it = iter(torchfeed.DataLoader(dataset, batch_size=1, num_workers=1, timeout=timeout,
                                   prefetch_factor=3,  # so batch 2 is sent before any next()
                                   worker_method=worker_method))
    assert wait_until(stuck.exists, 30), "the worker never reached the slow sample"
    got = []
    with pytest.raises(RuntimeError) as info:
        for batch in it:
            got.append(batch)
            last = time.monotonic()
    elapsed = time.monotonic() - last
    del it
    traceback.clear_frames(info.value.__traceback__)
    ours = info.value
    assert type(ours) is RuntimeError
    # torch's message as the first line, then what was awaited and where the stuck worker is
    first, second = str(ours).splitlines()[:2]
    who = "worker thread 0" if worker_method == "thread" else "worker 0"
    assert first == f"DataLoader timed out after {timeout} seconds"
    assert second.startswith(f"It was waiting for batch 2 (sample indices [2]) from {who}")
    assert re.search(rf"^Python stacks? of {who} ", str(ours), re.M), str(ours)
    assert "in __getitem__" in str(ours)
    assert len(got) == 2
    assert timeout <= elapsed < timeout + 3


@pytest.mark.timeout(60)
@both_kinds
def test_timeout_not_hit_by_steady_workers(worker_method, fork_server_running):
    out = list(torchfeed.DataLoader(SlowIndexDataset(6, slow=1, delay=0.3), batch_size=1,
                                    num_workers=2, timeout=2, worker_method=worker_method))
    assert [int(b) for b in out] == list(range(6))


# -- workers that die --------------------------------------------------------------------------
DEATHS = {"sigkill": "SIGKILL (9)", "segfault": "SIGSEGV (11)", "exit": "exited with code 3"}
TORCH_DEATHS = {  # what torch's SIGCHLD handler says, then torchfeed's line
    "sigkill": r"is killed by signal: Killed\. ", "segfault": r"is killed by signal: Segmentation fault\. ",
    "exit": r"exited unexpectedly with exit code 3\. Details are lost due to multiprocessing\."}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", list(DEATHS))
def test_dead_worker_raises_runtime_error_naming_it(how):
    before = Snapshot()
    loader = torchfeed.DataLoader(DyingDataset(how, n=12, bad=5), batch_size=1, num_workers=2)
    it = iter(loader)
    pids = {p.pid for p in live_children()} - before.children
    got = []
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        for batch in it:
            got.append(int(batch))
            start = time.monotonic()
    assert time.monotonic() - start < 5, "noticed within seconds"
    message = str(info.value)
    first = message.splitlines()[0]
    match = re.fullmatch(r"DataLoader worker \(pid\(s\) (\d+)\) exited unexpectedly", first)
    assert match, message
    pid = int(match.group(1))
    assert pid in pids
    assert re.search(rf"^DataLoader worker \(pid {pid}\) {TORCH_DEATHS[how]}", message, re.M), message
    match = re.search(r"^Worker (\d+) \(pid (\d+)\) ", message, re.M)
    assert match and int(match.group(1)) == 1, message  # batch 5 went to worker 1, round-robin
    assert int(match.group(2)) == pid
    assert DEATHS[how] in message
    assert "batch 5 (sample indices [5])" in message
    # Batches of the dead worker that had not been handed over yet are lost
    # with it (torch's transport fetches tensors from their sender), so the
    # error may come before batch 5's turn; what came is a prefix, in order.
    assert got == list(range(len(got))) and len(got) <= 5
    # The iterator shut the other worker down on the way out, even though
    # the exception (and so the iterator) is still referenced.
    deadline = time.monotonic() + 3
    while {p.pid for p in live_children()} & pids and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not {p.pid for p in live_children()} & pids


@pytest.mark.timeout(60)
def test_worker_whose_iterable_ended_exits_without_being_taken_for_dead():
    # Worker 2's share is one sample, so it ends first and exits cleanly while the
    # others still deliver: the epoch completes, with no dead-worker error and no hang.
    out = list(torchfeed.DataLoader(ShardedIterable(0, 5), batch_size=2, num_workers=3))
    assert sorted(int(row[0]) for b in out for row in b) == list(range(5))


@pytest.mark.timeout(60)
def _dead(pid: int) -> bool:
    """A zombie waiting for us, or gone: a fork server reaps the workers it forked."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_worker_killed_while_the_iterator_is_idle_is_reported_at_the_next_batch():
    warm_up()
    before = Snapshot()
    loader = torchfeed.DataLoader(ShardedIterable(0, 80), batch_size=2, num_workers=2)
    it = iter(loader)
    got = [next(it)]
    pid = loader.stats()["workers"][1]["pid"]
    os.kill(pid, signal.SIGKILL)  # while nobody is in next(): the iterator is idle
    deadline = time.monotonic() + 5
    while not _dead(pid):
        assert time.monotonic() < deadline, "the killed worker did not die"
        time.sleep(0.01)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        for batch in it:  # what worker 1 sent before it died may come first
            got.append(batch)
    traceback.clear_frames(info.value.__traceback__)
    assert time.monotonic() - start < 5, "noticed within seconds, not at the epoch's end"
    message = str(info.value)
    assert message.startswith(f"DataLoader worker (pid(s) {pid}) exited unexpectedly\n"
                              f"DataLoader worker (pid {pid}) is killed by signal: Killed. \n"
                              f"Worker 1 (pid {pid}) was killed by signal SIGKILL (9)."), message
    assert len(got) < 40  # the epoch (40 batches) did not run to its end
    del it, info, got  # held batches keep their slots (and fds) alive
    before.wait_clean(within=3)  # worker 0 was shut down too


# -- nothing left behind after an error ----------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case, worker_method", [
    ("getitem", "multiprocessing"), ("timeout", "multiprocessing"),
    ("dead worker", "multiprocessing"), ("getitem", "thread"), ("timeout", "thread")])
def test_error_leaves_nothing_behind(case, worker_method):
    warm_up()
    before = Snapshot()
    kwargs = dict(batch_size=1, num_workers=2, worker_method=worker_method)
    # The stuck sample: a process is killed; a thread, which cannot be, ends by
    # itself when its sleep does, 1.5 s after the timeout, within wait_clean's bound.
    dataset = {"getitem": FailingDataset(10, bad=3),
               "timeout": SlowIndexDataset(10, slow=3, delay=2),
               "dead worker": DyingDataset("exit", n=10, bad=3)}[case]
    if case == "timeout":
        kwargs["timeout"] = 0.5
    try:
        for batch in torchfeed.DataLoader(dataset, **kwargs):
            del batch  # a batch's shared storage is an fd of its own
    except (BadIndexError, RuntimeError):
        pass
    else:
        raise AssertionError("expected an error")
    before.wait_clean(within=3)


# -- without automatic batching a task holds a single index -----------------------------------
@pytest.mark.timeout(60)
@both_kinds
def test_getitem_error_without_batching_names_the_index(worker_method):
    error, got = raised(torchfeed.DataLoader, FailingDataset(8, bad=3), batch_size=None,
                        num_workers=2, worker_method=worker_method)
    assert type(error) is BadIndexError, error
    assert f"{worker_words(worker_method)} 1" in str(error) and "sample indices [3]" in str(error)
    assert got == [0, 1, 2]


@pytest.mark.timeout(60)
def test_dead_worker_without_batching_names_the_index():
    with pytest.raises(RuntimeError) as info:
        list(torchfeed.DataLoader(DyingDataset("exit", n=8, bad=3), batch_size=None,
                                  num_workers=2))
    assert "\nWorker 1 (pid " in str(info.value), info.value
    assert "batch 3 (sample indices [3])" in str(info.value)
