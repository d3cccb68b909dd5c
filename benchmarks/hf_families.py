"""Every causal LM type of the installed transformers that declares a base_model_pp_plan, run by plait unchanged.

For each type: a tiny config from ``AutoConfig.for_model`` (sizes shrunk: `tiny_overrides`), written to
WORK/<type>/config.json; then each plan on 2 ranks: dp2, pp2 (1F1B), tp2 (with sequence parallelism; where the
class has a tensor-parallel plan) and ep2 (where it has experts). Each plan is

* REFUSED when plait's legality rules (or the adapter, for a layout it cannot read) refuse it before any rank
  starts: the rule is shown;
* otherwise run by the verdict of `plait check` (plait.execute.equivalence, float64, 2 AdamW steps): EQUAL or
  DIFFERENT; CRASH when a rank raised.

All admitted cases run in one launch of 2 ranks (this file is also its worker), which saves the ranks' imports
per case; results go to a JSON-lines file as they come, so a run resumes where it stopped (--results). A rank
that dies marks its case CRASH and the launch restarts on the rest.

    python benchmarks/hf_families.py                                  # every type, every plan (long: hours)
    python benchmarks/hf_families.py --families llama,olmo2 --plans dp2,pp2 --jobs 2
    nohup python benchmarks/hf_families.py --results /tmp/sweep.jsonl > /tmp/sweep.log 2>&1 &
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

PLANS: dict[str, dict[str, Any]] = {
    "dp2": dict(dp=2),
    "pp2": dict(pp=2, schedule="1f1b"),
    "tp2": dict(tp=2, sequence_parallel=True),
    "ep2": dict(dp=2, ep=2),
}
SEQ_LEN = 16
MAX_TINY_PARAMS = 20_000_000
SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=96, max_position_embeddings=128, moe_intermediate_size=32,
             shared_expert_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4,
             num_experts_per_tok=2, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
             v_head_dim=16, qk_head_dim=16, rotary_dim=8, sliding_window=64, first_k_dense_replace=1, n_group=1, topk_group=1,
             vocab_size_per_layer_input=96, hidden_size_per_layer_input=16, laurel_rank=8, num_kv_shared_layers=0,
             index_topk=8, index_head_dim=16, index_n_heads=2, linear_head_dim=16, linear_num_heads=4)
"""Sizes a tiny model takes, where its config has the key (others keep the class's defaults)."""
FILLED = dict(head_dim=16, num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1)
"""Sizes set even where the class's default is None (a None it cannot run with: MoE classes whose defaults leave the
expert counts to checkpoints, attention whose head_dim a checkpoint always gives)."""


def tiny_overrides(config: Any) -> dict[str, Any]:
    """The shrunk values for the keys `config` has; token ids inside the vocabulary; per-layer lists cut to a few
    layers that hold every kind the full list holds (a hybrid's attention layers, a MoE's dense and sparse MLPs).
    A heterogeneous config's per-layer overrides (transformers' per_layer_config) are cut and shrunk alike."""
    if getattr(config, "is_heterogeneous", False):
        config.allow_global_per_layer_attribute_access = True  # read the class's global defaults to shrink them
    out = {key: value for key, value in SIZES.items() if getattr(config, key, None) is not None}
    out.update({key: value for key, value in FILLED.items() if hasattr(config, key) and getattr(config, key) is None})
    for key, value in SIZES.items():  # a per-layer list of sizes (Gemma 3n's intermediate_size)
        if isinstance(getattr(config, key, None), list):
            out[key] = [value] * len(getattr(config, key))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(config, key, None) is not None:
            out[key] = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}[key]
    if "qk_rope_head_dim" in out:  # multi-head latent attention: its rotary tables are qk_rope_head_dim wide
        out["head_dim"] = out["qk_rope_head_dim"]
    if "kv_lora_rank" in out and "num_attention_heads" in out:  # latent attention has no grouped kv heads
        out["num_key_value_heads"] = out["num_attention_heads"]
    kept = _kept_layers(config)
    if kept is not None:
        out["num_hidden_layers"] = len(kept)
        for key, value in _per_layer_lists(config, {**vars(config), **out}).items():
            out[key] = [value[i] for i in kept]
        per_layer = {int(i): overrides for i, overrides in (config.to_dict().get("per_layer_config") or {}).items()}
        if per_layer:
            out["per_layer_config"] = {new: _shrunk(per_layer[old], out) for new, old in enumerate(kept) if old in per_layer}
    _rope_per_layer_type(config, out)
    for key, value in vars(config).items():  # a multimodal class's encoders: shrunk alike
        if hasattr(value, "to_dict") and hasattr(value, "model_type") and not key.startswith("_"):
            out[key] = {**value.to_dict(), **tiny_overrides(value)}
    return out


