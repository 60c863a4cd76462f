"""Copies of a tree whose shipped binary of one split-state variant is compiled anew for each copy.

TileLang 0.1.15 assigns equal-sized shared buffers (the K/Q halves, the V, A_g and P_g rings) to the same offsets in
another order on every compile (``bench/NOTES-fwd.md``, session 28), so an A/B of a rebuilt kernel against the
checkout mixes the change with a new placement. Timing a few copies of each tree (the checkout's too, through
``bench/device/ab_trees.sh``) tells the two apart. Each copy is ``qla_compile``, ``bench``, ``tests`` and
``pyproject.toml`` of ``TREE`` with the variant compiled here (QLA_PREBUILT=0, a fresh kernel cache) and swapped into
its prebuilt archive; the manifest's archive hash follows.

    python bench/placement_copies.py TREE NAME --copies 2 --out STAGE   # STAGE/NAME.c1, STAGE/NAME.c2
    tar cJf .carry/trees.tar.xz -C STAGE .

``--params`` (JSON) picks the variant; by default the on-chip one the benches' rows run (bf16, h0, int64 bounds).
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

DEFAULT = dict(dk=128, dv=128, dtype="bfloat16", has_h0=True, inverse=True, cu_dtype="int64")
COMPILE = """
import json, sys
from qla_compile.kernels import split_state_recurrence as m
from qla_compile.kernels._build import full_params
params = full_params(m.chunk_fwd_split.factory, json.loads(sys.argv[1]))
m.chunk_fwd_split(**params)
print(m.chunk_fwd_split.key(**params))
"""


def compile_fresh(tree, params, cache):
    """The key of the variant, compiled from ``tree``'s sources into the empty kernel cache ``cache``."""
    env = dict(os.environ, PYTHONPATH=tree, QLA_PREBUILT="0", QLA_CACHE_DIR=cache)
    out = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(params)], env=env, cwd=tree, check=True,
                         capture_output=True, text=True).stdout  # cwd: python -c puts it first on the path
    return out.split()[-1]


def swap_in(copy, key, entry):
    """Replace ``key``'s files in ``copy``'s prebuilt archive by those in ``entry``; the manifest's hash follows."""
    prebuilt = os.path.join(copy, "qla_compile", "kernels", "prebuilt")
    archive, manifest = os.path.join(prebuilt, "kernels.tar.xz"), os.path.join(prebuilt, "manifest.json")
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        if not os.path.isdir(os.path.join(tmp, key)):
            raise SystemExit(f"{key} is not in {archive}: the tree's prebuilt binaries are not of its sources")
        shutil.rmtree(os.path.join(tmp, key))
        shutil.copytree(entry, os.path.join(tmp, key))
        with tarfile.open(archive, "w:xz") as tar:
            for name in sorted(os.listdir(tmp)):
                tar.add(os.path.join(tmp, name), arcname=name)
    with open(manifest) as f:
        m = json.load(f)
    with open(archive, "rb") as f:
        m["archive_sha256"] = hashlib.sha256(f.read()).hexdigest()
    with open(manifest, "w") as f:
        json.dump(m, f, indent=1, sort_keys=True)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tree", help="a checkout or a tree from bench/patch_trees.sh, its prebuilt binaries built")
    ap.add_argument("name")
    ap.add_argument("--copies", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--params", default=json.dumps(DEFAULT), help="the chunk_fwd_split variant, as JSON")
    args = ap.parse_args()
    tree = os.path.abspath(args.tree)
    for i in range(1, args.copies + 1):
        copy = os.path.join(args.out, f"{args.name}.c{i}")
        for part in ("qla_compile", "bench", "tests"):
            shutil.copytree(os.path.join(tree, part), os.path.join(copy, part),
                            ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(os.path.join(tree, "pyproject.toml"), copy)
        with tempfile.TemporaryDirectory() as cache:
            key = compile_fresh(tree, json.loads(args.params), cache)
            swap_in(copy, key, os.path.join(cache, "kernels", key))
        print(f"{copy}: {key[:12]} compiled anew")


if __name__ == "__main__":
    main()
