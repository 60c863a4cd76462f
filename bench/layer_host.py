"""Where a layer step spends its host time on the GPU machine, eagerly and compiled.

For FLA's ``GatedDeltaNet`` (``bench_layer.build``) at one length, per path (``fla``: our FLA backend off,
``qla-eager``: on, ``qla-compiled``: under ``qla_compile.backend``): the host ms of one step (the time until
``step()`` returns, the GPU kept idle before it, so that no launch waits on a full queue), the device-to-host
synchronisations it makes (``torch.cuda.set_sync_debug_mode``), dynamo's graphs and breaks, and a ``cProfile``
of ten steps (top functions by own time and by cumulative time).

    python bench/layer_host.py --out $OUT [--layer fla-128x32] [--T 8192]
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
import warnings

os.environ.setdefault("FLA_FLASH_QLA", "0")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_layer import build, step_fn  # noqa: E402
from bench.model import dynamo_counts  # noqa: E402


def host_ms(step, reps=20):
    """Median host ms of ``step`` from an idle GPU."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def syncs(step):
    """The synchronisation warnings one ``step`` raises (first line of each)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return [str(w.message).splitlines()[0][:160] for w in caught if "synchroniz" in str(w.message)]


def profile_text(step, sort, lines):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        step()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats(sort).print_stats(lines)
    return out.getvalue()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--layer", default="fla-128x32")
    ap.add_argument("--T", type=int, default=8192)
    args = ap.parse_args()
    import qla_compile

    qla_compile.register_substitutions()
    layer = build(args.layer)
    x = torch.randn(1, args.T, 2048, device="cuda", dtype=torch.bfloat16)
    rows, report = [], []
    for op in ("fwd", "fwd+bwd"):
        for path in ("fla", "qla-eager", "qla-compiled"):
            os.environ["FLA_QLA_COMPILE"] = "0" if path == "fla" else "1"
            torch._dynamo.reset()
            fn = torch.compile(layer, backend=qla_compile.backend) if path == "qla-compiled" else layer
            step = step_fn(fn, layer, x, op)
            breaks0, graphs0 = dynamo_counts()
            for _ in range(3):
                step()
            breaks, graphs = (a - b for a, b in zip(dynamo_counts(), (breaks0, graphs0)))
            rows.append(dict(layer=args.layer, T=args.T, op=op, path=path, host_ms=round(host_ms(step), 3),
                             syncs=syncs(step), graphs=graphs, graph_breaks=breaks))
            print(json.dumps(rows[-1]), flush=True)
            for sort in ("tottime", "cumulative"):
                report.append(f"## {op} {path}, 10 steps, by {sort}\n" + profile_text(step, sort, lines=40))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "layer-host.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(args.out, "layer-host-profile.txt"), "w") as f:
        f.write("\n".join(report))


if __name__ == "__main__":
    main()
