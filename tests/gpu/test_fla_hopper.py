"""FLA on an H100/H200 with our backend registered (issue 19): FLA's public op and its ``GatedDeltaNet`` layer
run our op, eagerly, and agree with the float64 oracle (the op) or with an fp32 run of the layer as closely as
FLA's own kernels do; ``FLA_QLA_COMPILE=0`` gives the call back to FLA."""
import os

import pytest
import torch
from fla_checks import TorchGatedRMSNorm, _conv_standin
from gdn_inputs import make_inputs, rel_err
from torch.profiler import ProfilerActivity, profile

import qla_compile

pytestmark = pytest.mark.gpu
fla = pytest.importorskip("fla")

LEAVES = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


@pytest.fixture(autouse=True, scope="module")
def _one_config_per_fla_kernel():
    """FLA's Triton kernels each compiled for their first autotune config only: a full search compiles every config
    of every kernel on first use (over 200 s of a cold machine for the first test). These tests compare numerics,
    which the config changes by rounding at most. ``QLA_TEST_FLA_AUTOTUNE=1`` keeps FLA's search."""
    if os.environ.get("QLA_TEST_FLA_AUTOTUNE") == "1":
        yield
        return
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs  # FLA's own pruning first, then its first survivor
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Autotuner, "prune_configs", lambda self, *a, **k: prune(self, *a, **k)[:1])
        yield


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _ran_ours(fn):
    """``fn()``'s result, and whether our forward and backward ops ran in it."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = fn()
        torch.cuda.synchronize()
    keys = {e.key for e in prof.key_averages()}
    return result, {"qla::chunk_gdr_fwd", "qla::chunk_gdr_bwd"} <= keys


@pytest.mark.skipif(not _sm90(), reason="needs an SM90 GPU")
def test_fla_op_runs_ours_with_every_layer_option(monkeypatch):
    """FLA's op with what its layer passes (raw gates, beta sigmoid, negative eigenvalues, V-first states,
    varlen, initial and final state), bf16: our op runs forward and backward, and the outputs and gradients are
    as close to the float64 oracle as FLA's own kernels' (within 2x, or 2e-3)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    kw = make_inputs(T=600, H=2, HV=4, K=128, V=128, cu_seqlens=[0, 1, 250, 250, 600], initial_state=True,
                     l2norm=True, gate_in_kernel=True, beta_sigmoid=True, state_v_first=True,
                     dtype=torch.bfloat16, device="cuda", seed=0)
    kw["cu_seqlens"] = kw["cu_seqlens"].to(torch.int32)
    names = [n for n in LEAVES if n in kw]
    do = torch.randn(1, 600, 4, 128, device="cuda")
    dht = torch.randn(4, 4, 128, 128, device="cuda")

    def run(dtype=None, fn=chunk_gated_delta_rule):
        leaves = {n: (x if n not in names else (x if dtype is None else x.to(dtype)).detach().requires_grad_())
                  for n, x in kw.items()}
        o, ht = fn(**leaves, output_final_state=True)
        loss = (o.double() * do.double()).sum() + (ht.double() * dht.double()).sum()
        return [o, ht, *torch.autograd.grad(loss, [leaves[n] for n in names])]

    ours, ran = _ran_ours(run)
    assert ran
    monkeypatch.setenv("FLA_QLA_COMPILE", "0")
    theirs, ran = _ran_ours(run)
    assert not ran
    oracle = run(torch.float64, qla_compile.recurrent_gdr_reference)
    for name, a, b, ref in zip(["o", "final_state", *names], ours, theirs, oracle):
        assert rel_err(a, ref) <= max(2 * rel_err(b, ref), 2e-3), (name, rel_err(a, ref), rel_err(b, ref))


def _layer(dtype):
    from fla.layers import GatedDeltaNet

    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden_size=1024, head_dim=128, num_heads=4, num_v_heads=8, expand_v=1.0, mode="chunk")
    return layer.to(device="cuda", dtype=dtype)


def _float64_gdn(q, k, v, g, beta, **kwargs):
    """FLA's op as the float64 oracle, in the tensors' dtype (for the fp32 reference run of the layer: FLA's own
    kernels in fp32 would spend minutes autotuning)."""
    wide = {n: x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for n, x in kwargs.items()}
    o, ht = qla_compile.recurrent_gdr_reference(*(x.double() for x in (q, k, v, g, beta)), **wide)
    return o.to(q.dtype), None if ht is None else ht.float()


