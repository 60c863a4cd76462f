"""Integrations on the CPU: the route to FLA's op for calls our kernels do not serve, the reversible rebinding of
transformers' eager GDN functions, and which FLA leaves become ops while tracing (FLA's backend registry and the
leaves in a compiled FLA layer: ``test_fla.py``)."""
import logging
import sys
import types

import pytest
import torch
from gdn_inputs import make_inputs, rel_err
from torch.profiler import ProfilerActivity, profile

import qla_compile
from qla_compile import dispatch

LEAVES = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def _run(kw, fn=qla_compile.chunk_gated_delta_rule):
    inputs = {n: (x.detach().clone().requires_grad_() if n in LEAVES else x) for n, x in kw.items()}
    o, state = fn(**inputs, output_final_state=True)
    (o.square().sum() + state.sin().sum()).backward()
    return o, state, {n: inputs[n].grad for n in LEAVES if n in inputs}


@pytest.mark.parametrize("compiled", [False, True])
def test_fla_route_gives_the_reference_values(compiled, monkeypatch):
    """The "fla" path's plumbing (every option passed by name, the backward through FLA's own autograd with its
    forward run again, also inside a compiled training graph), with the float64 oracle standing in for FLA's op:
    values and gradients as the reference path's."""
    kw = make_inputs(T=90, H=2, HV=4, K=16, V=16, l2norm=True, gate_in_kernel=True, beta_sigmoid=True,
                     initial_state=True, state_v_first=True, cu_seqlens=[0, 40, 90], seed=4)
    o_ref, st_ref, g_ref = _run(kw)
    monkeypatch.setattr(dispatch, "choose", lambda q, k, v: ("fla", "FLA stands in"))
    monkeypatch.setattr(dispatch, "fla_op", lambda: qla_compile.recurrent_gdr_reference)
    torch._dynamo.reset()
    o, st, grads = _run(kw, torch.compile(qla_compile.chunk_gated_delta_rule, backend="aot_eager", fullgraph=True)
                        if compiled else qla_compile.chunk_gated_delta_rule)
    assert rel_err(o, o_ref) < 1e-4 and rel_err(st, st_ref) < 1e-4
    for name in g_ref:
        assert rel_err(grads[name], g_ref[name]) < 1e-3, name


def _reference_fla_leaves(calls):
    """Stand-ins for FLA's forward and backward leaves (``dispatch.fla_leaves``), on the reference, that record
    their calls; the forward's A is random, so that the backward can check it gets the very tensor."""
    from qla_compile.reference import GDROptions, chunk_gdr_bwd_reference, chunk_gdr_fwd_reference

    def fwd(q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first, cu_seqlens):
        assert all(t.is_contiguous() for t in (q, k, v, g, beta, initial_state)), "FLA's leaves take contiguous inputs"
        opts = GDROptions(scale, state_v_first=state_v_first)
        o, ht = chunk_gdr_fwd_reference(q, k, v, g, beta, None, None, initial_state, cu_seqlens, opts)
        A, g_cumsum = torch.randn(*v.shape[:3], 64).to(k.dtype), g.float().cumsum(1)  # FLA's aux, as it shapes it
        calls.append(("fwd", A, g_cumsum))
        return g_cumsum, o, A, ht, initial_state, None

    def bwd(q, k, v, g, beta, A, scale, initial_state, do, dht, state_v_first, cu_seqlens):
        assert calls[-1][0] == "fwd" and torch.equal(A, calls[-1][1]) and torch.equal(g, calls[-1][2])
        calls.append(("bwd",))
        raw = torch.diff(g, dim=1, prepend=torch.zeros_like(g[:, :1]))
        dq, dk, dv, dg, db, _, _, dh0 = chunk_gdr_bwd_reference(
            do, dht, q, k, v, raw, beta, None, None, initial_state, cu_seqlens,
            GDROptions(scale, state_v_first=state_v_first))
        return dq, dk, dv, db, dg, dh0, None, None

    return fwd, bwd


def _fla_route_inputs(seed):
    return make_inputs(T=90, H=2, HV=4, K=16, V=16, l2norm=True, gate_in_kernel=True, beta_sigmoid=True,
                       initial_state=True, state_v_first=True, cu_seqlens=[0, 40, 90], seed=seed)


def test_compiled_fla_route_keeps_flas_aux_for_its_backward(monkeypatch):
    """A compiled training call on FLA's kernels runs FLA's forward once: its forward leaf's A and gate cumsum go
    to its backward leaf as they came (the reference stands in for both leaves), with the reference's values."""
    kw = _fla_route_inputs(seed=5)
    o_ref, st_ref, g_ref = _run(kw)
    calls = []
    monkeypatch.setattr(dispatch, "choose", lambda q, k, v: ("fla", "FLA stands in"))
    monkeypatch.setattr(dispatch, "fla_leaves", lambda: _reference_fla_leaves(calls))
    torch._dynamo.reset()
    o, st, grads = _run(kw, torch.compile(qla_compile.chunk_gated_delta_rule, backend="aot_eager", fullgraph=True))
    assert [c[0] for c in calls] == ["fwd", "bwd"]
    assert rel_err(o, o_ref) < 1e-4 and rel_err(st, st_ref) < 1e-4
    for name in g_ref:
        assert rel_err(grads[name], g_ref[name]) < 1e-3, name


