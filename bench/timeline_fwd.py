"""Where a chunk's time goes inside ``chunk_recurrence.chunk_fwd_ws``: a per-warpgroup clock timeline on the GPU.

Runs our forward on one shape with the recurrence swapped for its ``trace=True`` variant (the first thread of each
warpgroup of four CTAs writes the SM clock at fixed points of every chunk, see ``chunk_fwd_ws``), then prints per
warpgroup the median cycles of each step over the steady-state chunks, the chunk period, and the critical chain
S published -> K S -> V' -> state update. The trace variant is not prebuilt: compile it on the CPU machine first
(``python bench/timeline_fwd.py --build``, into ``$QLA_CACHE_DIR``) and carry that cache.

    python bench/timeline_fwd.py --heads 32/32 --seqs 4096x8 --out bench/results/timeline.md
"""

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import make_inputs, parse_seqs, rel_l2, time_graph, versions  # noqa: E402

# event names per warpgroup, in the order ``chunk_fwd_ws`` marks them (mark(.., wg, j, event))
EVENTS = {
    "WG0 state": ["start", "s_free seen", "S published", "inputs landed", "r o K built, S decayed", "V' seen",
                  "S updated"],
    "WG1 delta": ["start", "inputs landed", "A_g built", "S seen", "K S done", "W' stored", "A_g W' done",
                  "V' published"],
    "WG2 output": ["start", "inputs landed", "S seen", "Q S, P_g done", "V' seen", "P_g V' done", "O stored"],
    "WG3 q/k loads": ["start", "slot free"],
}
PARAMS = [dict(dk=128, dv=128, dtype="bfloat16", has_h0=has_h0, block_dv=128, pdl=True, trace=True)
          for has_h0 in (True, False)]


def build():
    from qla_compile.kernels import chunk_recurrence

    for p in PARAMS:
        chunk_recurrence.chunk_fwd_ws(**p)


def traced_forward(x):
    """Our forward on ``x`` with the traced recurrence; returns (o, final state, timeline)."""
    from qla_compile.kernels import chunk_gdr_fwd_hopper, chunk_recurrence, forward

    tr = torch.zeros(chunk_recurrence.TRACE_CTAS, 4, chunk_recurrence.TRACE_CHUNKS, chunk_recurrence.TRACE_EVENTS,
                     dtype=torch.int64, device="cuda")

    def traced(dk, dv, dtype, has_h0, n_ctas, device, pdl=False):
        """The unsplit forward's recurrence as chunk_fwd_ws over all of V, traced (the forward itself takes
        split_state_recurrence there)."""
        kernel = chunk_recurrence.chunk_fwd_ws(dk=dk, dv=dv, dtype=dtype, has_h0=has_h0, block_dv=dv, pdl=True,
                                               trace=True)
        return lambda *args: kernel(*args, tr)

    real = forward._state_kernel
    forward._state_kernel = traced
    try:
        o, ht = chunk_gdr_fwd_hopper(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["h0"], x["cu"])
        torch.cuda.synchronize()
        ms = time_graph(lambda: chunk_gdr_fwd_hopper(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["h0"],
                                                     x["cu"]))
    finally:
        forward._state_kernel = real
    return o, ht, tr.cpu(), ms


def split_ms(x):
    """CUDA-graph medians (ms) of the forward's launches one at a time: the tables, ``kkt_inverse``, the recurrence
    (``forward._state_kernel``'s, taking T~)."""
    from qla_compile.kernels import forward

    _, n_tok, h_qk, dk = x["q"].shape
    h_v, dv, n_seq = x["v"].shape[2], x["v"].shape[3], x["cu"].numel() - 1
    q3, k3, v3 = x["q"].view(n_tok, h_qk, dk), x["k"].view(n_tok, h_qk, dk), x["v"].view(n_tok, h_v, dv)
    cu, offsets, order, spans = forward._tables(x["cu"], 1, n_tok, q3.device)
    tt, gb, bad = forward._chunk_tables(n_tok, n_seq, h_v, q3.device)
    o, ht = torch.empty_like(v3), torch.empty_like(x["h0"])
    kernel = forward._state_kernel(dk, dv, "bfloat16", True, n_seq * h_v, q3.device)
    steps = {
        "tables": lambda: forward._tables(x["cu"], 1, n_tok, q3.device),
        "kkt_inverse": lambda: forward._gate_inverse(k3, x["g"], x["beta"], spans, (tt, gb, bad), "bfloat16"),
        "recurrence": lambda: kernel(q3, k3, v3, tt, gb, cu, offsets, order, cu[:1], x["h0"], float(x["scale"]), o,
                                       ht),
    }
    return {name: time_graph(fn) for name, fn in steps.items()}


