"""Items 1-3: a worker that dies without a word (SIGKILL, SIGSEGV, os._exit).

The error starts with torch's sentences (its iterator's "DataLoader worker
(pid(s) P) exited unexpectedly", then its signal handler's), then must name the
worker id and pid, the signal or exit code, the
batches and sample indices it had in flight, and what usually causes that
death; it must surface within 5 s of the death, and leave nothing behind.
"""
import multiprocessing
import re
import time

import pytest
from faults_datasets import FaultyMap, make_dataset, read_marker, share_through_files
from faults_helpers import SURFACE_WITHIN, epochs_for, iterate_until_failure
from loader_helpers import open_fds

from torchfeed import DataLoader
from torchfeed._ipc import wait_ready

CASES = {
    # fault: (what the message says about the death, words of the hint)
    "sigkill": ("was killed by signal SIGKILL (9)", ["out-of-memory", "dmesg", "batch_size"]),
    "segv": ("was killed by signal SIGSEGV (11)", ["native code", "num_workers=0"]),
    "exit3": ("exited with code 3", ["os._exit", "num_workers=0"]),
}
TORCH_SENTENCE = {  # torch's SIGCHLD handler's, the second line
    "sigkill": "is killed by signal: Killed. ",
    "segv": "is killed by signal: Segmentation fault. ",
    "exit3": ("exited unexpectedly with exit code 3. Details are lost due to multiprocessing. "
              "Rerunning with num_workers=0 may give better error trace."),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fault", list(CASES))
def test_dead_worker_is_explained(fault, loader_config, tmp_path, no_pin_warning):
    marker = tmp_path / "fired"
    visit = epochs_for(loader_config)
    dataset = make_dataset(loader_config.kind, fault=fault, at=21, marker=str(marker),
                           visit=visit)
    loader = DataLoader(dataset, batch_size=4, num_workers=2, **loader_config.kwargs())
    failure = iterate_until_failure(loader, epochs=visit)
    fired_at, pid, worker_id = read_marker(marker)

    assert failure.type is RuntimeError, failure
    death, hint_words = CASES[fault]
    msg = failure.message
    # torch's sentence first (its iterator's), then torchfeed's line naming the worker
    assert msg.startswith(f"DataLoader worker (pid(s) {pid}) exited unexpectedly\n"), msg
    assert f"\nWorker {worker_id} (pid {pid}) " in msg, msg
    assert msg.splitlines()[1] == f"DataLoader worker (pid {pid}) {TORCH_SENTENCE[fault]}", msg
    assert death in msg, msg
    assert "Hint:" in msg and all(w in msg for w in hint_words), msg
    # Sample 21 is in batch 5 either way: map-style batches are [20..23] and go
    # round-robin; worker 1 of an iterable yields 1, 3, ..., 21 in its third batch,
    # which is the loader's batch 5.
    if loader_config.kind == "map":
        assert "batch 5 (sample indices [20, 21, 22, 23])" in msg, msg
    else:
        assert re.search(r"batch 5 \(an iterable dataset's batch", msg), msg
    assert failure.raised_at - fired_at < SURFACE_WITHIN, failure.raised_at - fired_at
    del loader


@pytest.mark.timeout(30)
def test_dead_worker_whose_sentinel_stays_quiet_is_seen(tmp_path, resource_tracker, leaks):
    """Issue 51: a worker started by ``spawn`` is handed its sentinel's write end
    as an inheritable descriptor, so the ``torch_shm_manager`` it starts under the
    ``file_system`` sharing strategy (macOS's default) inherits it and, orphaned,
    keeps the sentinel quiet after the worker is gone.  torch polls
    ``is_alive()`` and raises its sentence; waiting on the sentinel alone, the
    loop waited forever (NOTE [ A sentinel held open ], _ipc/_wait.py)."""
    sockets_before = _sockets()
    marker = tmp_path / "fired"
    loader = DataLoader(FaultyMap(fault="exit3", at=9, marker=str(marker)), batch_size=4,
                        num_workers=1, transport="torch", worker_init_fn=share_through_files,
                        multiprocessing_context=multiprocessing.get_context("spawn"))
    it = iter(loader)
    worker = it._workers[0]
    received = []  # kept: the main process stays a client of the worker's manager
    with pytest.raises(RuntimeError) as raised:
        for batch in it:
            received.append(batch)
    raised_at = time.time()
    fired_at, pid, _ = read_marker(marker)
    # The premise: the worker is gone and its sentinel still says nothing.
    assert not worker.is_alive() and worker.exitcode == 3
    assert wait_ready([worker.sentinel], 0) == [], "the sentinel woke up: nothing held it open"
    message = str(raised.value)
    assert message.startswith(f"DataLoader worker (pid(s) {pid}) exited unexpectedly\n"), message
    assert "Worker 0 (pid %d) exited with code 3." % pid in message, message
    assert len(received) == 2
    assert raised_at - fired_at < SURFACE_WITHIN, raised_at - fired_at
    del it, worker, received, raised
    # torch's libshm keeps its client socket to each torch_shm_manager for the
    # life of the process (under torch's own loader too): not a leak of ours.
    assert len(_sockets() - sockets_before) == 1
    leaks.fds += 1


def _sockets() -> set:
    return {fd for fd, target in open_fds().items() if target.startswith("socket:")}