def _shrunk(overrides: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    return {key: out.get(key, SIZES.get(key, FILLED.get(key, value))) if isinstance(value, int) and not isinstance(value, bool)
            else value for key, value in overrides.items()}


def _per_layer_lists(config: Any, values: dict[str, Any]) -> dict[str, list]:
    count = getattr(config, "num_hidden_layers", -1)
    return {key: value for key, value in values.items()
            if isinstance(value, list) and len(value) == count and key != "architectures"}


def _kept_layers(config: Any) -> list[int] | None:
    """The first layer of each kind a per-layer list names, filled up to the tiny layer count with the first layers."""
    count = getattr(config, "num_hidden_layers", None)
    if not isinstance(count, int):
        return None
    kept: set[int] = set()
    for values in _per_layer_lists(config, vars(config)).values():
        kinds = [repr(v) for v in values]
        kept.update(kinds.index(kind) for kind in dict.fromkeys(kinds))
    for i in range(count):
        if len(kept) >= SIZES["num_hidden_layers"]:
            break
        kept.add(i)
    return sorted(kept)


def _rope_per_layer_type(config: Any, out: dict[str, Any]) -> None:
    """A class that reads rope_parameters per layer type, left empty by its defaults: the default rope per type."""
    rope, kinds = getattr(config, "rope_parameters", None), out.get("layer_types", getattr(config, "layer_types", None))
    if rope == {} and kinds:
        theta = getattr(config, "rope_theta", None) or 10000.0
        out["rope_parameters"] = {kind: {"rope_type": "default", "rope_theta": theta} for kind in dict.fromkeys(kinds)}


def write_tiny(model_type: str, directory: Path) -> str | None:
    """Write a tiny config of `model_type` to `directory`; returns an error line, or None. A config transformers
    itself cannot build and run one forward of (on CPU, without plait) is no test of plait: NO-CONFIG. The shrunk
    config is tried first, then each of `REPAIRS` (a class's validator that ties two sizes the shrinking set apart);
    the first error is the one reported."""
    from transformers import AutoConfig

    try:
        overrides = tiny_overrides(AutoConfig.for_model(model_type))
    except Exception as error:
        return f"transformers alone: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
    first_error = None
    for repair in (None, *REPAIRS):
        candidate = repair(overrides) if repair else overrides
        if candidate is None:
            continue
        error = _try_tiny(model_type, candidate, directory)
        if error is None:
            return None
        first_error = first_error or error
    return first_error


def _mla_head_dim_whole(overrides: dict[str, Any]) -> dict[str, Any] | None:
    """Latent attention whose head_dim is the whole query-key width (nope + rope), not the rotary part."""
    if "qk_nope_head_dim" not in overrides or "qk_rope_head_dim" not in overrides:
        return None
    return {**overrides, "head_dim": overrides["qk_nope_head_dim"] + overrides["qk_rope_head_dim"]}


REPAIRS = (_mla_head_dim_whole,)


def _try_tiny(model_type: str, overrides: dict[str, Any], directory: Path) -> str | None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.for_model(model_type, **overrides)
        with torch.device("meta"):
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if size > MAX_TINY_PARAMS:  # parts the shrinking does not reach (a multimodal class's encoders)
            return f"the tiny config still has {size / 1e6:.0f}M parameters"
        model = AutoModelForCausalLM.from_config(config)
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))
        config.save_pretrained(str(directory))
    except Exception as error:
        return f"transformers alone: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
    return None


def families_with_pp_plan() -> list[str]:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            if getattr(AutoConfig.for_model(model_type), "base_model_pp_plan", None):
                out.append(model_type)
        except Exception:  # a config class that cannot build with its own defaults has no plan to read
            continue
    return out


_SPECS: dict[Path, Any] = {}


def make_plan(directory: Path, plan: str):
    from plait.plan import Plan
    from plait.spec import TrainSpec
    from plait.spec.clusters import CLUSTER_PRESETS
    from plait.spec.load import load_model

    if directory not in _SPECS:  # measured on meta once per type
        _SPECS[directory] = load_model(str(directory))

    kwargs = dict(PLANS[plan], micro_batch=1, num_micro_batches=2)
    global_batch = kwargs.get("dp", 1) * 2
    return Plan.of(model=_SPECS[directory], train=TrainSpec(global_batch=global_batch, seq_len=SEQ_LEN,
                                                                      precision="fp32"),
                   cluster=CLUSTER_PRESETS["local-cpu"], **kwargs)


