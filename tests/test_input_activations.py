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
# (name, x): a slice of a fused projection (rows of a token strided), a slice of transformers' convolution
# output ([B, C, T] transposed: a row's elements T apart, tokens adjacent), a batch of padded sequences, a head
# dim that is not a power of two, and nothing at all
fused = torch.randn(2, 37, 3 * 4 * 128).to(torch.bfloat16)
conv_out = torch.randn(2, 3 * 4 * 128, 37).to(torch.bfloat16).transpose(1, 2)
cases = [
    ("fused-slice", fused[..., 512:1024].unflatten(-1, (4, 128))),
    ("transposed-slice", conv_out[..., 512:1024].reshape(2, 37, 4, 128)),
    ("padded-batch", torch.randn(3, 40, 2, 128).to(torch.bfloat16)[:, :29]),
    ("d96-fp16", torch.randn(1, 9, 3, 96).to(torch.float16)),
    ("empty", torch.randn(1, 0, 2, 128).to(torch.bfloat16)),
]
# relative to the exact value (floored far below the rows' scale)
def err(a, b):
    return ((a.double() - b).abs() / (b.abs() + 1e-4 * b.abs().max())).max().item() if b.numel() else 0.0
for name, x in cases:
    ref = l2norm(x.double())
    (y,), (rstd,), _ = acts.l2norm(x)
    rstd_exact = torch.rsqrt((x.double() ** 2).sum(-1, keepdim=True) + 1e-6)
    out[name] = dict(contiguous=y.is_contiguous(), dtype=str(y.dtype), shape=list(y.shape) == list(x.shape),
                     y=err(y, ref), rstd=err(rstd.view(rstd_exact.shape), rstd_exact), want_dtype=str(x.dtype))
# q and k in one launch (slices of one fused projection) with v copied contiguous in it, and a pair of two
# layouts (one launch each): the same values as one at a time; v's copy exact, v already contiguous not copied
pairs = {}
for name, (a, b, v_all) in {
        "one-launch": (fused[..., :512], fused[..., 512:1024], fused[..., 1024:]),
        "one-launch-transposed": (conv_out[..., :512], conv_out[..., 512:1024], conv_out[..., 1024:]),
        "two-layouts": (fused[..., :512], fused[..., :512].contiguous()[:, 5:], fused[..., 1024:])}.items():
    a, b = (t.reshape(*t.shape[:2], 4, 128) for t in (a, b))
    v = v_all[:, :a.shape[1]].reshape(2, a.shape[1], 2, 256)
    (ya,), (ra,), _ = acts.l2norm(a)
    (yb,), (rb,), _ = acts.l2norm(b)
    single = (ya, yb, ra, rb, v)
    ys, rstds, copied = acts.l2norm(a, b, copy=v)
    paired = (*ys, *rstds, copied)
    pairs[name] = all(torch.equal(s, p) for s, p in zip(single, paired)) and copied.is_contiguous()
