"""The forward alone with its inverse on chip (``chunk_fwd_split(inverse=True)``) against ``kkt_inverse`` + the
split-state recurrence (``forward._onchip_inverse`` forced), same process, per ``H_qk/H_v:seqs`` row (``common``):
CUDA-graph medians of the package forward both ways, each output against the float64 oracle on the first and last
sequences (a prefix of at most 2048 tokens) and the two outputs and final states against each other; and, as the
memory floor, one elementwise op that reads q, k, v and writes o once (``addcmul``, q and k broadcast over a qk-head's
v-heads):

    python bench/onchip_inverse_ab.py 32/32:4096x8 16/64:512x64 16/16:1000+3000+77 --out $OUT

``--l2norm`` passes ``use_qk_l2norm=True`` (the forward normalises q and k, as a model with
``use_qk_l2norm_in_kernel`` asks; the oracle normalises the same inputs).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", nargs="+", help="H_qk/H_v:seqs items, e.g. 32/32:4096x8")
    ap.add_argument("--out", default=None)
    ap.add_argument("--l2norm", action="store_true", help="the forward normalises q and k itself")
    args = ap.parse_args()
    import torch

    from bench.common import ab_cells, ab_row, make_inputs, parse_row, time_graph, write_results
    from qla_compile.kernels import forward as F

    rows = []
    for spec in args.rows:
        hk, hv, lens = parse_row(spec)
        x = make_inputs(hk, hv, lens)

        def forward():
            return F.chunk_gdr_fwd_hopper(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["h0"], x["cu"],
                                          use_qk_l2norm=args.l2norm)

        arms = [("kkt", lambda *_: False), ("onchip", lambda *_: True)]
        row = dict(row=spec, l2norm=args.l2norm, **ab_row(forward, F, "_onchip_inverse", arms, x, lens, args.l2norm))
        q, k, v = x["q"], x["k"], x["v"]
        group = (*v.shape[:2], hk, hv // hk, v.shape[-1])
        o = torch.empty_like(v)
        row["stream_us"] = time_graph(lambda: torch.addcmul(v.view(group), q.unsqueeze(3), k.unsqueeze(3),
                                                            out=o.view(group))) * 1e3
        rows.append(row)
        print(row, flush=True)
    print("\n| row | kkt_inverse + recurrence us | on chip us | speedup | o err fp64 (kkt / on chip) "
          "| o, ht on chip vs kkt | memory floor us |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"{ab_cells(r, 'kkt', 'onchip')} {r['stream_us']:.1f} |")
    if args.out:
        write_results(args.out, "onchip-inverse-ab.json", rows)


if __name__ == "__main__":
    main()
