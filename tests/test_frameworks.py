"""Frameworks that rebuild loaders keep torchfeed through ``torchfeed.prepare``.

Accelerate (one process here, two under torchrun with gloo in
tests/_accelerate_ranks.py), the Hugging Face Trainer, and Ray Train on CPU with
two workers and a worker failure (tests/_ray_train.py).  All of them are real:
the [test] extra installs them.
"""
import importlib.util
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from dist_launches import LAUNCHES, ranks_of
from doc_examples import doc_python_block
from loader_helpers import launch_in_own_session
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import Dataset

import torchfeed
from torchfeed import _prepared

HERE = Path(__file__).resolve().parent


class Ids(Dataset):
    def __init__(self, n=22):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i])


def ids(batches):
    return [b.flatten().tolist() for b in batches]


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(_prepared, "_warned", set())


# -- Accelerate, one process ----------------------------------------------------------
@pytest.fixture
def new_accelerator():
    """A new Accelerator per call, as in a new process (Accelerate keeps singletons)."""
    pytest.importorskip("accelerate", reason="Accelerate is not installed (the [test] extra has it)")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    def make(**kwargs):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        return Accelerator(cpu=True, **kwargs)

    yield make
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _through_accelerate(accelerator, loader_class, seed, **kw):
    torch.manual_seed(seed)
    loader = loader_class(Ids(), batch_size=4, shuffle=True, num_workers=2, **kw)
    if loader_class is TorchLoader:
        return loader, accelerator.prepare(loader)
    return loader, torchfeed.prepare(accelerator.prepare, loader)


@pytest.mark.timeout(90)
def test_accelerate_keeps_torchfeed_and_round_trips_save_state(new_accelerator, tmp_path):
    _, theirs = _through_accelerate(new_accelerator(), TorchLoader, seed=3)
    expected = ids(theirs)

    accelerator = new_accelerator()
    loader, ours = _through_accelerate(accelerator, torchfeed.DataLoader, seed=3,
                                       transport="shm", device=accelerator.device)
    assert type(ours.base_dataloader) is torchfeed.DataLoader  # what iterates
    assert ours.base_dataloader.transport == "shm"
    assert ours.base_dataloader.device == accelerator.device  # the device stage survives
    got = []
    for step, batch in enumerate(ours):
        assert batch.device == accelerator.device  # Accelerate still places the batches
        got.append(batch.flatten().tolist())
        if step == 1:
            accelerator.save_state(str(tmp_path / "ckpt"))
            saved = ours.state_dict()
            mine = loader.state_dict()  # the user's own loader: what they received, too
    assert got == expected
    assert ours.stats()["batches_yielded"] == len(expected) == loader.stats()["batches_yielded"]
    assert ours.stats()["transport"] == "shm"

    # A new process: another global seed before prepare, so only the state restores the shuffle.
    accelerator = new_accelerator()
    _, resumed = _through_accelerate(accelerator, torchfeed.DataLoader, seed=99)
    accelerator.load_state(str(tmp_path / "ckpt"))
    # What save_state would write now is the loaded position, not the fresh loader's.
    assert resumed.state_dict()["batches_yielded"] == saved["batches_yielded"] == 2
    assert ids(resumed) == expected[2:]

    # The user's loader's state is the same position, not Accelerate's look-ahead (one
    # batch further): loaded into a new run's loader, no batch is skipped.
    assert mine["batches_yielded"] == 2
    accelerator = new_accelerator()
    again_loader, again = _through_accelerate(accelerator, torchfeed.DataLoader, seed=98)
    again_loader.load_state_dict(mine)
    assert ids(again) == expected[2:]


def test_accelerate_stateful_dataloader_option_warns_and_keeps_torchfeed(fresh_warnings):
    """Accelerate's use_stateful_dataloader builds torchdata's loader and takes its state
    (drawing from the RNG) before torchfeed replaces it: torchfeed says so."""
    pytest.importorskip("accelerate", reason="Accelerate is not installed (the [test] extra has it)")
    pytest.importorskip("torchdata", reason="torchdata is not installed (the [test] extra has it)")
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
            use_stateful_dataloader=True))
        loader = torchfeed.DataLoader(Ids(), batch_size=4, shuffle=True)
        with pytest.warns(UserWarning, match="Leave use_stateful_dataloader off"):
            prepared = torchfeed.prepare(accelerator.prepare, loader)
        assert type(prepared.base_dataloader) is torchfeed.DataLoader
        assert sorted(i for batch in ids(prepared) for i in batch) == list(range(22))
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


