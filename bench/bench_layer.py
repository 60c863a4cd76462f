"""Layer-level benchmark on the GPU machine: FLA's ``GatedDeltaNet`` and transformers' ``Qwen3NextGatedDeltaNet``
eagerly with FLA's kernels, eagerly with our FLA backend, and under ``qla_compile.backend``.

Paths: ``fla`` (eager, our FLA backend off: ``FLA_QLA_COMPILE=0``), ``qla-eager`` (eager, our backend in FLA's
registry), ``qla-compiled`` (``torch.compile(layer, backend=qla_compile.backend)``). ``FLA_FLASH_QLA=0`` throughout,
so ``fla`` is FLA's own Triton path. Layers (hidden 2048, bf16, batch 1): ``fla-128x16`` and ``fla-128x32``
(K = V = 128 with 16 qk-heads and 16 or 32 v-heads), ``fla-default`` (FLA's defaults: 6 heads, K 256, V 512) and
``hf-qwen3next`` (16 qk / 32 v heads x 128). Per row the median ms of the layer's forward (no grad) or forward +
backward (of ``out.float().square().mean()``; the paths timed in turns, :func:`interleaved_ms`), from one
profiled step the GPU-busy time of all its kernels and of the GDN op's own (:func:`bench.model.profile_step`:
overlapping kernels count once; the op's kernels, one per launch, go to ``latest-layer-profiles.json`` and the
log), the graphs and graph breaks dynamo counted while compiling (``qla-compiled``), the median ms of the same
step replayed as one CUDA graph (``graph_ms``: the GPU's time without Python and launch overhead; ``None`` where
capture fails, with the reason in the log), and the relative L2 of the output against the ``fla`` path.

    python bench/bench_layer.py --out $OUT [--layers ...] [--lengths 8192,32768] [--ops fwd,fwd+bwd] [--paths ...]
"""

import argparse
import datetime
import json
import os
import statistics
import sys

os.environ.setdefault("FLA_FLASH_QLA", "0")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import rel_l2, versions  # noqa: E402
from bench.model import dynamo_counts, events_ms, median_ms, profile_step  # noqa: E402

PATHS = ("fla", "qla-eager", "qla-compiled")
LAYERS = ("fla-128x16", "fla-128x32", "fla-default", "hf-qwen3next")


def build(name):
    torch.manual_seed(0)
    if name.startswith("fla"):
        from fla.layers import GatedDeltaNet

        kw = {} if name == "fla-default" else dict(head_dim=128, num_heads=16, expand_v=1.0,
                                                     num_v_heads=32 if name.endswith("x32") else 16)
        layer = GatedDeltaNet(hidden_size=2048, mode="chunk", **kw)
    else:
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

        cfg = Qwen3NextConfig(hidden_size=2048, linear_num_key_heads=16, linear_num_value_heads=32,
                              linear_key_head_dim=128, linear_value_head_dim=128, layer_types=["linear_attention"],
                              num_hidden_layers=1)
        layer = Qwen3NextGatedDeltaNet(cfg, layer_idx=0)
    return layer.to("cuda", torch.bfloat16)


def head_dims(layer):
    return layer.head_k_dim, layer.head_v_dim


def step_fn(fn, layer, x, op):
    def step():
        if op == "fwd":
            with torch.no_grad():
                return _out(fn(x))
        layer.zero_grad(set_to_none=True)
        out = _out(fn(x))
        out.float().square().mean().backward()
        return out.detach()
    return step


def _use(path):
    """Our FLA backend on for our paths, off for ``fla`` (FLA reads the variable on every call)."""
    os.environ["FLA_QLA_COMPILE"] = "0" if path == "fla" else "1"


def interleaved_ms(steps, reps, rounds):
    """Median ms per step of each of ``steps`` (path -> step), timed ``reps`` steps back to back per round, the
    paths taking turns within each round (in an order that rotates), so that the host's and the GPU's drift over
    a run falls on every path alike."""
    times = {path: [] for path in steps}
    order = list(steps)
    for r in range(rounds):
        for path in order[r % len(order):] + order[:r % len(order)]:
            _use(path)
            steps[path]()  # the previous path's queue drained into this one's first step, not timed
            torch.cuda.synchronize()
            times[path].append(events_ms(steps[path], reps))
    return {path: statistics.median(t) for path, t in times.items()}


