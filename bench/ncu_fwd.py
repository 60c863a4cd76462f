"""Our forward and FlashInfer 0.6.13's on one shape, each in its own NVTX range, for Nsight Compute on the GPU
machine (issue 20: where the per-chunk time of each kernel goes at high parallelism):

    ncu --nvtx --nvtx-include "qla/" --nvtx-include "flashinfer/" --csv --metrics $(python bench/ncu_fwd.py --metrics) \\
        python bench/ncu_fwd.py --heads 32/32 --seqs 4096x8 > $OUT/ncu.csv
    python bench/ncu_fwd.py --table $OUT/ncu.csv

Each implementation runs once to warm up (outside the ranges), then once inside its range; the two outputs are
checked against each other (relative L2) before the profiled calls. ``--table`` prints one row per kernel.
"""

import argparse
import csv
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_fwd import orient_flashinfer, peers  # noqa: E402
from bench.common import make_inputs, parse_seqs, rel_l2  # noqa: E402

METRICS = {  # ncu metric -> column
    "gpu__time_duration.sum": "us",
    "launch__grid_size": "CTAs",
    "launch__registers_per_thread": "regs",
    "launch__shared_mem_per_block_dynamic": "dyn smem",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy %",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue active %",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor pipe %",
    "l1tex__throughput.avg.pct_of_peak_sustained_active": "L1/smem %",
    "l1tex__data_bank_reads.avg.pct_of_peak_sustained_active": "smem bank reads %",
    "l1tex__data_bank_writes.avg.pct_of_peak_sustained_active": "smem bank writes %",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum": "LSU smem wavefronts",
    "sm__inst_executed.sum": "warp instr",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM %",
    "dram__bytes_read.sum": "DRAM read MB",
    "dram__bytes_write.sum": "DRAM write MB",
    "smsp__average_warp_latency_issue_stalled_barrier.ratio": "stall barrier",
    "smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio": "stall long sb",
}
_PER_US = {"ns": 1e3, "nsecond": 1e3, "us": 1.0, "usecond": 1.0, "ms": 1e-3, "msecond": 1e-3}
_PER_MB = {"byte": 1e6, "Kbyte": 1e3, "Mbyte": 1.0, "Gbyte": 1e-3}


def table(path):
    """One line per profiled kernel from ``ncu --csv`` output (long format: a row per kernel and metric)."""
    with open(path) as f:
        lines = [ln for ln in f if ln.startswith('"')]  # skip the program's own output and ncu's banners
    kernels = {}
    for row in csv.DictReader(lines):
        rng = next((v for k, v in row.items() if k and ("Push/Pop" in k or "NVTX" in k)), "")  # --nvtx's column
        rng = next((name for name in ("flashinfer", "qla") if f":{name}:" in rng), rng)
        key = (row["ID"], rng, row["Kernel Name"][:48])
        value = row["Metric Value"]
        if row["Metric Name"] == "gpu__time_duration.sum":  # ncu picks the unit; the column is us
            value = f"{float(value.replace(',', '')) / _PER_US[row['Metric Unit']]:.1f}"
        elif row["Metric Name"].startswith("dram__bytes"):  # likewise for bytes: the column is MB
            value = f"{float(value.replace(',', '')) / _PER_MB[row['Metric Unit']]:.1f}"
        kernels.setdefault(key, {})[METRICS.get(row["Metric Name"], row["Metric Name"])] = value
    cols = list(METRICS.values())
    print("| id | range | kernel | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 3) + "|")
    for (kid, rng, name), vals in kernels.items():
        print(f"| {kid} | {rng} | {name} | " + " | ".join(vals.get(c, "-") for c in cols) + " |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="32/32", help="H_qk/H_v")
    ap.add_argument("--seqs", default="4096x8", help="sequence mix (bench_fwd's notation)")
    ap.add_argument("--peers", default="flashinfer", help="beside qla: a comma list of bench_fwd's peers")
    ap.add_argument("--metrics", action="store_true", help="print the ncu metric list and exit")
    ap.add_argument("--table", metavar="CSV", help="print the kernels of an ncu --csv output and exit")
    args = ap.parse_args()
    if args.metrics:
        return print(",".join(METRICS))
    if args.table:
        return table(args.table)
    hk, hv = (int(s) for s in args.heads.split("/"))
    x = make_inputs(hk, hv, parse_seqs(args.seqs))
    fns = peers(args.peers.split(","))
    outs = {name: fn(x) for name, fn in fns.items()}  # warm-up (and FlashInfer's scratch) outside the ranges
    if "flashinfer" in fns:
        outs["flashinfer"], fns["flashinfer"] = orient_flashinfer(fns["flashinfer"], x, outs["flashinfer"],
                                                                  outs["qla"][0])
    torch.cuda.synchronize()
    for name in outs:
        if name != "qla":
            print(f"{name} o vs qla: {rel_l2(outs[name][0], outs['qla'][0]):.2e}", file=sys.stderr)
    for name, fn in fns.items():
        torch.cuda.nvtx.range_push(name)
        fn(x)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main()