def admit(directory: Path, plan: str) -> dict[str, Any] | None:
    """A REFUSED row when the plan is refused before any rank starts (legality, or the adapter), else None."""
    from plait import legality
    from plait.errors import ConfigError

    try:
        built = make_plan(directory, plan)
        problems = legality.plan_problems(built, world_size=2)
    except ConfigError as error:
        return {"status": "REFUSED", "detail": str(error).splitlines()[0]}
    except Exception as error:  # planning itself failed: a crash, before any rank
        return {"status": "CRASH", "detail": f"planning: {type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    no_plan = (built.model.tp_plan or {}).get(legality.NO_TENSOR_PLAN, "")
    if plan == "tp2" and built.model.source.startswith("hf:") and (not built.model.tp_plan or no_plan):
        return {"status": "N/A", "detail": f"no tensor-parallel plan{': ' + no_plan if no_plan else ''}"}
    if plan == "ep2" and not built.model.num_experts:
        return {"status": "N/A", "detail": "no experts"}
    if problems:
        return {"status": "REFUSED", "detail": str(problems[0])}
    return None


# ---- the worker: every admitted case in one launch -------------------------------------------------
def worker(cases_file: Path, results: Path) -> None:
    import torch.distributed as dist

    from plait.runtime.launch import init_distributed, shutdown_distributed

    init_distributed(timeout_s=120)
    rank = dist.get_rank()
    for line in cases_file.read_text().splitlines():
        case = json.loads(line)
        if rank == 0:
            _append(results, {**case, "status": "STARTED"})
        try:
            row = _verdict(case, "float64")
            if _shared(row)["status"] == "DIFFERENT":  # a class computing parts in float32 (norms, routers, MLPs)
                again = _verdict(case, "float32")      # blurs float64's verdict: judged as float32 training runs
                if _shared(again)["status"] == "EQUAL":
                    row = {"status": "EQUAL-FP32", "detail": f"float64: {row['detail']}"} if row else None
        except Exception as error:
            row = {"status": "CRASH", "detail": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                   if str(error) else type(error).__name__}
            if rank == 0:
                sys.stderr.write(traceback.format_exc())
        dist.barrier()
        if rank == 0 and row is not None:
            _append(results, {**case, **row})
    shutdown_distributed()


def _verdict(case: dict, dtype: str) -> dict | None:
    """`plait check`'s verdict of one case at `dtype` (rank 0; None on the others)."""
    from plait.execute.equivalence import CheckSettings, Tolerance, check_plan

    result = check_plan(make_plan(Path(case["dir"]), case["plan"]), CheckSettings(steps=2, seed=1, dtype=dtype))
    if result is None:
        return None
    tolerance = Tolerance.for_dtype(dtype)
    if result.passed(tolerance):
        return {"status": "EQUAL"}
    return {"status": "DIFFERENT", "detail": "; ".join(result.failures(tolerance))[:300]}


def _shared(row: dict | None) -> dict:
    """Rank 0's row, on every rank (the others take the same branch)."""
    import torch.distributed as dist

    box = [row]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _append(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def _done(results: Path) -> dict[tuple[str, str], dict]:
    rows: dict[tuple[str, str], dict] = {}
    if results.exists():
        for line in results.read_text().splitlines():
            row = json.loads(line)
            rows[(row["family"], row["plan"])] = row
    return rows


def _launch(cases: list[dict], results: Path, work: Path, timeout_s: float) -> int:
    from plait.runtime.launch import run_local

    cases_file = work / f"cases-{os.getpid()}-{id(cases)}.jsonl"
    cases_file.write_text("".join(json.dumps(c) + "\n" for c in cases))
    return run_local(2, [__file__, "--worker", str(cases_file), str(results)], module=None, timeout_s=timeout_s)


def _launch_all(cases: list[dict], results: Path, work: Path, timeout_s: float, jobs: int) -> None:
    """One launch of 2 ranks, or `jobs` of them side by side (each a process of its own: the launcher owns signals)."""
    if jobs <= 1 or len(cases) < 2:
        _launch(cases, results, work, timeout_s)
        return
    import subprocess

    chunks = [cases[i::jobs] for i in range(jobs) if cases[i::jobs]]
    procs = []
    for i, chunk in enumerate(chunks):
        chunk_file = work / f"chunk-{os.getpid()}-{i}.jsonl"
        chunk_file.write_text("".join(json.dumps(c) + "\n" for c in chunk))
        procs.append(subprocess.Popen([sys.executable, __file__, "--launch", str(chunk_file), str(results), str(work),
                                       str(timeout_s)]))
    for proc in procs:
        proc.wait()


def run(families: list[str], plans: list[str], results: Path, work: Path, timeout_s: float, jobs: int = 1) -> None:
    done = _done(results)
    pending = []
    for family in families:
        directory = work / family
        if all(done.get((family, p), {}).get("status", "STARTED") != "STARTED" for p in plans):
            continue
        error = None if (directory / "config.json").exists() else write_tiny(family, directory)
        for plan in plans:
            if done.get((family, plan), {}).get("status", "STARTED") != "STARTED":
                continue
            if error:
                _append(results, {"family": family, "plan": plan, "status": "NO-CONFIG", "detail": error})
                continue
            refused = admit(directory, plan)
            if refused:
                _append(results, {"family": family, "plan": plan, **refused})
            else:
                pending.append({"family": family, "plan": plan, "dir": str(directory)})
    while pending:
        _launch_all(pending, results, work, timeout_s, jobs)
        rows = _done(results)
        started = [c for c in pending if rows.get((c["family"], c["plan"]), {}).get("status") == "STARTED"]
        for case in started[:jobs]:  # the cases a rank died in (one per launch at most)
            _append(results, {**case, "status": "CRASH", "detail": "a rank died or the launch timed out"})
        rows = _done(results)
        pending = [c for c in pending if (c["family"], c["plan"]) not in rows
                   or rows[(c["family"], c["plan"])]["status"] == "STARTED"]


def report(results: Path, families: list[str], plans: list[str]) -> None:
    rows = _done(results)
    width = max(len(f) for f in families) + 2
    print(f"{'type':<{width}}" + "".join(f"{p:<11}" for p in plans))
    totals: dict[str, Counter] = {p: Counter() for p in plans}
    for family in families:
        cells = []
        for plan in plans:
            status = rows.get((family, plan), {}).get("status", "-")
            totals[plan][status] += 1
            cells.append(f"{status:<11}")
        print(f"{family:<{width}}" + "".join(cells))
    print()
    for plan in plans:
        t = totals[plan]
        counted = sum(t.values()) - t["N/A"]
        built = counted - t["NO-CONFIG"]

        def share(n: int, of: int) -> str:
            return f"{100 * n / of:.0f}%" if of else "-"

        print(f"{plan}: " + ", ".join(f"{k} {v}" for k, v in sorted(t.items()))
              + f"  | EQUAL {share(t['EQUAL'], counted)} of {counted} types, EQUAL or EQUAL-FP32 "
              f"{share(t['EQUAL'] + t['EQUAL-FP32'], counted)}; of the {built} with a tiny config transformers runs: "
              f"{share(t['EQUAL'] + t['EQUAL-FP32'], built)}")
    print("\nrefusals and failures:")
    for family in families:
        for plan in plans:
            row = rows.get((family, plan), {})
            if row.get("status") in ("REFUSED", "DIFFERENT", "CRASH", "NO-CONFIG", "EQUAL-FP32"):
                print(f"  {family} {plan} {row['status']}: {row.get('detail', '')}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--launch":  # one of --jobs side-by-side launches
        cases = [json.loads(line) for line in Path(sys.argv[2]).read_text().splitlines()]
        _launch(cases, Path(sys.argv[3]), Path(sys.argv[4]), float(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", help="comma-separated model types (default: every type with a pp plan)")
    parser.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated, of {', '.join(PLANS)}")
    parser.add_argument("--results", default="hf_families.jsonl", help="JSON-lines results (resumed if present)")
    parser.add_argument("--work", default="/tmp/plait-hf-families", help="where the tiny configs are written")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds for one launch of the ranks")
    parser.add_argument("--jobs", type=int, default=1, help="launches of 2 ranks side by side (default 1: on 2 cores "
                        "more only share them)")
    parser.add_argument("--report-only", action="store_true", help="print the tables of the results file")
    args = parser.parse_args()
    families = args.families.split(",") if args.families else families_with_pp_plan()
    plans = args.plans.split(",")
    unknown = [p for p in plans if p not in PLANS]
    if unknown:
        sys.exit(f"error: unknown plan {unknown[0]!r}; use among {', '.join(PLANS)}")
    results, work = Path(args.results), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        run(families, plans, results, work, args.timeout, args.jobs)
    report(results, families, plans)


if __name__ == "__main__":
    main()
