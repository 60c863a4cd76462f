"""FLA under ``torch.compile(..., backend=qla_compile backend)`` on CPU; run by ``test_fla.py`` in a subprocess
with ``.sidepkgs/fla`` importable (see ``legacy_sources.py``).  ``python fla_checks.py op|layer``.

FLA's own kernels are Triton and do not run on CPU, so every result is checked against the float64 oracle
``qla_compile.recurrent_gdr_reference`` fed the same inputs.  Of FLA's ``GatedDeltaNet`` layer, the output norm
(``FusedRMSNormGated``: Triton) cannot run on CPU and is swapped for the same gated RMSNorm in torch; the short
convolution's Triton leaves are replaced by torch stand-ins behind our ``qla::fla_causal_conv1d_*`` ops
(``check_leaves``), or the layer is built with ``use_short_conv=False``.  Everything else, including the
``chunk_gated_delta_rule`` call with all the layer's options, is FLA's code.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

import qla_compile
from gdn_inputs import make_inputs, rel_err


class TorchGatedRMSNorm(nn.Module):
    """``FusedRMSNormGated`` (swish gate) in torch."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x, gate):
        x = x.float()
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.weight
        return x * F.silu(gate.float())


def check_op():
    """FLA's public op: no graph break under fullgraph, one graph for several lengths, the oracle's values."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    qla_compile.register_substitutions()
    backend = qla_compile.make_backend(inductor=False)
    compiled = torch.compile(chunk_gated_delta_rule, backend=backend, fullgraph=True, dynamic=True)
    for T in (30, 64, 100, 200):
        kw = make_inputs(T=T, H=2, HV=4, K=16, V=16, l2norm=True, gate_in_kernel=True, beta_sigmoid=True,
                         initial_state=True, state_v_first=True, seed=T)
        o, state = compiled(**kw, output_final_state=True)
        o_ref, state_ref = qla_compile.recurrent_gdr_reference(**kw, output_final_state=True)
        assert rel_err(o, o_ref) < 1e-4 and rel_err(state, state_ref) < 1e-4, T
    assert len(backend.reports) == 1, [r.summary() for r in backend.reports]
    assert backend.reports[0].front_door_calls == 1, backend.reports[0].summary()
    print(f"op OK: 4 lengths, {len(backend.reports)} graph")


def _layer():
    from fla.layers import GatedDeltaNet

    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden_size=64, head_dim=16, num_heads=2, num_v_heads=4, expand_v=1.0,
                          use_short_conv=False)
    layer.o_norm = TorchGatedRMSNorm(layer.o_norm)
    return layer


def _oracle_forward(layer, x):
    """The layer's forward (``use_short_conv=False``) with the oracle in place of ``chunk_gated_delta_rule``."""
    heads = lambda t, h: t.unflatten(-1, (h, -1))
    q = heads(F.silu(layer.q_proj(x)), layer.num_heads)
    k = heads(F.silu(layer.k_proj(x)), layer.num_heads)
    v = heads(F.silu(layer.v_proj(x)), layer.num_v_heads)
    o, _ = qla_compile.recurrent_gdr_reference(
        q, k, v, layer.a_proj(x), layer.b_proj(x), use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        A_log=layer.A_log, dt_bias=layer.dt_bias, use_beta_sigmoid_in_kernel=True, state_v_first=True,
    )
    o = layer.o_norm(o.float(), heads(layer.g_proj(x), layer.num_v_heads))
    return layer.o_proj(o.flatten(-2))


def _grads(layer, out):
    layer.zero_grad(set_to_none=True)
    out.square().mean().backward()
    return {n: p.grad.clone() for n, p in layer.named_parameters()}


def check_layer():
    """FLA's layer, fullgraph with the default (Inductor) backend: outputs and gradients equal the oracle's."""
    layer = _layer()
    qla_compile.register_substitutions()
    backend = qla_compile.backend
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    x = torch.randn(2, 70, 64, generator=torch.Generator().manual_seed(1))
    out = compiled(x)[0]
    ref = _oracle_forward(layer, x)
    assert rel_err(out, ref) < 1e-4, rel_err(out, ref)
    grads, ref_grads = _grads(layer, out), _grads(layer, ref)
    for name in ("A_log", "dt_bias", "q_proj.weight", "b_proj.weight", "a_proj.weight", "o_proj.weight"):
        assert grads[name].abs().sum() > 0, name
        assert rel_err(grads[name], ref_grads[name]) < 1e-3, (name, rel_err(grads[name], ref_grads[name]))
    (report,) = backend.reports
    assert report.front_door_calls == 1, report.summary()
    print(f"layer OK: {report.summary()}")