@pytest.mark.skipif(not _sm90(), reason="needs an SM90 GPU")
def test_fla_layer_trains_on_ours_as_closely_as_on_flas(monkeypatch):
    """FLA's ``GatedDeltaNet`` (K = V = 128, GVA), bf16, training mode: our op runs its GDN forward and backward;
    its output and gradients are as close to an fp32 run of the layer in torch (its GDN the float64 oracle, its
    short convolution and gated norm torch's: FLA's Triton kernels in fp32 would autotune for minutes) as with
    FLA's kernels (within 2x)."""
    x = torch.randn(2, 700, 1024, device="cuda")
    params = ("A_log", "dt_bias", "q_proj.weight", "a_proj.weight", "b_proj.weight", "v_proj.weight")

    def run(dtype, torch_norm=False):
        layer = _layer(dtype)
        if torch_norm:
            layer.o_norm = TorchGatedRMSNorm(layer.o_norm)
        xi = x.to(dtype).requires_grad_()
        out = layer(xi)[0]
        out.float().square().mean().backward()
        grads = dict(layer.named_parameters())
        return [out, xi.grad, *(grads[n].grad for n in params)]

    ours, ran = _ran_ours(lambda: run(torch.bfloat16))
    assert ran
    monkeypatch.setenv("FLA_QLA_COMPILE", "0")
    theirs, ran = _ran_ours(lambda: run(torch.bfloat16))
    assert not ran
    from fla.layers import gated_deltanet

    monkeypatch.setattr(gated_deltanet, "chunk_gated_delta_rule", _float64_gdn)
    monkeypatch.setattr(gated_deltanet, "causal_conv1d", _conv_standin)  # its fused q/k/v call, in torch
    ref = run(torch.float32, torch_norm=True)
    for name, a, b, r in zip(["out", "x.grad", *params], ours, theirs, ref):
        assert rel_err(a, r) <= max(2 * rel_err(b, r), 2e-3), (name, rel_err(a, r), rel_err(b, r))


@pytest.mark.skipif(not _sm90(), reason="needs an SM90 GPU")
def test_compiled_fla_layer_is_one_graph_with_flas_leaves():
    """FLA's ``GatedDeltaNet`` under ``qla_compile.backend`` with ``fullgraph=True``, without grad and in training:
    its short convolution and gated norm (``torch.compiler.disable``-d by FLA) run as our ``qla::fla_*`` ops inside
    the graph, on FLA's kernels, and the output and gradients equal the eager layer's (the same kernels eagerly)."""
    layer = _layer(torch.bfloat16)
    x = torch.randn(2, 700, 1024, device="cuda", dtype=torch.bfloat16)
    params = ("q_conv1d.weight", "v_conv1d.weight", "A_log", "q_proj.weight", "o_norm.weight", "o_proj.weight")

    def run(fn):
        layer.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_()
        out = fn(xi)[0]
        out.float().square().mean().backward()
        grads = dict(layer.named_parameters())
        return [out, xi.grad, *(grads[n].grad.clone() for n in params)]

    eager = run(layer)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=qla_compile.backend, fullgraph=True)  # no explicit registration
    with torch.no_grad():  # inference too (the first trace once broke at the conv: registered only after it)
        assert rel_err(compiled(x)[0], eager[0]) < 3e-2
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = run(compiled)
        torch.cuda.synchronize()
    keys = {e.key for e in prof.key_averages()}
    ours = {"qla::fla_causal_conv1d_fwd", "qla::fla_causal_conv1d_bwd", "qla::fla_layer_norm_gated_fwd",
            "qla::fla_layer_norm_gated_bwd", "qla::chunk_gdr_bwd"}
    assert ours <= keys, ours - keys
    for name, a, b in zip(["out", "x.grad", *params], got, eager):
        assert rel_err(a, b) < 3e-2, (name, rel_err(a, b))  # Inductor and our Triton passes round apart


def test_compiled_call_on_flas_kernels_runs_its_forward_once(monkeypatch):
    """A compiled training call our kernels do not take (K = V = 64) runs on FLA's kernels with FLA's forward
    once: its forward leaf's aux goes to its backward leaf (no recompute), and the outputs and gradients equal
    FLA's own op's, eagerly; without grad the forward leaf alone runs."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from qla_compile import dispatch

    kw = make_inputs(T=600, H=2, HV=4, K=64, V=64, cu_seqlens=[0, 250, 600], initial_state=True, l2norm=True,
                     gate_in_kernel=True, beta_sigmoid=True, dtype=torch.bfloat16, device="cuda", seed=6)
    kw["cu_seqlens"] = kw["cu_seqlens"].to(torch.int32)
    names = [n for n in LEAVES if n in kw]

    def run(fn):
        leaves = {n: (x.detach().requires_grad_() if n in names else x) for n, x in kw.items()}
        o, ht = fn(**leaves, output_final_state=True)
        (o.float().square().sum() + ht.float().sin().sum()).backward()
        return [o, ht, *(leaves[n].grad for n in names)]

    real = dispatch.fla_leaves()
    assert real is not None
    calls = []
    counted = tuple(lambda *a, _f=f, _d=d, **k: (calls.append(_d), _f(*a, **k))[1] for f, d in zip(real, "fb"))
    monkeypatch.setattr(dispatch, "fla_leaves", lambda: counted)
    theirs = run(chunk_gated_delta_rule)
    torch._dynamo.reset()
    compiled = torch.compile(qla_compile.chunk_gated_delta_rule, backend=qla_compile.backend, fullgraph=True)
    ours = run(compiled)
    assert calls == ["f", "b"], calls
    for name, a, b in zip(["o", "final_state", *names], ours, theirs):
        assert rel_err(a, b) < 2e-2, (name, rel_err(a, b))  # our graph's activations vs FLA's fused ones
    calls.clear()  # without grad: FLA's forward leaf alone, not its public op
    with torch.no_grad():
        ours = compiled(**kw, output_final_state=True)
    assert calls == ["f"], calls
    for name, a, b in zip(["o", "final_state"], ours, theirs):
        assert rel_err(a, b) < 2e-2, (name, rel_err(a, b))
