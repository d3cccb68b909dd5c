"""Generate text from trained weights in one process (the demo's proof that the model learned)."""

from __future__ import annotations

from pathlib import Path

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
