"""Which files of a folder make up its Hugging Face tokenizer: what an export copies (plait.hf.checkpoint)
and what the token cache's key hashes (plait.train.data.HFTokenizer.identity), so that the two never disagree.

transformers 5 writes a tokenizer as ``tokenizer.json``, ``tokenizer_config.json``, the chat template as
``chat_template.jinja`` (named extra templates under ``additional_chat_templates/``), and, depending on the class,
vocabulary files (``vocab.json`` and ``merges.txt``, ``tokenizer.model``, ``vocab.txt``, ...). Older folders hold
``special_tokens_map.json``, ``added_tokens.json`` or a processor's ``chat_template.json``. The class's own
vocabulary file names come from transformers (``vocab_files_names`` of the ``tokenizer_class`` the config names).

No torch here: the launcher reads tokenizers before any rank starts.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = "chat_template.jinja"
"""Where transformers 5 writes a tokenizer's chat template (older folders keep it in tokenizer_config.json)."""
CHAT_TEMPLATE_DIR = "additional_chat_templates"
FIXED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
               CHAT_TEMPLATE, "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt",
               "spiece.model", "sentencepiece.bpe.model")
"""Files any tokenizer folder may hold, whatever its class."""


def tokenizer_files(folder: str | Path) -> list[Path]:
    """The tokenizer files `folder` holds, relative to it, in a fixed order (the named templates last)."""
    folder = Path(folder)
    names = dict.fromkeys([*FIXED_FILES, *_class_vocabulary_files(folder)])
    found = [Path(name) for name in names if (folder / name).is_file()]
    templates = folder / CHAT_TEMPLATE_DIR
    if templates.is_dir():
        found += sorted(p.relative_to(folder) for p in templates.glob("*.jinja") if p.is_file())
    return found


def _class_vocabulary_files(folder: Path) -> list[str]:
    """The vocabulary files of the tokenizer class tokenizer_config.json names, as transformers knows them."""
    try:
        name = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return []
    if not isinstance(name, str) or not name.isidentifier():
        return []
    try:
        import transformers

        names = getattr(getattr(transformers, name, None), "vocab_files_names", None) or {}
    except Exception:  # a transformers that cannot import this class: the fixed names still hold
        return []
    return [value for value in names.values() if isinstance(value, str)]


def has_chat_template(folder: str | Path) -> bool:
    """Whether the tokenizer in `folder` carries a chat template (its own file, or tokenizer_config.json's key)."""
    folder = Path(folder)
    if (folder / CHAT_TEMPLATE).is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False
