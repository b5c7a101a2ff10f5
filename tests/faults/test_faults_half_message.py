"""A worker killed while its result is half written into the result pipe.

``multiprocessing.Queue.get`` would read the half message's length and then
block forever for the rest (torch is saved by its SIGCHLD handler; a loader
that waits on sentinels is not, unless it reads with care).  The loader must
raise the dead-worker error instead, within 5 s, and say the result was lost
mid-write.
"""
import time

import pytest
from faults_datasets import BigSamples, collate_list, read_marker
from faults_helpers import SURFACE_WITHIN, Failure

from torchfeed import DataLoader


@pytest.mark.timeout(60)
def test_worker_killed_mid_write_never_hangs(tmp_path):
    marker = str(tmp_path / "fired")
    # The kill comes 0.8 s after sample 4 is fetched: long after the worker has
    # built batch 1 and begun to write it even on a loaded machine (a kill
    # before the write would be an ordinary death, which the restart hides),
    # and well before the main process wakes at 2 s.
    loader = DataLoader(BigSamples(n=8, at=4, after=0.8, marker=marker), batch_size=4,
                        num_workers=1, prefetch_factor=1, collate_fn=collate_list,
                        max_worker_restarts=1)  # the error says why it was not used
    it = iter(loader)
    del loader
    batch = next(it)
    del batch
    # Busy in the training step: the worker's 32 MB batch 1 fills the pipe,
    # its feeder thread blocks part-way, and the timer kills the worker.
    time.sleep(2.0)
    asked = time.time()
    try:
        next(it)
    except RuntimeError as exc:
        failure = Failure(exc, time.time(), 1)
    else:
        pytest.fail("no error")
    del it
    fired_at, pid, worker_id = read_marker(marker)
    msg = failure.message
    # torch's sentence first (its iterator's), then torchfeed's line naming the worker
    assert msg.startswith(f"DataLoader worker (pid(s) {pid}) exited unexpectedly\n"), msg
    assert f"\nWorker 0 (pid {pid}) " in msg, msg
    assert "was killed by signal SIGKILL" in msg, msg
    assert "died while writing a result" in msg, msg
    assert "so it was not restarted" in msg, msg
    # The main process was asleep when the worker died: count from its waking.
    assert fired_at < asked
    assert failure.raised_at - asked < SURFACE_WITHIN, failure.raised_at - asked