vc = fused[..., 1024:].unflatten(-1, (2, 256)).contiguous()
pairs["v-contiguous"] = acts.l2norm(fused[..., :512].unflatten(-1, (4, 128)), copy=vc)[2] is vc
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
    # the kernels' head-major gradients where there is a gate activation, else contiguous ones
    dga, dba = (torch.randn(x.shape[-1], x.numel() // x.shape[-1]).t().reshape(x.shape) if gate
                else torch.randn(x.shape) for x in (g, beta))
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
    assert results.pop("pairs") == {"one-launch": True, "one-launch-transposed": True, "two-layouts": True,
                                    "v-contiguous": True}
    assert set(results) == {"fused-slice", "transposed-slice", "padded-batch", "d96-fp16", "empty"}
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
        assert r["y"] < 1.05 * unit, (name, r)
        assert r["rstd"] < 1e-6, (name, r)  # fp32


EAGER_PATH = r"""
import json, sys, types, torch
sys.path.insert(0, "tests")
from gdn_inputs import make_inputs, outputs_and_grads, rel_err
from qla_compile import api, dispatch
from qla_compile.kernels import backward as hopper_backward, input_activations as acts
from qla_compile.reference import GDROptions, chunk_gdr_bwd_reference, chunk_gdr_fwd_reference, recurrent_gdr_reference

seen = {"fwd_v": [], "bwd_v": [], "calls": [], "keys_normalised": []}

def fwd(q, k, v, g, beta, scale, h0, cu, for_backward=True, keys_normalised=False):  # the Hopper forward, by reference
    seen["fwd_v"].append((v.data_ptr(), v.is_contiguous(), q.is_contiguous() and k.is_contiguous()))
    seen["keys_normalised"].append(keys_normalised)
    o, ht = chunk_gdr_fwd_reference(q, k, v, g, beta, None, None, h0, cu, GDROptions(scale))
    return o, ht, v.new_empty(0), v.new_empty(0), None, v.new_empty(0)

def bwd(do, dht, q, k, v, g, beta, scale, h0, cu, aux=None, rstd=None):
    seen["bwd_v"].append((v.data_ptr(), v.is_contiguous(), rstd is not None))
    dq, dk, dv, dg, db, _, _, dh0 = chunk_gdr_bwd_reference(do, dht, q, k, v, g, beta, None, None, h0, cu,
                                                            GDROptions(scale))
    if rstd is not None:  # the raw rows' gradients from the normalised ones (chunk_grads' l2norm)
        dq, dk = (r.view(*y.shape[:-1], 1) * (d - y.float() * (d * y.float()).sum(-1, keepdim=True))
                  for y, r, d in ((q, rstd[0], dq.float()), (k, rstd[1], dk.float())))
    # the kernels' head-major dg, dbeta
    dg, db = (x.reshape(-1, x.shape[-1]).t().contiguous().t().view(x.shape) for x in (dg, db))
    return dq.to(q.dtype), dk.to(k.dtype), dv, dg, db, dh0

def counted(name, fn):
    def call(*a, **kw):
        seen["calls"].append(name)
        return fn(*a, **kw)
    return call

dispatch._kernels = lambda: types.SimpleNamespace(unsupported=lambda q, k, v: None, chunk_gdr_fwd_hopper_aux=fwd,
                                                  cp_cache_numel=lambda *a: 0)
hopper_backward.chunk_gdr_bwd_hopper = bwd
for name in ("l2norm", "gates"):
    setattr(acts, name, counted(name, getattr(acts, name)))

# FLA's layer call: q, k, v slices of one fused projection, raw gates, beta logits, a V-first initial state
kw = make_inputs(B=1, T=100, H=2, HV=4, K=32, V=32, initial_state=True, l2norm=True, gate_in_kernel=True,
                 beta_sigmoid=True, state_v_first=True, seed=3)
fused = torch.cat([kw["q"].flatten(2), kw["k"].flatten(2), kw["v"].flatten(2)], -1).to(torch.bfloat16)
q, k, v = (t.unflatten(-1, (-1, 32)) for t in fused.split([64, 64, 128], -1))
names = ["q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state"]
flags = {n: x for n, x in kw.items() if n not in names}
args = [q, k, v] + [kw[n] for n in names[3:]]

def ours(*a):
    return api.chunk_gated_delta_rule(*a[:5], initial_state=a[7], output_final_state=True, A_log=a[5],
                                      dt_bias=a[6], **flags)

def oracle(*a):
    a = [x.double() for x in a]
    return recurrent_gdr_reference(*a[:5], initial_state=a[7], output_final_state=True, A_log=a[5],
                                   dt_bias=a[6], **flags)

outs, grads = outputs_and_grads(ours, args)
calls_fwd = list(seen["calls"])
ref_outs, ref_grads = outputs_and_grads(oracle, args)
print(json.dumps(dict(
    errors={n: rel_err(x, r) for n, x, r in zip(["o", "ht"] + names, outs + list(grads), ref_outs + list(ref_grads))},
    calls_fwd=calls_fwd, calls_bwd=seen["calls"][len(calls_fwd):],
    v_copied=seen["fwd_v"][0][0] != v.data_ptr() and seen["fwd_v"][0][1] and seen["fwd_v"][0][2],
    bwd_same_v=seen["bwd_v"] == [(*seen["fwd_v"][0][:2], True)], keys_normalised=seen["keys_normalised"],
    choices={f"{i}: {w}": n for (i, w), n in dispatch.choices().items()})))
"""


def test_eager_hopper_path_keeps_the_activated_inputs_for_its_backward():
    """``ops.EagerChunkGDR`` on the Hopper path (its kernels stood in for by the reference, the activations by
    Triton's interpreter), called as FLA's layer calls it: outputs and every gradient as the float64 oracle's,
    v made contiguous once in the forward and handed as is to the backward with the norms' rstd (the kernels form the
    L2 norm's backward), no activation run again there."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), fla_pythonpath()]))
    if not (FLA_DIR / "triton").exists():
        pytest.skip("Triton is not in .sidepkgs/fla")
    proc = subprocess.run([sys.executable, "-c", EAGER_PATH], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["calls_fwd"] == ["l2norm", "gates"] and r["calls_bwd"] == [], r
    assert r["v_copied"] and r["bwd_same_v"], r
    assert r["keys_normalised"] == [True], r  # the op's own norm ran: the forward is told
    assert list(r["choices"]) == ["hopper: our Hopper kernels (SM90, bf16/fp16, K = V = 128)"], r
    assert r["choices"]["hopper: our Hopper kernels (SM90, bf16/fp16, K = V = 128)"] == 2, r
    # bf16 q, k, v (rounded once from the oracle's inputs' values) and bf16 o and gradients
    for name, e in r["errors"].items():
        assert e < 2e-2, (name, r["errors"])
