"""End to end: a training job checkpointing model + loader state is SIGKILLed; the
restarted job sees exactly the samples (and augmentations) the uninterrupted job saw."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "_resume_train.py")


def _job(tmp, name, *extra):
    env = dict(os.environ)
    root = os.path.dirname(HERE)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    log = os.path.join(tmp, f"{name}.log")
    cmd = [sys.executable, SCRIPT, "--ckpt", os.path.join(tmp, f"{name}.pt"), "--log", log,
           *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT), log


def _reference_here(tmp, name, monkeypatch):
    """The uninterrupted job, run in this process (a fresh interpreter would only import
    torch again): the same script's main(), with torch's seed and thread count put back."""
    sys.path.insert(0, HERE)
    try:
        import _resume_train
    finally:
        sys.path.remove(HERE)
    log = os.path.join(tmp, f"{name}.log")
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    with monkeypatch.context() as m:
        m.setattr(sys, "argv", [SCRIPT, "--ckpt", os.path.join(tmp, f"{name}.pt"), "--log", log])
        try:
            _resume_train.main()
        finally:
            torch.set_num_threads(threads)
            torch.set_rng_state(rng)
    return log


def _steps(log):
    """step -> (epoch, ids), and the DONE line."""
    steps, done = {}, None
    with open(log) as f:
        for line in f:
            head, _, rest = line.strip().partition(" ")
            if head == "DONE":
                done = rest
            elif head.isdigit():
                epoch, _, ids = rest.partition(" ")
                steps[int(head)] = (int(epoch), ids)
    return steps, done


@pytest.mark.long
@pytest.mark.timeout(240)  # hang guards: ~10 s alone, several-fold in a parallel run
def test_sigkilled_training_resumes_with_the_same_samples(tmp_path, monkeypatch):
    tmp = str(tmp_path)
    victim, log = _job(tmp, "victim", "--sleep", "0.05")
    try:
        # Kill it once it is past a few checkpoints (every 5 steps), mid-run.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if os.path.exists(log) and len(_steps(log)[0]) >= 13:
                break
            assert victim.poll() is None, victim.stdout.read().decode()
            time.sleep(0.01)
        else:
            pytest.fail("the job never got to step 13")
        workers = [c.pid for c in psutil.Process(victim.pid).children(recursive=True)]
        assert workers, "expected DataLoader worker processes"
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        killed_at = max(_steps(log)[0])
        assert killed_at < 30, "the job finished before it was killed"
        # Its workers notice the main process is gone and leave by themselves.
        gone_by = time.monotonic() + 5
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                  for p in workers) and time.monotonic() < gone_by:
            time.sleep(0.05)
        assert not [p for p in workers if psutil.pid_exists(p)
                    and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]

        resumed, _ = _job(tmp, "victim", "--resume")
        try:
            ref_log = _reference_here(tmp, "reference", monkeypatch)  # while it resumes
            out, _ = resumed.communicate(timeout=100)
        finally:
            if resumed.poll() is None:
                resumed.kill()
        assert resumed.returncode == 0, out.decode()
    finally:
        if victim.poll() is None:
            victim.kill()

    expected, expected_done = _steps(ref_log)
    with open(log) as f:
        resume_line = [line for line in f if line.startswith("RESUME")]
    assert len(resume_line) == 1
    ckpt_step = int(resume_line[0].split()[1])
    assert ckpt_step % 5 == 0 and 0 < ckpt_step <= killed_at
    # The resumed job's lines come after the RESUME line.
    after = {}
    with open(log) as f:
        lines = f.read().splitlines()
    for line in lines[lines.index(resume_line[0].strip()) + 1:]:
        head, _, rest = line.partition(" ")
        if head.isdigit():
            epoch, _, ids = rest.partition(" ")
            after[int(head)] = (int(epoch), ids)
    assert sorted(after) == list(range(ckpt_step + 1, 31))
    assert after == {s: expected[s] for s in after}
    # Same samples and same augmentations, so the same model at the end.
    assert _steps(log)[1] == expected_done
