"""The documentation's examples run as written: README.md's and docs/'s.

Every ```python block whose first line names a file (``# quickstart.py``) is
an example, collected from README.md and docs/*.md alike (tests/doc_examples.py);
where one stands in both, the texts must be the same, and it runs once.
tests/test_docs.py checks that every named example is run here (or, for
``feed_gpu.py``, by tests/test_gpu_feed.py on a CUDA machine).

The examples run with ``python <file>`` are each saved under their own name and
run as ``__main__``, one after another in one fresh interpreter (``examples``).

The example of "Multiple GPUs and nodes" (docs/distributed.md) is saved as
``train_ddp.py`` and run by torchrun with two processes, then again with one,
which must resume the last epoch from the checkpoint the first run left.  Both
runs ride on the torchrun jobs of tests/dist_launches.py (world 2, then world 1):
each rank runs the script as ``__main__`` from its folder, with torchrun's
environment, after the other scenarios of that job, so no launch of its own
pays for an agent and ranks that import torch.
"""
import json
import re
import subprocess
import sys

import pytest
from dist_launches import LAUNCHES, readme_ddp_output
from doc_examples import doc_python_block
from loader_helpers import ROOT, env_with_path


@pytest.mark.long
@LAUNCHES
@pytest.mark.timeout(420)  # the three torchrun jobs, should this test launch them
def test_train_ddp_example_runs_and_resumes_at_another_scale(tmp_path_factory):
    first = readme_ddp_output(tmp_path_factory, 2)
    assert [line for line in first.splitlines() if line.startswith("epoch ")][-1].startswith(
        "epoch 2: loss"), first
    assert "resuming" not in first

    second = readme_ddp_output(tmp_path_factory, 1)
    assert "resuming epoch 2 on 1 processes" in second, second
    assert re.search(r"^epoch 2: loss \d", second, re.M), second
    assert "epoch 0:" not in second and "epoch 1:" not in second


# The examples run with ``python <file>`` run one after another in one fresh
# interpreter (one torch import for all of them), each from its own file and as
# ``__main__``, as ``python <file>`` runs it (a spawned worker imports it as
# ``__mp_main__`` from that file too); each one's output and traceback are kept apart.
EXAMPLES = ("quickstart.py", "stateful_iterable.py", "stall_demo.py", "copy_on_read.py",
            "share_records.py")
RUN_EXAMPLES = """
import contextlib, io, json, runpy, sys, traceback
results = {}
for path in sys.argv[1:]:
    out = io.StringIO()
    error = None
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
    except BaseException:
        error = traceback.format_exc()
    results[path] = {"stdout": out.getvalue(), "error": error}
print(json.dumps(results))
"""
examples_together = pytest.mark.xdist_group("test_readme_examples")


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("readme")
    for name in EXAMPLES:
        (tmp / name).write_text(doc_python_block(f"# {name}"))
    proc = subprocess.run([sys.executable, "-c", RUN_EXAMPLES, *EXAMPLES], cwd=tmp,
                          env=env_with_path(ROOT),
                          capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])

    def output(name: str) -> str:
        assert results[name]["error"] is None, results[name]["error"] + proc.stderr[-4000:]
        return results[name]["stdout"]

    return output


@pytest.mark.long
@examples_together
@pytest.mark.timeout(240)  # hang guards: the first of these runs them all
def test_stall_demo_prints_a_data_bound_summary(examples):
    """The "Is my training data-bound?" example, run as written.

    Loading a batch takes 2 workers x 32 x 2 ms against a 10 ms step, so the
    loop waits on data whatever the machine's speed: the verdict is fixed, the
    figures are not asserted beyond their shape.
    """
    out = examples("stall_demo.py")
    assert out.startswith("torchfeed loader stats: epoch 0, 2 workers, transport shm, finished")
    assert re.search(r"^  batches yielded +40 in [\d.]+ s", out, re.M), out
    stall = re.search(r"^  data stall +([\d.]+)% \(blocked in __next__", out, re.M)
    assert stall and float(stall.group(1)) > 30, out
    workers = re.findall(r"^  ([01]) +\d+ +(\d+) +\d+% +[\d.]+$", out, re.M)
    assert [w for w, _ in workers] == ["0", "1"] and sum(int(n) for _, n in workers) == 40, out
    assert "verdict             data-bound" in out, out


@pytest.mark.long
@examples_together
@pytest.mark.timeout(240)
def test_quickstart_example_resumes_with_other_workers(examples):
    """docs/getting-started.md's first loop: three batches at num_workers=2, the
    state through json, the rest at num_workers=1, as the uninterrupted run."""
    out = examples("quickstart.py")
    assert out.startswith("resumed after 3 batches: the same 5 batches\n"), out
    assert "torchfeed loader stats: epoch 0, 2 workers, transport shm" in out, out


@pytest.mark.long
@examples_together
@pytest.mark.timeout(240)
def test_stateful_iterable_example_resumes(examples):
    """The Stateful IterableDataset of "What is saved", run as written."""
    out = examples("stateful_iterable.py")
    assert out.startswith("resumed [["), out


@pytest.mark.long
@examples_together
@pytest.mark.timeout(240)
def test_copy_on_read_example_shows_the_fix(examples):
    """300,000 records: a worker copies over 20 MiB of them (70 bytes a record;
    35 MiB here) without sharing, and less than 5 MiB in all with it."""
    out = examples("copy_on_read.py")
    before, after = (int(m) for m in re.findall(
        r"^share_dataset=(?:False|True): a worker's private memory grew (\d+) MiB$", out, re.M))
    assert before > 20 and after < 5, out


@pytest.mark.long
@examples_together
@pytest.mark.timeout(240)
def test_share_records_example_prints_what_the_readme_shows(examples):
    """The example of "One copy of the data per machine: torchfeed.share", as written: two
    spawned workers read 200,000 shared records, each receiving a handle."""
    lines = examples("share_records.py").splitlines()
    assert len(lines) == 3, lines
    assert lines[0] == "99900000.0"
    assert re.fullmatch(r"18 MiB shared; a spawned worker receives \d{3} bytes of it", lines[1])
    assert lines[2].startswith("'SharedSequence' object does not support append: this list is "
                               "shared read-only between processes")
