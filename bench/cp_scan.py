"""The context-parallel scan alone (``context_parallel.scan``, the forward walk) per ``block_dv``, on the GPU machine.

For each ``H_v:pieces`` item, one sequence cut into that many pieces: fresh random E (fp32) and M (a random
contraction, norm about 0.9) per (piece, v-head), every piece exact (skip < 0: M read and multiplied, the slowest
case, which sets a row's time) or, with ``--exact-every 4``, one head in four exact and the others E only (the
bench's gates: every fourth head does not decay). CUDA-graph medians (us) per ``block_dv``, and the relative L2 of
each result against a float64 chain of the same inputs:

    python bench/cp_scan.py 8:16 16:16 64:4 --block-dv 16,32,64

With ``--forward``, items are ``H_qk/H_v:seqs`` rows (bench_fwd's notation) and the package's context-parallel forward
is timed with the rule's scan columns (``forward._scan_block_dv``) and with 32 (the scan's default), same process,
with the relative L2 of the two outputs:

    python bench/cp_scan.py --forward 2/8:1x32768 16/16:1x32768
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import rel_l2, time_graph  # noqa: E402


def chain(e, m, skip, h0):
    """h0p[p + 1] = M[p] h0p[p] + E[p] (M counts as 0 where skip >= 0), float64."""
    states = [h0.double()]
    for p in range(e.shape[0] - 1):
        exact = (skip[p] < 0).double()[:, None, None]
        states.append(exact * (m[p].double() @ states[-1]) + e[p].double())
    return torch.stack(states)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shapes", nargs="+", help="H_v:pieces items, e.g. 8:16")
    ap.add_argument("--block-dv", default="16,32,64", help="comma list of the scan's block_dv values")
    ap.add_argument("--exact-every", type=int, default=1, help="one head in this many forms M (default: all)")
    ap.add_argument("--forward", action="store_true", help="time the forward per rule and at 32 columns")
    args = ap.parse_args()
    if args.forward:
        return forward_ab(args.shapes)
    from qla_compile.kernels import context_parallel

    blocks = [int(b) for b in args.block_dv.split(",")]
    dk = dv = 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"| H_v:pieces | " + " | ".join(f"block_dv {b} (us)" for b in blocks) + " | max rel L2 |")
    print("|---" * (len(blocks) + 2) + "|")
    for item in args.shapes:
        h_v, n_p = (int(s) for s in item.split(":"))
        e = torch.randn(n_p, h_v, dk, dv, device="cuda", generator=gen)
        q, _ = torch.linalg.qr(torch.randn(n_p, h_v, dk, dk, device="cuda", generator=gen))
        m = (0.9 * q).contiguous()
        skip = torch.full((n_p, h_v), 3, device="cuda", dtype=torch.int32)
        skip[:, :: args.exact_every] = -1
        skip[-1] = 1 << 30  # the last piece passes nothing on
        seq_pieces = torch.tensor([0, n_p], device="cuda", dtype=torch.int32)
        h0 = torch.randn(1, h_v, dk, dv, device="cuda", generator=gen)
        want = chain(e, m, skip, h0[0])
        cells, worst = [], 0.0
        for b in blocks:
            kernel = context_parallel.scan(dk=dk, dv=dv, has_h0=True, block_dv=b)
            h0p = torch.full((n_p, h_v, dk, dv), float("nan"), device="cuda")
            kernel(e, m, skip, seq_pieces, h0, h0p)
            worst = max(worst, rel_l2(h0p.double(), want))
            cells.append(f"{1e3 * time_graph(lambda: kernel(e, m, skip, seq_pieces, h0, h0p)):.1f}")
        print(f"| {item} | " + " | ".join(cells) + f" | {worst:.1e} |", flush=True)


def forward_ab(rows):
    """The forward with the rule's scan columns against 32 columns, per row."""
    from bench.common import make_inputs, parse_row
    from qla_compile.kernels import forward as F

    rule = F._scan_block_dv
    print("| row | scan columns | forward us, 32 columns | forward us, rule | speedup | o rel L2 |")
    print("|---|---|---|---|---|---|")
    for spec in rows:
        hk, hv, lens = parse_row(spec)
        x = make_inputs(hk, hv, lens)

        def forward():
            return F.chunk_gdr_fwd_hopper(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["h0"], x["cu"])

        us, outs = {}, {}
        for name, fn in (("32", lambda *_: 32), ("rule", rule)):
            F._scan_block_dv = fn
            outs[name] = forward()[0].clone()
            us[name] = 1e3 * time_graph(forward)
        F._scan_block_dv = rule
        cols = rule(len(lens) * hv, x["v"].shape[-1], x["v"].device)
        print(f"| {spec} | {cols} | {us['32']:.1f} | {us['rule']:.1f} | {us['32'] / us['rule']:.3f} | "
              f"{rel_l2(outs['rule'], outs['32']):.1e} |", flush=True)


if __name__ == "__main__":
    main()
