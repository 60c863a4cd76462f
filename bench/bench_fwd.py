"""Forward benchmark on the GPU machine: qla vs FLA Triton vs FlashQLA vs FlashInfer, in one run.

Every implementation gets the same packed varlen inputs (B = 1 + cu_seqlens, see ``common.make_inputs``),
with the initial state and the final state output, and is timed as the median of CUDA-graph replays.
Per configuration we check our o and final state against FLA, and our o on the first 1024 tokens
against the float64 oracle. FlashQLA JIT-compiles per shape class (20-60 s each), so it runs only
while ``--flashqla-budget`` seconds of its compile+run time remain (done-when configurations first).
The whole matrix takes longer than one 10-minute device command: run it per head configuration,

    python bench/bench_fwd.py --heads 16/64 --out $OUT
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("FLA_FLASH_QLA", "0")  # FLA's own Triton path, not its FlashQLA dispatch

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import make_inputs, parse_seqs, rel_l2, time_graph, versions  # noqa: E402

HEADS = [(2, 8), (4, 16), (8, 32), (16, 32), (16, 64)]
SEQS = ["1x32768", "1x8192", "1x2048", "28672+4096", "8192x4", "1024x8"]
ORACLE_TOKENS = 1024


def peers():
    """name -> fn(x) returning (o [1,T,Hv,V], final state [N,Hv,K,V]) for each importable peer."""
    fns = {}
    from qla_compile.kernels import chunk_gdr_fwd_hopper

    fns["qla"] = lambda x: chunk_gdr_fwd_hopper(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["h0"], x["cu"])
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla

        fns["fla"] = lambda x: fla(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=x["scale"], initial_state=x["h0"],
                                   output_final_state=True, cu_seqlens=x["cu"])
    except ImportError as err:
        print("FLA unavailable:", err)
    try:
        import flash_qla

        fns["flashqla"] = lambda x: flash_qla.chunk_gated_delta_rule(
            x["q"], x["k"], x["v"], x["g"], x["beta"], scale=x["scale"], initial_state=x["h0"],
            output_final_state=True, cu_seqlens=x["cu"])
    except ImportError as err:
        print("FlashQLA unavailable:", err)
    try:
        from flashinfer.gdn_prefill import chunk_gated_delta_rule as fi

        def flashinfer(x, transposed=False):
            """FlashInfer wants alpha = exp(g), fp32 beta and a preallocated state output; its state
            orientation is not documented, so ``transposed`` passes h0 as [N, H, V, K] and reads the
            final state back the same way (main() keeps whichever matches our output)."""
            n, hv, dk, dv = x["h0"].shape
            if "fi_state" not in x:
                x["fi_state"] = torch.empty(n, hv, dk, dv, device="cuda", dtype=torch.float32)
                x["fi_alpha"] = x["g"][0].exp()
                x["fi_beta"] = x["beta"][0].float()
                x["fi_h0t"] = x["h0"].mT.contiguous()
            o = fi(x["q"][0], x["k"][0], x["v"][0], g=x["fi_alpha"], beta=x["fi_beta"], scale=x["scale"],
                   initial_state=x["fi_h0t"] if transposed else x["h0"], output_final_state=True,
                   cu_seqlens=x["cu"], output_state=x["fi_state"])
            o = o[0] if isinstance(o, tuple) else o
            return o[None], (x["fi_state"].mT if transposed else x["fi_state"])

        fns["flashinfer"] = flashinfer
    except ImportError as err:
        print("FlashInfer unavailable:", err)
    return fns


def first_call_seconds():
    """Seconds from a fresh interpreter to the first qla result (import torch and qla, load, run)."""
    code = ("import time; t = time.time(); import torch; from bench.common import make_inputs; "
            "from qla_compile.kernels import chunk_gdr_fwd_hopper as f; x = make_inputs(2, 8, [100]); "
            "f(x['q'], x['k'], x['v'], x['g'], x['beta'], x['scale'], x['h0'], x['cu']); "
            "torch.cuda.synchronize(); print(time.time() - t)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def oracle_prefix(x, o):
    """Relative L2 error of o on the first tokens of sequence 0 against the float64 oracle."""
    from qla_compile.reference import recurrent_gdr_reference

    n = min(ORACLE_TOKENS, int(x["cu"][1]))
    ref, _ = recurrent_gdr_reference(x["q"][:, :n], x["k"][:, :n], x["v"][:, :n], x["g"][:, :n], x["beta"][:, :n],
                                     x["scale"], x["h0"][:1])
    return rel_l2(o[:, :n], ref)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--flashqla-budget", type=float, default=150.0)
    ap.add_argument("--heads", default=",".join(f"{a}/{b}" for a, b in HEADS))
    ap.add_argument("--seqs", default=",".join(SEQS))
    args = ap.parse_args()
    heads = [tuple(int(s) for s in h.split("/")) for h in args.heads.split(",")]
    seqs = args.seqs.split(",")

    # two fresh processes: the first on a new machine can also pay cold file caches and bytecode writes
    cold, first_call = first_call_seconds(), first_call_seconds()
    print(f"qla in a fresh process: import + first call {first_call:.2f} s (first process on the machine {cold:.2f} s)")
    fns = peers()

    configs = [(hk, hv, s) for hk, hv in heads for s in seqs]
    # FlashQLA's JIT budget goes to the done-when configurations (H_v x sequences >= 64) first.
    fq_order = sorted(configs, key=lambda c: c[1] * len(parse_seqs(c[2])) < 64)
    fq_left = args.flashqla_budget
    rows, checks = [], []
    meta = {"versions": versions(), "first_call_s": round(first_call, 2), "first_call_cold_s": round(cold, 2),
            "checks": checks}
    for hk, hv, spec in sorted(configs, key=fq_order.index):
        x = make_inputs(hk, hv, parse_seqs(spec))
        outs = {}
        for name, fn in fns.items():
            if name == "flashqla" and fq_left <= 0:
                continue
            t = time.time()
            try:
                outs[name] = fn(x)
                ms = time_graph(lambda: fn(x), reps=10)
            except Exception as err:  # noqa: BLE001 - a failing peer is reported, not fatal
                print(f"{name} failed on {hk}/{hv} {spec}: {type(err).__name__}: {err}")
                continue
            finally:
                if name == "flashqla":
                    fq_left -= time.time() - t
            rows.append({"op": "fwd", "hk": hk, "hv": hv, "seqs": spec, "impl": name, "ms": round(ms, 4)})
        o, ht = outs["qla"]
        if "flashinfer" in outs:
            flipped = fns["flashinfer"](x, transposed=True)
            if rel_l2(flipped[0], o) < rel_l2(outs["flashinfer"][0], o):
                outs["flashinfer"] = flipped
        check = {"hk": hk, "hv": hv, "seqs": spec, "qla_vs_fp64_o_prefix": oracle_prefix(x, o)}
        for name in ("fla", "flashqla", "flashinfer"):
            if name in outs:
                check[f"{name}_o_vs_qla"] = rel_l2(outs[name][0], o)
                check[f"{name}_ht_vs_qla"] = rel_l2(outs[name][1], ht)
        checks.append(check)
        line = " ".join(f"{r['impl']} {r['ms']:.3f}" for r in rows if (r["hk"], r["hv"], r["seqs"]) == (hk, hv, spec))
        print(f"{hk}/{hv} {spec}: {line} | " + " ".join(f"{k} {v:.1e}" for k, v in check.items() if k.endswith(("o", "ht", "prefix"))))
        del x, outs
        torch.cuda.empty_cache()
        md = save(args.out, rows, meta)  # after every configuration, so a cut-short run keeps its rows
    print(md)


def save(out, rows, meta):
    """Write the results, merged with rows and checks of other configurations already in ``out``
    (so the matrix can be run one head configuration per command)."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, name) for name in ("latest-fwd.json", "latest-fwd-meta.json")]
    done = {(r["hk"], r["hv"], r["seqs"]) for r in rows}
    old_rows, old_checks = [], []
    if all(os.path.exists(p) for p in paths):
        with open(paths[0]) as f:
            old_rows = [r for r in json.load(f) if (r["hk"], r["hv"], r["seqs"]) not in done]
        with open(paths[1]) as f:
            old_checks = [c for c in json.load(f)["checks"] if (c["hk"], c["hv"], c["seqs"]) not in done]
    rows = old_rows + rows
    meta = {**meta, "checks": old_checks + meta["checks"]}
    with open(paths[0], "w") as f:
        json.dump(rows, f, indent=1)
    with open(paths[1], "w") as f:
        json.dump(meta, f, indent=1)
    md = render(rows, meta)
    with open(os.path.join(out, f"{datetime.date.today().isoformat()}-fwd.md"), "w") as f:
        f.write(md)
    return md


