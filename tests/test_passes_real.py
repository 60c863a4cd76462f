"""The FX pass on real eager GDN code it has never seen by identity: outputs equal the code it replaced."""
import types

import pytest
import torch

import qla_compile as qb
from gdn_inputs import make_inputs, rel_err
from legacy_sources import fla_naive, legacy_transformers_gdn
from qla_compile.passes import frontdoor


def _copy(fn):
    """The same code under a new identity: the front door does not know it, only the FX pass can fuse it."""
    fn = frontdoor.eager_body(fn)  # its own code, should the front door have taken it
    return types.FunctionType(fn.__code__, fn.__globals__, "copied_gdn", fn.__defaults__, fn.__closure__)


def _fuse(fn, args, dynamic=False):
    backend = qb.make_backend(inductor=False)
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)
    return compiled(*args), backend.reports


def _check(fn, kw, output_final_state, dynamic=False):
    args = (kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], kw.get("initial_state"))
    call = lambda q, k, v, g, beta, h0: fn(q, k, v, g, beta, initial_state=h0, output_final_state=output_final_state,
                                           **({"use_qk_l2norm_in_kernel": True} if kw["use_qk_l2norm_in_kernel"] else {}))
    torch._dynamo.reset()
    (o, st), reports = _fuse(call, args, dynamic)
    o_ref, st_ref = call(*args)
    (report,) = reports
    assert [r.status for r in report.regions] == ["replaced"], report.summary()
    assert report.nodes_after < 20 < report.nodes_before, report.summary()
    assert rel_err(o, o_ref) < 1e-5
    if output_final_state:
        assert rel_err(st, st_ref) < 1e-5
    return report


@pytest.mark.parametrize("HV, l2norm, initial_state, final", [(2, True, False, True), (4, False, True, False)])
def test_transformers_current_form_is_fused(HV, l2norm, initial_state, final):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    fn = _copy(list(frontdoor.unwrap_chain(torch_chunk_gated_delta_rule))[-1])
    kw = make_inputs(T=40, H=2, HV=HV, K=16, V=16, l2norm=l2norm, initial_state=initial_state, seed=0)
    report = _check(fn, kw, final, dynamic=True)
    assert f"l2norm={l2norm}" in report.regions[0].reason


def test_transformers_legacy_loop_form_is_fused():
    fn, version = legacy_transformers_gdn()
    kw = make_inputs(T=24, H=2, HV=2, K=16, V=16, l2norm=True, initial_state=True, seed=1)
    report = _check(fn, kw, True)
    assert report.nodes_before > 600  # the 63-row substitution loop, unrolled


def test_fla_naive_chunk_reference_is_fused():
    naive = fla_naive()
    kw = make_inputs(T=20, H=2, HV=2, K=16, V=16, initial_state=True, seed=2)
    kw["use_qk_l2norm_in_kernel"] = False
    _check(naive.naive_chunk_gated_delta_rule, kw, True)


def test_transformers_recurrent_form_is_fused():
    """transformers' token-by-token recurrence (its decode path, here over 16 tokens): GVA, L2 norm, states."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    fn = _copy(list(frontdoor.unwrap_chain(torch_recurrent_gated_delta_rule))[-1])
    kw = make_inputs(T=16, H=2, HV=4, K=16, V=16, l2norm=True, initial_state=True, seed=3)
    report = _check(fn, kw, True)
    assert "l2norm=True" in report.regions[0].reason and "final state" in report.regions[0].reason


def test_fla_naive_recurrent_reference_is_fused():
    naive = fla_naive()
    kw = make_inputs(T=12, H=2, HV=2, K=16, V=16, initial_state=True, seed=4)
    kw["use_qk_l2norm_in_kernel"] = False
    fn = lambda q, k, v, g, beta, **kwargs: naive.naive_recurrent_gated_delta_rule(q, k, v, beta, g, **kwargs)
    _check(fn, kw, True)
