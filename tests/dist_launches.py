"""The torchrun jobs (real gloo process groups) that several test modules share.

Each launch costs an agent interpreter and one per rank, each importing torch, so
one world-2 job runs every scenario checked across two ranks:
tests/_dist_ranks.py's (it also saves the checkpoints the world-3 and world-1
launches resume from), tests/_share_ranks.py's (test_share.py) and
tests/_dist_datapipes.py's (test_torch_fidelity.py) and, where Accelerate is installed,
tests/_accelerate_ranks.py's (test_frameworks.py; with no GPU visible, as Accelerate's
CPU ranks need: with one, each rank reached for a CUDA device of its own).  The
world-2 and world-1 jobs then run the DDP example of docs/distributed.md, its first run and its
resume at another scale (test_readme.py), as torchrun runs a script: each rank
runs it as ``__main__`` (tests/_dist_ranks.py, ``--readme-ddp``).  ``runs(tmp_path_factory)``
launches each job once per pytest process and keeps its results; the tests that
use it carry ``LAUNCHES`` (one ``xdist_group``), so pytest-xdist runs them all on
one worker, which launches each job once.
"""
from __future__ import annotations

import importlib.util
import json
import sys
import uuid
from pathlib import Path

import pytest
from _dist_ranks import HANG_S
from doc_examples import doc_python_block
from loader_helpers import launch_in_own_session

HERE = Path(__file__).resolve().parent

LAUNCHES = pytest.mark.xdist_group("torchrun_launches")


class Launch:
    """One torchrun job: each rank's map-style results, and its IterableDataset results."""

    def __init__(self, nproc, out, *extra, env=None):
        out.mkdir()
        self.out = out
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", str(HERE / "_dist_ranks.py"), str(out), *extra]
        self.returncode, self.output = launch_in_own_session(cmd, HANG_S + 30, env)
        self.results = self.read("rank{}.json", nproc)
        self.iterable = self.read("rank{}-iterable.json", nproc)

    def read(self, pattern, nproc):
        """Each rank's json file ``pattern`` (under this launch's folder), or None if
        any rank did not write its own."""
        files = [self.out / pattern.format(r) for r in range(nproc)]
        if not all(f.exists() for f in files):
            return None
        return [json.loads(f.read_text()) for f in files]

    def failure(self, what):
        return f"torchrun exited {self.returncode} before writing {what}:\n{self.output[-6000:]}"


_launched: dict[str, Launch] = {}
_base: list[Path] = []


def launch(tmp_path_factory, name: str) -> Launch:
    """Launch ``name`` (once per pytest process): "n2" saves, "n3" resumes from n2 and
    checkpoints again, "n1" resumes from n2 and from n3's second checkpoint."""
    if name in _launched:
        return _launched[name]
    if not _base:
        _base.append(tmp_path_factory.mktemp("torchrun"))
    base = _base[0]
    readme = ["--readme-ddp", str(base / "readme")]
    if name == "n2":
        (base / "readme").mkdir()
        (base / "readme" / "train_ddp.py").write_text(doc_python_block("# train_ddp.py"))
        accelerate = ["--accelerate"] if importlib.util.find_spec("accelerate") else []
        run = Launch(2, base / name, "--save", "--share", f"ranks-{uuid.uuid4().hex[:12]}",
                     "--datapipes", *accelerate, *readme, env={"CUDA_VISIBLE_DEVICES": ""})
    elif name == "n3":
        launch(tmp_path_factory, "n2")
        run = Launch(3, base / name, "--resume-from", str(base / "n2"),
                     "--save-chain", "--torch-sampler-from", str(base / "n2"))
    elif name == "n1":
        launch(tmp_path_factory, "n3")
        run = Launch(1, base / name, "--resume-from", str(base / "n2"),
                     "--chain-from", str(base / "n3"), *readme)
    else:
        raise ValueError(f"no launch named {name!r}")
    _launched[name] = run
    return run


def readme_ddp_output(tmp_path_factory, nproc: int) -> str:
    """What rank 0 of the DDP example (docs/distributed.md) printed in the world-``nproc`` job
    (2: its first run; 1: its resume from the checkpoint that run left)."""
    run = launch(tmp_path_factory, {2: "n2", 1: "n1"}[nproc])
    out = _base[0] / "readme" / f"output-{nproc}.txt"
    assert out.exists(), run.failure(out.name)
    return out.read_text()


def ranks_of(tmp_path_factory, part: str, nproc: int = 2) -> list:
    """Each rank's results of ``part`` ("share", "datapipes", "accelerate") in the world-2
    launch."""
    run = launch(tmp_path_factory, "n2")
    results = run.read(f"{part}/rank{{}}.json", nproc)
    assert results is not None, run.failure(f"the {part} results")
    return results
