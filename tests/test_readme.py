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
