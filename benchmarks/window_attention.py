"""The attention kernels that compute only what a mask keeps (plait.models.windows) against SDPA over the whole
masked square (what the class's mask alone gives), forward and backward: a sliding window band by band at sequences
of several windows, and packed documents document by document at rows of several documents. Measured time ratio,
and the ratio plait's cost model prices (plait.cost.attention.computed_square of the dense and plait's kernel).

    OMP_NUM_THREADS=1 python benchmarks/window_attention.py [--window 256] [--multiples 2 4 8 16] [--repeat 5]

The reference is torch's SDPA on the dense boolean mask (transformers' own mask for the layer); both run the same
shapes (batch 1, 8 heads of 64, fp32), the same dtype and the same backend choice (SDPA's default). The documents
are `--window` tokens each. Each time is the median of --repeat forward + backward passes after one warm-up; the
ratios are taken within one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from plait.cost.attention import computed_square
from plait.spec.attention import window_kernel
from plait.models.windows import attention_by_document, banded_attention


def timed(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def window_mask(seq: int, window: int) -> torch.Tensor:
    behind = torch.arange(seq)[:, None] - torch.arange(seq)[None, :]
    return ((behind >= 0) & (behind < window))[None, None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--multiples", type=int, nargs="+", default=[2, 4, 8, 16], help="sequence lengths, in windows")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    table = Table(title=f"sliding window {args.window}: band by band vs SDPA over the masked square (fwd + bwd, "
                        f"median of {args.repeat})")
    for column in ("seq", "kernel plait runs", "dense s", "banded s", "measured dense / banded",
                   "priced dense / banded"):
        table.add_column(column, justify="right")
    for multiple in args.multiples:
        seq = multiple * args.window
        q, k, v = (torch.randn(1, 8, seq, 64, requires_grad=True) for _ in range(3))
        mask = window_mask(seq, args.window)

        def dense():
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()

        def banded():
            banded_attention(q, k, v, mask, args.window).sum().backward()

        dense_s, banded_s = timed(dense, args.repeat), timed(banded, args.repeat)
        priced = 1.0 / computed_square(seq, args.window) if window_kernel(seq, args.window) == "banded" else 1.0
        table.add_row(str(seq), window_kernel(seq, args.window), f"{dense_s:.4f}", f"{banded_s:.4f}",
                      f"{dense_s / banded_s:.2f}", f"{priced:.2f}")
    Console().print(table)
    Console().print(documents_table(args))


def documents_table(args) -> Table:
    table = Table(title=f"packed documents of {args.window} tokens: document by document vs SDPA over the masked "
                        f"square (fwd + bwd, median of {args.repeat})")
    for column in ("seq", "documents", "dense s", "by document s", "measured dense / by document",
                   "priced dense / by document"):
        table.add_column(column, justify="right")
    for multiple in args.multiples:
        seq = multiple * args.window
        q, k, v = (torch.randn(1, 8, seq, 64, requires_grad=True) for _ in range(3))
        positions = (torch.arange(seq) % args.window)[None]
        documents = torch.arange(seq) // args.window
        causal = torch.arange(seq)[:, None] >= torch.arange(seq)[None, :]
        mask = (causal & (documents[:, None] == documents[None, :]))[None, None]

        def dense():
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()

        def by_document():
            attention_by_document(q, k, v, positions).sum().backward()

        dense_s, ours_s = timed(dense, args.repeat), timed(by_document, args.repeat)
        priced = computed_square(seq, None) * 2 / computed_square(seq, None, document_len=args.window)
        table.add_row(str(seq), str(multiple), f"{dense_s:.4f}", f"{ours_s:.4f}", f"{dense_s / ours_s:.2f}",
                      f"{priced:.2f}")
    return table


if __name__ == "__main__":
    main()
