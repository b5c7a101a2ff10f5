"""The pre-emption test's training job: checkpoints model + loader every N steps.

    python _resume_train.py --ckpt CKPT --log LOG [--resume] [--every N] [--sleep S]

Each step appends ``step epoch sample-ids`` to LOG (flushed, so a SIGKILL loses
nothing already written); the job ends with a ``DONE`` line holding the final
weights.  With ``--resume`` it loads CKPT (model, loader state, the global
RNG) and goes on from there.
"""
from __future__ import annotations

import argparse
import os

import torch
from torch.utils.data import Dataset

from torchfeed import DataLoader


class Noisy(Dataset):
    """Sample i: its id and features with a random augmentation (seed_per_batch restores it)."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        x = torch.full((4,), float(i) / 40) + 0.1 * torch.rand(4)
        return i, x


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Linear(4, 1)
    loader = DataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=args.workers,
                        generator=torch.Generator().manual_seed(0), seed_per_batch=True)
    step, start_epoch = 0, 0
    with open(args.log, "a") as log:  # closed when main() returns: the test runs it in-process too
        train(args, model, loader, log, step, start_epoch)


def train(args, model, loader, log, step, start_epoch):
    """Resume from the checkpoint if asked, then train to the end, one log line a step."""
    if args.resume:
        ck = torch.load(args.ckpt, weights_only=True)
        model.load_state_dict(ck["model"])
        loader.load_state_dict(ck["loader"])
        torch.set_rng_state(ck["rng"])
        step, start_epoch = ck["step"], ck["epoch"]
        log.write(f"RESUME {step}\n")
        log.flush()

    import time
    for epoch in range(start_epoch, args.epochs):
        for i, (ids, x) in enumerate(loader):
            loss = ((model(x).squeeze(1) - ids.float() / 40) ** 2).mean()
            model.zero_grad()
            loss.backward()
            with torch.no_grad():  # plain SGD; torch.optim would import torch._dynamo (3 s)
                for q in model.parameters():
                    q -= 0.1 * q.grad
            step += 1
            log.write(f"{step} {epoch} {' '.join(map(str, ids.tolist()))}\n")
            log.flush()
            if step % args.every == 0:
                # After an epoch's last batch the loader's state is at that epoch's end:
                # the resumed loop starts at the next epoch, as Lightning's does.
                ck = {"model": model.state_dict(),
                      "loader": loader.state_dict(), "rng": torch.get_rng_state(),
                      "step": step, "epoch": epoch + (i + 1 == len(loader))}
                torch.save(ck, args.ckpt + ".tmp")
                os.replace(args.ckpt + ".tmp", args.ckpt)
            if args.sleep:
                time.sleep(args.sleep)
    weights = torch.cat([q.detach().flatten() for q in model.parameters()]).tolist()
    log.write(f"DONE {' '.join(repr(w) for w in weights)}\n")
    log.flush()


if __name__ == "__main__":
    main()
