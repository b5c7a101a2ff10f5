"""The benchmark harness end to end, its measurements' bookkeeping, and the progress display.

Real loaders, real worker processes, tiny runs.  Speed is never asserted: a
figure must exist and be sane, not be fast.
"""
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.utils.data
from loader_helpers import env_with_path

from torchfeed._progress import Progress
from torchfeed.bench.__main__ import main as bench_main
from torchfeed.bench.compare import BenchConfig, LoaderFigures, WorkloadResult, loader_class, run_comparison
from torchfeed.bench.measure import Timing, time_loader
from torchfeed.bench.report import format_table
from torchfeed.bench.workloads import WORKLOADS, SmallDataset

ROOT = Path(__file__).resolve().parent.parent
FIGURES = {"batches_per_s", "first_batch_s", "cpu_us_per_batch", "peak_mem_bytes",
           "peak_rss_bytes", "peak_shm_bytes", "runs", "error"}


@pytest.mark.long
@pytest.mark.timeout(180)
def test_bench_quick_prints_the_table_and_writes_json(tmp_path):
    out_json = tmp_path / "bench.json"
    env = env_with_path(ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "torchfeed.bench", "--quick", "--workloads", "small",
         "--num-workers", "1", "--batches", "3", "--peers", "none", "--json", str(out_json)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "torch" in out and "torchfeed" in out and "tf/torch" in out
    assert "batches/s (higher=better)" in out and "first batch, ms (lower=better)" in out
    assert "main CPU us/batch (lower=better)" in out
    assert "machine: " in out and "torch " + torch.__version__ in out
    assert ("command: python -m torchfeed.bench --quick --workloads small --num-workers 1 "
            "--batches 3 --peers none --json") in out
    assert "vs num_workers=0, batches/s" in out and "torch@0" in out
    row = next(line for line in out.splitlines() if line.startswith("small "))
    # a ratio in each of the four torch-vs-torchfeed groups, two against num_workers=0
    assert row.count("x") >= 6
    # Not a terminal: plain progress lines on stderr, one per run.
    assert "torchfeed.bench [1/6] small torch warm-up" in proc.stderr
    assert "torchfeed.bench [3/6] small torch@0 warm-up" in proc.stderr
    assert "torchfeed.bench [4/6] small torch run 1/1" in proc.stderr
    assert "torchfeed.bench [5/6] small torchfeed run 1/1" in proc.stderr
    assert "torchfeed.bench [6/6] small torch@0 run 1/1" in proc.stderr

    data = json.loads(out_json.read_text())
    assert data["command"].startswith("python -m torchfeed.bench --quick")
    assert {"cores_usable", "cpu_model", "torch"} <= set(data["machine"])
    assert data["config"]["num_workers"] == 1 and data["config"]["repeats"] == 1
    assert data["config"]["first_batch_runs"] == 0  # --quick
    (result,) = data["results"]
    assert result["workload"] == "small" and result["batches"] == 3
    assert data["config"]["baseline"] == "torch@0"
    for loader in ("torch", "torchfeed", "torch@0"):
        figures = result[loader]
        assert FIGURES <= set(figures) and figures["error"] is None
        assert figures["batches_per_s"] > 0 and figures["first_batch_s"] > 0
        assert figures["peak_rss_bytes"] > 0 and len(figures["runs"]) == 1
        assert figures["runs"][0]["batches"] == 3
    assert set(result["ratio"]) >= {"batches_per_s", "first_batch_s", "cpu_us_per_batch",
                                    "peak_mem_bytes"}
    assert result["ratio"]["batches_per_s"] > 0
    vs_0 = result["batches_per_s_vs_num_workers_0"]
    assert vs_0["torchfeed"] == pytest.approx(
        result["torchfeed"]["batches_per_s"] / result["torch@0"]["batches_per_s"])
    assert vs_0["torch"] == pytest.approx(
        result["torch"]["batches_per_s"] / result["torch@0"]["batches_per_s"])


def test_transport_reaches_torchfeed_only_when_given():
    workload = WORKLOADS["small"]
    assert "transport" not in BenchConfig(["small"]).loader_kwargs("torchfeed", workload)
    config = BenchConfig(["small"], transport="torch")
    assert config.loader_kwargs("torchfeed", workload)["transport"] == "torch"
    assert "transport" not in config.loader_kwargs("torch", workload)


@pytest.mark.long
@pytest.mark.timeout(120)  # hang guards: a parallel run may starve a test several-fold
@pytest.mark.parametrize("transport", ["torch", "shm"])
def test_bench_runs_each_transport(transport):
    config = BenchConfig(["small"], num_workers=1, batches=2, repeats=1, transport=transport,
                         progress=False, first_batch_runs=2)
    (result,) = run_comparison(config)
    for name in ("torch", "torchfeed"):
        assert result.figures[name].error is None
        assert result.figures[name].runs[0].batches == 2
        assert len(result.figures[name].first_batches) == 2
        assert all(s > 0 for s in result.figures[name].first_batches)
    assert result.figures["torch@0"].first_batches == []  # its first batch is not compared


@pytest.mark.long
@pytest.mark.timeout(60)
def test_a_loader_that_fails_is_reported_and_the_others_still_run():
    config = BenchConfig(["small"], num_workers=1, batches=2, repeats=2, transport="bogus",
                         progress=False, first_batch_runs=2, baseline=False)
    (result,) = run_comparison(config)
    ours = result.figures["torchfeed"]
    assert "bogus" in ours.error
    assert ours.runs == [] and ours.first_batches == []
    theirs = result.figures["torch"]
    assert theirs.error is None and len(theirs.runs) == 2 and len(theirs.first_batches) == 2


def test_baseline_is_torch_without_workers_and_can_be_left_out():
    workload = WORKLOADS["small"]
    config = BenchConfig(["small"], num_workers=2)
    assert config.loaders() == ("torch", "torchfeed", "torch@0")
    assert config.loader_kwargs("torch@0", workload)["num_workers"] == 0
    assert config.loader_kwargs("torch", workload)["num_workers"] == 2
    assert loader_class("torch@0") is torch.utils.data.DataLoader
    # nothing to compare against when the loaders themselves run without workers
    assert BenchConfig(["small"], num_workers=0).loaders() == ("torch", "torchfeed")
    assert BenchConfig(["small"], baseline=False).loaders() == ("torch", "torchfeed")


def test_unknown_workload_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["--workloads", "small,nope"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown workload(s) nope" in err and "cpu_heavy" in err


def _timing(rate, first, cpu, mem):
    return Timing(batches=10, seconds=10 / rate, first_batch_s=first, batches_per_s=rate,
                  cpu_us_per_batch=cpu, peak_rss_bytes=mem, peak_shm_bytes=0)


def test_table_medians_ratios_and_errors():
    ours = LoaderFigures([_timing(r, 0.1, 500.0, 100 << 20) for r in (190.0, 200.0, 400.0)])
    theirs = LoaderFigures([_timing(r, 0.2, 2000.0, 100 << 20) for r in (100.0, 50.0, 120.0)])
    ok = WorkloadResult(WORKLOADS["small"], 10, {"torch": theirs, "torchfeed": ours})
    assert ok.ratio("batches_per_s") == pytest.approx(2.0)  # medians 200 / 100
    assert ok.ratio("cpu_us_per_batch") == pytest.approx(0.25)
    # First-batch-only runs count towards the first batch, and nothing else.
    steadier = LoaderFigures(list(ours.runs), first_batches=[0.3, 0.3, 0.3, 0.3])
    assert steadier.median("first_batch_s") == pytest.approx(0.3)
    assert steadier.median("batches_per_s") == pytest.approx(200.0)
    broken = WorkloadResult(WORKLOADS["image"], 10, {
        "torch": theirs, "torchfeed": LoaderFigures(error="TypeError: boom")})
    table = format_table([ok, broken])
    small_row = next(line for line in table.splitlines() if line.startswith("small"))
    assert "2.00x" in small_row and "0.50x" in small_row and "0.25x" in small_row
    image_row = next(line for line in table.splitlines() if line.startswith("image"))
    assert "error" in image_row and "x" not in image_row.replace("error", "")
    assert "num_workers=0" not in table  # no baseline measured, no such columns

    at_0 = LoaderFigures([_timing(r, 0.05, 3000.0, 50 << 20) for r in (80.0, 50.0, 400.0)])
    with_base = WorkloadResult(WORKLOADS["small"], 10,
                               {"torch": theirs, "torchfeed": ours, "torch@0": at_0})
    assert with_base.ratio("batches_per_s", "torchfeed", "torch@0") == pytest.approx(2.5)
    table = format_table([with_base])
    assert "vs num_workers=0, batches/s" in table.splitlines()[0]
    row = next(line for line in table.splitlines() if line.startswith("small"))
    # torch@0's median 80, torch 100/80, torchfeed 200/80, after the four usual groups
    assert row.split("|")[-1].split() == ["80.0", "1.25x", "2.50x"]


@pytest.mark.timeout(60)
def test_time_loader_counts_batches_and_cleans_up():
    dataset = SmallDataset(64 * 8)
    timing = time_loader(lambda: torch.utils.data.DataLoader(dataset, batch_size=64,
                                                             num_workers=1), batches=4)
    assert timing.batches == 4 and timing.leftover_processes == 0
    assert timing.first_batch_s > 0 and timing.batches_per_s > 0
    assert timing.peak_rss_bytes > 0 and timing.cpu_us_per_batch >= 0
    with pytest.raises(RuntimeError, match="ran out after 8 batches"):
        time_loader(lambda: torch.utils.data.DataLoader(dataset, batch_size=64), batches=20)
    # An epoch that ends early starts again when the caller asks for it.
    short = time_loader(lambda: torch.utils.data.DataLoader(SmallDataset(8), batch_size=4),
                        seconds=0.05, restart_epochs=True)
    assert short.epochs_started > 1


class _FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_and_plain_fallback():
    plain = io.StringIO()
    with Progress(2, "job", stream=plain) as bar:
        bar.step("first")
        bar.step("second")
    lines = plain.getvalue().splitlines()
    assert lines[:2] == ["job [1/2] first", "job [2/2] second"]
    assert lines[2].startswith("job done: 2/2 steps")

    tty = _FakeTerminal()
    with Progress(4, "job", stream=tty) as bar:
        bar.step("a")
        bar.step("b")
    text = tty.getvalue()
    assert "\r" in text and "[######------------------] 1/4" in text and text.endswith("\n")

    silent = io.StringIO()
    with Progress(1, "job", stream=silent, enabled=False) as bar:
        bar.step("x")
    assert silent.getvalue() == ""
