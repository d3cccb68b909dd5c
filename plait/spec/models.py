"""Model presets: the GPT family of Narayanan et al. (SC21), GPT-3 175B, the 22B model of
Korthikanti et al., Llama-2/3, Mixtral 8x7B (mixture of experts), and tiny models for local runs. Shapes
from the papers and the models' published config.json files."""

from __future__ import annotations

from plait.spec.model import ModelSpec


def _gpt(name: str, layers: int, hidden: int, heads: int, vocab: int = 51200, seq: int = 2048,
         tied: bool = True) -> ModelSpec:
    # Megatron's GPT shares the input embedding with the output layer: the papers' parameter
    # formula P = 12Lh²(1 + 13/(12h) + (V+s)/(12Lh)) counts the V·h table once.
    return ModelSpec(name=name, arch="gpt", num_layers=layers, hidden_size=hidden, num_heads=heads,
                     vocab_size=vocab, max_seq_len=seq, tied_embeddings=tied)


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int, seq: int,
           theta: float) -> ModelSpec:
    return ModelSpec(name=name, arch="llama", num_layers=layers, hidden_size=hidden, num_heads=heads,
                     num_kv_heads=kv, ffn_hidden_size=ffn, vocab_size=vocab, max_seq_len=seq,
                     norm_eps=1e-5, rope_theta=theta)


MODEL_PRESETS: dict[str, ModelSpec] = {
    # Narayanan et al. 2021, Table 1 (V = 51,200, s = 2048)
    "gpt-1.7b": _gpt("gpt-1.7b", 24, 2304, 24),
    "gpt-3.6b": _gpt("gpt-3.6b", 30, 3072, 32),
    "gpt-7.5b": _gpt("gpt-7.5b", 36, 4096, 32),
    "gpt-18.4b": _gpt("gpt-18.4b", 40, 6144, 48),
    "gpt-39.1b": _gpt("gpt-39.1b", 48, 8192, 64),
    "gpt-76.1b": _gpt("gpt-76.1b", 60, 10240, 80),
    "gpt-145.6b": _gpt("gpt-145.6b", 80, 12288, 96),
    "gpt-310.1b": _gpt("gpt-310.1b", 96, 16384, 128),
    "gpt-529.6b": _gpt("gpt-529.6b", 105, 20480, 128),
    "gpt-1t": _gpt("gpt-1t", 128, 25600, 160),
    # Korthikanti et al. 2022
    "gpt-22b": _gpt("gpt-22b", 48, 6144, 64),
    "gpt3-175b": _gpt("gpt3-175b", 96, 12288, 96),
    # Llama-2 / Llama-3 (published config.json)
    "llama2-7b": _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096, 10000.0),
    "llama2-13b": _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096, 10000.0),
    "llama2-70b": _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096, 10000.0),
    "llama3-8b": _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, 500000.0),
    "llama3-70b": _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, 500000.0),
    "llama3-405b": _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192, 500000.0),
    # Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1 config.json): Mistral 7B's attention, every MLP 8 experts of
    # width 14336, each token to 2 of them (46.7B parameters, 12.9B active); run as plait's reference MoE
    "mixtral-8x7b": _llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 32768, 1e6).replace(
        num_experts=8, experts_per_token=2, moe_ffn_hidden_size=14336, moe_aux_loss_coef=0.02),
    # Local runs on CPU: byte-level vocabulary
    "tiny-gpt": _gpt("tiny-gpt", 4, 128, 4, vocab=256, seq=256, tied=False),
    "tiny-llama": _llama("tiny-llama", 4, 128, 4, 2, 256, 256, 256, 10000.0),
    # 4 experts of width 128, each token to 2 of them
    "tiny-moe": _llama("tiny-moe", 4, 128, 4, 2, 256, 256, 256, 10000.0).replace(
        num_experts=4, experts_per_token=2, moe_ffn_hidden_size=128),
}
