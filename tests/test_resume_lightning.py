"""The real Lightning Trainer saving and loading the loader's state.

Lightning knows ``len(loader)``, so it never calls ``next()`` after an epoch's
last batch: a checkpoint on that step holds a state with every batch yielded
and no StopIteration.  Resumed from it, Lightning starts the next epoch, and the
loader must give that epoch whole, as the uninterrupted run had it.
"""
from __future__ import annotations

import pytest
import torch
from _resume_helpers import Ids, ids

from torchfeed import DataLoader

# Lightning, in this process: on the one pytest-xdist worker that runs every test
# importing Lightning (tests/test_constructor.py's too), which pays its import once.
pytestmark = [pytest.mark.big_imports, pytest.mark.xdist_group("lightning")]
N, BS = 10, 3  # 4 steps an epoch


@pytest.fixture(scope="module")
def fit():
    """``fit(tmp_path, max_epochs, generator, num_workers, ckpt_path=None, every=None)``:
    a real Trainer's run, returning (epoch, sample ids) per step.

    Lightning is imported here, not when the module is collected: it adds ~200 MiB
    to the process, whose page tables every later fork in it (a loader's workers,
    in whichever test runs next) would copy."""
    lightning = pytest.importorskip("lightning")  # the test extra installs it; see setup.cfg

    class Recorder(lightning.LightningModule):
        def __init__(self, generator: bool, num_workers: int):
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)
            self.generator, self.num_workers = generator, num_workers
            self.seen = []  # (epoch, sample ids) per step

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1) if self.generator else None
            return DataLoader(Ids(N), batch_size=BS, shuffle=True, generator=g,
                              num_workers=self.num_workers)

        def training_step(self, batch, batch_idx):
            self.seen.append((self.current_epoch, ids(batch)))
            return self.layer(batch.float().unsqueeze(1)).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    def fit(tmp_path, max_epochs, generator, num_workers, ckpt_path=None, every=None):
        callbacks = []
        if every is not None:
            callbacks.append(lightning.pytorch.callbacks.ModelCheckpoint(
                dirpath=tmp_path, every_n_train_steps=every, save_top_k=-1,
                filename="{step}"))
        trainer = lightning.Trainer(
            max_epochs=max_epochs, accelerator="cpu", devices=1, logger=False,
            enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=bool(callbacks), callbacks=callbacks)
        model = Recorder(generator, num_workers)
        trainer.fit(model, ckpt_path=ckpt_path)
        return model.seen

    return fit


@pytest.mark.timeout(120)
@pytest.mark.parametrize("generator, num_workers", [(True, 0), (False, 2)])
def test_checkpoint_on_the_last_step_of_an_epoch_resumes_with_the_whole_next_epoch(
        tmp_path, generator, num_workers, fit):
    torch.manual_seed(0)
    full = fit(tmp_path / "full", 2, generator, num_workers)
    steps = -(-N // BS)
    assert [e for e, _ in full] == [0] * steps + [1] * steps

    torch.manual_seed(0)
    fit(tmp_path / "ckpt", 1, generator, num_workers, every=steps)
    ckpt = tmp_path / "ckpt" / f"step={steps}.ckpt"
    saved = torch.load(ckpt, weights_only=False)["loops"]["fit_loop"]["state_dict"]
    loader_state = saved["combined_loader"][0]
    assert loader_state["batches_yielded"] == steps and not loader_state["epoch_finished"]

    torch.manual_seed(12345)  # a new process
    resumed = fit(tmp_path / "resumed", 2, generator, num_workers, ckpt_path=str(ckpt))
    # Epoch 1 whole, with the uninterrupted run's shuffle: drawn from the generator,
    # or without one from the global RNG the state recorded at the end of epoch 0.
    assert resumed == full[steps:]