def _conv_standin(x, weight, bias=None, residual=None, initial_state=None, output_final_state=False,
                  activation=None, **_):
    """FLA's ``causal_conv1d_fwd`` in torch (its Triton kernels do not run on CPU): ``y[t] = act(bias + sum_j
    weight[:, j] * x[t - W + 1 + j])``, zeros before the first token."""
    assert residual is None and initial_state is None
    W = weight.shape[1]
    padded = F.pad(x, (0, 0, W - 1, 0))
    y = sum(padded[:, j:j + x.shape[1]] * weight[:, j] for j in range(W))
    y = y if bias is None else y + bias
    y = F.silu(y) if activation in ("silu", "swish") else y
    return y.contiguous(), (padded[:, -W:].mT.contiguous() if output_final_state else None)


def _conv_bwd_standin(x, dy, dht, weight, bias=None, residual=None, initial_state=None, activation=None, **_):
    """FLA's ``causal_conv1d_bwd`` as the gradient of :func:`_conv_standin` (recorded below the op's dispatch,
    as ``dispatch._recording`` allows)."""
    from qla_compile import dispatch

    with dispatch._recording():
        leaves = [t.detach().requires_grad_() for t in (x, weight) + ((bias,) if bias is not None else ())]
        y, _ = _conv_standin(*leaves, activation=activation)
        grads = torch.autograd.grad(y, leaves, dy)
    return grads[0], grads[1], grads[2] if bias is not None else None, None, None


def _norm_standin(x, g, weight, bias, activation="swish", eps=1e-5, residual=None, out_dtype=None,
                  residual_dtype=None, is_rms_norm=False):
    """FLA's ``layer_norm_gated_fwd`` (RMS norm, swish gate, no residual) in torch: ``(y, None, rstd, x)``."""
    assert is_rms_norm and residual is None and residual_dtype is None and activation in ("swish", "silu")
    rstd = torch.rsqrt(x.float().square().mean(-1) + eps)
    y = x.float() * rstd[:, None] * weight
    y = (y if bias is None else y + bias) * F.silu(g.float())
    return y.to(x.dtype if out_dtype is None else out_dtype), None, rstd, x


def _norm_bwd_standin(dy, x, g, weight, bias, activation="swish", eps=1e-5, mean=None, rstd=None, dresidual=None,
                      has_residual=False, is_rms_norm=False, x_dtype=None, recompute_output=False):
    """FLA's ``layer_norm_gated_bwd`` as the gradient of :func:`_norm_standin`."""
    from qla_compile import dispatch

    assert not has_residual and dresidual is None and not recompute_output
    with dispatch._recording():
        leaves = [t.detach().requires_grad_() for t in (x, g, weight) + ((bias,) if bias is not None else ())]
        y = _norm_standin(*leaves[:3], leaves[3] if bias is not None else None, activation, eps, is_rms_norm=True)[0]
        grads = torch.autograd.grad(y, leaves, dy)
    return grads[0], grads[1], grads[2], grads[3] if bias is not None else None, None


def _standin_leaves():
    """FLA's leaves' bodies as torch stand-ins (their Triton kernels do not run on CPU)."""
    from qla_compile.integrations import fla_leaves

    fla_leaves._leaf = {"causal_conv1d_fwd": _conv_standin, "causal_conv1d_bwd": _conv_bwd_standin,
                        "layer_norm_gated_fwd": _norm_standin, "layer_norm_gated_bwd": _norm_bwd_standin}.get


def check_leaves_first_trace():
    """FLA's layer modules imported after qla_compile registered its substitutions (as a script that calls
    ``register_substitutions()`` first, then builds its model, does) and ``torch._dynamo.reset()`` between: the
    first trace of the layer compiled with the backend has FLA's functions substituted already (registered as
    FLA imported them), so it is one graph with ``fullgraph=True``, with and without grad (registered only at the
    backend's first graph: a graph break at FLA's short convolution, gb0099)."""
    from qla_compile.integrations import fla_leaves

    assert "fla.layers" not in sys.modules
    qla_compile.register_substitutions()
    assert not fla_leaves.registered()
    _standin_leaves()
    from fla.layers import GatedDeltaNet

    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden_size=64, head_dim=16, num_heads=2, num_v_heads=4, expand_v=1.0)
    x = torch.randn(1, 70, 64, generator=torch.Generator().manual_seed(3))
    backend = qla_compile.make_backend(inductor=False)
    for grad in (False, True):
        torch._dynamo.reset()
        with torch.set_grad_enabled(grad):
            torch.compile(layer, backend=backend, fullgraph=True)(x)
    assert [r.front_door_calls > 0 for r in backend.reports] == [True, True], [r.summary() for r in backend.reports]
    assert len(fla_leaves.registered()) == 4, fla_leaves.registered()
    print("leaves_first_trace OK")


