"""What a (sequence, v-head) pair costs the on-chip forward besides its chunks: the forward over one token count cut
into sequences of different lengths (``--lens``, each ``--tokens / len`` sequences), per head configuration, with
and without the initial state (h0 load) and with and without the final state's store (ht skipped by ``ht_rows`` =
-1, which the kernel reads as "not kept"). Per row the time per round of pairs (``ceil(pairs / SMs)`` rounds, one
pair a CTA at a time) is fitted as ``chunks a pair x P + X``: P the chunk period, X a pair's own cost. Lengths under
``forward._WALK_MIN_TOKENS`` (512) get a CTA per pair instead of walking, outside that model. The op's output is
checked against the float64 oracle on each row (``common.oracle_errors``).

    python bench/pair_overhead.py --heads 32/32,16/64 --tokens 32768 --lens 512,1024,2048,4096,8192 --out $OUT
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ARMS = ("full", "no_h0", "no_ht", "neither")  # with h0 and the ht store, without h0, without the store, neither


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="32/32,16/64")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--lens", default="512,1024,2048,4096,8192")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from bench.common import make_inputs, oracle_errors, time_graph, write_results
    from qla_compile.kernels import chunk_gdr_fwd_hopper
    from qla_compile.kernels import forward as F
    from qla_compile.kernels.chunking import CHUNK

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tables = F._onchip_tables

    def no_ht(cu_seqlens, lens, batch, seqlen, device):
        cu, order, _ = tables(cu_seqlens, lens, batch, seqlen, device)
        return cu, order, torch.full((len(lens),), -1, device=device, dtype=torch.int32)

    rows = []
    for heads in args.heads.split(","):
        hk, hv = map(int, heads.split("/"))
        for n in map(int, args.lens.split(",")):
            lens = [n] * (args.tokens // n)
            x = make_inputs(hk, hv, lens)
            rounds = -(-len(lens) * hv // sms)
            row = dict(heads=heads, seq_len=n, seqs=len(lens), pairs=len(lens) * hv, rounds=rounds)
            for name, h0, patched in zip(ARMS, (x["h0"], None, x["h0"], None), (tables, tables, no_ht, no_ht)):
                F._onchip_tables = patched
                try:
                    def forward():
                        return chunk_gdr_fwd_hopper(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], h0,
                                                    x["cu"])

                    if name == "full":
                        row["o_vs_fp64"] = max(oracle_errors(forward()[0], x, lens, prefix=1024).values())
                    row[name + "_us"] = time_graph(forward) * 1e3
                finally:
                    F._onchip_tables = tables
                row[name + "_us_round"] = row[name + "_us"] / rounds
            rows.append(row)
            print(row, flush=True)
    print("\n| heads | seq len | pairs | rounds | full us | no h0 | no ht | neither | o err fp64 |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        times = " | ".join(f"{r[name + '_us']:.1f}" for name in ARMS)
        print(f"| {r['heads']} | {r['seq_len']} | {r['pairs']} | {r['rounds']} | {times} | {r['o_vs_fp64']:.1e} |")
    print("\nfit per round: us = P x chunks a pair + X\n\n| heads | arm | P us (chunk) | X us (pair) |\n"
          "|---|---|---|---|")
    for heads in args.heads.split(","):
        mine = [r for r in rows if r["heads"] == heads]
        for name in ARMS:
            p, x0 = statistics.linear_regression([r["seq_len"] / CHUNK for r in mine],
                                                 [r[name + "_us_round"] for r in mine])
            print(f"| {heads} | {name} | {p:.3f} | {x0:.2f} |")
    if args.out:
        write_results(args.out, "pair-overhead.json", rows)


if __name__ == "__main__":
    main()
