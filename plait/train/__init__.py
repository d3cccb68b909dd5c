"""plait.train: what `plait train` and `plait demo` run on every rank.

* config.py   -- the TOML config: nested frozen dataclasses, `--set section.key=value` overrides;
* resolve.py  -- config -> ModelSpec and Plan, every mismatch refused before ranks start (no torch);
* data.py     -- tokenizers (bytes, tokenizer.json), shipped/text/JSON-lines/token-file sources, the token cache,
                 the sharded, resumable BatchLoader;
* loop.py     -- parallelize the plan, AdamW + warm-up/cosine, clip, steps, metrics, loss plot;
* metrics.py  -- model FLOPs, tokens/s and MFU, metrics.jsonl, the rank-0 progress bar;
* hooks.py    -- where checkpoints plug into the loop (TrainState, resume / after_step);
* checkpoint.py -- checkpoints, exact resume, resharding (Hugging Face weights in and out: plait.hf.checkpoint;
                 injected faults: plait.runtime.faults);
* sample.py   -- text generation from the full weights in one process (the demo's sample).
"""
