"""Measure the devices and links in hand and write a cluster file the cost model reads.

    devices.py      GEMM / attention / block throughput, free memory (torch)
    collectives.py  collective timings per group placement and message size (torch.distributed)
    runner.py       the whole profile on an initialized process group
    fit.py          least-squares fits in the cost model's conventions (pure numpy)
    calibrate.py    measurements -> ClusterSpec (pure)
    clusterfile.py  atomic YAML writing, strict reading, validate_cluster_for_world

Importing this package does not import torch: tune and train call the file functions cheaply.
"""

from plait.profile.clusterfile import read_cluster_file, validate_cluster_for_world, write_cluster_file
from plait.profile.fit import fit_link, fit_matmul_efficiency, ring_terms

__all__ = ["fit_link", "fit_matmul_efficiency", "read_cluster_file", "ring_terms", "validate_cluster_for_world",
           "write_cluster_file"]
