"""Sample text from trained weights: a `plait train` checkpoint, or a Hugging Face folder (an export).

    plait generate runs/x/ckpt --prompt "To be"                 # greedy, from the newest complete checkpoint
    plait generate runs/x/ckpt/step_000200 --prompt "ROMEO:" --temperature 0.8 --top-p 0.9 --tokens 200
    plait generate runs/ft/hf --prompt "To be, or not"          # a Hugging Face folder (plait export, export_hf)
    plait generate runs/chat/hf --chat --prompt "Who wrote Hamlet?" --stop "\n\n"   # the reply to one message

A checkpoint may come from any plan and any model plait trains (its own decoders, Hugging Face classes): its
sharded files are read into one process on CPU, with the tokenizer the run used. A Hugging Face folder is loaded
with transformers (`from_pretrained`, local files only) and its own tokenizer.json (bytes when it has none).

Generation stops at EOS, at the end-of-turn token of the tokenizer's chat template (ChatML's <|im_end|>, Llama 3's
<|eot_id|>, ...), at the model folder's generation_config.json eos_token_id, and at any --stop string (the text is
cut before it); special tokens are not printed. With --chat the prompt is one user message rendered by the chat
template, and only the reply is printed.
Note that a checkpoint's DCP metadata is unpickled by torch: read checkpoints you trust (share exports).
"""

from __future__ import annotations

import argparse
import functools
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from plait.commands import positive_int
from plait.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("weights", help="a checkpoint.dir (its newest complete checkpoint), one of its step_NNNNNN "
                                        "folders, or a Hugging Face model folder (config.json + safetensors)")
    parser.add_argument("--prompt", default="", help="text to continue (default: nothing, from the first token)")
    parser.add_argument("--tokens", type=positive_int, default=100, metavar="N", help="tokens to add (default 100)")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T",
                        help="0 (default): greedy, the most likely token each time; > 0 samples")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P",
                        help="sample from the most likely tokens holding this much probability (default 1: all)")
    parser.add_argument("--top-k", type=int, default=0, metavar="K", help="and at most K of them (default 0: any)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    parser.add_argument("--chat", action="store_true",
                        help="render --prompt as a user message with the tokenizer's chat template; print the reply")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="stop once the generated text holds TEXT, and print it without (repeatable)")


@dataclass(frozen=True, kw_only=True)
class Generator:
    """What sampling needs of a model: its logits for a batch of tokens, its tokenizer and its context length."""

    logits_of: Callable[[Any], Any]
    tokenizer: Any
    max_seq_len: int
    model_dir: Path | None = None
    """The Hugging Face model folder (its generation_config.json), None for plait's own models."""


def main(args: argparse.Namespace) -> int:
    from plait.train.sample import sample

    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        raise ConfigError(f"--temperature {args.temperature} must be >= 0, --top-p {args.top_p} in (0, 1] and "
                          f"--top-k {args.top_k} >= 0")
    if any(not text for text in args.stop):
        raise ConfigError("--stop '' would stop at once; give the text to stop at, e.g. --stop '\\n\\n'")
    if args.chat and not args.prompt:
        raise ConfigError("--chat answers a message: give it with --prompt \"...\"")
    generator = load_generator(Path(args.weights))
    chat = chat_template_tokenizer(generator.tokenizer) if args.chat else None
    prompt = chat_prompt_ids(chat, args.prompt) if chat is not None else prompt_ids(generator.tokenizer, args.prompt)
    decode, ends = generator.tokenizer.decode, end_ids(generator)
    stop = (lambda added: _holds_any(decode(added.numpy()), args.stop)) if args.stop else None
    out = sample(generator.logits_of, prompt, num_tokens=args.tokens, max_seq_len=generator.max_seq_len,
                 temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                 stop_ids=ends, stop=stop)
    print(printed_text(decode, prompt, out, ends, args.stop, reply_only=chat is not None))
    return 0


def _holds_any(text: str, stops: list[str]) -> bool:
    return any(s in text for s in stops)


def printed_text(decode: Callable[[Any], str], prompt: Any, out: Any, ends: frozenset[int], stops: list[str],
                 reply_only: bool) -> str:
    """The prompt and what was added (only what was added: `reply_only`), without the token of `ends` that ended
    it nor anything from a stop string on."""
    if len(out) > len(prompt) and int(out[-1]) in ends:
        out = out[:-1]
    text = decode(out[len(prompt):].numpy()) if reply_only else decode(out.numpy())
    start = 0 if reply_only else _prompt_length(decode(prompt.numpy()), text)
    cuts = [at for s in stops if (at := text.find(s, start)) >= 0]
    return text[:min(cuts)] if cuts else text


def _prompt_length(prompt_text: str, text: str) -> int:
    """Where the added text starts in the whole text (a stop string inside the prompt does not count)."""
    return len(prompt_text) if text.startswith(prompt_text) else 0


