"""The forward's time per context-parallel piece length, to fit ``chunking.piece_chunks`` (forward alone) on the GPU.

For each ``H_qk/H_v:seqs`` item (bench_fwd's notation), CUDA-graph medians (ms) of ``chunk_gdr_fwd_hopper`` with
``context_parallel`` = None (the rule's choice), False (unsplit) and each given piece length in 64-token chunks
(one no longer than the longest sequence is skipped), and the relative L2 of each split output against the unsplit
one where it exceeds 2e-3 (both carry their own bf16 rounding); one table per ``--sub`` value, the length of an
exact transition's sub-walks in chunks (the shortest allowed; the device picks how many run; 0: none; default: the
rule's, ``chunking.sub_walks``):

    python bench/cp_rule_sweep.py 2/8:1x2048 8/32:1x4096 --lengths 4,8,16,32,64 --sub 0,16
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import make_inputs, parse_seqs, rel_l2, set_shortest_sub_walk, time_graph  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shapes", nargs="+", help="H_qk/H_v:seqs items, e.g. 2/8:1x2048")
    ap.add_argument("--lengths", default="4,8,16,32,64", help="piece lengths in chunks (comma list; empty: none)")
    ap.add_argument("--sub", default="", help="sub-walk lengths in chunks (comma list, 0: none; default: the rule's)")
    args = ap.parse_args()
    import torch

    from qla_compile.kernels import chunking

    n_sm = torch.cuda.get_device_properties(0).multi_processor_count  # what the forward's rule is given
    settings = [None, False] + [int(s) for s in args.lengths.split(",") if s]
    rule = chunking.MIN_SUB_WALK_CHUNKS
    for sub in [int(s) for s in args.sub.split(",") if s] or [None]:
        set_shortest_sub_walk(rule if sub is None else sub)
        print(f"\nsub-walks: {'the rule' if sub is None else sub or 'none'}\n")
        table(args.shapes, settings, n_sm)


def table(shapes, settings, n_sm):
    """One markdown table: a row per shape, a column per setting."""
    from qla_compile.kernels import chunk_gdr_fwd_hopper, chunking

    print("| shape | rule L | " + " | ".join(str(s) for s in settings) + " | rule / unsplit |")
    print("|---" * (len(settings) + 3) + "|")
    for item in shapes:
        heads, seqs = item.split(":")
        hk, hv = (int(s) for s in heads.split("/"))
        lens = parse_seqs(seqs)
        x = make_inputs(hk, hv, lens)

        def forward(cp):
            return chunk_gdr_fwd_hopper(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["h0"], x["cu"],
                                        context_parallel=cp)

        unsplit = forward(False)[0].float()
        cells, ms = [], {}
        for s in settings:
            if s not in (None, False) and s * chunking.CHUNK >= max(lens):  # the forward would not split
                cells.append("-")
                continue
            err = rel_l2(forward(s)[0].float(), unsplit)
            ms[s] = time_graph(lambda: forward(s))
            cells.append(f"{ms[s]:.3f}" + ("" if err < 2e-3 else f" (err {err:.1e})"))
        rule = chunking.piece_chunks(lens, hv, n_sm)
        print(f"| {item} | {rule} | " + " | ".join(cells) + f" | {ms[None] / ms[False]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
