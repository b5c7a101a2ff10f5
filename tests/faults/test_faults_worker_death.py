"""Items 1-3: a worker that dies without a word (SIGKILL, SIGSEGV, os._exit).

The error starts with torch's sentences (its iterator's "DataLoader worker
(pid(s) P) exited unexpectedly", then its signal handler's), then must name the
worker id and pid, the signal or exit code, the
batches and sample indices it had in flight, and what usually causes that
death; it must surface within 5 s of the death, and leave nothing behind.
"""
import re

import pytest
from faults_datasets import make_dataset, read_marker
from faults_helpers import SURFACE_WITHIN, epochs_for, iterate_until_failure

from torchfeed import DataLoader

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