def render(rows, meta):
    """Markdown table: ms per implementation, FLA/qla, FlashQLA/qla, FlashInfer/qla, plus the checks."""
    by = {}
    for r in rows:
        by.setdefault((r["hk"], r["hv"], r["seqs"]), {})[r["impl"]] = r["ms"]
    lines = [
        "# Forward benchmark (CUDA-graph medians, ms)", "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()), "",
        f"qla in a fresh process with a warm kernel cache: import + first call {meta['first_call_s']} s "
        f"({meta.get('first_call_cold_s', '-')} s in the first process on the machine)", "",
        *[line for note in meta.get("notes", []) for line in (note, "")],
        "| H_qk/H_v | seqs | qla | FLA | FlashQLA | FlashInfer | FLA/qla | FlashQLA/qla | FlashInfer/qla |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    speedups = []
    for (hk, hv, spec), t in by.items():
        q = t.get("qla")

        def cell(name):
            return f"{t[name]:.3f}" if name in t else "-"

        def ratio(name):
            return f"{t[name] / q:.2f}" if name in t and q else "-"

        if q and "fla" in t:
            speedups.append(t["fla"] / q)
        lines.append(f"| {hk}/{hv} | {spec} | {cell('qla')} | {cell('fla')} | {cell('flashqla')} | "
                     f"{cell('flashinfer')} | {ratio('fla')} | {ratio('flashqla')} | {ratio('flashinfer')} |")
    if speedups:
        geo = torch.tensor(speedups).log().mean().exp().item()
        lines += ["", f"Geometric-mean speedup over FLA: {geo:.2f}x over {len(speedups)} configurations"]
    filled = [t["flashqla"] / t["qla"] for (hk, hv, spec), t in by.items()
              if "flashqla" in t and t.get("qla") and hv * len(parse_seqs(spec)) >= 64]
    if filled:
        lines += ["", f"FlashQLA/qla where H_v x sequences >= 64: min {min(filled):.2f}x over {len(filled)} configurations"]
    lines += ["", "## Checks (relative L2)", "", "```", json.dumps(meta["checks"], indent=1), "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
