"""OperatorSharding: the per-operator plan, a field of the Plan (plan.operators), pure data that round-trips
through JSON. The executor (plait.execute.operators) reads `params` and `outputs`; the rest is the planner's
account of why (shown by `plait plan`)."""

from __future__ import annotations

from dataclasses import dataclass, field

FUSED_OPTIMIZERS = ("sgd", "rowwise_adagrad")
"""Fused row-wise optimizers for embedding tables (plait.execute.embedding_tables runs them; the planner prices them): SGD,
and row-wise Adagrad (one accumulator per row, as TorchRec's and FBGEMM's EXACT_ROWWISE_ADAGRAD)."""


@dataclass(frozen=True, kw_only=True)
class OperatorCost:
    """One captured call under the chosen strategy: what the plan's report shows."""

    name: str
    """module:op#index"""
    placements: str
    """The strategy: its arguments' placements -> its outputs', e.g. "R,S0 -> S1"."""
    compute_s: float
    comm_s: float
    """Seconds of the redistributions into this call, forward and backward."""
    comm: str = ""
    """Which collectives, e.g. "all_reduce 64 KiB fwd"."""


@dataclass(frozen=True, kw_only=True)
class OperatorSharding:
    batch: str
    """The batch factory, "package.module:function": function(batch_size, generator) -> tuple of tensors, the
    module's forward arguments (the forward returns the loss)."""
    axis: str = "tp"
    """The mesh axis the placements are on; data parallelism (fully_shard) runs over "dp" around them."""
    params: dict[str, str] = field(default_factory=dict)
    """Parameter and buffer name -> placement on the axis: "R", "S<dim>", or for a fused embedding table "T<rank>"
    (table-wise: whole on that rank, plait.operators.table_wise)."""
    outputs: dict[str, str] = field(default_factory=dict)
    """Module name -> the placement its output is redistributed to ("R", "P", "S<dim>")."""
    inputs: dict[str, str] = field(default_factory=dict)
    """Module name -> the placement its first tensor argument is redistributed to before its forward."""
    param_reads: dict[str, str] = field(default_factory=dict)
    """Parameter (or buffer) name -> the placement its module reads it in, where that differs from how it is kept
    (kept split to save memory, gathered for use: ZeRO-3 on the axis)."""
    function_reads: dict[str, dict[str, str]] = field(default_factory=dict)
    """Torch-level call of the forward ("name(shapes)#occurrence", plait.operators.capture.FunctionKeys) ->
    {position of a tensor argument in tree_flatten((args, kwargs)): the placement the planned strategy reads it
    in}. The executor redistributes there before each call (above autograd), which subsumes `inputs`, `outputs`
    and `param_reads`."""
    fused_tables: dict[str, str] = field(default_factory=dict)
    """Embedding table weight -> the fused row-wise optimizer (FUSED_OPTIMIZERS) its lookup's backward applies:
    no gradient, no optimizer state, kept whole over dp (plait.execute.embedding_tables)."""
    distinct_exchange: tuple[str, ...] = ()
    """Fused tables whose data-parallel exchange sends each rank's distinct rows, their gradients summed (cheaper
    where ids repeat); the others send every id's row, which needs no count first (plait.cost.operators
    .row_exchange_time)."""
    table_sample: str = ""
    """Where the fused tables' lookups were priced from: the rows a micro-batch touches and their skew, from a
    sample of the batch factory's batches (plait.operators.id_sample); "" where every id was priced as a row."""
    synchronised_norms: tuple[str, ...] = ()
    """BatchNorm modules whose training statistics are summed over the data-parallel ranks (plait.execute.batchnorm):
    every BatchNorm when dp > 1; the tensor-parallel ranks see the whole micro-batch already."""
    pins: dict[str, str] = field(default_factory=dict)
    """What the user pinned (parameter or module name -> placement), honoured by the solver."""
    step_time_s: float = 0.0
    """Predicted seconds of a step's forward and backward (each of its micro-batches, without a pipeline) with the
    data-parallel synchronisation."""
    data_parallel_step_time_s: float = 0.0
    """The same work under data parallelism alone over every device (no operator split), for comparison."""
    comm_bytes: float = 0.0
    """Predicted bytes the axis's collectives carry per micro-batch (forward and backward, logical payload)."""
    comm_counts: dict[str, int] = field(default_factory=dict)
    """Predicted collectives per micro-batch on the axis, by kind (forward and backward)."""
    peak_memory_bytes: float = 0.0
    solver: str = "program"
    solve_time_s: float = 0.0
    lower_bound_s: float = 0.0
    """What the program proves no placement beats (0 when not computed): HiGHS's dual bound, or under a tied solve
    (a repeated block solved once) the untied program's LP relaxation."""
    solver_status: str = ""
    """How the solve ended (plait.search.sharding.STATUSES): "optimal", "time limit" (the best found when the time
    ran out), "tied" (optimal over plans that place every copy of a repeated block alike), "heuristic" (the
    propagation: no proof), "forced" (the pins left one placement); under a pipeline, the weakest of the stages'.
    "" in plans written before it was recorded."""
    proven_gap: float | None = None
    """How far step_time_s may be above the best placement, as proven: (cost - lower bound) / lower bound; under a
    pipeline, the largest of the stages' (each stage's time per micro-batch). None: nothing proven."""
    tensor_plan_step_time_s: float | None = None
    """For a decoder (plait.operators.tensor_plans): step_time_s of its class's own tensor plan (Megatron's
    pattern) as a candidate of the same program, which step_time_s never exceeds. None otherwise."""
    time_parts: dict[str, float] = field(default_factory=dict)
    """step_time_s by part ("compute", "tp_comm", "dp_comm"; plait.operators.planner.time_parts), without a
    pipeline; under one, each stage's per micro-batch."""
    memory_parts: dict[str, float] = field(default_factory=dict)
    """peak_memory_bytes by part ("params", "activations", "inputs"; plait.operators.planner.memory_parts); under a
    pipeline, the peak stage's."""
    costliest: tuple[OperatorCost, ...] = ()
    replicated_ops: tuple[str, ...] = ()
    """Operators DTensor has no rule for: run replicated, priced as such (add a rule with register_sharding)."""
    unread_params: tuple[str, ...] = ()
    """Parameters the captured forward never reads (no gradient reaches them): DDP must be told to look for them
    (plait.execute.operators.replicate_with_ddp)."""
    import_paths: tuple[str, ...] = ()
    """The folders the module and the batch factory were imported from when planned (outside Python's own
    installation): `plait check` and `plait train` import them from there, from any working directory."""
    blocks: str = ""
    """Under a pipeline (pp > 1): the module path of the repeated blocks the stages are cut between
    (plait.operators.stages); the blocks of each stage are the Plan's (Plan.stage_layers)."""
    stages: tuple["OperatorSharding", ...] = ()
    """Under a pipeline: each stage's own per-operator plan, on its own capture (its calls keyed as that stage runs
    them), in stage order; its step_time_s is one micro-batch's forward and backward on that stage with its
    data-parallel synchronisation. The fields above then sum the stages (params and pins: their union; comm_bytes
    and comm_counts: per micro-batch, every stage's; step_time_s: the pipeline's step, priced by the cost model's
    schedule simulator)."""

    def check_stages(self, pp: int) -> None:
        """ConfigError unless the placements hold one plan per pipeline stage of a pp-stage plan (none for pp = 1):
        what the executor builds each pipeline rank's stage from."""
        from plait.errors import ConfigError

        if len(self.stages) != (pp if pp > 1 else 0) or (pp > 1 and not self.blocks):
            raise ConfigError(f"the plan has pp={pp} but its per-operator placements hold {len(self.stages)} stage "
                              f"plans{'' if self.blocks else ' and no blocks to cut'}; plan it again with "
                              f"`plait plan --model module:... --batch ... --pp {pp}`")

    def describe(self) -> str:
        split = sum(1 for p in self.params.values() if p != "R")
        text = f"{split}/{len(self.params)} parameters split on {self.axis}"
        return text + (f", {len(self.stages)} pipeline stages of {self.blocks}" if self.stages else "")
