"""The eager op with ``use_qk_l2norm_in_kernel`` (``qla_compile.chunk_gated_delta_rule``, a forward alone) with and
without ``keys_normalised`` reaching the forward (``forward.chunk_gdr_fwd_hopper_aux``), same process, per
``H_qk/H_v:seqs`` row (``common``): CUDA-graph medians, each output against the float64 oracle on the first and
last sequences (a prefix of at most 2048 tokens) and the two outputs and final states against each other. q and k
come unnormalised (``common``'s unit rows times N(1, 0.25) per row), so the op's norm does real work:

    python bench/keys_normalised_ab.py 16/16:1x32768 32/32:1x32768 --out $OUT
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", nargs="+", help="H_qk/H_v:seqs items, e.g. 16/16:1x32768")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    import qla_compile
    from bench.common import make_inputs, oracle_errors, parse_seqs, rel_l2, time_graph, write_results
    from qla_compile.kernels import forward as F

    aux = F.chunk_gdr_fwd_hopper_aux
    rows = []
    for spec in args.rows:
        heads, seqs = spec.split(":")
        hk, hv = (int(h) for h in heads.split("/"))
        lens = parse_seqs(seqs)
        x = make_inputs(hk, hv, lens)
        gen = torch.Generator(device="cuda").manual_seed(1)
        for name in ("q", "k"):
            x[name] = (x[name] * (1 + 0.25 * torch.randn(*x[name].shape[:-1], 1, device="cuda", generator=gen))
                       ).to(x[name].dtype)
        cu, cu_cpu = x["cu"], x["cu"].cpu()

        def forward():
            return qla_compile.chunk_gated_delta_rule(
                x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["h0"], output_final_state=True,
                use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)

        row, outs = dict(row=spec), {}
        for told in (False, True):
            name = "told" if told else "untold"
            F.chunk_gdr_fwd_hopper_aux = aux if told else (lambda *a, **kw: aux(*a, **{**kw, "keys_normalised": False}))
            with torch.no_grad():
                outs[name] = [t.clone() for t in forward()]
                row[name + "_us"] = time_graph(forward) * 1e3
            for n, err in oracle_errors(outs[name][0], x, lens, l2norm=True).items():
                row[f"{name}_o_vs_fp64_seq{n}"] = err
        F.chunk_gdr_fwd_hopper_aux = aux
        row["o_told_vs_untold"] = rel_l2(outs["told"][0], outs["untold"][0])
        row["ht_told_vs_untold"] = rel_l2(outs["told"][1], outs["untold"][1])
        row["speedup"] = row["untold_us"] / row["told_us"]
        rows.append(row)
        print(row, flush=True)
    print("\n| row | untold us | told us | speedup | o err fp64 (untold / told) | o, ht told vs untold |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        eu = max(v for k, v in r.items() if k.startswith("untold_o_vs"))
        et = max(v for k, v in r.items() if k.startswith("told_o_vs"))
        print(f"| {r['row']} | {r['untold_us']:.1f} | {r['told_us']:.1f} | {r['speedup']:.3f} | {eu:.1e} / {et:.1e} | "
              f"{r['o_told_vs_untold']:.1e}, {r['ht_told_vs_untold']:.1e} |")
    if args.out:
        write_results(args.out, "keys-normalised-ab.json", rows)


if __name__ == "__main__":
    main()
