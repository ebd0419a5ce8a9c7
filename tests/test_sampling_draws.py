"""``PoissonSampler`` draws: indices plus an identity that ``DPOptimizer`` charges per draw."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.utils.data import TensorDataset

from opake_compile import random as oprandom
from opake_compile.exceptions import CheckpointError, ConfigurationError, InputTypeError
from opake_compile.sampling import Draw, DrawId, PoissonSampler, draw_loader, draw_of


def test_draws_are_lists_with_sequential_ids():
    s = PoissonSampler(30, 0.2, key=oprandom.key(0), steps=3)
    epoch0 = list(s)
    assert all(isinstance(d, Draw) and isinstance(d, list) for d in epoch0)
    assert [d.id.seq for d in epoch0] == [0, 1, 2]
    assert [(d.id.epoch, d.id.step) for d in epoch0] == [(0, 0), (0, 1), (0, 2)]
    assert s.draws_handed_out == 3
    peek = s.batch_at(0, 1)  # the same sample as draw 1: the same draw, not a fresh one
    assert peek == epoch0[1] and list(peek) == list(epoch0[1]) and peek.id == epoch0[1].id
    assert s.draws_handed_out == 3
    fresh = s.batch_at(3, 0)  # a position not handed out yet is the next draw
    assert fresh.id.seq == 3 and s.draws_handed_out == 4
    epoch1 = list(s)
    assert [d.id.seq for d in epoch1] == [4, 5, 6] and epoch1[0].id.epoch == 1
    assert s.batch_at(3, 0).id == fresh.id and s.batch_at(1, 2).id == epoch1[2].id
    assert torch.as_tensor(epoch1[0], dtype=torch.long).tolist() == list(epoch1[0])
    other = PoissonSampler(30, 0.2, key=oprandom.key(0), steps=3)
    assert next(iter(other)).id.source != epoch0[0].id.source


def test_draw_pickles_and_draw_of():
    d = next(iter(PoissonSampler(30, 0.5, key=oprandom.key(1))))
    back = pickle.loads(pickle.dumps(d))
    assert back == d and back.id == d.id
    assert draw_of(d) == d.id and draw_of(d.id) == d.id and draw_of(None) is None
    with pytest.raises(InputTypeError):
        draw_of([1, 2])
    assert isinstance(d.id, DrawId)


def test_state_dict_keeps_the_hand_out_counter():
    s = PoissonSampler(30, 0.2, key=oprandom.key(2), steps=4)
    list(s)
    state = s.state_dict()
    assert state["draws_handed_out"] == 4
    t = PoissonSampler(30, 0.2, key=oprandom.key(2), steps=4)
    t.load_state_dict(state)
    assert t.draws_handed_out == 4 and next(iter(t)).id.seq == 4
    with pytest.raises(CheckpointError):
        t.load_state_dict(dict(state, draws_handed_out=-1))


def test_an_iterator_made_before_load_state_dict_stops_there():
    """An iterator still open across load_state_dict went on from its own position and moved the
    restored one: the next fresh iterator then handed out a draw already charged (refused, but
    the run could not go on; a review). It now raises, naming what to do; a fresh iterator
    resumes where the state says."""
    s = PoissonSampler(40, 0.25, key=oprandom.key(0))
    it = iter(s)
    first = [next(it).id for _ in range(3)]
    saved = s.state_dict()
    s.load_state_dict(saved)
    with pytest.raises(ConfigurationError, match="made before its load_state_dict"):
        next(it)
    resumed = next(iter(s)).id
    assert (resumed.epoch, resumed.step, resumed.seq) == (0, 3, 3) and [d.seq for d in first] == [0, 1, 2]


def test_draw_loader_yields_batches_with_their_draw():
    x = torch.arange(40.0).reshape(20, 2)
    s = PoissonSampler(20, 0.3, key=oprandom.key(3), steps=5)
    expected = [s.batch_at(0, i) for i in range(5)]
    s2 = PoissonSampler(20, 0.3, key=oprandom.key(3), steps=5)
    got = list(draw_loader(TensorDataset(x), s2))
    assert [d.seq for _, d in got] == [0, 1, 2, 3, 4]
    for ((xb,), _), idx in zip(got, expected):
        assert xb.shape == (len(idx), 2) and torch.equal(xb, x[torch.as_tensor(list(idx), dtype=torch.long)])
    with pytest.raises(ConfigurationError):
        draw_loader(TensorDataset(x), s2, batch_size=4)
    with pytest.raises(InputTypeError):
        draw_loader(TensorDataset(x), [[0, 1]])


def test_samplers_and_optimizers_are_not_copied():
    """A deepcopy (or pickle) of a sampler kept its identity: the copy handed out a sample the
    original had handed out as a new draw, and the optimizer charged the two as independent
    draws; a sampler pickled in another process at q = 1 passed as this process's first
    sampler at q = 0.01 (its id was a per-process counter). A copied DPOptimizer drew the same
    noise as the original (review). Copies are refused; ids are random."""
    import copy

    import opake_compile as opake
    from opake_compile.distributed import DistributedPoissonSampler
    from opake_compile.sampling import CyclicPoissonSampler

    sampler = PoissonSampler(20, 0.25, key=opake.random.key(0))
    model = torch.nn.Linear(2, 2)
    opt = opake.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
                            sampler=sampler, key=opake.random.key(1))
    for obj in (sampler, opt, (model, opt), CyclicPoissonSampler(20, 0.25, 2, opake.random.key(2)),
                DistributedPoissonSampler(20, 0.25, key=opake.random.key(3), rank=0, world_size=2)):
        for how in (copy.copy, copy.deepcopy, pickle.dumps)[isinstance(obj, tuple):]:  # (copy.copy of a tuple is itself)
            with pytest.raises(ConfigurationError, match="is not copied or pickled"):
                how(obj)
    assert copy.deepcopy(model) is not model  # the model alone copies as before
    ids = {PoissonSampler(20, 0.25, key=opake.random.key(0))._id for _ in range(50)}
    assert len(ids) == 50 and min(ids) >= 0 and max(ids) < 2**62
