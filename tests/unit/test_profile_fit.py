"""Fits of `plait profile`: recover known latency/bandwidth and efficiency curves from synthetic data,
in exactly the conventions the cost model predicts with."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from plait.cost import comm, compute
from plait.profile.calibrate import Measurements, calibrate, describe, measurements_from_json, measurements_json
from plait.profile.fit import (
    COLLECTIVES, CommSample, ComputeSample, evaluate_link, fit_link, fit_matmul_efficiency, fit_overhead,
    predict_seconds, ring_terms,
)
from plait.spec.cluster import ClusterSpec, Efficiency, LinkSpec

SIZES = [2**k for k in range(12, 26, 2)]


def synthetic_comm(alpha: float, beta: float, *, noise: float = 0.0, seed: int = 0,
                   group_sizes: tuple[int, ...] = (2, 4, 8)) -> list[CommSample]:
    rng = np.random.default_rng(seed)
    samples = []
    for name in COLLECTIVES:
        for p in group_sizes if name != "p2p" else (2,):
            for n in SIZES:
                t = predict_seconds(name, p, n, alpha, beta) * (1 + noise * rng.uniform(-1, 1))
                samples.append(CommSample(collective=name, group_size=p, num_bytes=n, seconds=t))
    return samples


def test_fit_recovers_exact_alpha_beta():
    fit = fit_link(synthetic_comm(30e-6, 2.5e9))
    assert fit.latency_s == pytest.approx(30e-6, rel=1e-9)
    assert fit.bandwidth == pytest.approx(2.5e9, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0)
    assert fit.max_rel_residual < 1e-9


@pytest.mark.parametrize("alpha,beta", [(5e-6, 230e9), (80e-6, 1e9), (2e-3, 0.1e9)])
def test_fit_recovers_alpha_beta_under_noise(alpha, beta):
    fit = fit_link(synthetic_comm(alpha, beta, noise=0.05, seed=1))
    assert fit.latency_s == pytest.approx(alpha, rel=0.1)
    assert fit.bandwidth == pytest.approx(beta, rel=0.1)
    assert fit.r2 > 0.98
    assert fit.max_rel_residual < 0.12


def test_latency_free_link_fits_zero_latency_not_negative():
    samples = [CommSample(collective="p2p", group_size=2, num_bytes=n, seconds=n / 1e9 * (1.02 if i % 2 else 0.98))
               for i, n in enumerate(SIZES)]
    fit = fit_link(samples)
    assert fit.latency_s >= 0
    assert fit.bandwidth == pytest.approx(1e9, rel=0.05)


def test_fit_needs_two_samples():
    with pytest.raises(ValueError, match="at least 2"):
        fit_link(synthetic_comm(1e-5, 1e9)[:1])


def test_evaluate_link_reports_a_bad_fit():
    samples = synthetic_comm(30e-6, 2.5e9)
    assert evaluate_link(samples, 30e-6, 2.5e9).max_rel_residual < 1e-9
    assert evaluate_link(samples, 30e-6, 1.25e9).max_rel_residual > 0.5


@pytest.mark.parametrize("p", [2, 4, 8])
def test_ring_convention_is_the_cost_models(p):
    """What the profile fits is what plait.cost.comm predicts with the fitted LinkSpec."""
    link = LinkSpec(latency_s=20e-6, bandwidth=3e9)
    cluster = ClusterSpec(num_devices=8, devices_per_node=8, memory_bytes=1e9, peak_flops=1e12,
                          intra_node=link, inter_node=link)
    group = comm.Group(size=p)
    n = 3 * 2**20
    assert predict_seconds("all_reduce", p, n, 20e-6, 3e9) == pytest.approx(comm.all_reduce(n, group, cluster))
    assert predict_seconds("all_gather", p, n, 20e-6, 3e9) == pytest.approx(comm.all_gather(n, group, cluster))
    assert predict_seconds("reduce_scatter", p, n, 20e-6, 3e9) == pytest.approx(
        comm.reduce_scatter(n, group, cluster))
    assert predict_seconds("p2p", 2, n, 20e-6, 3e9) == pytest.approx(comm.p2p(n, False, cluster))


def test_ring_terms_reject_unknown():
    with pytest.raises(ValueError):
        ring_terms("broadcast", 4)  # type: ignore[arg-type]
    assert ring_terms("all_reduce", 1) == (0.0, 0.0)


def gemm_samples(peak: float, matmul: float, half_dim: float, noise: float = 0.0) -> list[ComputeSample]:
    rng = np.random.default_rng(2)
    out = []
    for h in (128, 256, 512, 1024, 2048):
        for name, flops in (("qkv", 3.0e9), ("fc1", 4.0e9)):
            rate = peak * matmul * h / (h + half_dim) * (1 + noise * rng.uniform(-1, 1))
            out.append(ComputeSample(name=name, hidden_size=h, flops=flops, seconds=flops / rate))
    return out


def test_matmul_curve_recovered_and_equal_to_cost_model():
    fit = fit_matmul_efficiency(gemm_samples(1e12, 0.7, 300.0), 1e12)
    assert fit.matmul == pytest.approx(0.7, rel=1e-9)
    assert fit.half_dim == pytest.approx(300.0, rel=1e-9)
    cluster = ClusterSpec(memory_bytes=1e9, peak_flops=1e12, efficiency=Efficiency(matmul=fit.matmul,
                          matmul_half_dim=fit.half_dim), intra_node=LinkSpec(latency_s=0, bandwidth=1),
                          inter_node=LinkSpec(latency_s=0, bandwidth=1))
    assert compute.gemm_fraction(cluster, 512) == pytest.approx(0.7 * 512 / 812)


def test_matmul_curve_under_noise():
    fit = fit_matmul_efficiency(gemm_samples(1e12, 0.6, 200.0, noise=0.03), 1e12)
    assert fit.matmul == pytest.approx(0.6, rel=0.08)
    assert fit.half_dim == pytest.approx(200.0, rel=0.3)


def test_flat_rates_give_no_size_effect():
    fit = fit_matmul_efficiency(gemm_samples(1e12, 0.5, 0.0), 1e12)
    assert fit.half_dim == pytest.approx(0.0, abs=1e-6)
    assert fit.matmul == pytest.approx(0.5)


def test_overhead_recovered():
    peak, matmul = 1e12, fit_matmul_efficiency(gemm_samples(1e12, 0.7, 300.0), 1e12)
    blocks = []
    for h in (256, 1024):
        flops = 5e9
        gemm_seconds = flops / (peak * 0.7 * h / (h + 300.0))
        blocks.append(ComputeSample(name="block", hidden_size=h, flops=flops, seconds=gemm_seconds * 1.25))
    assert fit_overhead(blocks, peak, matmul) == pytest.approx(0.25)


def synthetic_measurements(datasheet_peak: float | None = None, nodes: int = 1) -> Measurements:
    compute_samples = gemm_samples(50e9, 1.0, 100.0)
    block_h = 512
    block_flops = 1e9
    block_seconds = block_flops / (50e9 * block_h / (block_h + 100.0)) * 1.3
    compute_samples.append(ComputeSample(name="block", hidden_size=block_h, flops=block_flops, seconds=block_seconds))
    comm_samples = {"intra_node": tuple(synthetic_comm(50e-6, 2e9, group_sizes=(2, 4)))}
    if nodes > 1:
        comm_samples["inter_node"] = tuple(synthetic_comm(200e-6, 0.5e9, group_sizes=(2,)))
    return Measurements(world_size=4 * nodes, devices_per_node=4, num_nodes=nodes, device_type="cpu",
                        device_name="CPU", dtype="float32", backend="gloo", datasheet_peak_flops=datasheet_peak,
                        memory_bytes=3 * 2**30, compute=tuple(compute_samples), comm=comm_samples, host="box",
                        torch_version="x", started_at="now", seconds=12.0)


def test_calibrate_cpu_uses_the_fitted_asymptote_as_peak():
    cal = calibrate(synthetic_measurements())
    c = cal.cluster
    assert c.num_devices == 4 and c.devices_per_node == 4 and c.device_type == "cpu" and c.backend == "gloo"
    assert c.peak_flops == pytest.approx(50e9, rel=1e-3)
    assert c.efficiency.matmul == 1.0
    assert c.efficiency.matmul_half_dim == pytest.approx(100.0, rel=1e-3)
    assert c.efficiency.overhead == pytest.approx(0.3, rel=1e-3)
    assert c.intra_node.latency_s == pytest.approx(50e-6, rel=1e-3)
    assert c.intra_node.bandwidth == pytest.approx(2e9, rel=1e-3)
    assert c.inter_node == c.intra_node  # one node: nothing crosses nodes
    assert c.memory_bytes == 3 * 2**30
    text = "\n".join(describe(synthetic_measurements(), cal))
    assert "intra_node: latency 50.0 us" in text and "R2 1.000" in text
    assert c.oversubscription == 1.0
    shared = Measurements(**{**synthetic_measurements().__dict__, "oversubscription": 2.0})
    assert calibrate(shared).cluster.oversubscription == 2.0
    assert "oversubscription 2" in "\n".join(describe(shared, calibrate(shared)))


def test_calibrate_gpu_keeps_datasheet_peak_and_fits_inter_node():
    cal = calibrate(synthetic_measurements(datasheet_peak=100e9, nodes=2))
    assert cal.cluster.peak_flops == 100e9
    assert cal.cluster.efficiency.matmul == pytest.approx(0.5, rel=1e-3)
    assert cal.cluster.inter_node.latency_s == pytest.approx(200e-6, rel=1e-3)
    assert cal.cluster.inter_node.bandwidth == pytest.approx(0.5e9, rel=1e-3)
    assert set(cal.per_collective["intra_node"]) == set(COLLECTIVES)


def test_measurements_json_round_trip():
    m = synthetic_measurements(nodes=2)
    assert measurements_from_json(measurements_json(m)) == m


def test_each_collective_is_priced_on_its_own_measured_line():
    """gloo's all-gather and reduce-scatter run well below its all-reduce: the profile writes each
    collective's own line, and the cost model then predicts every measured sample."""
    lines = {"all_reduce": (50e-6, 1e9), "all_gather": (80e-6, 0.25e9), "reduce_scatter": (120e-6, 0.3e9),
             "p2p": (30e-6, 2.5e9), "all_to_all": (60e-6, 0.5e9)}
    samples = [s for name, (alpha, beta) in lines.items() for s in synthetic_comm(alpha, beta, group_sizes=(2, 4))
               if s.collective == name]
    m = synthetic_measurements()
    m = Measurements(**{**m.__dict__, "comm": {"intra_node": tuple(samples)}})
    cluster = calibrate(m).cluster
    assert cluster.intra_node.all_gather is not None and cluster.intra_node.all_gather.bandwidth < 0.5
    price = {"all_reduce": lambda n, p: comm.all_reduce(n, comm.Group(p), cluster),
             "all_gather": lambda n, p: comm.all_gather(n, comm.Group(p), cluster),
             "reduce_scatter": lambda n, p: comm.reduce_scatter(n, comm.Group(p), cluster),
             "p2p": lambda n, p: comm.p2p(n, False, cluster)}
    for s in samples:
        if s.collective in price:
            assert price[s.collective](s.num_bytes, s.group_size) == pytest.approx(s.seconds, rel=2e-3)
    # the file holds them, and a file without them (a preset, or written before) means the level's line
    from plait.profile.clusterfile import parse_cluster_text, render_cluster_yaml

    assert parse_cluster_text(render_cluster_yaml(cluster), "t.yaml") == cluster
    level = LinkSpec(latency_s=50e-6, bandwidth=1e9)
    plain = cluster.replace(intra_node=level, inter_node=level)
    assert "all_gather" not in render_cluster_yaml(plain)
    assert parse_cluster_text(render_cluster_yaml(plain), "t.yaml") == plain


