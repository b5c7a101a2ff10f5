"""A worker killed while its result is half written into the result pipe.

``multiprocessing.Queue.get`` would read the half message's length and then
block forever for the rest (torch is saved by its SIGCHLD handler; a loader
that waits on sentinels is not, unless it reads with care).  The loader must
raise the dead-worker error instead, within 5 s, and say the result was lost
mid-write.
"""
import multiprocessing
import os
import threading
import time

import psutil
import pytest
from faults_datasets import (
    BigSamples,
    HoldSentinel,
    blocked_in_a_pipe_write,
    collate_list,
    read_marker,
)
from faults_helpers import SURFACE_WITHIN, Failure

from torchfeed import DataLoader
from torchfeed._ipc import wait_ready


def _kernel_names_pipe_writes() -> bool:
    """The premise of the fault: this kernel says which thread waits in a pipe write."""
    r, w = os.pipe()
    writer = threading.Thread(target=os.write, args=(w, bytes(1 << 20)), daemon=True)
    writer.start()
    try:
        deadline = time.monotonic() + 5
        while not blocked_in_a_pipe_write() and time.monotonic() < deadline:
            time.sleep(0.01)
        return blocked_in_a_pipe_write()
    finally:
        os.close(r)  # the write fails with EPIPE and the thread ends
        writer.join()
        os.close(w)


def _dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start", ["fork", "spawn-quiet-sentinel"])
def test_worker_killed_mid_write_never_hangs(start, tmp_path, resource_tracker):
    """With ``spawn-quiet-sentinel`` the worker starts a process that keeps its
    sentinel quiet after its death, as torch's ``torch_shm_manager`` can (NOTE [
    A sentinel held open ] in _ipc/_wait.py): the reader must still see the
    writer die."""
    if not _kernel_names_pipe_writes():
        pytest.skip("this kernel's /proc/<pid>/task/<tid>/wchan does not name a pipe write")
    held: dict = {}
    if start == "spawn-quiet-sentinel":
        fifo = str(tmp_path / "fifo")
        os.mkfifo(fifo)
        fifo_end = os.open(fifo, os.O_RDWR)  # cat's EOF comes when this closes
        held = {"multiprocessing_context": multiprocessing.get_context("spawn"),
                "worker_init_fn": HoldSentinel(fifo)}
        try:
            _killed_mid_write(tmp_path, held)
        finally:
            os.close(fifo_end)
    else:
        _killed_mid_write(tmp_path, held)


def _killed_mid_write(tmp_path, held: dict) -> None:
    marker = str(tmp_path / "fired")
    # The worker is killed once its 32 MB batch 1 has filled the pipe and its
    # writer sleeps part-way (a kill before the write would be an ordinary
    # death, which the restart hides), while the main process is not reading.
    loader = DataLoader(BigSamples(n=8, at=4, marker=marker), batch_size=4,
                        num_workers=1, prefetch_factor=1, collate_fn=collate_list,
                        max_worker_restarts=1,  # the error says why it was not used
                        **held)
    it = iter(loader)
    del loader
    batch = next(it)
    del batch
    # Busy in the training step until the worker is dead.
    deadline = time.monotonic() + 40
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.01)
    fired_at, pid, worker_id = read_marker(marker)
    while not _dead(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    asked = time.time()
    try:
        next(it)
    except RuntimeError as exc:
        failure = Failure(exc, time.time(), 1)
    else:
        pytest.fail("no error")
    if held:  # the premise: the worker is gone and its sentinel still says nothing
        assert wait_ready([it._workers[0].sentinel], 0) == [], "nothing held the sentinel"
    del it
    msg = failure.message
    # torch's sentence first (its iterator's), then torchfeed's line naming the worker
    assert msg.startswith(f"DataLoader worker (pid(s) {pid}) exited unexpectedly\n"), msg
    assert f"\nWorker 0 (pid {pid}) " in msg, msg
    assert "was killed by signal SIGKILL" in msg, msg
    assert "died while writing a result" in msg, msg
    assert "so it was not restarted" in msg, msg
    # The main process was not reading when the worker died: count from its asking.
    assert fired_at < asked
    assert failure.raised_at - asked < SURFACE_WITHIN, failure.raised_at - asked
