"""Does running a Hugging Face model unchanged cost anything? Step time of transformers' LlamaForCausalLM under
plait against plait's reference Llama decoder of exactly the same shape (the same ModelSpec but its source),
under the same plans, in one launch (target: within 5%).

The runs alternate inside one launch, one step each per round, the order rotating, so that the noise of a
shared machine hits all of them alike; the table gives per-step medians (the slowest rank's time of each
step) and the ratio HF / plait per plan.

    .venv/bin/python benchmarks/adapter_overhead.py [--nproc 2] [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _ranks import add_worker_flag, run_on_ranks

WARMUP_STEPS = 2
PLANS = {"dp2 (DDP)": dict(dp=2), "dp2 FSDP": dict(dp=2, zero=3), "tp2 SP": dict(tp=2, sequence_parallel=True),
         "pp2 1F1B": dict(pp=2, schedule="1f1b")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30, help="timed steps of each run (one per round)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--plans", default=",".join(PLANS), help="comma-separated subset of: " + ", ".join(PLANS))
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    add_worker_flag(parser)
    return parser.parse_args(argv)


def write_config(args: argparse.Namespace, directory: Path) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=int(args.hidden * 8 / 3) // 64 * 64,
                num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 128,
                max_position_embeddings=args.seq_len, bos_token_id=0, eos_token_id=1).save_pretrained(str(directory))
    return directory


def plans(args: argparse.Namespace) -> dict[str, tuple]:
    from plait.plan import Plan
    from plait.spec import TrainSpec
    from plait.spec.clusters import CLUSTER_PRESETS
    from plait.spec.load import load_model

    hf = load_model(args.model_dir)
    reference = hf.replace(source="plait", name="plait-llama")  # the same shape on plait's own decoder
    out = {}
    for name in args.plans.split(","):
        kwargs = dict(PLANS[name])
        dp = kwargs.get("dp", 1)
        micro = 2
        train = TrainSpec(global_batch=args.global_batch, seq_len=args.seq_len, precision="fp32")
        common = dict(micro_batch=args.global_batch // dp // micro, num_micro_batches=micro, train=train,
                      cluster=CLUSTER_PRESETS["local-cpu"].with_devices(args.nproc), **kwargs)
        out[name] = (Plan.of(model=hf, **common), Plan.of(model=reference, **common))
    return out


class Loop:
    def __init__(self, plan) -> None:
        from plait.execute import parallelize

        self.model = parallelize(plan, seed=0, device="cpu")
        self.optimizer = self.model.make_optimizer(lr=1e-3)
        self.plan = plan

    def step(self, tokens, targets) -> None:
        from plait.execute import dp_shard

        self.optimizer.zero_grad(set_to_none=True)
        rank = self.model.dp_rank
        self.model.train_step(dp_shard(self.plan, tokens, rank), dp_shard(self.plan, targets, rank))
        self.model.clip_grad_norm_(1.0)
        self.optimizer.step()


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from plait.execute import batch_for_step
    from plait.runtime.launch import init_distributed

    rank, _ = init_distributed("gloo")
    loops = {}
    for name, (hf, ref) in plans(args).items():
        loops[f"{name} | HF"] = Loop(hf)
        loops[f"{name} | plait"] = Loop(ref)
    any_plan = next(iter(plans(args).values()))[0]
    batches = [batch_for_step(any_plan, 0, i) for i in range(4)]
    for loop in loops.values():
        for i in range(WARMUP_STEPS):
            loop.step(*batches[i])
    times: dict[str, list[float]] = {name: [] for name in loops}
    names = list(loops)
    for r in range(args.rounds):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            dist.barrier()
            began = time.perf_counter()
            loops[name].step(*batches[r % len(batches)])
            times[name].append(time.perf_counter() - began)
    for name, values in times.items():
        tensor = torch.tensor(values)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        times[name] = tensor.tolist()
    if rank == 0:
        report(args, times)
    from plait.runtime.launch import shutdown_distributed

    shutdown_distributed()  # at a barrier: a rank closing its connections while another reads aborts it


def report(args: argparse.Namespace, times: dict[str, list[float]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"HF LlamaForCausalLM vs plait's Llama, same shape and plan: {args.nproc} ranks, "
                        f"{args.layers}x{args.hidden}, {args.global_batch}x{args.seq_len} tokens/step, "
                        f"{args.rounds} rounds")
    for column in ("plan", "HF median", "plait median", "HF / plait"):
        table.add_column(column, justify="left" if column == "plan" else "right")
    for plan in args.plans.split(","):
        hf, ref = statistics.median(times[f"{plan} | HF"]), statistics.median(times[f"{plan} | plait"])
        table.add_row(plan, f"{hf * 1e3:.1f} ms", f"{ref * 1e3:.1f} ms", f"{hf / ref:.3f}")
    Console(width=120).print(table)


def main() -> int:
    args = parse_args()
    if args.worker:
        return run_on_ranks(args, worker, __file__)
    with tempfile.TemporaryDirectory(prefix="plait-bench-") as tmp:
        directory = write_config(args, Path(tmp) / "llama")
        return run_on_ranks(args, worker, __file__, extra=("--model-dir", str(directory)))


if __name__ == "__main__":
    sys.exit(main())
