"""Clocks and power of the forward under sustained load: is a row power-capped, and which kernel spends less energy a call?

Per row and implementation (qla and one peer: FlashInfer 0.7 from ``--fi07-path``, else FlashInfer 0.6.13 where it
imports), in the order qla, peer, peer, qla (the GPU warms as it goes): a CUDA graph of ``--reps`` forwards; after an
idle pause its first replay (``cool_ms``), then replays back to back for ``--seconds`` while ``nvidia-smi`` samples the
SM clock, the power draw and the clock-event reasons every 50 ms (``hot_ms``, medians over that span; ``mj`` = power x
hot_ms, the energy of one forward; ``reasons``: the ``clocks_event_reasons.active`` bitmasks seen, 0x4 the software power
cap, 0x20 / 0x40 thermal slowdown, 0x1 idle). Each output is checked against the float64 oracle first.

    python bench/power_probe.py 16/64:8192x4 32/32:8192x4 16/16:1024x8 --fi07-path /tmp/fi07 --out /tmp/o/power
"""
import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.bench_fwd import FI07, fi07_call, import_fi07, peers  # noqa: E402
from bench.common import capture_graph, make_inputs, oracle_errors, parse_row, replay_ms, versions  # noqa: E402

FIELDS = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


class Sampler:
    """``nvidia-smi`` lines, each stamped with this process's clock when read."""

    def __init__(self):
        self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits",
                                      "-lms", "50"], stdout=subprocess.PIPE, text=True)
        self.samples = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                self.samples.append((time.time(), float(parts[0]), float(parts[1]), float(parts[2]), parts[3]))
            except (ValueError, IndexError):
                print("nvidia-smi:", line.strip(), file=sys.stderr)

    def between(self, t0, t1):
        return [s for s in self.samples if t0 <= s[0] <= t1]

    def close(self):
        self.proc.terminate()


def probe(name, fn, reps, seconds, sampler, pause):
    graph = capture_graph(fn, reps)
    graph.replay()
    torch.cuda.synchronize()
    time.sleep(pause)
    cool = replay_ms(graph, reps)
    times, t0 = [], time.time()
    while time.time() - t0 < seconds:
        times.append(replay_ms(graph, reps))
    t1 = time.time()
    s = sampler.between(t0 + 0.5, t1)  # past the first half second, where the clocks settle
    reasons = sorted({x[4] for x in s})
    hot = statistics.median(times)
    power = statistics.median(x[2] for x in s) if s else float("nan")
    return {"impl": name, "cool_ms": round(cool, 4), "hot_ms": round(hot, 4),
            "sm_mhz": statistics.median(x[1] for x in s) if s else None, "power_w": power,
            "temp_c": max(x[3] for x in s) if s else None, "reasons": reasons, "samples": len(s),
            "mj": round(power * hot, 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", nargs="+", help="H_qk/H_v:seqs, e.g. 16/64:8192x4")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--pause", type=float, default=2.0, help="idle seconds before the cool replay")
    ap.add_argument("--out", default="bench/results/power")
    ap.add_argument("--fi07-path", help="unpacked bench/flashinfer07_bundle.sh parts: FlashInfer 0.7 as the peer")
    args = ap.parse_args()
    if args.fi07_path:  # imported first: this interpreter then has no FlashInfer 0.6.13
        fi07 = fi07_call(import_fi07(args.fi07_path)[0], "auto")  # as in the matrix
        fns = {**peers(set()), FI07: fi07}
    else:
        fns = peers({"flashinfer"})
    limit = subprocess.run(["nvidia-smi", "--query-gpu=name,power.limit,enforced.power.limit,clocks.max.sm",
                            "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    print("GPU:", limit)
    sampler = Sampler()
    rows = []
    try:
        for spec in args.rows:
            hk, hv, lens = parse_row(spec)
            x = make_inputs(hk, hv, lens)
            for name in [*fns, *reversed(fns)]:
                fn = fns[name]
                err = max(oracle_errors(fn(x)[0], x, lens).values())
                if name == "flashinfer" and err > 1e-2:  # its state orientation: bench_fwd.orient_flashinfer
                    fns[name] = fn = functools.partial(fn, transposed=True)
                    err = max(oracle_errors(fn(x)[0], x, lens).values())
                r = {"row": spec, **probe(name, lambda: fn(x), args.reps, args.seconds, sampler, args.pause),
                     "o_err": float(f"{err:.1e}")}
                print(json.dumps(r), flush=True)
                rows.append(r)
            del x
            torch.cuda.empty_cache()
    finally:
        sampler.close()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "power.json"), "w") as f:
        json.dump({"gpu": limit, "versions": versions(), "rows": rows}, f, indent=1)
    print("\n| row | impl | cool ms | hot ms | SM MHz | W | mJ a call | reasons |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['row']} | {r['impl']} | {r['cool_ms']} | {r['hot_ms']} | {r['sm_mhz']} | {r['power_w']} | "
              f"{r['mj']} | {' '.join(r['reasons'])} |")


if __name__ == "__main__":
    main()
