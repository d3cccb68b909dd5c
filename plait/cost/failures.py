"""Failures priced: expected goodput, the checkpoint interval, and what one failure costs.

With a failure rate (ClusterSpec.failures: a mean time between failures per device or per node), a run of N
units fails every M = MTBF / N seconds on average. Two ways to live with it:

* one job (a plain plan, or islands in lockstep without fault tolerance): a failure stops every rank; the run
  restarts (restart_s) from its last checkpoint, losing on average half an interval of work. Checkpoints every
  tau seconds cost save_s each. Young's first-order optimum (Young 1974; Daly 2006) tau = sqrt(2 save_s M)
  gives the fraction lost 1 - save_s / tau - (tau / 2 + restart_s) / M.
* replica groups (islands under torchft): a failure takes one of k groups out while the others train on; it
  rejoins and takes the weights from a peer (recovery_s) and loses the work since its last exchange with the
  others (half of H inner steps under DiLoCo, half a step under sync). Checkpoints guard only against losing
  every group at once; they are still written at Young's interval of the whole run's failures, which bounds
  their cost. Fraction lost: save_s / tau + (recovery_s + lost_s) / (k M).

The restart, recovery and save times default to what plait's runs measured (the MEASURED_* constants below,
from benchmarks/islands.py's fault case; a cluster file's `failures` may give its own).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from plait.spec.cluster import ClusterSpec, Failures

MEASURED_RESTART_S = 17.3
"""Seconds a whole-job restart of `plait train` took beyond the lost work: every rank stopped, started again, the
model rebuilt and the last checkpoint loaded (tiny-gpt on 4 CPU ranks, rank 1 SIGKILLed right after a checkpoint,
--max-restarts 1; `python benchmarks/islands.py --faults`, benchmarks/results/islands/faults.json, on a 2-core
machine shared with other work; an earlier run under heavier load measured 34.9 s)."""
MEASURED_RECOVERY_S = 17.1
"""Seconds an island SIGKILLed mid-run took to come back: its launcher restarted its ranks, they rejoined the
quorum and took the weights from a peer, while the other island trained on (2 islands x 2 ranks of tiny-gpt,
the same run; 26.8 s in the earlier one)."""
MEASURED_SAVE_S = 1.04
"""Seconds one checkpoint write stalled an island's training (the median of the same run's 16 saves; 1.91 s in the earlier one)."""


@dataclass(frozen=True, kw_only=True)
class FailureCost:
    """What failures cost one plan."""

    mtbf_s: float
    """Mean time between failures of the whole run, seconds."""
    checkpoint_interval_s: float
    lost_fraction: float
    """Fraction of the run's time lost to checkpoint writes, lost work and restarts or recoveries."""
    per_failure_s: float
    """What one failure costs, in seconds of the whole run's work (restart + half an interval for one job; one
    group's share of recovery + lost work for replica groups)."""
    goodput_tokens_per_s: float
    replica_groups: int = 1

    @property
    def goodput_fraction(self) -> float:
        return 1.0 - self.lost_fraction


def run_mtbf_s(cluster: ClusterSpec, failures: Failures) -> float:
    """Mean seconds between failures of the whole cluster (units fail independently)."""
    units = cluster.num_devices if failures.per == "device" else cluster.num_nodes
    return failures.mtbf_hours * 3600.0 / max(1, units)


def young_interval(save_s: float, mtbf_s: float) -> float:
    """Young's checkpoint interval: sqrt(2 x save time x mean time between failures)."""
    return math.sqrt(2.0 * save_s * mtbf_s)


def price_failures(cluster: ClusterSpec, tokens_per_s: float, *, replica_groups: int = 1,
                   lost_work_s: float = 0.0) -> FailureCost | None:
    """Goodput of a plan running at `tokens_per_s` on `cluster` (None when it has no failure rate). With
    `replica_groups` > 1 a failure costs one group's recovery and `lost_work_s` (its work since the last exchange)."""
    failures = cluster.failures
    if failures is None:
        return None
    mtbf = run_mtbf_s(cluster, failures)
    save = failures.save_s or MEASURED_SAVE_S
    interval = young_interval(save, mtbf)
    if replica_groups > 1:
        recovery = failures.recovery_s or MEASURED_RECOVERY_S
        per_failure = (recovery + lost_work_s) / replica_groups
    else:
        restart = failures.restart_s or MEASURED_RESTART_S
        per_failure = interval / 2 + restart
    lost = min(1.0, save / interval + per_failure / mtbf)
    return FailureCost(mtbf_s=mtbf, checkpoint_interval_s=interval, lost_fraction=lost, per_failure_s=per_failure,
                       goodput_tokens_per_s=tokens_per_s * (1.0 - lost), replica_groups=replica_groups)