def test_compiled_inference_call_on_fla_runs_its_forward_leaf_not_its_public_op(monkeypatch):
    """A compiled call on FLA's kernels without grad (non-contiguous v) goes to FLA's forward leaf directly,
    skipping its public op's backend dispatch and autograd function, with the reference's values."""
    kw = _fla_route_inputs(seed=7)
    kw["v"] = kw["v"].transpose(1, 2).contiguous().transpose(1, 2)  # the same values, head-major in memory
    with torch.no_grad():
        o_ref, st_ref = qla_compile.recurrent_gdr_reference(**kw, output_final_state=True)
    calls = []

    def public_op(*args, **kwargs):
        raise AssertionError("FLA's public op ran")

    monkeypatch.setattr(dispatch, "choose", lambda q, k, v: ("fla", "FLA stands in"))
    monkeypatch.setattr(dispatch, "fla_op", lambda: public_op)
    monkeypatch.setattr(dispatch, "fla_leaves", lambda: _reference_fla_leaves(calls))
    torch._dynamo.reset()
    compiled = torch.compile(qla_compile.chunk_gated_delta_rule, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        o, st = compiled(**kw, output_final_state=True)
    assert [c[0] for c in calls] == ["fwd"]
    assert rel_err(o, o_ref) < 1e-4 and rel_err(st, st_ref) < 1e-4


def test_a_gpu_call_without_our_kernels_or_fla_runs_the_reference(monkeypatch):
    on_gpu = types.SimpleNamespace(device=torch.device("cuda"))
    monkeypatch.setattr(dispatch, "_kernels", lambda: types.SimpleNamespace(unsupported=lambda q, k, v: "K = 256"))
    monkeypatch.setattr(dispatch, "fla_op", lambda: None)
    impl, why = dispatch.choose(on_gpu, on_gpu, on_gpu)
    assert impl == "reference" and "K = 256" in why and "install fla-core" in why


def _tiny_model_logits(model, ids):
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        logits = model(ids, use_cache=False).logits
    return logits, any(e.key == "qla::chunk_gdr_fwd" for e in prof.key_averages())


def test_transformers_functions_rebound_to_our_op_and_back():
    from test_backend_models import tiny_qwen3_next
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    model, ids = tiny_qwen3_next(), torch.randint(0, 96, (1, 70), generator=torch.Generator().manual_seed(0))
    original = m.torch_chunk_gated_delta_rule
    eager, ours = _tiny_model_logits(model, ids)
    assert not ours
    try:
        rebound = qla_compile.apply_to_transformers(model)
        assert "transformers.models.qwen3_next.modeling_qwen3_next.torch_chunk_gated_delta_rule" in rebound
        assert qla_compile.apply_to_transformers(model) == []  # idempotent
        patched, ours = _tiny_model_logits(model, ids)
        assert ours and rel_err(patched, eager) < 1e-5
    finally:
        assert qla_compile.revert_transformers() == len(rebound)
    assert m.torch_chunk_gated_delta_rule is original
    again, ours = _tiny_model_logits(model, ids)
    assert not ours and torch.equal(again, eager)


def test_fla_leaves_only_where_the_signature_is_known(monkeypatch, caplog):
    """FLA's leaves become ``qla::`` ops only where their parameters are those the ops mirror (another FLA version
    keeps its graph break, with a warning), and ``QLA_FLA_LEAVES=0`` registers none."""
    from qla_compile.integrations import fla_leaves

    conv = types.ModuleType(fla_leaves.CONV)
    conv.causal_conv1d_fwd = lambda x, weight, bias, residual, initial_state=None, output_final_state=False, \
        activation=None, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, chunk_size=64, \
        layout_fallback=False: None
    conv.causal_conv1d_bwd = lambda x, dy, dht, weight=None, bias=None, residual=None, initial_state=None, \
        activation=None, cu_seqlens=None, seq_idx=None: None  # not the parameters of FLA 0.6
    monkeypatch.setitem(sys.modules, fla_leaves.CONV, conv)
    monkeypatch.setattr(fla_leaves, "_registered", {})  # this test's stand-ins stay out of what explain lists
    monkeypatch.setenv("QLA_FLA_LEAVES", "0")
    assert fla_leaves.register() == []
    monkeypatch.delenv("QLA_FLA_LEAVES")
    with caplog.at_level(logging.WARNING, logger=fla_leaves.__name__):
        assert fla_leaves.register() == [f"{fla_leaves.CONV}.causal_conv1d_fwd"]
    assert "causal_conv1d_bwd takes" in caplog.text and "graph break under torch.compile stays" in caplog.text
    assert fla_leaves.register() == []  # once


def test_fla_leaf_layouts_come_from_the_fake_once_per_signature(monkeypatch):
    """An FLA leaf op's body runs its fake (on meta copies) only for an argument signature it has not seen: a call
    with the shapes, strides and dtypes of an earlier one reuses its layout; other strides or another dtype get their
    own, the fake's. A backend's output in that layout is returned itself, one in another copied into it."""
    from qla_compile.integrations import fla_leaves

    fake, fakes, given = fla_leaves._bwd_fake, [], []
    monkeypatch.setattr(fla_leaves, "_bwd_fake", lambda *args: fakes.append(args) or fake(*args))
    monkeypatch.setattr(fla_leaves, "_layouts", {})
    leaf = lambda x, weight, bias, **_: given.append(
        (torch.randn(x.shape), torch.randn(weight.shape), torch.randn(bias.shape), None, None)) or given[-1]
    monkeypatch.setattr(fla_leaves, "_leaf", lambda name: leaf)
    w, b = torch.randn(16, 4), torch.randn(16)

    def dx_of(x):
        args = (x, torch.randn(x.shape, dtype=x.dtype), None, w, b, False, None, None, None, None, "silu", 64, False)
        dx = fla_leaves.conv_bwd(*args)[0]
        want = fake(*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args))[0]
        assert (dx.shape, dx.stride(), dx.dtype) == (want.shape, want.stride(), want.dtype)
        assert torch.equal(dx, given[-1][0].to(dx.dtype))
        return dx

    assert dx_of(torch.randn(2, 9, 16)).data_ptr() == given[-1][0].data_ptr()  # the backend's dx itself
    dx_of(torch.randn(2, 9, 16))
    assert len(fakes) == 1  # same signature: no fake run
    transposed, half = torch.randn(2, 16, 9).mT, torch.randn(2, 9, 16, dtype=torch.bfloat16)  # same shape
    assert dx_of(transposed).stride() == (144, 1, 9) and dx_of(half).dtype == torch.bfloat16  # copies
    assert len(fakes) == 3
    dx_of(torch.randn(2, 16, 9).mT)
    dx_of(half.clone())
    assert len(fakes) == 3 and len(fla_leaves._layouts) == 3
    monkeypatch.setattr(fla_leaves, "_MAX_LAYOUTS", 3)
    dx_of(torch.randn(3, 9, 16))
    assert len(fakes) == 4 and len(fla_leaves._layouts) == 1  # full: cleared


