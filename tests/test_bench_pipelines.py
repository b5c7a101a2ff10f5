"""The bench's real pipelines (JPEG folder, padded text, Hugging Face datasets) and its
peer columns (torchdata's StatefulDataLoader, SPDL).

Real files, real worker processes, real peer loaders, tiny sizes.  The
central check: every loader the bench compares delivers the same batches on
every workload, so the columns measure the same work.  Speed is never asserted.
"""
import dataclasses
import importlib.util
import math
import random
import sys

import pytest
import torch

from torchfeed.bench.__main__ import main as bench_main
from torchfeed.bench.compare import BenchConfig, LoaderFigures, WorkloadResult, run_comparison
from torchfeed.bench.loaders import PEERS, build_loader
from torchfeed.bench.measure import Timing
from torchfeed.bench.pipelines import (
    IGNORE_INDEX,
    PAD_ID,
    JpegFolderDataset,
    TokenDataset,
    crop_box,
    hf_dataset,
    jpeg_folder,
    pad_collate,
)
from torchfeed.bench.report import format_peer_table, format_report
from torchfeed.bench.workloads import WORKLOADS

# Checked, not imported: Hugging Face datasets adds ~100 MiB to the process, whose page
# tables every later fork in it would copy; only the tests that use it import it.
if importlib.util.find_spec("datasets") is None:
    pytest.skip("Hugging Face datasets is not installed (the [test] extra has it)",
                allow_module_level=True)

COMPARED = ("torch", "torchfeed", *PEERS)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture(scope="module")
def tiny_datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-cache")
    return {
        "jpeg": JpegFolderDataset(24, root=root, files=12, classes=3),
        "text": TokenDataset(24),
        "hf": hf_dataset(24, seq_len=16, root=root),
    }


@pytest.mark.big_imports
@pytest.mark.xdist_group("hf_datasets")  # one worker builds tiny_datasets and imports datasets
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["jpeg", "text", "hf"])
def test_every_loader_gives_the_same_batches(name, tiny_datasets):
    workload = dataclasses.replace(WORKLOADS[name], batch_size=4)
    dataset = tiny_datasets[name]
    config = BenchConfig([name], num_workers=2, peers=tuple(PEERS))
    assert config.compared() == COMPARED  # every peer is installed by the test extra
    expected = list(torch.utils.data.DataLoader(
        dataset, **config.loader_kwargs("torch@0", workload)))[:5]
    assert len(expected) == 5
    for loader in COMPARED:
        kwargs = config.loader_kwargs(loader, workload)
        assert kwargs["num_workers"] == 2
        got = []
        for batch in build_loader(loader, dataset, kwargs):
            got.append(batch)
            if len(got) == 5:
                break
        assert _same(got, expected), f"{loader} on {name}"


def test_crop_box_follows_random_resized_crop():
    rng = random.Random(0)
    for width, height in [(500, 375), (375, 500), (224, 224)]:
        for _ in range(300):
            left, top, w, h = crop_box(rng, width, height)
            assert 0 <= left and left + w <= width and 0 <= top and top + h <= height
            # rounding to whole pixels moves the area and the aspect a little
            assert 0.08 * 0.95 <= w * h / (width * height) <= 1.0
            assert 3 / 4 * 0.95 <= w / h <= 4 / 3 * 1.05
    # Ten misses on a strip no crop fits: the widest centred crop at the bound ratio.
    assert crop_box(random.Random(0), 1000, 10, scale=(2.0, 3.0)) == (493, 0, 13, 10)
    assert crop_box(random.Random(0), 300, 200, scale=(2.0, 3.0)) == (16, 0, 267, 200)
    assert crop_box(random.Random(0), 200, 200, scale=(2.0, 3.0)) == (0, 0, 200, 200)


