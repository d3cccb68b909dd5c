"""Generate text from trained weights in one process (the demo's proof that the model learned)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Collection

import torch

from plait.models import build_model
from plait.spec import ModelSpec
from plait.train.data import ByteTokenizer


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: torch.Tensor, *, num_tokens: int, max_seq_len: int,
             top_k: int = 0, temperature: float = 1.0, seed: int = 0) -> torch.Tensor:
    """Extend `prompt` [s] by `num_tokens` tokens: greedy when top_k == 0, else top-k sampling."""
    generator = torch.Generator().manual_seed(seed)
    tokens = prompt.clone()
    for _ in range(num_tokens):
        window = tokens[-max_seq_len:].unsqueeze(0)  # [1, s]
        logits = model(window)[0, -1].float()  # [V]
        tokens = torch.cat([tokens, _pick(logits, top_k, temperature, generator).view(1)])
    return tokens


@torch.no_grad()
def sample(logits_of: Callable[[torch.Tensor], torch.Tensor], prompt: torch.Tensor, *, num_tokens: int,
           max_seq_len: int, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
           stop_ids: Collection[int] = (), stop: Callable[[torch.Tensor], bool] | None = None) -> torch.Tensor:
    """Extend `prompt` [s] by up to `num_tokens` tokens from `logits_of(tokens [1, s]) -> [1, s, V]`: greedy at
    temperature 0, else sampled from softmax(logits / temperature) cut to the top_k most likely (0: all) and to
    the smallest set holding top_p of the probability (nucleus sampling). Stops after a token of `stop_ids` (EOS,
    a chat template's end of turn), or once `stop(the tokens added so far)` is true (a stop string)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = prompt.clone()
    for _ in range(num_tokens):
        logits = logits_of(tokens[-max_seq_len:].unsqueeze(0))[0, -1].float()  # [V]
        picked = logits.argmax() if temperature <= 0 else _nucleus(logits / temperature, top_p, top_k, generator)
        tokens = torch.cat([tokens, picked.view(1)])
        if int(picked) in stop_ids or (stop is not None and stop(tokens[len(prompt):])):
            break
    return tokens


def _nucleus(logits: torch.Tensor, top_p: float, top_k: int, generator: torch.Generator) -> torch.Tensor:
    probs, order = torch.sort(torch.softmax(logits, dim=-1), descending=True)
    keep = torch.cumsum(probs, dim=-1) - probs < top_p  # the most likely tokens until top_p is covered (>= 1 kept)
    if top_k > 0:
        keep[top_k:] = False
    kept = probs * keep
    choice = torch.multinomial(kept / kept.sum(), 1, generator=generator)
    return order[choice[0]]


def _pick(logits: torch.Tensor, top_k: int, temperature: float, generator: torch.Generator) -> torch.Tensor:
    if top_k <= 0:
        return logits.argmax()
    values, indices = torch.topk(logits / temperature, min(top_k, logits.numel()))
    choice = torch.multinomial(torch.softmax(values, dim=-1), 1, generator=generator)
    return indices[choice[0]]


def sample_text(spec: ModelSpec, state_dict: dict[str, torch.Tensor], prompt: str, *, num_tokens: int = 300,
                top_k: int = 5, seed: int = 0) -> str:
    """Load a full state dict into a single-process model and continue `prompt` (byte tokens)."""
    model = build_model(spec, device="cpu")
    model.load_state_dict(state_dict)
    model.eval()
    tokenizer = ByteTokenizer()
    prompt_ids = torch.from_numpy(tokenizer.encode(prompt))
    out = generate(model, prompt_ids, num_tokens=num_tokens, max_seq_len=spec.max_seq_len, top_k=top_k, seed=seed)
    return tokenizer.decode(out.numpy())


def sample_from_file(spec: ModelSpec, model_file: str | Path, prompt: str, **kwargs) -> str:
    state_dict = torch.load(model_file, map_location="cpu", weights_only=True)
    return sample_text(spec, state_dict, prompt, **kwargs)
