"""GradReducer refuses a gradient for a bucket it already reduced (more backward passes than `rounds`, or
one after `reduce_and_clip`): before, such a gradient was silently lost and the step's gradients were wrong."""
import pytest
import torch

from shardwise.config import ParallelConfig, TrainConfig
from shardwise.mesh import Mesh
from shardwise.training.trainer import Trainer


def _trainer(zero: int, overlap: bool = True) -> Trainer:
    cfg = TrainConfig(model="tiny", parallel=ParallelConfig(zero=zero), steps=2, seq_len=16, micro_batch=2,
                      global_batch=2, seed=3, progress=False, overlap_grad_reduce=overlap)
    cfg = cfg.resolved()
    return Trainer(cfg, Mesh.single(torch.device("cpu")))


def _backward(t: Trainer) -> None:
    x = torch.randint(0, 200, (2, 16))
    t.model(x).float().square().mean().backward()


@pytest.mark.parametrize("zero", [0, 1])
def test_extra_backward_pass_is_refused(zero):
    t = _trainer(zero)
    _backward(t)  # rounds=1: every bucket is reduced during this backward
    with pytest.raises(RuntimeError, match=r"gradient for '[\w.]+' arrived after its bucket was reduced \(rounds=1\)"):
        _backward(t)


@pytest.mark.parametrize("zero,overlap", [(0, False), (2, True)])
def test_backward_after_reduce_and_clip_is_refused(zero, overlap):
    t = _trainer(zero, overlap)
    _backward(t)
    t.finish_gradients()
    with pytest.raises(RuntimeError, match=r"arrived after reduce_and_clip\(\).*rounds=1"):
        _backward(t)
    t.reducer.zero_grad()  # the documented way out: a fresh step accepts gradients again
    _backward(t)
    t.finish_gradients()
    t.reducer.step()


def test_docstring_states_the_contract():
    from shardwise.data_parallel import GradReducer

    doc = GradReducer.__doc__
    assert "exactly `rounds` backward passes" in doc and "reduce_and_clip" in doc and "step()" in doc
