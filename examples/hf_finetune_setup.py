"""Build the tiny checkpoint examples/hf-finetune.toml fine-tunes, then check its export.

    python examples/hf_finetune_setup.py            # writes runs/hf-finetune/base (nothing is downloaded)
    plait train examples/hf-finetune.toml           # fine-tunes it on 4 local processes, exports runs/hf-finetune/hf
    python examples/hf_finetune_setup.py --check    # loads the export with from_pretrained and compares logits

The base folder is what a Hugging Face checkpoint looks like: config.json, model.safetensors (a 4-layer Llama
with random weights) and a tokenizer (byte-level BPE, 512 ids, trained here on the shipped Shakespeare text).
--check loads runs/hf-finetune/hf with `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer`, and compares
its logits on a line of the text with those of the weights plait gathered at the end of training (model.pt),
and its loss with the base model's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path("runs/hf-finetune")
VOCAB = 512
MODEL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=172, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=1)


def build(root: Path) -> None:
    from plait.hf.tiny import train_tokenizer, write_tiny_checkpoint
    from plait.train.data import shipped_text_path

    base = root / "base"
    text = shipped_text_path().read_text(encoding="utf-8")
    write_tiny_checkpoint("llama", base, seed=0, **MODEL)
    train_tokenizer([text[i:i + 10_000] for i in range(0, len(text), 10_000)], VOCAB, base)
    print(f"wrote {base}: {', '.join(sorted(p.name for p in base.iterdir()))}")
    print("next: plait train examples/hf-finetune.toml")


def check(root: Path) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    from plait.train.data import shipped_text_path

    logging.disable_progress_bar()
    export = root / "hf"
    tokenizer = AutoTokenizer.from_pretrained(str(export), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(export), local_files_only=True).eval()
    trained = AutoModelForCausalLM.from_config(model.config).eval()
    trained.load_state_dict(torch.load(root / "model.pt"), strict=False)
    trained.tie_weights()
    base = AutoModelForCausalLM.from_pretrained(str(root / "base"), local_files_only=True).eval()
    text = shipped_text_path().read_text(encoding="utf-8")[:2000]
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :128]
    with torch.no_grad():
        logits, reference = model(ids).logits, trained(ids).logits
        loss, base_loss = model(ids, labels=ids).loss.item(), base(ids, labels=ids).loss.item()
    diff = (logits - reference).abs().max().item()
    print(f"from_pretrained({export}): logits on {ids.shape[1]} tokens differ from the trained weights' by "
          f"{diff:.1e} (max abs)")
    print(f"loss on them: {loss:.3f} fine-tuned, {base_loss:.3f} before")
    return 0 if diff < 1e-4 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="load the export and compare logits")
    parser.add_argument("--root", type=Path, default=ROOT, help=f"where the runs go (default {ROOT})")
    args = parser.parse_args()
    if args.check:
        return check(args.root)
    build(args.root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
