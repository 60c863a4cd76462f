"""The Triton input activations of eager Hopper calls (``qla_compile.kernels.input_activations``: q/k L2 norm,
gate, beta sigmoid) against a float64 oracle (autograd through ``reference``'s activations), run
on the CPU by Triton's interpreter (``TRITON_INTERPRET=1``) in a subprocess, with the Triton of
``.sidepkgs/fla`` (see ``legacy_sources.py``); on the GPU the Hopper tests run it compiled."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from legacy_sources import FLA_DIR, fla_pythonpath

ROOT = Path(__file__).resolve().parent.parent

CHECK = r"""
import json, torch
from qla_compile.kernels import input_activations as acts
from qla_compile.reference import GDROptions, activate_gates, l2norm
torch.manual_seed(0)
out = {}
# (name, x): a slice of a fused projection (rows of a token strided), a view the rows cannot address (copied),
# a head dim that is not a power of two, and nothing at all
fused = torch.randn(2, 37, 3 * 4 * 128).to(torch.bfloat16)
cases = [
    ("fused-slice", fused[..., 512:1024].unflatten(-1, (4, 128))),
    ("padded-batch", torch.randn(3, 40, 2, 128).to(torch.bfloat16)[:, :29]),
    ("d96-fp16", torch.randn(1, 9, 3, 96).to(torch.float16)),
    ("empty", torch.randn(1, 0, 2, 128).to(torch.bfloat16)),
]
# relative to the exact value (floored far below the rows' scale)
def err(a, b):
    return ((a.double() - b).abs() / (b.abs() + 1e-4 * b.abs().max())).max().item() if b.numel() else 0.0
for name, x in cases:
    dy = torch.randn(x.shape).to(x.dtype)
    xr = x.double().requires_grad_()
    ref = l2norm(xr)
    (ref * dy.double()).sum().backward()
    (y,), (dx,) = acts.l2norm(x), acts.l2norm_bwd((x, dy))
    out[name] = dict(contiguous=y.is_contiguous() and dx.is_contiguous(), dtype=str(y.dtype) + str(dx.dtype),
                     shape=list(y.shape) == list(x.shape) == list(dx.shape), y=err(y, ref.detach()),
                     dx=err(dx, xr.grad), want_dtype=str(x.dtype) * 2)
# q and k in one launch (slices of one fused projection), and a pair of two layouts (one launch each): the
# same values as one at a time
pairs = {}
for name, (a, b) in {"one-launch": (fused[..., :512], fused[..., 512:1024]),
                     "two-layouts": (fused[..., :512], fused[..., :512].contiguous()[:, 5:])}.items():
    a, b = (t.unflatten(-1, (4, 128)) for t in (a, b))
    da, db = torch.randn(a.shape).to(a.dtype), torch.randn(b.shape).to(b.dtype)
    single = acts.l2norm(a) + acts.l2norm(b) + acts.l2norm_bwd((a, da)) + acts.l2norm_bwd((b, db))
    paired = acts.l2norm(a, b) + acts.l2norm_bwd((a, da), (b, db))
    pairs[name] = all(torch.equal(s, p) for s, p in zip(single, paired))
out["pairs"] = pairs
gates = {}
# FLA's layer options, over gate inputs from -30 to 30 (softplus' tails) and a strided beta
for gate, dt, sig, neg in [(True, True, True, True), (True, False, True, False), (False, False, False, False),
                           (False, False, True, False)]:
    opts = GDROptions(0.1, use_gate_in_kernel=gate, use_beta_sigmoid_in_kernel=sig, allow_neg_eigval=neg)
    g = (torch.linspace(-30, 30, 2 * 50 * 6).view(2, 50, 6)[:, torch.randperm(50)]).to(torch.bfloat16)
    beta = (torch.randn(2, 50, 12) * 4)[..., ::2].to(torch.bfloat16)
    A_log = torch.randn(6) if gate else None
    dt_bias = torch.randn(6) if dt else None
    leaves = [None if x is None else x.double().requires_grad_() for x in (g, beta, A_log, dt_bias)]
    ga_ref, ba_ref = activate_gates(*leaves, opts, torch.float64)
    dga, dba = torch.randn(g.shape), torch.randn(beta.shape)
    (ga_ref * dga.double() + ba_ref * dba.double()).sum().backward()
    ga, ba = acts.gates(g, beta, A_log, dt_bias, opts)
    dg, db, dA, ddt = acts.gates_bwd(g, beta, A_log, dt_bias, opts, dga, dba)
    key = f"gate={gate},dt={dt},sigmoid={sig},neg={neg}"
    gates[key] = dict(fwd=max(err(ga, ga_ref.detach()), err(ba, ba_ref.detach())),
                      dg=err(dg, leaves[0].grad), db=err(db, leaves[1].grad),
                      dA=err(dA, leaves[2].grad) if gate else (dA is None) - 1.0,
                      ddt=err(ddt, leaves[3].grad) if dt else (ddt is None) - 1.0,
                      dtypes=[str(ga.dtype), str(ba.dtype), str(dg.dtype), str(db.dtype)])
out["gates"] = gates
print(json.dumps(out))
"""


def test_triton_activations_match_float64_forward_and_backward():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), fla_pythonpath()]))
    if not (FLA_DIR / "triton").exists():
        pytest.skip("Triton is not in .sidepkgs/fla")
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    gates = results.pop("gates")
    assert results.pop("pairs") == {"one-launch": True, "two-layouts": True}
    assert set(results) == {"fused-slice", "padded-batch", "d96-fp16", "empty"}
    assert len(gates) == 4
    for name, r in gates.items():
        # fp32 results (the gates, dA_log and ddt_bias sums) to fp32's precision; dg and dbeta rounded once to bf16
        assert r["dtypes"] == ["torch.float32", "torch.float32", "torch.bfloat16", "torch.bfloat16"], (name, r)
        assert r["fwd"] < 1e-5 and r["dA"] < 1e-5 and r["ddt"] < 1e-5, (name, r)
        assert r["dg"] < 1.05 * 2.0 ** -7 and r["db"] < 1.05 * 2.0 ** -7, (name, r)
    for name, r in results.items():
        assert r["contiguous"] and r["shape"] and r["dtype"] == r["want_dtype"], (name, r)
        # computed in fp32 and rounded once to the half dtype: half a unit in the last place (fp16: 2^-11
        # relative), plus fp32's error; a whole unit for bf16 (2^-7), which the interpreter rounds by truncating
        unit = 2.0 ** -7 if "bfloat16" in r["want_dtype"] else 2.0 ** -11
        assert r["y"] < 1.05 * unit and r["dx"] < 1.05 * unit, (name, r)
