"""FlashInfer 0.7's forward beside ours, launch by launch: CUDA-graph medians and torch.profiler device time per launch.

Needs FlashInfer 0.7 unpacked at ``--fi07-path`` (``bench/flashinfer07_bundle.sh``); both run in this process on
``common.make_inputs`` (FlashInfer 0.7 with its own CP choice, ``use_cp="auto"``), and their outputs are compared:

    python bench/fi07_breakdown.py 16/16:1x32768 32/32:4096x8 --out $OUT
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", nargs="+", help="H_qk/H_v:seqs items, e.g. 16/16:1x32768")
    ap.add_argument("--fi07-path", default=os.environ.get("QLA_FI07_PATH", "/tmp/fi07"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with open(os.path.join(args.fi07_path, "fi07_bundle.json")) as f:
        info = json.load(f)
    dsl = info.get("dsl_path", "nvidia_cutlass_dsl/dsl_packages")
    sys.path[:0] = [args.fi07_path, os.path.join(args.fi07_path, dsl)]
    from flashinfer.gdn_prefill import chunk_gated_delta_rule

    from bench.bench_fwd import fi07_call
    from bench.common import make_inputs, parse_row, rel_l2, time_graph, write_results
    from bench.cp_breakdown import per_launch
    from qla_compile.kernels import chunk_gdr_fwd_hopper

    fi07 = fi07_call(chunk_gated_delta_rule, "auto")
    rows = []
    for spec in args.rows:
        hk, hv, lens = parse_row(spec)
        x = make_inputs(hk, hv, lens)
        fns = {"qla": lambda: chunk_gdr_fwd_hopper(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["h0"],
                                                   x["cu"]),
               "flashinfer-0.7": lambda: fi07(x)}
        row = dict(row=spec, o_fi07_vs_qla=rel_l2(fns["flashinfer-0.7"]()[0].float(), fns["qla"]()[0].float()))
        for name, fn in fns.items():
            row[name] = dict(graph_us=time_graph(fn) * 1e3, kernels=per_launch(fn, calls=5))
        rows.append(row)
        print(f"\n{spec}: o FlashInfer 0.7 vs qla {row['o_fi07_vs_qla']:.1e}")
        for name in fns:
            print(f"  {name}: graph {row[name]['graph_us']:.1f} us; "
                  + ", ".join(f"{k['us']:.1f}" for k in row[name]["kernels"]))
    if args.out:
        write_results(args.out, "fi07-breakdown.json", rows)


if __name__ == "__main__":
    main()
