"""The gate-free inverse kernels against each other, and the forward with each: which one ``forward._gate_inverse``
should pick per head ratio.

``kkt_inverse.kkt_inverse`` ("grouped": one CTA per chunk, qk-head and group of up to four of its v-heads, K K^T once
per group, fp32 substitution) and ``kkt_inverse.kkt_inverse_tc`` ("tc1", "tc2", "tc4": one CTA per chunk and 1, 2
or 4 v-heads of one qk-head, K K^T once per CTA, the tile inverted on tensor cores; tc2 and tc4 where the head
ratio allows, compiled on first use unless prebuilt). For each
``H_qk/H_v:seqs`` row (``common.make_inputs``): both kernels' T~ against a float64 inverse of the same I + L~ on
sampled chunk slots, gb and the contraction flags bit for bit, each kernel alone and the forward with each
(CUDA-graph medians), and the forward's output against the float64 oracle on a prefix:

    python bench/kkt_inverse_ab.py 32/32:4096x8 16/32:4096x8 16/64:4096x8 8/32:1024x8 --out $OUT
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHUNK = 64


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", nargs="+", help="H_qk/H_v:seqs items, e.g. 32/32:4096x8")
    ap.add_argument("--samples", type=int, default=64, help="chunk slots checked against float64 per row")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from bench.common import make_inputs, parse_row, rel_l2, time_graph, write_results
    from qla_compile.kernels import forward as F
    from qla_compile.reference import recurrent_gdr_reference

    def route(name, **params):
        def call(k3, g, beta, spans, tables, dtype):
            n_tok, h_v = k3.shape[0], tables[1].shape[1]
            kernel = getattr(F.kkt_inverse, name)(dk=k3.shape[2], dtype=dtype, **params)
            kernel(k3, g.reshape(n_tok, h_v).float().contiguous(), beta.reshape(n_tok, h_v).float().contiguous(),
                   spans, *tables)
        return call

    package_inverse = F._gate_inverse
    rows = []
    for spec in args.rows:
        hk, hv, lens = parse_row(spec)
        x = make_inputs(hk, hv, lens)
        inverses = {"grouped": route("kkt_inverse")}
        inverses.update({f"tc{n}": route("kkt_inverse_tc", heads=n) for n in (1, 2, 4) if (hv // hk) % n == 0})
        k3 = x["k"][0].contiguous()
        n_tok = k3.shape[0]
        _, _, _, spans = F._tables(x["cu"], 1, n_tok, k3.device)
        outs = {}
        row = dict(row=spec)
        for name, fn in inverses.items():
            tables = F._chunk_tables(n_tok, len(lens), hv, k3.device)
            fn(k3, x["g"], x["beta"], spans, tables, "bfloat16")
            torch.cuda.synchronize()
            outs[name] = [t.clone() for t in tables]
            row[name + "_kernel_us"] = time_graph(lambda: fn(k3, x["g"], x["beta"], spans, tables, "bfloat16")) * 1e3
        n_slots = int(spans[:, 1].gt(0).sum())
        row["gb_equal"] = all(torch.equal(outs["grouped"][1][:n_slots], o[1][:n_slots]) for o in outs.values())
        row["bad_equal"] = all(torch.equal(outs["grouped"][2][:n_slots], o[2][:n_slots]) for o in outs.values())
        # T~ of sampled slots and v-heads against a float64 inverse of I + strictly_lower(diag(beta) K K^T)
        gen = torch.Generator().manual_seed(0)
        errs = {name: [] for name in inverses}
        beta = x["beta"][0].double()
        for s in torch.randint(0, n_slots, (args.samples,), generator=gen).tolist():
            a, n = spans[s].tolist()
            h = int(torch.randint(0, hv, (1,), generator=gen))
            kk = k3[a : a + n, h // (hv // hk)].double()
            lt = torch.zeros(CHUNK, CHUNK, dtype=torch.float64, device=k3.device)
            lt[:n, :n] = torch.tril(beta[a : a + n, h, None] * (kk @ kk.T), -1)
            ref = torch.linalg.inv(torch.eye(CHUNK, dtype=torch.float64, device=k3.device) + lt)
            for name in errs:
                errs[name].append(rel_l2(outs[name][0][s, h].double(), ref))
        for name in errs:
            row[name + "_tt_vs_fp64_max"] = max(errs[name])

        def forward():
            return F.chunk_gdr_fwd_hopper(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["h0"], x["cu"])

        for name, fn in inverses.items():
            F._gate_inverse = fn
            o, _ = forward()
            row[name + "_forward_us"] = time_graph(forward) * 1e3
            t = min(lens[0], 2048)  # a prefix of the first sequence
            ref_o, _ = recurrent_gdr_reference(x["q"][:, :t], x["k"][:, :t], x["v"][:, :t], x["g"][:, :t],
                                               x["beta"][:, :t], scale=x["scale"], initial_state=x["h0"][:1],
                                               output_final_state=True, cu_seqlens=torch.tensor([0, t], device="cuda"))
            row[name + "_o_vs_fp64_prefix"] = rel_l2(o[:, :t], ref_o)
        F._gate_inverse = package_inverse
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| row | inverse | kernel us | forward us | T~ err | gb, flags equal |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        for n in ("grouped", "tc1", "tc2", "tc4"):
            if n + "_kernel_us" in r:
                print(f"| {r['row']} | {n} | {r[n + '_kernel_us']:.1f} | {r[n + '_forward_us']:.1f} | "
                      f"{r[n + '_tt_vs_fp64_max']:.1e} | {r['gb_equal']}, {r['bad_equal']} |")
    if args.out:
        write_results(args.out, "kkt-inverse-ab.json", rows)


if __name__ == "__main__":
    main()
