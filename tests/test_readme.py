"""The README's examples run as written.

The "Multiple GPUs and nodes" example is cut out of the README, saved as
``train_ddp.py`` and launched with torchrun exactly as the README says: once
with two processes, then again with one, which must resume the last epoch from
the checkpoint the first run left.
"""
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def python_block(starting_with: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    matches = [b for b in blocks if b.startswith(starting_with)]
    assert len(matches) == 1, f"expected one README block starting with {starting_with!r}"
    return matches[0]


def torchrun(nproc: int, script: Path) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", script.name]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # Own session, so a hung run takes its ranks and their workers with it.
    proc = subprocess.Popen(cmd, cwd=script.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=100)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, output[-4000:]
    return output


@pytest.mark.long
@pytest.mark.timeout(240)
def test_train_ddp_example_runs_and_resumes_at_another_scale(tmp_path):
    script = tmp_path / "train_ddp.py"
    script.write_text(python_block("# train_ddp.py"))
    first = torchrun(2, script)
    assert [line for line in first.splitlines() if line.startswith("epoch ")][-1].startswith(
        "epoch 2: loss"), first
    assert "resuming" not in first
    assert (tmp_path / "checkpoint.pt").exists()

    second = torchrun(1, script)
    assert "resuming epoch 2 on 1 processes" in second, second
    assert re.search(r"^epoch 2: loss \d", second, re.M), second
    assert "epoch 0:" not in second and "epoch 1:" not in second


@pytest.mark.long
@pytest.mark.timeout(120)
def test_stall_demo_prints_a_data_bound_summary(tmp_path):
    """The "Is my training data-bound?" example, run as written.

    Loading a batch takes 2 workers x 32 x 2 ms against a 10 ms step, so the
    loop waits on data whatever the machine's speed: the verdict is fixed, the
    figures are not asserted beyond their shape.
    """
    script = tmp_path / "stall_demo.py"
    script.write_text(python_block("# stall_demo.py"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(README.parent)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    proc = subprocess.run([sys.executable, script.name], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.startswith("torchfeed loader stats: epoch 0, 2 workers, transport shm, finished")
    assert re.search(r"^  batches yielded +40 in [\d.]+ s", out, re.M), out
    stall = re.search(r"^  data stall +([\d.]+)% \(blocked in __next__", out, re.M)
    assert stall and float(stall.group(1)) > 30, out
    workers = re.findall(r"^  ([01]) +\d+ +(\d+) +\d+% +[\d.]+$", out, re.M)
    assert [w for w, _ in workers] == ["0", "1"] and sum(int(n) for _, n in workers) == 40, out
    assert "verdict             data-bound" in out, out


@pytest.mark.long
@pytest.mark.timeout(120)
def test_stateful_iterable_example_resumes(tmp_path):
    """The Stateful IterableDataset of "What is saved", run as written."""
    script = tmp_path / "stateful_iterable.py"
    script.write_text(python_block("# stateful_iterable.py"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(README.parent)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    proc = subprocess.run([sys.executable, script.name], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("resumed [["), proc.stdout


@pytest.mark.long
@pytest.mark.timeout(240)  # hang guards: ~5 s alone, several-fold in a parallel run
def test_copy_on_read_example_shows_the_fix(tmp_path):
    """300,000 records: a worker copies over 20 MiB of them (70 bytes a record;
    35 MiB here) without sharing, and less than 5 MiB in all with it."""
    script = tmp_path / "copy_on_read.py"
    script.write_text(python_block("# copy_on_read.py"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(README.parent)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    proc = subprocess.run([sys.executable, script.name], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stderr
    before, after = (int(m) for m in re.findall(
        r"^share_dataset=(?:False|True): a worker's private memory grew (\d+) MiB$",
        proc.stdout, re.M))
    assert before > 20 and after < 5, proc.stdout