def summarise(tr, n_chunks, lo=4):
    """Markdown lines: per warpgroup the median cycles between consecutive events over chunks [lo, hi)."""
    hi = min(n_chunks, tr.shape[2]) - 1
    lines = []
    period = [int(tr[c, 0, j + 1, 0] - tr[c, 0, j, 0]) for c in range(tr.shape[0]) for j in range(lo, hi)]
    lines.append(f"Chunk period (WG0 start to start), median over {len(period)} chunks of {tr.shape[0]} CTAs: "
                 f"**{statistics.median(period):.0f} cycles**\n")
    lines.append("| warpgroup | step (from the previous event) | median cycles | share of the period |")
    lines.append("|---|---|---|---|")
    med_period = statistics.median(period)
    for wg, (name, events) in enumerate(EVENTS.items()):
        for e in range(1, len(events) + 1):
            if e < len(events):
                d = [int(tr[c, wg, j, e] - tr[c, wg, j, e - 1]) for c in range(tr.shape[0]) for j in range(lo, hi)]
                label = f"-> {events[e]}"
            else:
                d = [int(tr[c, wg, j + 1, 0] - tr[c, wg, j, e - 1]) for c in range(tr.shape[0]) for j in range(lo, hi)]
                label = "-> next chunk's start"
            m = statistics.median(d)
            lines.append(f"| {name} | {label} | {m:.0f} | {100 * m / med_period:.0f}% |")
    # the state chain across warpgroups: WG0 publishes S -> WG1 K S -> V' -> WG0 sees V' -> S updated -> published
    chain = [("WG0 S published -> WG1 S seen", (0, 2), (1, 3), 0), ("WG1 S seen -> K S done", (1, 3), (1, 4), 0),
             ("K S done -> A_g W' done", (1, 4), (1, 6), 0), ("A_g W' done -> V' published", (1, 6), (1, 7), 0),
             ("V' published -> WG0 V' seen", (1, 7), (0, 5), 0), ("WG0 V' seen -> S updated", (0, 5), (0, 6), 0),
             ("S updated -> next S published", (0, 6), (0, 2), 1)]
    lines.append("\nThe state chain (median cycles):\n")
    lines.append("| link | cycles |")
    lines.append("|---|---|")
    for label, (w0, e0), (w1, e1), dj in chain:
        d = [int(tr[c, w1, j + dj, e1] - tr[c, w0, j, e0]) for c in range(tr.shape[0]) for j in range(lo, hi)]
        lines.append(f"| {label} | {statistics.median(d):.0f} |")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", action="store_true", help="compile the trace variants into the kernel cache and exit")
    ap.add_argument("--heads", default="32/32")
    ap.add_argument("--seqs", default="4096x8")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.build:
        return build()
    from qla_compile.kernels import chunk_gdr_fwd_hopper

    hk, hv = map(int, a.heads.split("/"))
    lens = parse_seqs(a.seqs)
    x = make_inputs(hk, hv, lens)
    o_ref, ht_ref = chunk_gdr_fwd_hopper(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["h0"], x["cu"])
    ms_plain = time_graph(lambda: chunk_gdr_fwd_hopper(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["h0"],
                                                       x["cu"]))
    o, ht, tr, ms_traced = traced_forward(x)
    # the first walk in launch order is a longest sequence
    lines = [f"# chunk_fwd_ws timeline, {a.heads} {a.seqs}\n", f"Versions: {versions()}\n",
             f"Forward {ms_plain:.3f} ms plain, {ms_traced:.3f} ms with the traced recurrence (CUDA-graph medians); "
             f"traced o vs plain: rel. L2 {rel_l2(o, o_ref):.1e}, states {rel_l2(ht, ht_ref):.1e}\n"]
    split = split_ms(x)
    lines.append("Launches alone (CUDA-graph medians, ms): " + ", ".join(f"{k} {v:.3f}" for k, v in split.items())
                 + "\n")
    lines += summarise(tr, max(lens) // 64)
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
