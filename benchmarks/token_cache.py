"""Tokenized once: the time a run spends on its data the first time (tokenize, pack, write the cache) and every
later time (hash the file, open the cached tokens), for the shipped text and for JSON lines.

    OMP_NUM_THREADS=1 python benchmarks/token_cache.py [--repeat 5] [--copies 8]

The tokenizer is the example's (byte-level BPE, 512 ids, trained here on the shipped text). The JSON-lines file
holds the shipped text's paragraphs, one document each, `--copies` times. Each figure is the median of --repeat
runs (a fresh cache folder for every cold run); the ratio is cold / cached, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table


def timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--copies", type=int, default=8, help="copies of the text in the JSON-lines file")
    args = parser.parse_args()

    from plait.hf.tiny import train_tokenizer
    from plait.train.data import cached_tokens, load_tokenizer, shipped_text_path

    root = Path(tempfile.mkdtemp(prefix="plait-token-cache-"))
    text = shipped_text_path().read_text(encoding="utf-8")
    tokenizer = load_tokenizer(str(train_tokenizer([text[i:i + 10_000] for i in range(0, len(text), 10_000)],
                                                   512, root / "tokenizer")))
    paragraphs = [p for p in text.split("\n\n") if p.strip()] * args.copies
    jsonl = root / "paragraphs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    cases = [("shipped text, 1 doc", shipped_text_path(), "text"), (f"JSON lines, {len(paragraphs):,} docs", jsonl, "jsonl")]

    table = Table(title=f"token cache, byte-level BPE of 512 ids, median of {args.repeat}")
    for col in ("data", "MB", "tokens", "cold s", "cached s", "cold / cached"):
        table.add_column(col, justify="right")
    for label, file, source in cases:
        cold, warm, tokens = [], [], 0
        for run in range(args.repeat):
            cache = root / f"cache-{source}-{run}"
            cold.append(timed(lambda: cached_tokens(file, source, tokenizer, cache)))
            warm.append(timed(lambda: cached_tokens(file, source, tokenizer, cache)))
            tokens = len(cached_tokens(file, source, tokenizer, cache))
        c, w = statistics.median(cold), statistics.median(warm)
        table.add_row(label, f"{file.stat().st_size / 1e6:.1f}", f"{tokens:,}", f"{c:.3f}", f"{w:.4f}",
                      f"{c / w:.0f}x")
    Console().print(table)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
