"""A Ray Train job on CPU, with 2 workers and a worker failure; run by tests/test_frameworks.py.

    python tests/_ray_train.py OUT_DIR

Each worker first iterates torch's loader through Ray's ``prepare_data_loader``
(the reference split), then a torchfeed loader through
``torchfeed.prepare(ray.train.torch.prepare_data_loader, loader)`` (and, in step
with it, one with ``torchfeed.DistributedSampler``, which Ray leaves alone), checkpointing
``loader.state_dict()`` with ``ray.train.report`` at every step.  After step
FAIL_AT both workers die; Ray restarts them (``FailureConfig(max_failures=1)``)
and they resume from ``ray.train.get_checkpoint()``.  Also records what a plain
``prepare_data_loader`` does to a torchfeed loader and what its ``state_dict()``
warns.  Writes OUT_DIR/rank{R}-attempt{A}.json.
"""
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torchfeed  # noqa: E402

N, BATCH, FAIL_AT = 64, 4, 2


class Ids(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.tensor([i])


def ids(batch):
    return batch.flatten().tolist()


def train_func(config):
    import ray.train
    import ray.train.torch
    from ray.train import Checkpoint

    out = Path(config["out"])
    rank = ray.train.get_context().get_world_rank()
    attempt = 1 + len(list(out.glob(f"rank{rank}-attempt*.json")))
    result = {"rank": rank, "world": ray.train.get_context().get_world_size()}
    checkpoint = ray.train.get_checkpoint()
    if attempt == 1:
        theirs = ray.train.torch.prepare_data_loader(
            TorchLoader(Ids(), batch_size=BATCH, shuffle=True, num_workers=1))
        result["torch"] = [ids(b) for b in theirs]
        # The import swap alone: Ray rebuilds the loader on torch's DataLoader.
        plain_loader = torchfeed.DataLoader(Ids(), batch_size=BATCH, shuffle=True, num_workers=1)
        plain = ray.train.torch.prepare_data_loader(plain_loader)
        next(iter(plain))
        result["plain_inner"] = type(plain._dataloader).__module__
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plain_loader.state_dict()
        result["plain_state_warnings"] = [str(w.message) for w in caught]

    loader = torchfeed.DataLoader(Ids(), batch_size=BATCH, shuffle=True, num_workers=1,
                                  persistent_workers=True, prefetch_factor=3)
    batches = torchfeed.prepare(ray.train.torch.prepare_data_loader, loader)
    # Already distributed: Ray keeps this loader, and its wrapper still reads ahead.
    kept = torchfeed.DataLoader(Ids(), batch_size=BATCH, num_workers=1,
                                sampler=torchfeed.DistributedSampler(Ids(), shuffle=True))
    kept_batches = torchfeed.prepare(ray.train.torch.prepare_data_loader, kept)
    result["resumed_from"] = None
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            saved = json.loads((Path(d) / f"loader-rank{rank}.json").read_text())
        loader.load_state_dict(saved["loader"])
        kept.load_state_dict(saved["kept"])
        result["resumed_from"] = saved["step"]
    result["steps"] = []
    start = 0 if checkpoint is None else saved["step"] + 1
    for step, (batch, kept_batch) in enumerate(zip(batches, kept_batches), start=start):
        result["steps"].append([step, ids(batch), ids(kept_batch)])
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / f"loader-rank{rank}.json").write_text(json.dumps(
                {"step": step, "loader": loader.state_dict(), "kept": kept.state_dict()}))
            ray.train.report({"step": step}, checkpoint=Checkpoint.from_directory(d))
        if attempt == 1 and step == FAIL_AT:
            (out / f"rank{rank}-attempt{attempt}.json").write_text(json.dumps(result))
            raise RuntimeError("a worker failure: Ray restarts the group")
    inner = kept_batches._dataloader
    result["kept"] = [type(getattr(inner, "engine", inner)).__module__, "_prepared_as" in vars(kept)]
    engine = loader._prepared_as
    result["engine"] = [type(engine).__module__, engine.persistent_workers, engine.prefetch_factor,
                        loader.stats()["batches_yielded"], loader.stats()["transport"]]
    (out / f"rank{rank}-attempt{attempt}.json").write_text(json.dumps(result))


def main(out: Path) -> None:
    import ray
    import ray.train.torch
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    # Ray Train's controller polls the worker group every 2 s by default, and
    # noticing the failure, the restarted group and the end each wait for a
    # poll (42 s -> 28 s for this job at 0.2 s).  It changes only how soon Ray
    # notices; the failure and the restart are the same.  Set before ray.init,
    # so the local cluster's processes (the controller among them) inherit it.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    # What this job does not use, and costs CPU on a 2-core machine: the watcher of
    # cloud node preemption notices (an actor process of its own; the failure here is
    # a worker's exception, which the controller's health check sees), Train's and
    # Ray's metrics exports, and the usage-stats report.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    os.environ.setdefault("RAY_TRAIN_METRICS_ENABLED", "0")
    os.environ.setdefault("RAY_enable_metrics_collection", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Nor does it use the task events that feed Ray's state API and dashboard, nor
    # the idle worker processes Ray prestarts, one per CPU (in its logs each worker
    # process of the job hosted an actor; the two prestarted ones hosted nothing):
    # 3 to 5 of the job's 47 CPU-seconds, alternating runs on 2 cores (2026-11-28).
    os.environ.setdefault("RAY_task_events_report_interval_ms", "0")
    os.environ.setdefault("RAY_event_stats", "0")
    os.environ.setdefault("RAY_enable_worker_prestart", "0")
    # The two workers need a CPU each.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        trainer = ray.train.torch.TorchTrainer(
            train_func, train_loop_config={"out": str(out)},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
            run_config=RunConfig(storage_path=str(out / "storage"), name="run",
                                 failure_config=FailureConfig(max_failures=1)))
        result = trainer.fit()
        (out / "fit.json").write_text(json.dumps({"error": repr(result.error)}))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
