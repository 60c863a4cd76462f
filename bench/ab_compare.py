"""Side-by-side table of ``bench/onchip_inverse_ab.py`` runs of several trees (one call, one process per tree):
per row, each tree's forward with the inverse on chip and through ``kkt_inverse`` + the T~ recurrence, as us and
as base time / tree time, and the row's largest float64-oracle error over the trees' outputs (but those of the
``--unchecked`` trees, probes whose outputs are wrong by design).

    python bench/ab_compare.py OUT_DIR [--base base] [--unchecked NAME,...] [--md FILE]

``OUT_DIR`` holds one ``ab_NAME/onchip-inverse-ab.json`` per tree (as ``.carry/s20_call1.sh`` writes them).
"""

import argparse
import glob
import json
import os


def load(out_dir):
    """``{tree: (versions, {row: record})}`` from the ``ab_*`` folders of ``out_dir``."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "ab_*", "onchip-inverse-ab.json"))):
        name = os.path.basename(os.path.dirname(path))[3:]
        with open(path) as f:
            data = json.load(f)
        runs[name] = (data["versions"], {r["row"]: r for r in data["rows"]})
    return runs


def table(runs, base, unchecked=()):
    """Markdown lines: one row per shape, per tree ``on chip us (x base) / T~ us (x base)``, the worst oracle error
    over the trees not ``unchecked``."""
    if base not in runs:
        raise SystemExit(f"no ab_{base} run among {sorted(runs)}")
    names = [base] + sorted(n for n in runs if n != base)
    lines = ["| row | " + " | ".join(f"{n}: on chip / T~ path (us)" for n in names)
             + f" | worst o error{' (not ' + ', '.join(unchecked) + ')' if unchecked else ''} |",
             "|---" * (len(names) + 2) + "|"]
    for row, b in runs[base][1].items():
        cells, worst = [], 0.0
        for n in names:
            r = runs[n][1].get(row)
            if r is None:
                cells.append("-")
                continue
            if n not in unchecked:
                worst = max([worst] + [v for k, v in r.items() if "vs_fp64" in k])
            ratio = "" if n == base else (f" ({b['onchip_us'] / r['onchip_us']:.3f}x / "
                                          f"{b['kkt_us'] / r['kkt_us']:.3f}x)")
            cells.append(f"{r['onchip_us']:.1f} / {r['kkt_us']:.1f}{ratio}")
        lines.append(f"| {row} | " + " | ".join(cells) + f" | {worst:.1e} |")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--base", default="base")
    ap.add_argument("--unchecked", default="", help="trees whose outputs are wrong by design (probes), comma-separated")
    ap.add_argument("--md", default=None, help="also write the table (with the versions) to this file")
    args = ap.parse_args()
    runs = load(args.out_dir)
    lines = table(runs, args.base, tuple(n for n in args.unchecked.split(",") if n))
    print("\n".join(lines))
    if args.md:
        versions = runs[args.base][0]
        head = ", ".join(f"{k} {v}" for k, v in versions.items())
        with open(args.md, "w") as f:
            f.write(f"Versions: {head}\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
