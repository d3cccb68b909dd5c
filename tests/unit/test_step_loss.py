"""The step's loss is the mean over its trained tokens however the batch is cut (plait.execute.step_loss): the
shares of the pieces add up to one process's loss and gradient, where a mean of per-piece means does not."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plait.execute.batches import chat_batch_for_step
from plait.execute.step_loss import StepLoss, step_trained_tokens
from plait.models.adapter import IGNORE_INDEX, ModelAdapter
from plait.plan import Plan
from plait.spec import TrainSpec
from plait.spec.clusters import CLUSTER_PRESETS
from plait.spec.models import MODEL_PRESETS


def _plan(global_batch: int = 4, seq_len: int = 16) -> Plan:
    return Plan.of(model=MODEL_PRESETS["tiny-gpt"], cluster=CLUSTER_PRESETS["local-cpu"],
                   train=TrainSpec(global_batch=global_batch, seq_len=seq_len, precision="fp32"), dp=1,
                   micro_batch=1, num_micro_batches=global_batch)


def _loss_and_grad(pieces: list[tuple[torch.Tensor, torch.Tensor]], weight: torch.Tensor, criterion):
    weight.grad = None
    total = 0.0
    for hidden, targets in pieces:
        loss = criterion(hidden @ weight, targets)
        loss.backward()
        total += loss.item()
    return total, weight.grad.clone()


def test_chat_batches_train_different_numbers_of_tokens_per_row_and_none_in_the_last():
    tokens, targets, positions = chat_batch_for_step(_plan(), seed=1, step=0)
    counts = (targets != IGNORE_INDEX).sum(dim=1).tolist()
    assert counts[-1] == 0 and all(c > 0 for c in counts[:-1])
    assert len(set(counts[:-1])) > 1, counts
    assert positions is None, "documents only where asked"
    packed = chat_batch_for_step(_plan(), seed=1, step=0, documents=True)[2]
    starts = (packed == 0).sum(dim=1)
    assert packed.shape == (4, 16) and bool((starts >= 1).all()) and int(starts.max()) > 1  # some rows pack several
    for row in packed:  # counting up within each document
        steps = row[1:] - row[:-1]
        assert bool(((steps == 1) | (row[1:] == 0)).all())
    plain = chat_batch_for_step(_plan(), seed=1, step=0)[0]
    assert torch.equal(tokens, plain), "the same tokens; only the targets are masked"


def test_the_shares_of_any_cut_add_up_to_the_whole_batch_token_mean():
    torch.manual_seed(0)
    _, targets, _ = chat_batch_for_step(_plan(global_batch=6), seed=3, step=1)
    vocab = 256
    targets = targets.remainder(vocab).masked_fill(targets == IGNORE_INDEX, IGNORE_INDEX)
    hidden = torch.randn(6, 16, 8, dtype=torch.float64)
    weight = torch.randn(8, vocab, dtype=torch.float64, requires_grad=True)
    adapter = ModelAdapter.__new__(ModelAdapter)
    whole, whole_grad = _loss_and_grad([(hidden, targets)], weight, adapter.loss)
    assert whole == F.cross_entropy((hidden @ weight).flatten(0, 1), targets.flatten()).item()
    for pieces in (1, 2, 3, 6):
        step = StepLoss(adapter.loss_sum)
        assert step.start(targets) == int((targets != IGNORE_INDEX).sum())
        shares, grad = _loss_and_grad(list(zip(hidden.chunk(pieces), targets.chunk(pieces))), weight, step)
        assert abs(step.value(shares) - whole) < 1e-12 * whole
        torch.testing.assert_close(grad, whole_grad, rtol=1e-12, atol=1e-15)
    # what plait did before: each piece's own mean, averaged -- a different loss and gradient
    means, _ = _loss_and_grad(list(zip(hidden.chunk(3), targets.chunk(3))), weight,
                              lambda logits, t: adapter.loss(logits, t) / 3)
    assert abs(means - whole) > 1e-3 * whole


def test_data_ranks_scale_their_shares_by_how_many_the_reduction_averages():
    """Two data ranks each holding half the rows: each share times 2, so the averaged gradient is the whole mean."""
    targets = torch.tensor([[1, 2, IGNORE_INDEX, IGNORE_INDEX], [3, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]])
    step = StepLoss(lambda logits, t: logits.sum())
    step.tokens, step.ranks = 3, 2  # what start() finds over the two ranks' rows
    assert step(torch.tensor(6.0), targets) == 4.0 and step.value(12.0) == 6.0


def test_a_step_without_a_trained_token_weighs_nothing():
    step = StepLoss(ModelAdapter.__new__(ModelAdapter).loss_sum)
    targets = torch.full((2, 4), IGNORE_INDEX)
    assert step.start(targets) == 0 and step_trained_tokens(targets) == 0
    logits = torch.randn(2, 4, 5, requires_grad=True)
    loss = step(logits, targets)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(logits.grad) == 0