@pytest.mark.timeout(90)
def test_accelerate_dispatch_batches_keeps_torchfeed_and_resumes(new_accelerator, tmp_path):
    """DataLoaderConfiguration(dispatch_batches=True): Accelerate's DataLoaderDispatcher."""
    from accelerate import DataLoaderConfiguration

    def dispatching():
        return new_accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True))

    _, theirs = _through_accelerate(dispatching(), TorchLoader, seed=5)
    assert type(theirs).__name__ == "DataLoaderDispatcher"
    expected = ids(theirs)

    accelerator = dispatching()
    loader, ours = _through_accelerate(accelerator, torchfeed.DataLoader, seed=5)
    assert type(ours).__name__ == "DataLoaderDispatcher"
    assert type(ours.base_dataloader) is torchfeed.DataLoader
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one process: nothing to warn about
        got = []
        for step, batch in enumerate(ours):
            got.append(batch.flatten().tolist())
            if step == 2:
                accelerator.save_state(str(tmp_path / "ckpt"))
    assert got == expected
    assert loader.stats()["batches_yielded"] == len(expected)

    accelerator = dispatching()
    _, resumed = _through_accelerate(accelerator, torchfeed.DataLoader, seed=98)
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert resumed.state_dict()["batches_yielded"] == 3
    assert ids(resumed) == expected[3:]


def test_accelerate_prepare_of_a_torchfeed_loader_warns_once(new_accelerator, fresh_warnings):
    """accelerator.prepare(loader) alone rebuilds torch's loader: torchfeed says so once,
    at the user's line, and changes nothing that Accelerate or torch users see."""
    from torch.utils.data import BatchSampler, RandomSampler

    accelerator = new_accelerator()
    loader = torchfeed.DataLoader(Ids(), batch_size=4, shuffle=True)
    with pytest.warns(UserWarning, match=r"rebuilds this torchfeed.DataLoader") as record:
        prepared = accelerator.prepare(loader)
        accelerator.prepare(torchfeed.DataLoader(Ids(), batch_size=4))
    ours = [w for w in record if "torchfeed" in str(w.message)]
    assert len(ours) == 1 and ours[0].filename == __file__
    assert "torchfeed.prepare(accelerator.prepare, loader)" in str(ours[0].message)
    assert type(prepared.base_dataloader) is TorchLoader  # Accelerate's own rebuild, as before
    assert sorted(i for batch in ids(prepared) for i in batch) == list(range(22))
    assert type(loader.batch_sampler) is BatchSampler and type(loader.sampler) is RandomSampler
    assert "_is_accelerate_prepared" not in vars(loader)

    _prepared._warned.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the supported way, and preparing its result again
        supported = torchfeed.prepare(accelerator.prepare, torchfeed.DataLoader(Ids(), batch_size=4))
        assert accelerator.prepare(supported) is supported
        assert len(ids(supported)) == 6
        assert list(torchfeed.DataLoader(Ids(), batch_size=11))  # plain use


# -- Accelerate, two processes (torchrun, gloo) ----------------------------------------
def _launch(cmd, timeout, env=None):
    return launch_in_own_session(cmd, timeout, env)


