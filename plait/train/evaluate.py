"""Validation during training: the loss on held-out tokens every [eval] every steps, under the run's plan.

The held-out batches are the same at every evaluation (the first `eval.batches` of a loader over the held-out
tokens, seeded like the run), so two evaluations differ only by the weights. Every rank takes part (the
forward is as parallel as the training step); rank 0 writes the result to every sink and, with
`eval.keep_best`, every rank saves a checkpoint in <checkpoint.dir>/best when the loss is the lowest so far.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait.train.data import BatchLoader, LoaderPosition, eval_tokens
from plait.train.documents import packing_for

BEST_DIR = "best"


class Evaluator:
    def __init__(self, config: Any, plan: Any, model: Any) -> None:
        self.config = config
        self.every = config.eval.every
        self.module_run = plan.operators is not None
        if self.module_run:  # a module's held-out batches (eval.batch)
            from plait.train.module_run import module_loader

            self.loader = module_loader(config, plan, model, held_out=True)
        else:
            dp_mesh = model.mesh["dp"]
            self.loader = BatchLoader(_rank_eval_tokens(config, plan), global_batch=config.train.global_batch,
                                      seq_len=config.train.seq_len, seed=config.train.seed,
                                      dp_rank=dp_mesh.get_local_rank(), dp_degree=dp_mesh.size(),
                                      packing=packing_for(config, plan.model))
        self.batches = min(config.eval.batches, self.loader.steps_per_epoch)

    def for_model(self, plan: Any, model: Any) -> "Evaluator":
        """The same evaluation for a model switched to another plan (the best loss so far lives in the run's state)."""
        return Evaluator(self.config, plan, model)

    def due(self, step: int, final: bool) -> bool:
        return self.every > 0 and (final or step % self.every == 0)

    def loss(self, model: Any) -> float:
        """The token mean of the loss over the held-out batches' trained tokens, as a step's; a module's own loss
        averaged over its held-out batches (collective)."""
        mean = self._module_loss(model) if self.module_run else self._token_loss(model)
        # rank 0's value for everyone: whether to save the best checkpoint (a collective) is one decision
        agreed = torch.tensor([mean], dtype=torch.float64, device=model.device)
        dist.broadcast(agreed, src=0)
        return agreed.item()

    def _token_loss(self, model: Any) -> float:
        self.loader.position = LoaderPosition()
        total, tokens = 0.0, 0
        for _ in range(self.batches):
            rows = self.loader.next_rows()
            loss = model.eval_loss(rows.tokens, rows.targets, rows.positions)
            total += loss * model.step_loss.tokens  # each batch's mean over its trained tokens, counted by them
            tokens += model.step_loss.tokens
        return total / max(tokens, 1)

    def _module_loss(self, model: Any) -> float:
        self.loader.rewind()
        return sum(model.eval_loss(*self.loader.next_batch()) for _ in range(self.batches)) / self.batches

    def after_step(self, state: Any, sinks: Any, final: bool) -> float | None:
        """Evaluate when due, log it, and keep the best checkpoint when asked; returns the loss (None if not due)."""
        if not self.due(state.step, final):
            return None
        loss = self.loss(state.model)
        if dist.get_rank() == 0:
            sinks.evaluation(state.step, {"val_loss": loss})
            print(f"plait: step {state.step}: validation loss {loss:.4f}", file=sys.stderr, flush=True)
        if state.best_val_loss is None or loss < state.best_val_loss:
            state.best_val_loss = loss  # before the save: the best checkpoint's meta.json records its own loss
            if self.config.eval.keep_best:
                from plait.train.checkpoint import save_checkpoint

                save_checkpoint(Path(self.config.checkpoint.dir) / BEST_DIR, state, keep=1)
        return loss


def _rank_eval_tokens(config: Any, plan: Any) -> Any:
    """The held-out tokens on every rank; rank 0 reads (and caches) first, as plait.train.data.rank_tokens does."""
    if dist.get_rank() == 0:
        tokens = eval_tokens(config, plan.model)
    dist.barrier()
    return tokens if dist.get_rank() == 0 else eval_tokens(config, plan.model)
