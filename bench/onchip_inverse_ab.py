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

    from bench.common import make_inputs, oracle_errors, parse_seqs, rel_l2, time_graph, write_results
    from qla_compile.kernels import forward as F

    rows = []
    for spec in args.rows:
        heads, seqs = spec.split(":")
        hk, hv = (int(h) for h in heads.split("/"))
        lens = parse_seqs(seqs)
        x = make_inputs(hk, hv, lens)

        def forward():
            return F.chunk_gdr_fwd_hopper(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["h0"], x["cu"],
                                          use_qk_l2norm=args.l2norm)

        row, outs = dict(row=spec, l2norm=args.l2norm), {}
        routed = F._onchip_inverse
        for onchip in (False, True):
            name = "onchip" if onchip else "kkt"
            F._onchip_inverse = lambda *_, on=onchip: on
            outs[name] = [t.clone() for t in forward()]
            row[name + "_us"] = time_graph(forward) * 1e3
            for n, err in oracle_errors(outs[name][0], x, lens, args.l2norm).items():
                row[f"{name}_o_vs_fp64_seq{n}"] = err
        F._onchip_inverse = routed
        q, k, v = x["q"], x["k"], x["v"]
        group = (*v.shape[:2], hk, hv // hk, v.shape[-1])
        o = torch.empty_like(v)
        row["stream_us"] = time_graph(lambda: torch.addcmul(v.view(group), q.unsqueeze(3), k.unsqueeze(3),
                                                            out=o.view(group))) * 1e3
        row["o_onchip_vs_kkt"] = rel_l2(outs["onchip"][0], outs["kkt"][0])
        row["ht_onchip_vs_kkt"] = rel_l2(outs["onchip"][1], outs["kkt"][1])
        row["speedup"] = row["kkt_us"] / row["onchip_us"]
        rows.append(row)
        print(row, flush=True)
    print("\n| row | kkt_inverse + recurrence us | on chip us | speedup | o err fp64 (kkt / on chip) "
          "| o, ht on chip vs kkt | memory floor us |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ek = max(v for k, v in r.items() if k.startswith("kkt_o_vs"))
        eo = max(v for k, v in r.items() if k.startswith("onchip_o_vs"))
        print(f"| {r['row']} | {r['kkt_us']:.1f} | {r['onchip_us']:.1f} | {r['speedup']:.3f} | {ek:.1e} / {eo:.1e} | "
              f"{r['o_onchip_vs_kkt']:.1e}, {r['ht_onchip_vs_kkt']:.1e} | {r['stream_us']:.1f} |")
    if args.out:
        write_results(args.out, "onchip-inverse-ab.json", rows)


if __name__ == "__main__":
    main()