def test_calibrate_fits_host_time_on_the_probe_plans():
    """`plait profile` times the probe plans end to end; calibrate recovers the host time that produced them
    on top of its compute and link fits, and writes it in the file's header."""
    from plait.profile.calibrate import HostSample
    from plait.profile.terms import predicted_step
    from plait.profile.host import probe_plans

    base = calibrate(synthetic_measurements()).cluster
    host = dict(layer_overhead_s=1.2e-3, tp_layer_overhead_s=8e-3, fsdp_layer_overhead_s=3e-4,
                dtensor_param_overhead_s=2e-4, tp_param_overhead_s=4e-4, pipeline_overhead_s=6e-4, step_overhead_s=3e-3)
    truth = base.replace(host=dataclasses.replace(base.host, **host))
    probes = probe_plans(4)
    assert {(p.dp, p.tp, p.pp, p.zero, p.num_micro_batches) for p in probes} == {
        (4, 1, 1, 0, 1), (4, 1, 1, 0, 4), (4, 1, 1, 2, 1), (4, 1, 1, 2, 4), (2, 2, 1, 0, 1), (2, 2, 1, 0, 4),
        (2, 1, 2, 0, 2), (2, 1, 2, 0, 8)}
    samples = tuple(HostSample(plan=p.to_dict(), seconds=predicted_step(p, truth),
                               step_times=(predicted_step(p, truth),) * 3) for p in probes)
    m = Measurements(**{**synthetic_measurements().__dict__, "host_steps": samples})
    cal = calibrate(m)
    for name, value in host.items():
        assert getattr(cal.cluster.host, name) == pytest.approx(value, rel=0.02), name
    assert max(cal.host.errors_after) < 0.01
    assert "host time (fitted on 8 small plans" in "\n".join(describe(m, cal))
    assert measurements_from_json(measurements_json(m)) == m
    assert calibrate(synthetic_measurements()).host is None  # nothing timed, nothing fitted


