"""Where a chunk's time goes in the forward with the inverse on chip (``chunk_fwd_split(inverse=True)``): a clock
timeline on the GPU, next to the two launches it replaces (``kkt_inverse`` and the recurrence reading T~).

The traced variant (``trace=True``, a diagnostic, not prebuilt) has the first thread of the aux warpgroup, of state
warpgroup 0 and of the K/Q load warp of the first four CTAs write the SM clock at fixed points of each of the first
64 chunks the CTA walks, and inside the tile inverse between its levels. Prints the median cycles of each step over the
steady-state chunks of the first pair, and when the aux's A_g and P_g arrive relative to the state warpgroup's chunk
start; where pairs are shorter than 64 chunks, also what a pair boundary costs (the state's steps into a pair's first
chunk against the same steps within a pair). Compile the traced variant on the CPU first (``--build``, into
``$QLA_CACHE_DIR``) and carry that cache.

    python bench/timeline_onchip.py 32/32:4096x8 --out bench/results/timeline-onchip.md
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PARAMS = dict(dk=128, dv=128, dtype="bfloat16", has_h0=True, inverse=True)
# the events each traced warpgroup marks (``split_state_recurrence.chunk_fwd_split``'s ``mark`` calls); warpgroup 2's
# slots hold the aux's marks inside the inverse
EVENTS = {0: ["start", "full seen", "K K^T done", "A_g formed", "A_g handed over", "P_g handed over"],
          1: ["start", "full seen", "A_g seen", "P_g seen", "end"], 3: ["start", "stage free seen"]}
INNER = ["K K^T done", "tile filled", "16x16 blocks (warp 0)", "16x16 blocks (all)", "level 16", "level 32", "A_g gated"]
WG_NAMES = {0: "aux", 1: "state 0", 3: "K/Q loads"}


def build():
    from qla_compile.kernels import split_state_recurrence

    split_state_recurrence.chunk_fwd_split(**PARAMS, trace=True)


def median_steps(tr, lo, hi):
    """Markdown lines: per traced warpgroup the median cycles between consecutive events over chunks [lo, hi)."""
    ctas = range(tr.shape[0])

    def med(f):
        return statistics.median(f(c, j) for c in ctas for j in range(lo, hi))

    lines = [f"Chunk period (state warpgroup 0, start to start): **{med(lambda c, j: tr[c, 1, j + 1, 0] - tr[c, 1, j, 0]):.0f} "
             "cycles**\n", "| warpgroup | step | median cycles |", "|---|---|---|"]
    for wg, events in EVENTS.items():
        for e in range(1, len(events)):
            lines.append(f"| {WG_NAMES[wg]} | {events[e - 1]} -> {events[e]} | "
                         f"{med(lambda c, j: tr[c, wg, j, e] - tr[c, wg, j, e - 1]):.0f} |")
        lines.append(f"| {WG_NAMES[wg]} | {events[-1]} -> next chunk | "
                     f"{med(lambda c, j: tr[c, wg, j + 1, 0] - tr[c, wg, j, len(events) - 1]):.0f} |")
    for e in range(1, len(INNER)):
        start = (lambda c, j: tr[c, 0, j, 2]) if e == 1 else (lambda c, j, e=e: tr[c, 2, j, e - 1])
        lines.append(f"| aux, inside | {INNER[e - 1]} -> {INNER[e]} | {med(lambda c, j: tr[c, 2, j, e] - start(c, j)):.0f} |")
    for label, e in (("A_g", 4), ("P_g", 5)):
        lines.append(f"| aux -> state 0 | {label} handed over, after the state's full seen | "
                     f"{med(lambda c, j: tr[c, 0, j, e] - tr[c, 1, j, 1]):.0f} |")
    return lines


def pair_boundaries(tr):
    """Markdown lines: the state warpgroup's steps into the first chunk of a pair (the ht store, the next pair's
    fields, its h0 load) against the same steps into a chunk within a pair, median cycles over the first four CTAs'
    walked chunks; and the whole chunk (start to start) into and after a pair's first chunk."""
    def started(c, j):
        """Whether CTA c's state warpgroup marked the start of its j-th walked chunk."""
        return j < tr.shape[2] and bool(tr[c, 1, j, 0])

    walked = [(c, j) for c in range(tr.shape[0]) for j in range(1, tr.shape[2]) if started(c, j)]
    first = [(c, j) for c, j in walked if tr[c, 1, j, 7] == 0]
    inner = [(c, j) for c, j in walked if tr[c, 1, j, 7] > 1]
    if not first:
        return []

    def med(points, f):
        return statistics.median(int(f(c, j)) for c, j in points)

    s = lambda c, j, e: tr[c, 1, j, e]  # noqa: E731 - the state's event e of walked chunk j
    lines = [f"\nPair boundaries ({len(first)} pair starts, {len(inner)} inner chunks; median cycles)\n",
             "| step (state warpgroup 0) | into a pair's first chunk | within a pair |", "|---|---|---|"]
    # the boundary's marks in the order the kernel makes them: (chunk, event) of the last chunk's end, the ht stored
    # and the next pair's fields read (either first), the chunk's start
    names = {5: "ht stored", 6: "next pair's fields read"}
    between = sorted(names, key=lambda e: med(first, lambda c, j: s(c, j, e) - s(c, j - 1, 4)))
    steps = [(-1, 4, "last chunk's end")] + [(0, e, names[e]) for e in between] + [(0, 0, "chunk start")]
    for (dj0, e0, n0), (dj1, e1, n1) in zip(steps, steps[1:]):
        lines.append(f"| {n0} -> {n1} | {med(first, lambda c, j: s(c, j + dj1, e1) - s(c, j + dj0, e0))} | - |")
    lines.append(f"| previous end -> chunk start | {med(first, lambda c, j: s(c, j, 0) - s(c, j - 1, 4))} | "
                 f"{med(inner, lambda c, j: s(c, j, 0) - s(c, j - 1, 4))} |")
    for e in range(1, 5):
        name = f"{EVENTS[1][e - 1]} -> {EVENTS[1][e]}"
        lines.append(f"| {name} | {med(first, lambda c, j: s(c, j, e) - s(c, j, e - 1))} | "
                     f"{med(inner, lambda c, j: s(c, j, e) - s(c, j, e - 1))} |")
    def period(c, j):  # start to start
        return s(c, j + 1, 0) - s(c, j, 0)

    def timed(points):  # those whose next chunk started too
        return [(c, j) for c, j in points if started(c, j + 1)]

    second = [(c, j + 1) for c, j in first]
    lines += [f"| chunk start -> next chunk start | {med(timed(first), period)} | {med(timed(inner), period)} |",
              f"| the chunk after a first one, start to start | {med(timed(second), period)} | - |",
              f"| aux: A_g handed over - state's full seen | {med(first, lambda c, j: tr[c, 0, j, 4] - s(c, j, 1))} | "
              f"{med(inner, lambda c, j: tr[c, 0, j, 4] - s(c, j, 1))} |",
              f"| aux: chunk start - state's chunk start | {med(first, lambda c, j: tr[c, 0, j, 0] - s(c, j, 0))} | "
              f"{med(inner, lambda c, j: tr[c, 0, j, 0] - s(c, j, 0))} |"]
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("row", nargs="?", default="32/32:4096x8", help="H_qk/H_v:seqs")
    ap.add_argument("--build", action="store_true", help="compile the traced variant into the kernel cache and exit")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.build:
        return build()
    import torch

    from bench.common import make_inputs, parse_seqs, time_graph, versions
    from qla_compile.kernels import chunk_recurrence as CR
    from qla_compile.kernels import forward as F

    heads, seqs = a.row.split(":")
    hk, hv = map(int, heads.split("/"))
    lens = parse_seqs(seqs)
    x = make_inputs(hk, hv, lens)
    n_tok = sum(lens)
    q3, k3, v3 = (x[n].view(n_tok, -1, 128) for n in ("q", "k", "v"))
    cu, offsets, order, spans = F._tables(x["cu"], 1, n_tok, q3.device)
    g, b = F._token_gates(x["g"], x["beta"], n_tok, hv)
    o, ht = torch.empty_like(v3), torch.empty_like(x["h0"])
    tt, gb, bad = F._chunk_tables(n_tok, len(lens), hv, q3.device)
    scale = float(x["scale"])
    n_pairs = len(lens) * hv
    recurrence = F._split_state(n_pairs, q3.device, **{**PARAMS, "inverse": False})
    onchip = F._split_state(n_pairs, q3.device, True, **PARAMS)
    traced = F.split_state_recurrence.chunk_fwd_split(**PARAMS, trace=True)
    n_cta = min(n_pairs, F._sm_count(torch.cuda.current_device()))  # as ``onchip``: walking, tickets from 0
    ticket = torch.zeros(1, dtype=torch.int32, device="cuda")
    ms = {"kkt_inverse": time_graph(lambda: F._gate_inverse(k3, x["g"], x["beta"], spans, (tt, gb, bad), "bfloat16")),
          "recurrence reading T~": time_graph(lambda: recurrence(q3, k3, v3, tt, gb, cu, offsets, order, cu[:1],
                                                                 x["h0"], scale, o, ht)),
          "recurrence, inverse on chip": time_graph(lambda: onchip(q3, k3, v3, g, b, cu, order, cu[:1], x["h0"],
                                                                   scale, o, ht))}
    tr = torch.zeros(CR.TRACE_CTAS, 4, CR.TRACE_CHUNKS, CR.TRACE_EVENTS, dtype=torch.int64, device="cuda")
    traced(q3, k3, v3, g, b, cu, order, cu[:1], x["h0"], scale, n_cta, ticket, o, ht, tr)
    torch.cuda.synchronize()
    lines = [f"# Timeline of the recurrence with the inverse on chip, {a.row}\n", f"Versions: {versions()}\n",
             "Launches alone (CUDA-graph medians, us): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in ms.items())
             + "\n"]
    lines += median_steps(tr.cpu(), 4, min(CR.TRACE_CHUNKS, max(lens) // 64) - 1)
    lines += pair_boundaries(tr.cpu())
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