def test_jpeg_folder_is_written_once_and_read_as_an_image_folder(tmp_path):
    folder = jpeg_folder(files=6, classes=2, root=tmp_path)
    files = sorted(folder.rglob("*.jpg"))
    assert [f.parent.name for f in files] == ["class_000"] * 3 + ["class_001"] * 3
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # no temporary folder left
    stamp = [f.stat().st_mtime_ns for f in files]
    dataset = JpegFolderDataset(12, root=tmp_path, files=6, classes=2)
    assert [f.stat().st_mtime_ns for f in files] == stamp  # reused, not rewritten
    assert [label for _, label in dataset.samples] == [0, 0, 0, 1, 1, 1]

    image, label = dataset[4]
    assert image.shape == (3, 224, 224) and image.dtype == torch.uint8 and label == 1
    assert torch.equal(dataset[4][0], image)  # the index decides the crop and the flip
    # Index 10 reads the same file as 4 (wrap-around) with another crop.
    assert dataset[10][1] == 1 and not torch.equal(dataset[10][0], image)
    with pytest.raises(IndexError):
        dataset[12]


def test_pad_collate_pads_masks_and_labels():
    dataset = TokenDataset(4096)
    lengths = [len(dataset[i]["input_ids"]) for i in range(4096)]
    assert min(lengths) == 32 and max(lengths) == 512
    samples = [dataset[i] for i in range(8)]
    batch = pad_collate(samples)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    width = max(lengths[:8])
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (8, width)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        assert torch.equal(batch["input_ids"][row, :n], sample["input_ids"])
        assert (batch["input_ids"][row, n:] == PAD_ID).all()
        assert batch["attention_mask"][row].sum() == n
        assert torch.equal(batch["labels"][row, :n], sample["input_ids"])
        assert (batch["labels"][row, n:] == IGNORE_INDEX).all()


@pytest.mark.big_imports
@pytest.mark.xdist_group("hf_datasets")
def test_hf_workload_is_a_memory_mapped_torch_format_dataset(tmp_path):
    import datasets

    ds = hf_dataset(5000, seq_len=16, root=tmp_path)
    assert isinstance(ds, datasets.Dataset) and len(ds) == 8192  # the next power of two
    assert ds.format["type"] == "torch" and ds.cache_files  # read from disk, not memory
    row = ds[3]
    assert set(row) == {"input_ids", "attention_mask", "label"}
    assert row["input_ids"].shape == (16,) and row["input_ids"].dtype == torch.int64
    n = int(row["attention_mask"].sum())
    assert n >= 4 and (row["attention_mask"][:n] == 1).all() and (row["input_ids"][n:] == 0).all()
    again = hf_dataset(6000, seq_len=16, root=tmp_path)
    assert again.cache_files == ds.cache_files and _same(again[3], row)


def _block(monkeypatch, *modules):
    """Make ``modules`` fail to import, as on a machine without them."""
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


@pytest.mark.long
@pytest.mark.timeout(90)
def test_missing_peer_or_workload_package_is_a_one_line_note(monkeypatch):
    _block(monkeypatch, "spdl.dataloader", "datasets")
    config = BenchConfig(["text", "hf"], num_workers=1, batches=2, repeats=1,
                         first_batch_runs=1, baseline=False, progress=False,
                         peers=("torchdata", "spdl"))
    assert config.notes() == [
        "spdl: column skipped, spdl is not installed (pip install spdl, or pip install "
        "'torchfeed[bench]')",
        "workload hf: skipped, datasets is not installed (pip install datasets)",
    ]
    assert config.compared() == ("torch", "torchfeed", "torchdata")
    (result,) = run_comparison(config)
    assert result.workload.name == "text"
    assert set(result.figures) == {"torch", "torchfeed", "torchdata"}
    for figures in result.figures.values():
        assert figures.error is None and figures.runs[0].batches == 2
        assert len(figures.first_batches) == 1
    report = format_report([result], config, {"cores_usable": 2, "cores_total": 2,
                                              "cpu_model": "x", "torch": "t", "numpy": "n",
                                              "python": "p", "platform": "q"}, "cmd", None)
    notes = [line for line in report.splitlines() if line.startswith("note: ")]
    assert notes == [f"note: {note}" for note in config.notes()]
    assert "tf/torchdata" in report and "tf/spdl" not in report


