"""The shortest path through the loader: same batches as torch, in and out of process."""
import pytest
import torch
from torch.utils.data import TensorDataset

import torchfeed


def _dataset():
    return TensorDataset(torch.arange(40).float().view(20, 2), torch.arange(20))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_shuffled_batches_equal_torch(num_workers):
    def batches(cls):
        loader = cls(_dataset(), batch_size=3, shuffle=True, num_workers=num_workers,
                     generator=torch.Generator().manual_seed(7))
        return [tuple(t.clone() for t in b) for b in loader]

    ours, theirs = batches(torchfeed.DataLoader), batches(torch.utils.data.DataLoader)
    assert len(ours) == len(theirs) == 7
    for a, b in zip(ours, theirs):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_is_a_torch_dataloader():
    assert isinstance(torchfeed.DataLoader(_dataset()), torch.utils.data.DataLoader)


@pytest.mark.timeout(60)
def test_workers_start_under_capsys(capsys):
    # capsys swaps sys.stderr for an object without a file descriptor; a worker
    # that insists on one dies before its first task.
    loader = torchfeed.DataLoader(range(4), batch_size=2, num_workers=1)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