@pytest.mark.long
@pytest.mark.timeout(420)  # the shared world-2 torchrun job runs other modules' scenarios too
@LAUNCHES
def test_accelerate_two_processes_keep_torchfeed_and_resume(tmp_path_factory):
    pytest.importorskip("accelerate", reason="Accelerate is not installed (the [test] extra has it)")
    # Two CPU ranks (Accelerator(cpu=True), gloo) is what this test means: with
    # a GPU visible, the ranks still reached for a CUDA device each, by local
    # rank ("invalid device ordinal" on a one-GPU machine).  None is visible:
    # tests/_accelerate_ranks.py, run by both ranks of tests/dist_launches.py's
    # world-2 job, which hides them.
    ranks = ranks_of(tmp_path_factory, "accelerate")
    for r, result in enumerate(ranks):
        assert (result["rank"], result["world"]) == (r, 2)
        assert result["engine"] == "torchfeed.dataloader"
        assert result["torchfeed"] == result["torch"]  # Accelerate's own shard of each rank
        assert result["stats"] == [len(result["torch"]), "shm", len(result["torch"])]
        assert result["devices"][0] == ["cpu"] and result["devices"][1].startswith("cpu")
        assert result["resumed"] == result["torch"][2:]
        # dispatch_batches=True: only process 0 iterates, so save_state cannot be exact
        assert len(result["dispatch_warnings"]) == 1
        assert "dispatch_batches=False" in result["dispatch_warnings"][0]
    # the shards split the shuffled epoch: every sample once, evened out by wrapping
    seen = sorted(i for result in ranks for batch in result["torch"] for i in batch)
    assert set(seen) == set(range(38)) and len(seen) == 40


# -- the fallbacks ----------------------------------------------------------------------
def test_prepare_takes_a_torchfeed_loader():
    with pytest.raises(TypeError, match="takes a torchfeed.DataLoader"):
        torchfeed.prepare(lambda loader: loader, TorchLoader(Ids()))


def test_prepare_warns_once_when_the_framework_result_is_unknown(fresh_warnings):
    class Opaque:  # a framework product that holds no loader torchfeed can replace
        def __init__(self, loader):
            self.batches = list(TorchLoader(loader.dataset, batch_size=4))

    loader = torchfeed.DataLoader(Ids(), batch_size=4)
    with pytest.warns(UserWarning, match="torchfeed's iterator is not used") as record:
        result = torchfeed.prepare(Opaque, loader)
        torchfeed.prepare(Opaque, loader)
    assert len(record) == 1 and type(result) is Opaque
    assert "_prepared_as" not in vars(loader)


def test_prepare_keeps_a_loader_the_framework_left_alone():
    loader = torchfeed.DataLoader(Ids(), batch_size=4)
    assert torchfeed.prepare(lambda loader: loader, loader) is loader
    assert "_prepared_as" not in vars(loader)


