"""The forward launch by launch on the GPU machine: where a call's device time goes, per kernel.

For each ``H_qk/H_v:seqs`` item (bench_fwd's notation; inputs from ``common.make_inputs``) the forward alone
(``chunk_gdr_fwd_hopper``, the rule's context-parallel plan or ``--cp``) is timed as the median of CUDA-graph
replays, then run ``--calls`` times under ``torch.profiler``; per launch of a call (in launch order: every TileLang
kernel is named ``kernel_kernel``, so the order tells them apart, see ``forward.chunk_gdr_fwd_hopper_aux``) the
table gives its device microseconds, and what the graph time leaves for gaps between launches:

    python bench/cp_breakdown.py 16/16:1x32768 2/8:1x32768 --out $OUT
"""

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import make_inputs, parse_row, set_shortest_sub_walk, time_graph, write_results  # noqa: E402
from qla_compile.kernels import chunk_gdr_fwd_hopper, chunking  # noqa: E402


def kernel_label(name):
    """A kernel's profiler name, shortened to what tells launches apart (ours and FlashInfer 0.7's)."""
    return name.split("(")[0].replace("void ", "")[:70]


def per_launch(fn, calls):
    """Device us per launch of one call of ``fn`` (the mean over ``calls`` profiled calls), in launch order."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda ev: ev.time_range.start)
    per_call = len(events) // calls
    assert per_call * calls == len(events), "calls launched different kernels"
    us = collections.defaultdict(float)
    for i, ev in enumerate(events):
        us[i % per_call, kernel_label(ev.name)] += ev.device_time / calls
    return [dict(launch=i, kernel=name, us=t) for (i, name), t in sorted(us.items())]


def breakdown(spec, cp, calls):
    h_qk, h_v, lens = parse_row(spec)
    x = make_inputs(h_qk, h_v, lens)

    def forward():
        return chunk_gdr_fwd_hopper(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["h0"], x["cu"],
                                    context_parallel=cp)

    graph_ms = time_graph(forward)
    forward()
    kernels = per_launch(forward, calls)
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    rule = chunking.piece_chunks(lens, h_v, n_sm) if cp is None else cp
    return dict(row=spec, piece_chunks=rule, graph_us=graph_ms * 1e3, kernels=kernels)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="+")
    parser.add_argument("--cp", type=int, default=None, help="piece length in chunks (default: the rule's)")
    parser.add_argument("--sub", type=int, default=None,
                        help="shortest sub-walk of exact transitions in chunks (0: none; default: the rule's)")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    if a.sub is not None:
        set_shortest_sub_walk(a.sub)
    rows = [breakdown(spec, a.cp, a.calls) for spec in a.rows]
    if a.out:
        write_results(a.out, "cp-breakdown.json", rows)
    for r in rows:
        busy = sum(k["us"] for k in r["kernels"])
        print(f"\n{r['row']}: piece length {r['piece_chunks']} chunks, graph {r['graph_us']:.1f} us, "
              f"kernels {busy:.1f} us, gaps {r['graph_us'] - busy:.1f} us")
        for k in r["kernels"]:
            print(f"  {k['launch']:2d}  {k['us']:8.1f} us  {k['kernel']}")


if __name__ == "__main__":
    main()