def graph_ms(step, reps, rounds):
    """Median ms of ``step`` captured once as a CUDA graph and replayed, or None (the reason printed) where the
    step cannot be captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up off the default stream, as capture wants
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
    except Exception as exc:  # noqa: BLE001  (any capture failure is a row without the column)
        print(f"  capture failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        torch.cuda.synchronize()
        return None
    return median_ms(graph.replay, reps, rounds)


def _out(result):
    return result[0] if isinstance(result, tuple) else result


def markdown(rows, meta):
    """The results table (ratios against the ``fla`` row of the same layer, length and op), as lines."""
    lines = [f"# Layer level, {meta['gpu']}, {datetime.date.today().isoformat()}", "",
             "Versions: " + ", ".join(f"{a} {b}" for a, b in meta.items()), "",
             "| layer | K/V | T | op | path | ms | fla / path | graph ms | fla / path (graph) | kernels ms | GDN op ms | "
             "fla GDN / path GDN | graphs / breaks | out vs fla |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {(r["layer"], r["T"], r["op"]): r for r in rows if r["path"] == "fla"}
    for r in rows:
        b = base[(r["layer"], r["T"], r["op"])]
        gdn = f"{b['gdn_ms'] / r['gdn_ms']:.2f}" if r["gdn_ms"] else "-"
        graph = f"{b['graph_ms'] / r['graph_ms']:.2f}" if r["graph_ms"] and b["graph_ms"] else "-"
        lines.append(f"| {r['layer']} | {r['K']}/{r['V']} | {r['T']} | {r['op']} | {r['path']} | {r['ms']} | "
                     f"{b['ms'] / r['ms']:.2f} | {r['graph_ms'] or '-'} | {graph} | {r['kernels_ms']} | {r['gdn_ms']} | "
                     f"{gdn} | {r['graphs']} / {r['graph_breaks']} | {r['out_vs_fla']} |")
    return lines


def _write(out, rows, profiles):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "latest-layer.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(out, "latest-layer-profiles.json"), "w") as f:
        json.dump(profiles, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--ops", default="fwd,fwd+bwd")
    ap.add_argument("--paths", default=",".join(PATHS), help="fla (always, the baseline), qla-eager, qla-compiled")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    import qla_compile
    from torch._dynamo.utils import counters

    qla_compile.register_substitutions()
    rows, profiles = [], []
    for name in args.layers.split(","):
        layer = build(name)
        k, v = head_dims(layer)
        for T in (int(t) for t in args.lengths.split(",")):
            x = torch.randn(1, T, 2048, device="cuda", dtype=torch.bfloat16,
                            generator=torch.Generator("cuda").manual_seed(T))
            for op in args.ops.split(","):
                paths = [p for p in PATHS if p == "fla" or p in args.paths.split(",")]
                steps, found = {}, {}
                for path in paths:
                    _use(path)
                    torch._dynamo.reset()
                    fn = torch.compile(layer, backend=qla_compile.backend) if path == "qla-compiled" else layer
                    steps[path] = step_fn(fn, layer, x, op)
                    breaks0, graphs0 = dynamo_counts()
                    reasons0 = dict(counters["graph_break"])
                    out = steps[path]().float()
                    breaks, graphs = (a - b for a, b in zip(dynamo_counts(), (breaks0, graphs0)))
                    for reason, n in counters["graph_break"].items():
                        if n > reasons0.get(reason, 0):
                            print(f"  graph break x{n - reasons0.get(reason, 0)}: {' '.join(reason.split())[:300]}")
                    steps[path]()
                    found[path] = (out, graphs, breaks)
                wall = interleaved_ms(steps, args.reps, args.rounds)
                ref = found["fla"][0]
                for path in paths:
                    _use(path)
                    step, (out, graphs, breaks) = steps[path], found[path]
                    gdn_ms, kernels_ms, top, gdn_top = profile_step(step, by_launch=True)
                    g_ms = graph_ms(step, args.reps, args.rounds)
                    rows.append(dict(layer=name, K=k, V=v, T=T, op=op, path=path, ms=round(wall[path], 3),
                                     graph_ms=None if g_ms is None else round(g_ms, 3), graphs=graphs,
                                     graph_breaks=breaks,
                                     gdn_ms=round(gdn_ms, 3), kernels_ms=round(kernels_ms, 3),
                                     out_vs_fla=float(f"{rel_l2(out, ref):.3e}")))
                    profiles.append(dict(layer=name, T=T, op=op, path=path, top_kernels=top, gdn_kernels=gdn_top))
                    print(json.dumps(rows[-1]), flush=True)
                    print("  top kernels (ms):", "; ".join(f"{n[:60]} {t}" for n, t in top[:8]), flush=True)
                    print("  in the GDN op, by launch (ms):", "; ".join(f"{n[:60]} {t}" for n, t in gdn_top),
                          flush=True)
                    _write(args.out, rows, profiles)  # after each row: a run stopped by its time limit keeps them
                del steps, found
        del layer
        torch.cuda.empty_cache()
    lines = markdown(rows, versions())
    with open(os.path.join(args.out, f"{datetime.date.today().isoformat()}-layer.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