def test_a_peer_without_a_num_workers_0_mode_is_skipped_with_a_note():
    config = BenchConfig(["text"], num_workers=0, peers=("torchdata", "spdl"))
    assert config.compared() == ("torch", "torchfeed", "torchdata")
    assert config.notes() == ["spdl: column skipped, it has no num_workers=0 mode "
                              "(it would start a worker process anyway)"]


def test_peer_option_on_the_command_line(capsys):
    from torchfeed.bench.__main__ import build_parser

    assert build_parser().parse_args([]).peers == list(PEERS)  # every peer by default
    assert build_parser().parse_args(["--peers", "none"]).peers == []
    assert build_parser().parse_args(["--peers", "spdl"]).peers == ["spdl"]
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["--peers", "torchdata,nope"])
    assert exit_info.value.code == 2
    assert "unknown peer(s) nope" in capsys.readouterr().err


def _timing(rate, first, cpu, mem):
    return Timing(batches=10, seconds=10 / rate, first_batch_s=first, batches_per_s=rate,
                  cpu_us_per_batch=cpu, peak_rss_bytes=mem, peak_shm_bytes=0)


def test_peer_table_shows_each_peer_and_torchfeeds_ratio_to_it():
    figures = {
        "torch": LoaderFigures([_timing(100.0, 0.2, 2000.0, 100 << 20)]),
        "torchfeed": LoaderFigures([_timing(300.0, 0.1, 500.0, 100 << 20)]),
        "torchdata": LoaderFigures([_timing(150.0, 0.4, 1000.0, 200 << 20)]),
        "spdl": LoaderFigures(error="RuntimeError: boom"),
    }
    result = WorkloadResult(WORKLOADS["text"], 10, figures)
    table = format_peer_table([result])
    head = [c for c in table.splitlines()[1].split() if c != "|"]
    assert head[:6] == ["workload", "batch", "torchdata", "tf/torchdata", "spdl", "tf/spdl"]
    cells = [c for c in table.splitlines()[-1].split() if c != "|"]
    # batches/s: torchdata 150, torchfeed 300/150; spdl failed: no figure, no ratio
    assert cells[:6] == ["text", "32", "150", "2.00x", "error", "-"]
    assert cells[6:8] == ["400", "0.25x"]  # first batch, ms: 100 / 400
    ratios = result.to_dict()["ratio_vs_peers"]
    assert ratios["torchdata"]["cpu_us_per_batch"] == pytest.approx(0.5)
    assert ratios["spdl"]["batches_per_s"] is None
    assert format_peer_table([WorkloadResult(WORKLOADS["text"], 10, {
        "torch": figures["torch"], "torchfeed": figures["torchfeed"]})]) == ""
    assert math.isclose(result.ratio("batches_per_s", "torchfeed", "torchdata"), 2.0)


def test_cache_dir_is_the_users_cache_unless_told(monkeypatch, tmp_path):
    from torchfeed.bench.pipelines import cache_dir

    monkeypatch.delenv("TORCHFEED_BENCH_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "torchfeed" / "bench"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "torchfeed" / "bench"
    monkeypatch.setenv("TORCHFEED_BENCH_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


class _ThreadProbe(torch.utils.data.Dataset):
    """Records torch's intra-op thread count where the samples are fetched."""

    seen: list = []

    def __init__(self, length):
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        _ThreadProbe.seen.append(torch.get_num_threads())
        return torch.zeros(2)


@pytest.mark.timeout(60)
def test_torch_threads_apply_to_the_run_and_are_restored(monkeypatch):
    probe = dataclasses.replace(WORKLOADS["small"], name="probe", make=_ThreadProbe)
    monkeypatch.setitem(WORKLOADS, "probe", probe)
    before = torch.get_num_threads()
    _ThreadProbe.seen.clear()
    config = BenchConfig(["probe"], num_workers=0, batches=2, repeats=1, first_batch_runs=0,
                         progress=False, torch_threads=before + 1)  # differs from the default
    (result,) = run_comparison(config)
    assert all(f.error is None for f in result.figures.values())
    assert _ThreadProbe.seen and set(_ThreadProbe.seen) == {before + 1}
    assert torch.get_num_threads() == before
