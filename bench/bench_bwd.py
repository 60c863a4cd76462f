"""Forward+backward timing on the H200: qla (Hopper TileLang kernels) vs FLA Triton and FlashQLA.

Each implementation runs forward then backward (h0 and dht given) replayed from a CUDA graph; the
median is reported.  FLA runs with ``FLA_FLASH_QLA=0`` (its own Triton kernels); FLA and FlashQLA go
through their autograd functions, qla through its two host entry points.  Writes
``bench/results/<date>-bwd.md`` and ``bench/results/latest-bwd.json`` (or under ``--out``).

    python bench/bench_bwd.py [--quick] [--impls qla,fla,flashqla] [--only 16/64:8192x4,...] [--out DIR]
"""
import argparse
import datetime
import json
import os
import random
import sys

os.environ["FLA_FLASH_QLA"] = "0"
os.environ["FLA_QLA_COMPILE"] = "0"  # FLA's own kernels: not our backend in its registry (the peer would be us)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import make_inputs, parse_seqs, time_graph, versions  # noqa: E402

HEADS = [(2, 8), (4, 16), (8, 32), (16, 32), (16, 64)]
SEQS = ["1x32768", "1x8192", "1x2048", "28672+4096", "8192x4", "1024x8"]
# FlashQLA's backward set: total tokens split randomly (seeded) into n sequences.
BWD_HEADS = [(16, 32), (8, 16), (4, 8), (2, 4)]
BWD_SEQS = [(total, n) for total in (8192, 32768) for n in (1, 2, 4, 8)]


def random_split(total, n, seed=0):
    rng = random.Random(seed * 1000 + total + n)
    cuts = sorted(rng.sample(range(64, total - 63), n - 1)) if n > 1 else []
    bounds = [0] + cuts + [total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def configs(quick):
    if quick:
        picks = [(2, 8, "1x8192"), (16, 64, "1x8192"), (16, 64, "8192x4"), (8, 32, "1024x8"), (16, 32, "8k_4seq")]
        return [c for c in configs(False) if c[:3] in picks]
    out = [(hk, hv, f"{total // 1024}k_{n}seq", random_split(total, n)) for hk, hv in BWD_HEADS for total, n in BWD_SEQS]
    return out + [(hk, hv, s, parse_seqs(s)) for hk, hv in HEADS for s in SEQS]


def step_fn(impl, x, do, dht):
    q, k, v, g, beta, h0, cu, scale = (x[n] for n in ("q", "k", "v", "g", "beta", "h0", "cu", "scale"))
    if impl == "qla":
        from qla_compile.kernels import chunk_gdr_fwd_hopper_aux
        from qla_compile.kernels.backward import chunk_gdr_bwd_hopper

        def step():  # as the autograd op: the backward reuses the forward's T~, [gamma; beta] and CP cache
            _, _, tt, gb, _, cp_cache = chunk_gdr_fwd_hopper_aux(q, k, v, g, beta, scale, h0, cu)
            return chunk_gdr_bwd_hopper(do, dht, q, k, v, g, beta, scale, h0, cu, aux=(tt, gb, cp_cache))

        return step
    if impl == "fla":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
    else:
        from flash_qla import chunk_gated_delta_rule as fn
    leaves = [t.detach().requires_grad_() for t in (q, k, v, g, beta, h0)]

    def step():
        o, ht = fn(*leaves[:5], scale=scale, initial_state=leaves[5], output_final_state=True, cu_seqlens=cu)
        return torch.autograd.grad((o, ht), leaves, (do, dht))

    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--impls", default="qla,fla,flashqla")
    ap.add_argument("--only", default="", help="comma list of hk/hv:seqs, e.g. 16/64:8192x4")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    impls = args.impls.split(",")
    rows = []
    os.makedirs(args.out, exist_ok=True)
    for hk, hv, name, lens in configs(args.quick):
        if args.only and f"{hk}/{hv}:{name}" not in args.only.split(","):
            continue
        x = make_inputs(hk, hv, lens)
        gen = torch.Generator(device="cuda").manual_seed(1)
        do = torch.randn(x["v"].shape, device="cuda", generator=gen).to(x["v"].dtype)
        dht = torch.randn(x["h0"].shape, device="cuda", generator=gen)
        for impl in impls:  # every implementation on the same inputs, in the same run
            try:
                ms = time_graph(step_fn(impl, x, do, dht), reps=10, rounds=3)
            except Exception as exc:  # report and keep going: one failing baseline must not void the run
                print(f"{impl} {hk}/{hv} {name}: {type(exc).__name__}: {exc}", flush=True)
                ms = None
            rows.append(dict(op="fwd+bwd", hk=hk, hv=hv, seqs=name, impl=impl, ms=ms))
            print(json.dumps(rows[-1]), flush=True)
        with open(os.path.join(args.out, "latest-bwd.json"), "w") as f:  # after every configuration
            json.dump(rows, f, indent=1)
        del x, do, dht
        torch.cuda.empty_cache()
    text = render(rows, impls)
    print(text)
    with open(os.path.join(args.out, f"{datetime.date.today().isoformat()}-bwd.md"), "w") as f:
        f.write(text)


def render(rows, impls, notes=(), vers=None):
    """Markdown: ms per implementation and baseline time / qla time, per configuration (``vers``: the
    versions of the machine that ran it, by default this one's)."""
    table = ["| hk/hv | seqs | " + " | ".join(f"{i} ms" for i in impls) + " | fla/qla | flashqla/qla |",
             "|---|---|" + "---|" * (len(impls) + 2)]
    by = {}
    for r in rows:
        by.setdefault((r["hk"], r["hv"], r["seqs"]), {})[r["impl"]] = r["ms"]
    for (hk, hv, s), t in by.items():
        cells = [f"{t[i]:.3f}" if t.get(i) else "-" for i in impls]
        ratio = [f"{t[b] / t['qla']:.2f}" if t.get(b) and t.get("qla") else "-" for b in ("fla", "flashqla")]
        table.append(f"| {hk}/{hv} | {s} | " + " | ".join(cells + ratio) + " |")
    date = datetime.date.today().isoformat()
    head = [f"# fwd+bwd, {torch.cuda.get_device_name() if torch.cuda.is_available() else 'NVIDIA H200'}, {date}", "",
            "CUDA-graph medians (ms) of forward + backward with h0 and dht; ratios are baseline time / qla time.", "",
            "Versions: " + ", ".join(f"{k} {v}" for k, v in (vers or versions()).items()), ""]
    return "\n".join(head + [line for note in notes for line in (note, "")] + table) + "\n"


if __name__ == "__main__":
    main()
