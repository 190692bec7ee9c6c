"""spotguard.sampler: a resumed run consumes exactly the samples the interrupted one had not."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from spotguard.sampler import LoaderState, ResumableSampler, SamplerStateError

EPOCHS = 3
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata 0.11 noise


class Indices(Dataset):
    """Sample i is i, so a batch shows exactly which samples were consumed."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _loader(sampler: ResumableSampler, workers: int, batch_size: int = 4) -> DataLoader:
    return DataLoader(Indices(sampler.num_items), batch_size=batch_size, sampler=sampler,
                      num_workers=workers, prefetch_factor=4 if workers else None)


def _train(sampler, workers, stop_after=None, batch_size=4):
    """The documented loop; returns (batches consumed, state saved when stopped or None)."""
    loader, seen = _loader(sampler, workers, batch_size), []
    for epoch in range(sampler.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for batch in loader:
            seen.append(batch.tolist())
            sampler.advance(len(batch))
            if len(seen) == stop_after:
                return seen, json.loads(json.dumps(sampler.state_dict()))
    return seen, None


def _resumed(n, workers, stop_after, *, rank=0, world_size=1, seed=7, batch_size=4):
    def make() -> ResumableSampler:
        return ResumableSampler(n, seed=seed, rank=rank, world_size=world_size)

    first, state = _train(make(), workers, stop_after, batch_size)
    assert state is not None
    sampler = make()
    sampler.load_state_dict(state)
    rest, _ = _train(sampler, workers, batch_size=batch_size)
    return first + rest


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("n", [0, 7, 10, 11])
def test_same_indices_as_distributed_sampler(world_size, shuffle, drop_last, n):
    for rank in range(world_size):
        ours = ResumableSampler(n, shuffle=shuffle, seed=3, rank=rank, world_size=world_size,
                                drop_last=drop_last)
        theirs = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=shuffle,
                                    seed=3, drop_last=drop_last)
        for epoch in range(3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


def test_a_data_source_works_like_its_length():
    assert list(ResumableSampler(Indices(9), seed=1)) == list(ResumableSampler(9, seed=1))


@pytest.mark.parametrize(  # 6 batches per epoch: 6 is its last batch, 7 the next epoch's first
    ("workers", "stop_after"), [(0, 1), (0, 3), (0, 6), (0, 7), (0, 13), (2, 3), (2, 6), (2, 13)])
def test_interrupted_and_resumed_equals_uninterrupted(workers, stop_after):
    whole, _ = _train(ResumableSampler(23, seed=7), workers)
    assert len(whole) == 6 * EPOCHS
    assert _resumed(23, workers, stop_after) == whole


def test_epochs_are_different_permutations_of_everything():
    whole, _ = _train(ResumableSampler(23, seed=7), 0)
    epochs = [sum(whole[i * 6:(i + 1) * 6], []) for i in range(EPOCHS)]
    assert all(sorted(e) == list(range(23)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]


@pytest.mark.parametrize("workers", [0, 2])
def test_world_size_two_each_rank_resumes_its_own_shard(workers):
    shards = []
    for rank in (0, 1):
        sampler = ResumableSampler(20, seed=5, rank=rank, world_size=2)
        whole, _ = _train(sampler, workers, batch_size=3)
        assert _resumed(20, workers, 5, rank=rank, world_size=2, seed=5, batch_size=3) == whole
        shards.append(sum(whole[:4], []))  # epoch 0: 10 samples per rank, batches of 3,3,3,1
    assert sorted(shards[0] + shards[1]) == list(range(20))


def test_len_of_a_restored_epoch_is_what_remains():
    sampler = ResumableSampler(23)
    sampler.load_state_dict({**sampler.state_dict(), "epoch": 1, "position": 8})
    assert len(sampler) == 15 and len(_loader(sampler, 0)) == 4
    assert len(list(sampler)) == 15
    assert len(sampler) == 23, "after the restored pass, an epoch is whole again"


def test_iterating_an_epoch_again_without_set_epoch_repeats_it():
    sampler = ResumableSampler(10, seed=2)
    first = list(sampler)
    sampler.advance(10)
    assert list(sampler) == first


def test_state_is_plain_and_survives_torch_weights_only(tmp_path):
    sampler = ResumableSampler(10)
    list(sampler)
    sampler.advance(4)
    torch.save(sampler.state_dict(), tmp_path / "s.pt")
    other = ResumableSampler(10)
    other.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert list(other) == list(ResumableSampler(10))[4:]


@pytest.mark.parametrize(
    ("change", "key"),
    [({"data_source_or_len": 11}, "num_items"), ({"seed": 1}, "seed"), ({"shuffle": False}, "shuffle"), ({"drop_last": True}, "drop_last")],
)
def test_state_from_a_different_sampler_is_refused(change, key):
    saved = ResumableSampler(10).state_dict()
    other = ResumableSampler(**{"data_source_or_len": 10, **change})
    with pytest.raises(SamplerStateError, match=key):
        other.load_state_dict(saved)


@pytest.mark.parametrize(("old", "new", "drop_last"), [(2, 1, False), (2, 3, False), (4, 3, True)])
def test_another_world_size_resplits_the_rest_of_the_epoch(old, new, drop_last):
    """Elastic resume: 2 ranks saved after 3 samples each, 1 or 3 ranks take the rest of the epoch;
    together with what was consumed, every sample of the epoch once (DistributedSampler's padding
    aside), and the next epoch is a fresh run's on the new world."""
    n, seen = 23, []
    saved = [ResumableSampler(n, seed=4, rank=r, world_size=old, drop_last=drop_last) for r in range(old)]
    for sampler in saved:
        sampler.set_epoch(2)
        seen += list(sampler)[:3]
        sampler.advance(3)
    resumed = [ResumableSampler(n, seed=4, rank=r, world_size=new, drop_last=drop_last) for r in range(new)]
    for sampler in resumed:
        sampler.load_state_dict(saved[0].state_dict())
        sampler.set_epoch(2)
        assert (sampler.base, sampler.position) == (3 * old, 0)
        seen += list(sampler)
    if drop_last:
        assert len(seen) == len(set(seen)) and len(seen) > n - old - new
    else:
        assert set(seen) == set(range(n)) and len(seen) < n + old + new
    for rank, sampler in enumerate(resumed):
        sampler.set_epoch(3)
        fresh = ResumableSampler(n, seed=4, rank=rank, world_size=new, drop_last=drop_last)
        fresh.set_epoch(3)
        assert list(sampler) == list(fresh)


@pytest.mark.parametrize("bad", [{"position": 11}, {"position": -1}, {"epoch": -1},
                                 {"epoch": "1"}, {"format": 2}])
def test_malformed_state_is_refused_and_changes_nothing(bad):
    sampler = ResumableSampler(10)
    with pytest.raises(SamplerStateError):
        sampler.load_state_dict({**sampler.state_dict(), **bad})
    assert (sampler.epoch, sampler.position, len(sampler)) == (0, 0, 10)


def test_advance_past_the_epoch_is_an_error():
    sampler = ResumableSampler(10, rank=1, world_size=2)
    sampler.advance(5)
    with pytest.raises(SamplerStateError, match="passes the end"):
        sampler.advance(1)


def test_set_epoch_that_discards_a_restored_position_warns():
    sampler = ResumableSampler(10)
    sampler.load_state_dict({**sampler.state_dict(), "epoch": 2, "position": 3})
    sampler.set_epoch(2)  # the documented resume: silent, keeps the position
    assert len(sampler) == 7
    with pytest.warns(UserWarning, match="discards the restored position"):
        sampler.set_epoch(0)
    assert len(sampler) == 10


def test_saving_without_ever_calling_advance_warns():
    sampler = ResumableSampler(10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampler.state_dict()  # nothing iterated yet: no warning
    list(sampler)
    with pytest.warns(UserWarning, match="advance"):
        sampler.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampler.state_dict()  # once per pass, not at every save


def test_bad_topology_is_rejected():
    for rank, world in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="rank"):
            ResumableSampler(10, rank=rank, world_size=world)


def _stateful_loader(workers: int) -> StatefulDataLoader:
    torch.manual_seed(11)  # its RandomSampler seeds a private generator from the global one
    return StatefulDataLoader(Indices(23), batch_size=4, shuffle=True, num_workers=workers)


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_entry_resumes_the_same_batch_sequence(workers):
    reference = _stateful_loader(workers)
    whole = [b.tolist() for _ in range(2) for b in reference]  # two epochs
    assert whole[:6] != whole[6:]
    loader, first = _stateful_loader(workers), []
    entry = LoaderState(loader)
    for batch in loader:
        first.append(batch.tolist())
        if len(first) == 4:
            saved = entry.state_dict()
            break
    resumed = _stateful_loader(workers)
    LoaderState(resumed).load_state_dict(saved)
    rest = [b.tolist() for b in resumed] + [b.tolist() for b in resumed]
    assert first + rest == whole


def test_loader_state_refuses_a_loader_without_state():
    with pytest.raises(TypeError, match="StatefulDataLoader"):
        LoaderState(DataLoader(Indices(4)))


def test_module_imports_and_constructs_without_torch():
    code = ("import sys; from spotguard.sampler import ResumableSampler; "
            "s = ResumableSampler(10, world_size=2, rank=1); s.advance(2); s.state_dict(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