@pytest.mark.parametrize("world", ["1", "2"])
def test_state_dict_of_a_loader_a_framework_replaced_warns(monkeypatch, fresh_warnings, world):
    """Several ranks, a map-style loader never iterated here, no distributed sampler:
    the state of a loader that Ray or Accelerate rebuilt on torch's DataLoader."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", world)  # what torchrun and Ray Train set
    loader = torchfeed.DataLoader(Ids(), batch_size=4, shuffle=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        state = loader.state_dict()
    assert state["batches_yielded"] == 0
    messages = [str(w.message) for w in record]
    if world == "1":
        assert messages == []
    else:
        assert len(messages) == 1 and "torchfeed.prepare(" in messages[0]
        assert "restarts the epoch on resume" in messages[0]
    # an iterated loader, or one with a distributed sampler, is not that case
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        next(iter(loader))
        loader.state_dict()
        sampler = torchfeed.DistributedSampler(Ids(), num_replicas=2, rank=0)
        torchfeed.DataLoader(Ids(), batch_size=4, sampler=sampler).state_dict()


@pytest.mark.long
# -- Ray Train: 2 CPU workers, a failure, a restart ------------------------------------
@pytest.mark.timeout(300)
def test_ray_train_keeps_torchfeed_and_resumes_exactly_after_a_failure(tmp_path):
    # Checked, not imported: Ray runs in _ray_train.py's process, and importing it here
    # would add ~140 MiB to this one, whose page tables every later fork would copy.
    if importlib.util.find_spec("ray") is None:
        pytest.skip("Ray Train is not installed (the [test] extra has it)")
    code, output = _launch([sys.executable, str(HERE / "_ray_train.py"), str(tmp_path)],
                           timeout=280, env={"CUDA_VISIBLE_DEVICES": ""})  # CPU workers
    fit = tmp_path / "fit.json"
    assert code == 0 and fit.exists(), output[-6000:]
    assert json.loads(fit.read_text()) == {"error": "None"}
    union = []
    for rank in range(2):
        first, second = (json.loads((tmp_path / f"rank{rank}-attempt{a}.json").read_text())
                         for a in (1, 2))
        assert first["world"] == 2
        expected = first["torch"]  # Ray's split of torch's loader for this rank
        union += [i for batch in expected for i in batch]
        # without torchfeed.prepare Ray runs torch's loader, and the stale state says so
        assert first["plain_inner"] == "torch.utils.data.dataloader"
        assert len(first["plain_state_warnings"]) == 1
        assert "torchfeed.prepare(" in first["plain_state_warnings"][0]
        # with it, every rank iterates torchfeed, keeping the options Ray drops
        assert second["engine"][:3] == ["torchfeed.dataloader", True, 3]
        assert second["engine"][4] == "shm"
        # the samples trained across the failure equal the uninterrupted split
        resumed_from = second["resumed_from"]
        assert resumed_from is not None and 0 <= resumed_from < len(expected) - 1
        assert [s[0] for s in second["steps"]] == list(range(resumed_from + 1, len(expected)))
        trained = [s[1] for s in first["steps"] if s[0] <= resumed_from]
        trained += [s[1] for s in second["steps"]]
        assert trained == expected
        # the loader Ray kept (torchfeed.DistributedSampler deals torch's indices) too
        assert second["kept"] == ["torchfeed.dataloader", False]
        kept = [s[2] for s in first["steps"] if s[0] <= resumed_from]
        assert kept + [s[2] for s in second["steps"]] == expected
        assert second["engine"][3] == len(expected) - resumed_from - 1  # stats of this attempt
    assert sorted(union) == list(range(64))


# -- the Hugging Face Trainer -----------------------------------------------------------
class Pairs(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return {"x": torch.tensor([float(i)]), "labels": torch.tensor([2.0 * i])}


class Tiny(torch.nn.Module):
    """A one-weight regression that records the sample ids it trained on."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(1, 1)
        self.seen = []

    def forward(self, x, labels):
        self.seen.append([int(v) for v in x.flatten().tolist()])
        return {"loss": torch.nn.functional.mse_loss(self.linear(x), labels)}


def _trainers():
    """The stock Trainer, and the documentation's subclass as written there."""
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed (the [test] extra has it)")

    namespace = {"transformers": transformers, "torchfeed": torchfeed}
    exec(doc_python_block("class TorchfeedTrainer("), namespace)
    return transformers.Trainer, namespace["TorchfeedTrainer"]


def _train(trainer_class, out, resume_from=None):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, max_steps=6,
                             save_strategy="steps", save_steps=3, logging_strategy="no",
                             report_to="none", use_cpu=True, dataloader_num_workers=1, seed=11,
                             disable_tqdm=True)
    model = Tiny()
    trainer = trainer_class(model=model, args=args, train_dataset=Pairs())
    trainer.train(resume_from_checkpoint=resume_from)
    return model.seen, trainer


@pytest.mark.big_imports  # transformers' Trainer brings datasets: ~250 MiB
@pytest.mark.timeout(120)
def test_trainer_with_torchfeed_trains_on_the_stock_batches_and_resumes(tmp_path, new_accelerator):
    stock_class, torchfeed_class = _trainers()
    stock, _ = _train(stock_class, tmp_path / "stock")
    seen, trainer = _train(torchfeed_class, tmp_path / "ours")
    assert seen == stock and len(seen) == 6  # 16 samples: one epoch and a half
    assert sorted(i for batch in seen[:4] for i in batch) == list(range(16))
    engine = trainer.callback_handler.train_dataloader.base_dataloader
    assert type(engine) is torchfeed.DataLoader
    assert engine.stats()["batches_yielded"] >= 2  # the second epoch's (Accelerate reads ahead)
    # from the checkpoint at step 3, inside the first epoch
    resumed, _ = _train(torchfeed_class, tmp_path / "ours", tmp_path / "ours" / "checkpoint-3")
    assert resumed == seen[3:]