def check_leaves():
    """FLA's layer with its short convolution and gated output norm, compiled with ``fullgraph=True``: FLA's
    ``torch.compiler.disable``-d leaves of both are our ``qla::`` ops in the graph (no graph break), and outputs and
    gradients equal a torch oracle's (``F.conv1d``, the RMS norm written out). On the CPU the leaves' bodies run
    torch stand-ins for FLA's Triton kernels."""
    from torch.profiler import ProfilerActivity, profile

    from qla_compile.integrations import fla_leaves

    _standin_leaves()
    from fla.layers import GatedDeltaNet

    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden_size=64, head_dim=16, num_heads=2, num_v_heads=4, expand_v=1.0, conv_bias=True)
    registered = fla_leaves.registered()  # as FLA's modules were imported
    for leaf in ("causal_conv1d_fwd", "causal_conv1d_bwd"):
        assert f"{fla_leaves.CONV}.{leaf}" in registered, registered
    for leaf in ("layer_norm_gated_fwd", "layer_norm_gated_bwd"):
        assert f"{fla_leaves.NORM}.{leaf}" in registered, registered
    x = torch.randn(2, 70, 64, generator=torch.Generator().manual_seed(3))
    compiled = torch.compile(layer, backend=qla_compile.make_backend(inductor=False), fullgraph=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = compiled(x)[0]
        grads = _grads(layer, out)
    keys = {e.key for e in prof.key_averages()}
    ours = {"qla::fla_causal_conv1d_fwd", "qla::fla_causal_conv1d_bwd", "qla::fla_layer_norm_gated_fwd",
            "qla::fla_layer_norm_gated_bwd", "qla::chunk_gdr_fwd"}
    assert ours <= keys, ours - keys

    def conv(proj, module):
        w = module.weight.shape[-1]
        y = F.conv1d(proj(x).mT, module.weight, module.bias, padding=w - 1, groups=module.weight.shape[0])
        return F.silu(y[..., :x.shape[1]].mT)

    heads = lambda t, h: t.unflatten(-1, (h, -1))
    q, k = (heads(conv(p, m), layer.num_heads) for p, m in ((layer.q_proj, layer.q_conv1d),
                                                           (layer.k_proj, layer.k_conv1d)))
    v = heads(conv(layer.v_proj, layer.v_conv1d), layer.num_v_heads)
    o, _ = qla_compile.recurrent_gdr_reference(
        q, k, v, layer.a_proj(x), layer.b_proj(x), use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        A_log=layer.A_log, dt_bias=layer.dt_bias, use_beta_sigmoid_in_kernel=True, state_v_first=True,
    )
    ref = layer.o_proj(TorchGatedRMSNorm(layer.o_norm)(o, heads(layer.g_proj(x), layer.num_v_heads)).flatten(-2))
    assert rel_err(out, ref) < 1e-4, rel_err(out, ref)
    ref_grads = _grads(layer, ref)
    for name in ("q_conv1d.weight", "v_conv1d.bias", "k_proj.weight", "A_log", "o_norm.weight", "o_proj.weight"):
        assert grads[name].abs().sum() > 0, name
        assert rel_err(grads[name], ref_grads[name]) < 1e-3, (name, rel_err(grads[name], ref_grads[name]))
    # the ops' fake implementations against their bodies (schema, fake tensors, AOT), strided x as FLA's splits give
    qkv = torch.randn(2, 9, 48)
    x, w, b, dy = qkv[..., :16], torch.randn(16, 4), torch.randn(16), torch.randn(2, 9, 16)
    t, g, nw, rstd = torch.randn(18, 16), torch.randn(18, 16), torch.randn(16), torch.rand(18)
    for op, args in ((fla_leaves.conv_fwd, (x, w, b, None, None, None, None, None, True, "silu", 64, False)),
                     (fla_leaves.conv_bwd, (x, dy, None, w, b, False, None, None, None, None, "silu", 64, False)),
                     (fla_leaves.norm_fwd, (t, g, nw, None, "swish", 1e-5, None, None, None, True)),
                     (fla_leaves.norm_bwd, (t, t, g, nw, None, "swish", 1e-5, None, rstd, None, False, True,
                                            torch.float32, False))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    print("leaves OK")


def check_registry():
    """Our backend is in FLA's registry ahead of FlashQLA whichever package is imported first, and importing
    qla_compile does not import FLA."""
    import subprocess

    code = {
        "qla first": "import qla_compile, sys; assert 'fla' not in sys.modules; import fla",
        "fla first": "import fla, qla_compile",
    }
    for order, imports in code.items():
        out = subprocess.run([sys.executable, "-c", imports + "; from fla.backends import _operation_registries as r;"
                              " print(sorted((b.priority, t) for t, b in r['gated_delta_rule']._backends.items()))"],
                             capture_output=True, text=True, check=True)
        ranked = [name for _, name in eval(out.stdout.strip().splitlines()[-1])]
        assert "qla_compile" in ranked and ranked.index("qla_compile") < ranked.index("flash_qla"), (order, ranked)
    print("registry OK")


def _backend():
    import fla  # noqa: F401
    from fla.backends import _operation_registries

    return _operation_registries["gated_delta_rule"]._backends["qla_compile"]


def check_verifier():
    """What the verifier accepts and declines, with FLA's layer options, and the switch that turns it off."""
    import os

    from qla_compile import dispatch

    backend = _backend()
    verify = lambda kw, **extra: backend.verify("chunk_gated_delta_rule", **kw, **extra)
    layer = make_inputs(T=70, H=2, HV=4, K=16, V=16, l2norm=True, gate_in_kernel=True, beta_sigmoid=True,
                        initial_state=True, state_v_first=True, cu_seqlens=[0, 30, 70], seed=1)
    ok, why = verify(layer)
    assert not ok and "qla_compile: our Hopper kernels do not take tensors on cpu" in why, why
    real = dispatch.choose
    dispatch.choose = lambda q, k, v: ("hopper", "simulated")
    try:
        assert verify(layer) == (True, None)
        assert verify(layer, output_final_state=True, chunk_size=32) == (True, None)
        assert verify(layer, cp_context=object())[1].startswith("qla_compile does not take FLA's inter-card")
        assert "['transpose_state_layout']" in verify(layer, transpose_state_layout=True)[1]
        assert not verify(layer, chunk_size=128)[0]
    finally:
        dispatch.choose = real
    assert backend.is_enabled()
    os.environ["FLA_QLA_COMPILE"] = "0"
    assert not backend.is_enabled()
    del os.environ["FLA_QLA_COMPILE"]
    print("verifier OK")


def check_fla_calls_our_op():
    """An accepted call of FLA's public op runs our op, with every option of FLA's layers (on the CPU our op takes
    its reference path, checked against the float64 oracle)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from torch.profiler import ProfilerActivity, profile

    backend = _backend()
    type(backend).chunk_gated_delta_rule_verifier = lambda self, *a, **kw: (True, None)  # as on an SM90 GPU
    kw = make_inputs(T=70, H=2, HV=4, K=16, V=16, l2norm=True, gate_in_kernel=True, beta_sigmoid=True,
                     initial_state=True, state_v_first=True, cu_seqlens=[0, 30, 70], seed=2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        o, state = chunk_gated_delta_rule(**kw, output_final_state=True)
    assert "qla::chunk_gdr_fwd" in {e.key for e in prof.key_averages()}
    o_ref, state_ref = qla_compile.recurrent_gdr_reference(**kw, output_final_state=True)
    assert rel_err(o, o_ref) < 1e-4 and rel_err(state, state_ref) < 1e-4
    print("fla_calls_our_op OK")


def check_routing():
    """With FLA installed, a CUDA call our kernels do not serve goes to FLA's op, not to the PyTorch reference."""
    import types

    from qla_compile import dispatch

    on_gpu = types.SimpleNamespace(device=torch.device("cuda"))
    dispatch._kernels = lambda: types.SimpleNamespace(unsupported=lambda q, k, v: "head dims K = 256, V = 512")
    impl, why = dispatch.choose(on_gpu, on_gpu, on_gpu)
    assert impl == "fla" and why.endswith("FLA's kernels run"), (impl, why)
    print("routing OK")


if __name__ == "__main__":
    {"op": check_op, "layer": check_layer, "registry": check_registry, "verifier": check_verifier,
     "fla_calls_our_op": check_fla_calls_our_op, "routing": check_routing, "leaves": check_leaves,
     "leaves_first_trace": check_leaves_first_trace}[sys.argv[1]]()
