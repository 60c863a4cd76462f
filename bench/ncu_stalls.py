"""Where a kernel's warps wait, per chunk loop and per step inside a loop, from Nsight Compute's sampled stall
reasons (issue 20: which warpgroup of the recurrence holds up the chunk period, and on what).

On the GPU machine (``--clock-control none``: leave the clocks alone), then here on the CSV:

    ncu --clock-control none -k regex:kernel_onchip --launch-count 1 --section SourceCounters \\
        --section WarpStateStats --import-source no -o $OUT/prof python SCRIPT
    ncu -i $OUT/prof.ncu-rep --page source --csv --print-source sass > $OUT/src.csv
    python bench/ncu_stalls.py $OUT/src.csv [--kernel 0] [--steps]

A loop is a backward branch before the last EXIT whose body holds at least ``--min`` instructions; each warp role
of a warp-specialised kernel runs its own loop. Per loop: its stall samples (a sample is one warp caught in one
state, so a loop's share is the share of warp time spent in it), and the leading reasons. With ``--steps``,
each loop is cut after every barrier, wgmma wait and mbarrier arrive, one row per step.
"""

import argparse
import collections
import csv
import re

BOUNDARY = re.compile(r"BAR\.SYNC|WARPGROUP\.DEPBAR|SYNCS\.ARRIVE")


def kernels(path):
    """Per profiled launch, its instructions as ``(address, sass, samples, {reason: samples})``."""
    out, header, rows = [], None, None
    with open(path) as f:
        table = list(csv.reader(f))
    for r in table:
        if r and r[0] == "Kernel Name":
            rows = []
            out.append(rows)
        elif r and r[0] == "Address":
            header = r
        elif rows is not None and r and r[0].startswith("0x"):
            reasons = {h[6:]: float(v or 0) for h, v in zip(header, r)
                       if h.startswith("stall_") and "Not Issued" not in h}
            rows.append((int(r[0], 16), r[1], float(r[header.index("Warp Stall Sampling (All Samples)")] or 0),
                         reasons))
    return out


def loops(rows, min_len):
    """``(first, last)`` row indices of the loop bodies of at least ``min_len`` instructions (branches after the
    last EXIT are the return jumps of out-of-line mbarrier retries, not loops)."""
    index = {a: i for i, (a, *_) in enumerate(rows)}
    last_exit = max(i for i, r in enumerate(rows) if re.search(r"\bEXIT\b", r[1]))
    found = set()
    for i, (_, sass, _, _) in enumerate(rows[:last_exit]):
        m = re.search(r"\bBRA\s+(0x[0-9a-f]+)", sass)
        if m and int(m.group(1), 16) in index and i - index[int(m.group(1), 16)] + 1 >= min_len:
            found.add((index[int(m.group(1), 16)], i))
    return sorted(found)


def summary(rows, total):
    """The table cells of a run of instructions: samples, their share of ``total``, the leading reasons."""
    samples = sum(r[2] for r in rows)
    reasons = collections.Counter()
    for r in rows:
        reasons.update(r[3])
    top = ", ".join(f"{k} {v / max(samples, 1) * 100:.0f}%" for k, v in reasons.most_common(4) if v)
    return f"{samples:.0f} | {samples / total * 100:.1f}% | {top}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--kernel", type=int, default=0, help="which profiled launch of the CSV")
    ap.add_argument("--min", type=int, default=100, help="shortest loop body reported")
    ap.add_argument("--steps", action="store_true", help="also each loop's steps between barriers")
    a = ap.parse_args()
    rows = kernels(a.csv)[a.kernel]
    total = sum(r[2] for r in rows)
    print(f"{len(rows)} instructions, {total:.0f} stall samples\n")
    print("| loop | instructions | samples | share of the kernel's | leading reasons (share of the loop's) |")
    print("|---|---|---|---|---|")
    for s, e in loops(rows, a.min):
        print(f"| {rows[s][0]:#x}-{rows[e][0]:#x} | {e - s + 1} | {summary(rows[s:e + 1], total)} |")
    if not a.steps:
        return
    for s, e in loops(rows, a.min):
        print(f"\nSteps of the loop at {rows[s][0]:#x} (each ends at the instruction shown)\n")
        print("| step | instructions | samples | share of the kernel's | leading reasons | ends at |")
        print("|---|---|---|---|---|---|")
        first = s
        for i in range(s, e + 1):
            if BOUNDARY.search(rows[i][1]) or i == e:
                print(f"| {rows[first][0]:#x}-{rows[i][0]:#x} | {i - first + 1} | "
                      f"{summary(rows[first:i + 1], total)} | `{rows[i][1].strip()[:40]}` |")
                first = i + 1


if __name__ == "__main__":
    main()
