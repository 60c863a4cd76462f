"""How much of the package forward's CUDA-graph time the per-call varlen chunk tables take (``forward._tables``: one
``seq_tables`` launch inside a capture): the forward as ``bench_fwd`` times it against the same with the tables built
once before capture, per ``H_qk/H_v:seqs`` row (``common``), same process, each against the float64 oracle and the
two outputs against each other (``common.ab_row``). Since session 28 the on-chip route builds no tables where the
host knows the lengths (``forward._onchip_tables``): there both arms are the same call; what is left to measure is
the rows whose lengths are not known (e.g. 16/64:1024x8) and the T~ path.

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
    from bench.common import ab_cells, ab_row, make_inputs, parse_row, write_results
    from qla_compile.kernels import chunk_gdr_fwd_hopper
    from qla_compile.kernels import forward as F

    tables = F._tables
    rows = []
    for spec in args.rows:
        hk, hv, lens = parse_row(spec)
        x = make_inputs(hk, hv, lens)

        def forward():
            return chunk_gdr_fwd_hopper(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["h0"], x["cu"])

        built = tables(x["cu"], 1, x["q"].shape[1], x["q"].device)
        arms = [("per_call", tables), ("prebuilt", lambda *_: built)]
        row = dict(row=spec, **ab_row(forward, F, "_tables", arms, x, lens))
        rows.append(row)
        print(row, flush=True)
    print("\n| row | tables per call us | tables prebuilt us | speedup | o err fp64 (per call / prebuilt) "
          "| o, ht prebuilt vs per call |\n|---|---|---|---|---|---|")
    for r in rows:
        print(ab_cells(r, "per_call", "prebuilt"))
    if args.out:
        write_results(args.out, "tables-probe.json", rows)


if __name__ == "__main__":
    main()
