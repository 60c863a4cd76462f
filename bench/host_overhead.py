"""Host time of one eager GDN call through our op, with the Hopper kernels and the Triton activations stubbed out.

An eager layer at batch 1 is host-bound on the H200 (``bench_layer.py``: wall time well above GPU time), so what
our Python and torch's dispatch spend per call shows in its wall time. This measures that part alone, on any
machine (CPU tensors of one head, K = V = 128, 64 tokens, so that the CPU's own work on them is small beside the
dispatch; the stubs return uninitialised outputs of the kernels' shapes): the public function through ``ops.EagerChunkGDR`` (what eager calls run) and through the custom op
``qla::chunk_gdr_fwd`` (what they ran before, and what traced calls run), forward alone and forward + backward.

    python bench/host_overhead.py [--out bench/results] [--calls 2000]
"""
import argparse
import contextlib
import json
import os
import sys
import types
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import qla_compile  # noqa: E402
from bench.common import host_median_us, write_host_rows  # noqa: E402
from gdn_inputs import make_inputs  # noqa: E402
from qla_compile import dispatch, ops  # noqa: E402
from qla_compile.kernels import backward as hopper_backward  # noqa: E402


def _stub_kernels():
    """Replace the Hopper kernels and the Triton activations by stubs that only allocate their outputs."""
    def forward(q, k, v, g, beta, scale, h0, cu, for_backward=True, keys_normalised=False):
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        return (torch.empty_like(v), v.new_empty(B, HV, K, V, dtype=torch.float32),
                v.new_empty(0, dtype=torch.float16), v.new_empty(0, dtype=torch.float32), None,
                v.new_empty(0, dtype=torch.float32))

    def backward(do, dht, q, k, v, g, beta, scale, h0, cu, aux=None, rstd=None):
        return tuple(torch.empty_like(x) for x in (q, k, v, g, beta)) + (None,)

    kernels = types.SimpleNamespace(unsupported=lambda q, k, v: None, chunk_gdr_fwd_hopper_aux=forward,
                                    cp_cache_numel=lambda *a: 0)
    dispatch._kernels = lambda: kernels
    dispatch.input_activations = lambda: types.SimpleNamespace(
        l2norm=lambda *xs, copy=None: (xs, tuple(x.new_empty(0) for x in xs), copy),
        gates=lambda g, b, A, dt, o: (g.float(), b.float()),
        gates_bwd=lambda g, b, A, dt, o, dg, db: (dg, db, torch.zeros_like(A), torch.zeros_like(dt)))
    hopper_backward.chunk_gdr_bwd_hopper = backward


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    _stub_kernels()
    kw = make_inputs(T=64, H=1, HV=1, K=128, V=128, l2norm=True, gate_in_kernel=True, beta_sigmoid=True,
                     state_v_first=True, seed=0)  # FLA's layer options
    leaves = {n: (x.requires_grad_() if x.is_floating_point() else x) for n, x in kw.items()
              if isinstance(x, torch.Tensor)}
    flags = {n: x for n, x in kw.items() if not isinstance(x, torch.Tensor)}

    def step(backward):
        o, _ = qla_compile.chunk_gated_delta_rule(**leaves, **flags)
        if backward:
            o.backward(o)

    rows = []
    for path in ("eager function", "custom op"):
        with contextlib.ExitStack() as stack:
            if path == "custom op":  # what eager calls ran before ops.EagerChunkGDR
                stack.enter_context(mock.patch.object(ops.EagerChunkGDR, "apply", ops.chunk_gdr_fwd))
            for op in ("fwd", "fwd+bwd"):
                us = host_median_us(lambda: step(op == "fwd+bwd"), args.calls)
                rows.append(dict(path=path, op=op, us=round(us, 1)))
                print(json.dumps(rows[-1]), flush=True)
    write_host_rows(args.out, "host-overhead", rows)


if __name__ == "__main__":
    main()