def end_ids(generator: Generator) -> frozenset[int]:
    """The tokens that end a generation: EOS, the chat template's end of turn, generation_config.json's
    eos_token_id (one id or a list)."""
    import json

    tokenizer = generator.tokenizer
    ids = {tokenizer.eos_id} if tokenizer.eos_id is not None else set()
    config = generator.model_dir / "generation_config.json" if generator.model_dir else None
    if config is not None and config.is_file():
        try:
            eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            eos = None
        ids |= {i for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int)}
    chat = chat_template_tokenizer(tokenizer, required=False)
    if chat is not None:  # a model fine-tuned on chats ends its answer with the template's end of turn
        from plait.train.chat import end_of_turn_id

        end = end_of_turn_id(chat)
        ids |= {end} if end is not None else set()
    return frozenset(ids)


def chat_template_tokenizer(tokenizer: Any, required: bool = True) -> Any:
    """transformers' tokenizer of a Hugging Face tokenizer folder with a chat template; None when it has none and it
    is not `required` (--chat requires one)."""
    from plait.hf.tokenizer_files import has_chat_template

    folder = getattr(tokenizer, "folder", None)
    if folder is None or not has_chat_template(folder):
        if required:
            raise ConfigError(f"--chat renders the prompt with a chat template, and the tokenizer "
                              f"{getattr(tokenizer, 'name', 'byte')!r} has none; drop --chat, or generate from a "
                              f"model whose tokenizer has one (chat_template.jinja)")
        return None
    return _chat_tokenizer(str(folder))


@functools.lru_cache(maxsize=4)
def _chat_tokenizer(folder: str) -> Any:
    from plait.train.chat import chat_tokenizer

    return chat_tokenizer(Path(folder), needed_by="--chat", otherwise="drop --chat")


def chat_prompt_ids(chat: Any, text: str) -> Any:
    import numpy as np
    import torch

    from plait.train.chat import prompt_ids as rendered

    return torch.from_numpy(np.asarray(rendered(chat, text), dtype=np.int64))


def prompt_ids(tokenizer: Any, text: str) -> Any:
    import numpy as np
    import torch

    ids = tokenizer.encode_documents([text])[0] if text else np.zeros(0, dtype=np.int64)
    if not len(ids):  # sampling needs one token to condition on: the document separator starts a text
        ids = np.array([tokenizer.eos_id or 0], dtype=np.int64)
    return torch.from_numpy(np.asarray(ids, dtype=np.int64))


def load_generator(path: Path) -> Generator:
    if (path / "config.json").is_file() and not (path / "meta.json").is_file():
        return hf_folder_generator(path)
    return checkpoint_generator(path)


def hf_folder_generator(folder: Path) -> Generator:
    """A Hugging Face model folder, loaded by transformers itself."""
    import torch
    from transformers import AutoModelForCausalLM

    from plait.train.data import load_tokenizer
    from plait.train.resolve import position_limit

    if not any(folder.glob("*.safetensors")):
        raise ConfigError(f"model folder {str(folder)!r} holds no *.safetensors weights; give a folder plait export "
                          f"(or [checkpoint] export_hf) wrote, or a checkpoint folder")
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32).eval()
    limit = position_limit(folder)
    return Generator(logits_of=lambda tokens: model(tokens).logits, tokenizer=load_tokenizer(None, folder),
                     max_seq_len=limit[1] if limit else 2048, model_dir=folder)


def checkpoint_generator(path: Path) -> Generator:
    """A `plait train` checkpoint, whatever plan wrote it, as one single-process model on CPU."""
    from plait.commands.export import checkpoint_step
    from plait.models import adapter_for
    from plait.plan import Plan
    from plait.train.data import load_tokenizer

    step_dir, meta = checkpoint_step(path)
    plan = Plan.from_dict(meta["plan"])
    adapter = adapter_for(plan.model)
    model = adapter.build_adapted("cpu")
    if plan.model.lora is not None:  # the checkpoint holds the adapters; the base is where the run started from
        from plait.execute.lora_export import load_base

        load_base(model, plan.model, meta)
    load_model_state(model, step_dir)
    adapter.reset_buffers(model)  # non-persistent buffers (rotary tables) are not in the checkpoint
    model.eval()
    data = meta.get("config", {}).get("data", {})
    model_dir = plan.model.source.removeprefix("hf:") if plan.model.source.startswith("hf:") else None
    tokenizer = load_tokenizer(data.get("tokenizer"), model_dir)
    print(f"plait generate: step {meta.get('step')} of {step_dir.parent} ({plan.model.name})", file=sys.stderr)
    return Generator(logits_of=lambda tokens: adapter.forward(model, tokens), tokenizer=tokenizer,
                     max_seq_len=plan.model.max_seq_len, model_dir=Path(model_dir) if model_dir else None)


def load_model_state(model: Any, step_dir: Path) -> None:
    """Read the checkpoint's model tensors into `model` in this process (DCP reads every shard's slice); tied aliases
    are not saved, and follow their canonical parameter."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(step_dir))
    saved = {key.removeprefix("model.") for key in reader.read_metadata().state_dict_metadata if key.startswith("model.")}
    state = {name: tensor for name, tensor in model.state_dict().items() if name in saved}
    if not state:
        raise ConfigError(f"checkpoint {str(step_dir)!r} holds none of this model's tensors; was it saved for another "
                          f"model?")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": state}, storage_reader=reader)
    model.load_state_dict(state, strict=False)
