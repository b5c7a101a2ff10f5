"""The num_workers tuner end to end: from Python, from the command line, and its errors.

Real loaders and real worker processes on a tiny dataset; nothing here
asserts a speed, only that the tuner measures, recommends and explains.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from loader_helpers import env_with_path
from torch.utils.data import BatchSampler, IterableDataset, SequentialSampler

import torchfeed
from torchfeed._tuner import TuneRow, loader_arguments, recommend, tune
from torchfeed.tune.__main__ import main as tune_main

try:  # tests/ may or may not be a package
    from tests import tune_helper
except ImportError:
    import tune_helper

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
HELPER = tune_helper.__name__
QUICK = dict(seconds=0.2, max_workers=1, prefetch_factors=(2,))
# Tests that start workers capture with capfd, not capsys: capsys swaps
# sys.stderr for an object with no file descriptor, which a worker that calls
# faulthandler.enable() cannot use.


def _cli_env():
    return env_with_path(ROOT, TESTS)


def _run_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "torchfeed.tune", *args], cwd=cwd,
                          env=_cli_env(), capture_output=True, text=True, timeout=60)


def _tuple_collate(samples):
    return tuple(samples)


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(16))


@pytest.mark.timeout(60)
def test_tune_a_dataset_from_python(capfd):
    result = tune(tune_helper.TinyDataset(), batch_size=4, **QUICK)
    assert [(r.num_workers, r.prefetch_factor, r.worker_method) for r in result.rows] == [
        (0, None, None), (1, 2, "multiprocessing"), (1, 2, "thread")]  # both kinds of worker
    assert all(r.error is None and r.batches > 0 and r.batches_per_s > 0 for r in result.rows)
    assert (result.num_workers, result.prefetch_factor) in [(0, None), (1, 2)]
    assert result.reason
    assert result.loader_kwargs["num_workers"] == result.num_workers
    if result.num_workers:
        assert result.loader_kwargs["worker_method"] == result.worker_method
    out, err = capfd.readouterr()
    assert "batches/s" in out and "<- recommended" in out and "threads" in out
    assert f"recommended: num_workers={result.num_workers}" in out
    assert "why: " in out
    # stderr is not a terminal here: one plain line per setting, no carriage returns.
    assert "torchfeed.tune [1/4] warm-up" in err
    assert "torchfeed.tune [2/4] num_workers=0" in err
    assert "torchfeed.tune [3/4] num_workers=1 prefetch_factor=2\n" in err
    assert "torchfeed.tune [4/4] num_workers=1 prefetch_factor=2 worker_method=thread" in err
    assert "\r" not in err


@pytest.mark.timeout(60)
def test_tune_a_loader_keeps_its_arguments(capfd):
    loader = torchfeed.DataLoader(tune_helper.TinyDataset(), batch_size=8, shuffle=True,
                                  collate_fn=_tuple_collate, drop_last=True, timeout=30)
    cls, kwargs = loader_arguments(loader)
    assert cls is type(loader)
    assert kwargs["dataset"] is loader.dataset
    assert kwargs["sampler"] is loader.sampler  # the shuffle survives as its RandomSampler
    assert kwargs["collate_fn"] is _tuple_collate
    assert (kwargs["batch_size"], kwargs["drop_last"], kwargs["timeout"]) == (8, True, 30)
    assert "num_workers" not in kwargs and "prefetch_factor" not in kwargs
    assert loader_arguments(loader, batch_size=2)[1]["batch_size"] == 2
    # torchfeed's own options come along too.
    options = loader_arguments(torchfeed.DataLoader(tune_helper.TinyDataset(), transport="torch",
                                                    seed_per_batch=True))[1]
    assert options["transport"] == "torch" and options["seed_per_batch"] is True

    result = tune(loader, progress=False, verbose=False, **QUICK)
    assert result.batch_size == 8
    assert all(r.error is None and r.batches > 0 for r in result.rows)
    assert capfd.readouterr() == ("", "")  # progress=False, verbose=False: silent


def test_loader_arguments_other_batching_modes():
    dataset = tune_helper.TinyDataset()
    custom = torchfeed.DataLoader(dataset, batch_sampler=BatchSampler(
        SequentialSampler(dataset), batch_size=5, drop_last=False))
    kwargs = loader_arguments(custom)[1]
    assert kwargs["batch_sampler"] is custom.batch_sampler and "batch_size" not in kwargs
    with pytest.raises(ValueError, match="custom batch_sampler"):
        loader_arguments(custom, batch_size=3)
    # torch's own default collate is left out, so the rebuilt loader picks it again.
    assert "collate_fn" not in loader_arguments(torchfeed.DataLoader(dataset))[1]
    unbatched = loader_arguments(torchfeed.DataLoader(dataset, batch_size=None))[1]
    assert unbatched["batch_size"] is None and "collate_fn" not in unbatched
    streaming = loader_arguments(torchfeed.DataLoader(_Stream(), batch_size=4))[1]
    assert "sampler" not in streaming and streaming["batch_size"] == 4
    bare = loader_arguments(dataset)
    assert bare[0] is torchfeed.DataLoader and bare[1] == {"dataset": dataset, "batch_size": 1}


# One fresh interpreter (a torch import: ~2 CPU-s) for two checks: what a bare
# ``import torchfeed`` loads, then the command line's missing-module error, started
# as ``python -m torchfeed.tune`` starts it (runpy runs the package's __main__ with
# sys.argv set).  The xdist_group keeps both tests on the worker that ran it.
FRESH_INTERPRETER = (
    "import sys, torchfeed\n"
    "print(sorted(m for m in sys.modules if m.startswith(('torchfeed.bench', 'torchfeed._tuner'))))\n"
    "torchfeed.tune\n"
    "print('torchfeed._tuner' in sys.modules, flush=True)\n"
    "import runpy\n"
    "sys.argv = ['torchfeed.tune', 'no_such_module_xyz:factory', '--seconds', '0.1']\n"
    "runpy.run_module('torchfeed.tune', run_name='__main__', alter_sys=True)\n")
fresh_interpreter_group = pytest.mark.xdist_group("test_tune_fresh_interpreter")


@pytest.fixture(scope="module")
def fresh_interpreter(tmp_path_factory):
    """(the probe's two stdout lines, the rest of stdout, the finished process)."""
    proc = subprocess.run([sys.executable, "-c", FRESH_INTERPRETER],
                          cwd=tmp_path_factory.mktemp("fresh"), env=_cli_env(),
                          capture_output=True, text=True, timeout=60)
    lines = proc.stdout.split("\n")
    return lines[:2], "\n".join(lines[2:]), proc


@pytest.mark.long
@pytest.mark.timeout(90)
@fresh_interpreter_group
def test_import_torchfeed_loads_neither_the_tuner_nor_the_bench(fresh_interpreter):
    # Every spawned worker imports torchfeed: the bench (and what it pulls in)
    # must load only when torchfeed.tune is first used.
    probe, _, proc = fresh_interpreter
    assert probe == ["[]", "True"], proc.stdout + proc.stderr


@pytest.mark.timeout(60)
def test_torchfeed_tune_stays_callable_after_the_cli_is_imported():
    # Importing the torchfeed.tune package rebinds the name torchfeed.tune from
    # the function to the package; the package must then work as the function.
    import torchfeed.tune as tune_package

    assert torchfeed.tune is tune_package and callable(torchfeed.tune)
    result = torchfeed.tune(tune_helper.TinyDataset(), batch_size=4, seconds=0.1,
                            max_workers=0, progress=False, verbose=False)
    assert result.num_workers == 0 and "only setting tried" in result.reason


def _row(workers, factor, rate, method=None):
    return TuneRow(workers, factor, batches_per_s=rate, first_batch_s=0.1,
                   cpu_us_per_batch=100.0, peak_mem_bytes=1, batches=50,
                   worker_method=method if workers else None)


def test_recommend_chooses_threads_or_processes_and_says_why():
    def rows(threads, in_process=50.0):
        return ([_row(0, None, in_process)]
                + [_row(n, 2, rate, "multiprocessing") for n, rate in ((1, 100.0), (2, 190.0))]
                + [_row(n, 2, rate, "thread") for n, rate in threads])

    # __getitem__ holds the GIL: two threads barely beat one, processes scale
    pick, reason = recommend(rows([(1, 100.0), (2, 104.0)]), cores=2)
    assert (pick.num_workers, pick.worker_method) == (2, "multiprocessing")
    assert reason.startswith("worker_method='multiprocessing': threads load only 100.0 batches/s, "
                             "47% slower than processes (190.0)"), reason  # 1 thread: as fast as 2
    assert "`__getitem__` holds the GIL about 92% of its time (2 workers as threads loaded 1.04x" in reason
    # it releases the GIL: threads as fast, and cheaper
    pick, reason = recommend(rows([(1, 100.0), (2, 186.0)]), cores=2)
    assert (pick.num_workers, pick.worker_method) == (2, "thread")
    assert reason.startswith("worker_method='thread': 2 workers as threads load 186.0 batches/s, "
                             "only 2% slower than, within the 5% margin of processes"), reason
    # threads never beat loading in-process, processes do
    pick, reason = recommend(rows([(1, 60.0), (2, 70.0)], in_process=100.0), cores=2)
    assert pick.worker_method == "multiprocessing" and "threads never loaded faster" in reason


def test_recommend_takes_the_fewest_workers_near_the_best():
    rows = [_row(0, None, 100.0), _row(1, 2, 180.0), _row(1, 4, 182.0),
            _row(2, 2, 300.0), _row(2, 4, 290.0), _row(3, 2, 305.0), _row(4, 2, 200.0)]
    pick, reason = recommend(rows, cores=4)
    assert (pick.num_workers, pick.prefetch_factor) == (2, 2)
    assert "stops growing after 2 workers" in reason
    assert "3.0x the throughput of num_workers=0" in reason

    pick, reason = recommend([_row(0, None, 100.0), _row(1, 2, 60.0)], cores=1)
    assert pick.num_workers == 0 and "num_workers=0" in reason

    pick, reason = recommend([_row(0, None, 100.0), _row(1, 2, 190.0), _row(2, 2, 280.0)], cores=2)
    assert pick.num_workers == 2 and "still grows" in reason

    failed = TuneRow(1, 2, error="RuntimeError: boom")
    with pytest.raises(RuntimeError, match="boom"):
        recommend([failed], cores=1)


@pytest.mark.long
@pytest.mark.timeout(90)
def test_cli_end_to_end(tmp_path):
    out_json = tmp_path / "tune.json"
    proc = _run_cli("tune_helper:make_loader", "--seconds", "0.2", "--max-workers", "1",
                    "--prefetch-factors", "2", "--json", str(out_json), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "recommended: num_workers=" in proc.stdout and "why: " in proc.stdout
    assert "batch_size=4" in proc.stdout  # taken from the factory's DataLoader
    data = json.loads(out_json.read_text())
    assert {"rows", "num_workers", "prefetch_factor", "reason", "loader_kwargs"} <= set(data)
    assert [r["num_workers"] for r in data["rows"]] == [0, 1, 1]  # processes, then threads


@pytest.mark.long
@pytest.mark.timeout(90)
@fresh_interpreter_group
def test_cli_missing_module_is_one_clear_line(fresh_interpreter):
    probe, cli_stdout, proc = fresh_interpreter
    assert probe == ["[]", "True"], proc.stdout + proc.stderr  # the CLI's part ran after it
    assert proc.returncode == 2
    assert "cannot import module 'no_such_module_xyz'" in proc.stderr
    assert "PYTHONPATH" in proc.stderr
    assert "Traceback" not in proc.stderr and cli_stdout == ""


@pytest.mark.parametrize("target, message", [
    (f"{HELPER}:nosuch", f"module '{HELPER}' ("),
    (f"{HELPER}:nosuch", "has no attribute 'nosuch'. Callables it defines: "),
    (f"{HELPER}:NOT_CALLABLE", "is not callable (it is a value of type int)"),
    (f"{HELPER}:needs_args", "is called with no arguments"),
    (f"{HELPER}:not_a_dataset", "returned a builtins.list; it must return a torch Dataset"),
    ("no_colon_here", "expected MODULE:FACTORY"),
])
def test_cli_bad_targets(capsys, target, message):
    assert tune_main([target, "--seconds", "0.1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_missing_factory_lists_the_factories(capsys):
    assert tune_main([f"{HELPER}:make_datasett"]) == 2
    err = capsys.readouterr().err
    assert "make_dataset" in err and "make_loader" in err


@pytest.mark.timeout(60)
def test_plot_without_matplotlib_says_how_to_install_it(tmp_path, capfd, monkeypatch):
    # Whether or not matplotlib is installed here: None in sys.modules makes
    # `import matplotlib` raise ImportError, as on a machine without it.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    png = tmp_path / "tune.png"
    assert tune_main([f"{HELPER}:make_dataset", "--plot", str(png)]) == 2
    assert "pip install 'torchfeed[plot]'" in capfd.readouterr().err
    with pytest.raises(ImportError, match=r"pip install 'torchfeed\[plot\]'"):
        tune(tune_helper.TinyDataset(), plot=str(png), **QUICK)
    assert not png.exists()


# matplotlib and a drawn figure leave some 40,000 objects in this process, which
# every later gc.collect() walks (+30 ms a loader in the faults tests): so, last.
@pytest.mark.big_imports
@pytest.mark.timeout(60)
def test_plot_writes_a_png(tmp_path):
    # matplotlib is in the [test] extra, so this runs wherever the tests do; its
    # absence, the [plot] extra's case, is tested above with it hidden.
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (the [test] extra has it)")
    png = tmp_path / "tune.png"
    tune(tune_helper.TinyDataset(), batch_size=4, plot=str(png), progress=False, **QUICK)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
