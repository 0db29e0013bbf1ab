"""The stage step every engine runs (mesh/engine/stage_step.py): a chain of stage passes gives
one graph's gradients to the bit, the update's gradient sum and loss, and the screened rule."""

from __future__ import annotations

import torch
from torch import nn

from mesh.algo.robust import screened
from mesh.engine.stage_step import GradSum, stage_pass, update_loss
from mesh.model.build import stage_forward


def test_a_chain_of_stage_passes_gives_one_graphs_gradients_bit_for_bit():
    """Two stages backpropagated one at a time, the gradient of the second's input handed to
    the first (what the workers send over a link), equal the composed graph's gradients."""
    torch.manual_seed(0)
    first, second = nn.Linear(4, 4), nn.Linear(4, 3)
    x, y = torch.randn(2, 5, 4), torch.randint(0, 3, (2, 5))
    w1, w2 = dict(first.named_parameters()), dict(second.named_parameters())
    a = stage_pass(first, w1, x, "fp32", None, first=True)
    b = stage_pass(second, w2, a.output.detach(), "fp32", None, first=False)
    top = b.backward(targets=y, share=2)
    assert top.inputs is not None and top.loss is not None
    bottom = a.backward(top.inputs)
    assert bottom.inputs is None and bottom.loss is None

    logits = second(first(x))
    whole = torch.nn.functional.cross_entropy(logits.reshape(-1, 3), y.reshape(-1))
    want = torch.autograd.grad(whole / 2, [*first.parameters(), *second.parameters()])
    got = [*bottom.weights, *top.weights]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert top.loss == whole.item()
    with torch.no_grad():
        assert torch.equal(stage_forward(first, w1, x, "fp32", None), a.output)  # a no-grad send


def test_the_gradient_sum_takes_the_first_microbatch_as_it_is_and_adds_the_rest():
    like = [torch.zeros(3)]
    acc = GradSum(like)
    assert acc.take() is None  # no microbatch reached the stage: no update
    one, two = torch.ones(3), torch.full((3,), 2.0)
    acc.add([one])
    assert acc.tensors[0] is one  # no add into zeros, no copy
    acc.add([two])
    assert torch.equal(acc.take()[0], torch.full((3,), 3.0))
    assert acc.take() is None and torch.equal(acc.tensors[0], torch.full((3,), 3.0))


def test_an_updates_loss_is_the_mean_over_the_microbatches_that_reached_it():
    assert update_loss(3.0, 4, 4) == 3.0
    assert update_loss(1.0, 2, 4) == 2.0  # two of four: each added loss / 4
    assert update_loss(0.0, 0, 4) is None


def test_a_round_is_screened_by_a_robust_aggregate_or_the_deviation_bound():
    assert not screened("mean", 0.0)
    assert screened("median", 0.0) and screened("trimmed_mean", 0.0)
    assert screened("mean", 10.0)
