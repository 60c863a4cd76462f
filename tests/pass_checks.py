"""Checks of the FX pass on the collection of ``gdn_forms`` on any device (``tests/test_passes_forms.py`` runs them
on CPU, ``tests/gpu/test_passes_cuda.py`` on CUDA): a GDN form is fused into one call of our op and matches eager
and the float64 oracle; a look-alike is left as it was; the pass stays within its time budget."""
import dataclasses

import torch

import qla_compile as qb
from gdn_forms import FORMS, LOOK_ALIKES
from gdn_inputs import make_inputs, outputs_and_grads, rel_err
from qla_compile import recurrent_gdr_reference
from qla_compile.passes.fuse import PASS_BUDGET_SECONDS

NAMES = ("q", "k", "v", "g", "beta")


def compiled(fn, args, differentiable=True):
    """Outputs and gradients (``outputs_and_grads``) of ``fn`` compiled with the backend, and the pass's report."""
    torch._dynamo.reset()
    backend = qb.make_backend(inductor=False)
    outs, grads = outputs_and_grads(torch.compile(fn, backend=backend, fullgraph=True), args, differentiable)
    (report,) = backend.reports
    assert report.pass_seconds <= PASS_BUDGET_SECONDS, report.summary()
    return outs, grads, report


def form_inputs(form, seed, device="cpu"):
    """The form's arguments, in its layout and dtype (the initial state fp32), on ``device``."""
    kw = make_inputs(B=2, T=form.T, H=form.H, HV=form.HV, K=16, V=16, l2norm=form.l2norm,
                     initial_state=form.initial_state, seed=seed)
    args = [kw[n].to(form.dtype) for n in NAMES]
    args = [x.transpose(1, 2).contiguous() for x in args] if form.head_major else args
    return [a.to(device) for a in args + ([kw["initial_state"]] if form.initial_state else [])]


def _oracle(form):
    """The float64 per-token recurrence, as a function of the form's arguments and with its outputs."""
    def run(*args):
        q, k, v, g, beta, *h0 = (a.transpose(1, 2) if form.head_major and i < 5 else a for i, a in enumerate(args))
        o, state = recurrent_gdr_reference(q, k, v, g, beta, scale=form.scale, initial_state=h0[0] if h0 else None,
                                           output_final_state=form.final_state,
                                           use_qk_l2norm_in_kernel=form.l2norm)
        o = o.transpose(1, 2) if form.head_major else o
        return (o, state) if form.final_state else o

    return run


def check_form_fused(name, device="cpu", T=None):
    """The form ``name`` (at ``T`` tokens: the form's own length by default) compiles into one call of our op, as
    close to eager (fp32) or to the float64 oracle (half) as eager is."""
    form = FORMS[name] if T is None else dataclasses.replace(FORMS[name], T=T)
    args = form_inputs(form, seed=sorted(FORMS).index(name), device=device)
    eager, eager_grads = outputs_and_grads(form.fn, args, form.differentiable)
    oracle, oracle_grads = outputs_and_grads(_oracle(form), [a.double() for a in args], form.differentiable)
    half = form.dtype != torch.float32
    assert max(rel_err(e, r) for e, r in zip(eager, oracle)) < (1e-2 if half else 1e-5)  # the form is GDN
    outs, grads, report = compiled(form.fn, args, form.differentiable)
    assert [r.status for r in report.regions] == ["replaced"], report.summary()
    assert report.nodes_after < 20, report.summary()
    assert all(o.device == args[0].device for o in (*outs, *grads))
    if not half:
        assert all(rel_err(o, e) < 1e-4 for o, e in zip(outs, eager))
        assert all(rel_err(d, e) < 1e-3 for d, e in zip(grads, eager_grads))
        return
    # fp16/bf16: as close to the float64 oracle as eager is (or 1e-2); our op computes in fp32 inside
    for got, ref, want in (*zip(outs, eager, oracle), *zip(grads, eager_grads, oracle_grads)):
        assert rel_err(got, want) <= max(2 * rel_err(ref, want), 1e-2)


def _look_alike_inputs(form, seed, device):
    kw = make_inputs(B=2, T=form.T, H=2, HV=form.HV, K=16, V=16, seed=seed)
    if form.key_gate:  # per key channel, in the recurrences' stable range
        kw["g"] = -0.5 * torch.rand(2, form.T, 2, 16, generator=torch.Generator().manual_seed(seed))
    return [kw[n].to(device) for n in NAMES]


def check_look_alike_left_alone(name, device="cpu"):
    """The look-alike ``name`` compiles with no region replaced and every node kept, and runs as eager."""
    form = LOOK_ALIKES[name]
    args = _look_alike_inputs(form, seed=sorted(LOOK_ALIKES).index(name), device=device)
    eager, eager_grads = outputs_and_grads(form.fn, args)
    outs, grads, report = compiled(form.fn, args)
    assert report.fused_calls == 0 and report.nodes_after == report.nodes_before, report.summary()
    assert all(r.status == "rejected" for r in report.regions), report.summary()
    assert all(rel_err(o, e) < 1e-6 for o, e in zip(outs, eager))
    assert all(rel_err(d, e) < 1e-6 for d, e in zip(grads, eager_grads))
