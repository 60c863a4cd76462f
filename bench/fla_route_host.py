"""Host time of one forward on FLA's route through our op (``dispatch.forward_keeping``, what ``qla::chunk_gdr_fwd``
runs for a call our kernels do not take), FLA's inner forward stubbed: through FLA's public op (its backend
dispatch, ``input_guard``, autograd function) against FLA's forward leaf called directly (what plain calls run).

Plain options (the activations outside the op, as traced calls have them), CPU tensors of one head, K = 256,
V = 512, 64 tokens, without grad; needs FLA importable (``--fla-path`` for a ``pip --target`` copy). The stub
allocates the leaf's outputs; the rest of FLA runs as it is, our FLA backend registered (it declines CPU tensors).

    python bench/fla_route_host.py [--out bench/results] [--calls 2000] [--fla-path .sidepkgs/fla]
"""
import argparse
import json
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from bench.common import host_median_us, write_host_rows  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--fla-path", default=None, help="a folder to put first on sys.path (FLA installed with --target)")
    args = ap.parse_args()
    if args.fla_path:
        sys.path.insert(0, os.path.abspath(args.fla_path))
    import fla
    from fla.ops.gated_delta_rule import chunk as fla_chunk
    from gdn_inputs import make_inputs

    from qla_compile import dispatch
    from qla_compile.reference import GDROptions

    def leaf(q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first=False, cu_seqlens=None,
             **_):
        B, T, H = v.shape[:3]
        return (g.float(), torch.empty_like(v), k.new_empty(B, T, H, 64), torch.empty_like(initial_state),
                initial_state, None)

    kw = make_inputs(T=64, H=1, HV=1, K=256, V=512, initial_state=True, seed=0)
    opts = GDROptions(kw["q"].shape[-1] ** -0.5)
    args_ = (kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], None, None, kw["initial_state"], None, opts)
    rows = []
    with mock.patch.object(fla_chunk, "chunk_gated_delta_rule_fwd", leaf), \
            mock.patch.object(dispatch, "choose", lambda q, k, v: ("fla", "FLA's route, measured")), \
            torch.no_grad():
        dispatch.fla_leaves.cache_clear()  # found again, with the stub in FLA's module
        for path in ("public op", "forward leaf"):
            with mock.patch.object(dispatch, "_on_fla_leaves", (lambda opts: False) if path == "public op"
                                   else dispatch._on_fla_leaves):
                us = host_median_us(lambda: dispatch.forward_keeping(*args_, for_backward=False), args.calls)
            rows.append(dict(path=path, op="fwd", us=round(us, 1)))
            print(json.dumps(rows[-1]), flush=True)
        dispatch.fla_leaves.cache_clear()
    write_host_rows(args.out, "fla-route-host", rows, fla=getattr(fla, "__version__", "?"))


if __name__ == "__main__":
    main()
