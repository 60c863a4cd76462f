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
    from bench.common import ab_cells, ab_row, make_inputs, parse_row, write_results
    from qla_compile.kernels import forward as F

    aux = F.chunk_gdr_fwd_hopper_aux
    rows = []
    for spec in args.rows:
        hk, hv, lens = parse_row(spec)
        x = make_inputs(hk, hv, lens)
        gen = torch.Generator(device="cuda").manual_seed(1)
        for name in ("q", "k"):
            x[name] = (x[name] * (1 + 0.25 * torch.randn(*x[name].shape[:-1], 1, device="cuda", generator=gen))
                       ).to(x[name].dtype)
        cu, cu_cpu = x["cu"], x["cu"].cpu()

        def forward():
            with torch.no_grad():
                return qla_compile.chunk_gated_delta_rule(
                    x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["h0"], output_final_state=True,
                    use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)

        def untold(*a, **kw):
            return aux(*a, **{**kw, "keys_normalised": False})

        arms = [("untold", untold), ("told", aux)]
        row = dict(row=spec, **ab_row(forward, F, "chunk_gdr_fwd_hopper_aux", arms, x, lens, l2norm=True))
        rows.append(row)
        print(row, flush=True)
    print("\n| row | untold us | told us | speedup | o err fp64 (untold / told) | o, ht told vs untold |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(ab_cells(r, "untold", "told"))
    if args.out:
        write_results(args.out, "keys-normalised-ab.json", rows)


if __name__ == "__main__":
    main()