def test_when_imported_runs_after_the_import_or_at_once(tmp_path, monkeypatch, caplog):
    """``import_hooks.when_imported``: the callback runs right after the module executes (it sees the module's
    names), at once for a module already imported, and a failing callback is logged without failing the import."""
    from qla_compile import import_hooks

    (tmp_path / "qla_hook_probe.py").write_text("VALUE = 7\n")
    (tmp_path / "qla_hook_broken.py").write_text("VALUE = 8\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    import_hooks.when_imported("qla_hook_probe", lambda: seen.append(sys.modules["qla_hook_probe"].VALUE))
    assert seen == []
    import qla_hook_probe  # noqa: F401
    assert seen == [7]
    import_hooks.when_imported("qla_hook_probe", lambda: seen.append("again"))
    assert seen == [7, "again"]

    def broken():
        raise RuntimeError("probe")

    import_hooks.when_imported("qla_hook_broken", broken)
    with caplog.at_level(logging.WARNING, logger=import_hooks.__name__):
        import qla_hook_broken
    assert qla_hook_broken.VALUE == 8 and "probe" in caplog.text
    assert not {"qla_hook_probe", "qla_hook_broken"} & set(import_hooks._pending)


def test_when_imported_under_a_prefix_sees_each_module(tmp_path, monkeypatch):
    """``import_hooks.when_imported_under``: the callback gets each module below the prefix, those imported
    before it was set and each one imported after, and no other."""
    from qla_compile import import_hooks

    package = tmp_path / "qla_hook_pkg"
    package.mkdir()
    for name in ("__init__", "early", "late"):
        (package / f"{name}.py").write_text(f"NAME = {name!r}\n")
    (tmp_path / "qla_hook_other.py").write_text("NAME = 'other'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import qla_hook_pkg.early  # noqa: F401

    seen = []
    monkeypatch.setattr(import_hooks, "_prefixes", [])
    import_hooks.when_imported_under("qla_hook_pkg.", lambda module: seen.append(module.NAME))
    assert seen == ["early"]
    import qla_hook_other  # noqa: F401
    import qla_hook_pkg.late  # noqa: F401
    assert seen == ["early", "late"]
