"""How much of the package forward's CUDA-graph time the per-call varlen chunk tables take (``forward._tables``: one
``seq_tables`` launch inside a capture): the forward as ``bench_fwd`` times it against the same with the tables built
once before capture, per ``H_qk/H_v:seqs`` row (``common``), same process; outputs compared bitwise.

    python bench/tables_probe.py 16/16:1024x8 4/16:1024x8 16/16:4096x8 --out $OUT
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", nargs="+")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from bench.common import make_inputs, parse_seqs, time_graph, write_results
    from qla_compile.kernels import chunk_gdr_fwd_hopper
    from qla_compile.kernels import forward as F

    tables = F._tables
    rows = []
    for spec in args.rows:
        heads, seqs = spec.split(":")
        hk, hv = (int(h) for h in heads.split("/"))
        x = make_inputs(hk, hv, parse_seqs(seqs))

        def forward():
            return chunk_gdr_fwd_hopper(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["h0"], x["cu"])

        row = dict(row=spec)
        F._tables = tables
        o1 = forward()[0].clone()
        row["per_call_us"] = time_graph(forward) * 1e3
        built = tables(x["cu"], 1, x["q"].shape[1], x["q"].device)
        F._tables = lambda *a: built
        o2 = forward()[0].clone()
        row["prebuilt_us"] = time_graph(forward) * 1e3
        F._tables = tables
        row["equal"] = bool(torch.equal(o1, o2))
        row["ratio"] = row["per_call_us"] / row["prebuilt_us"]
        rows.append(row)
        print(row, flush=True)
    print("\n| row | tables per call us | tables prebuilt us | ratio | equal |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['row']} | {r['per_call_us']:.1f} | {r['prebuilt_us']:.1f} | {r['ratio']:.3f} | {r['equal']} |")
    if args.out:
        write_results(args.out, "tables-probe.json", rows)


if __name__ == "__main__":
    main()