def test_probe_plans_fit_any_world():
    from plait.profile.host import probe_plans

    for world in (2, 3, 8):
        probes = probe_plans(world)
        assert all(p.num_devices == world for p in probes)
        assert any(p.tp > 1 for p in probes) == any(p.pp > 1 for p in probes) == (world % 2 == 0)
        assert {p.num_micro_batches for p in probes if p.pp == 1} == {1, 4}


def test_host_time_stays_physical_where_load_hides_it():
    """Probe timings a loaded machine left no per-pass time in (each step exactly what the cost model prices
    without host time) fit no host time of 0 for CPU processes: the per-pass time stays at its floor, and the fit
    says it could not tell it."""
    from plait.cost import predict
    from plait.profile.calibrate import CPU_LAYER_PASS_FLOOR_S, HostSample, fit_host_terms
    from plait.profile.host import probe_plans
    from plait.spec.clusters import CLUSTER_PRESETS

    cluster = CLUSTER_PRESETS["local-cpu"].with_devices(2)
    assert cluster.host.layer_overhead_s == 0
    samples = []
    for plan in probe_plans(2):
        plan = plan.replace(cluster=cluster, predicted=None)
        samples.append(HostSample(plan=plan.to_dict(), seconds=predict(plan).step_time_s))
    fit = fit_host_terms(tuple(samples), cluster)
    host = fit.cluster.host
    assert 0 < host.layer_overhead_s <= CPU_LAYER_PASS_FLOOR_S * 1.01
    assert any("floor" in note for note in fit.notes)
