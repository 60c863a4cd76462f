"""The FX pass on CUDA tensors: GDN forms no library writes, proven on the GPU (random inputs on the graph's own
device) and fused into our op, with outputs and gradients as close to the float64 oracle as eager's (K = V = 128,
and the whole ``gdn_forms`` collection); its look-alikes left alone."""
import pytest
import torch
import torch.nn.functional as F

import qla_compile as qb
from gdn_forms import FORMS, LOOK_ALIKES, recurrent_indexed_heads_vk_state
from gdn_inputs import make_inputs, outputs_and_grads, rel_err
from pass_checks import check_form_fused, check_look_alike_left_alone
from qla_compile import dispatch, recurrent_gdr_reference
from qla_compile.passes.fuse import PASS_BUDGET_SECONDS

pytestmark = pytest.mark.gpu


def chunk_c64_head_major_bf16(q, k, v, g, beta, initial_state):
    """Head-major, bf16 in and out, fp32 inside, C = 64 (T a multiple of it), GVA by ``repeat_interleave`` on the
    head axis, L2 norm, initial and final state; the gated UT inverse by ``solve_triangular`` against the
    identity."""
    C = 64
    B, H, T, K = q.shape
    HV, out_dtype = v.shape[1], v.dtype
    q, k = (F.normalize(x.float(), dim=-1, eps=1e-6).repeat_interleave(HV // H, dim=1) for x in (q, k))
    n = T // C
    q, k, v = (x.reshape(B, HV, n, C, x.shape[-1]) for x in (q * K ** -0.5, k, v.float()))
    G, beta = g.float().reshape(B, HV, n, C).cumsum(-1), beta.float().reshape(B, HV, n, C)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(causal, G[..., :, None] - G[..., None, :], float("-inf")).exp()
    eye = torch.eye(C, device=q.device)
    lower = eye + (beta[..., None] * (k @ k.mT) * decay).tril(-1)
    inverse = torch.linalg.solve_triangular(lower, eye.expand_as(lower), upper=False, unitriangular=True)
    u = inverse @ (beta[..., None] * v)
    w = inverse @ ((beta * G.exp())[..., None] * k)
    S = initial_state.float()
    outs = []
    for i in range(n):
        Gi = G[:, :, i]
        v_new = u[:, :, i] - w[:, :, i] @ S
        outs.append((q[:, :, i] * Gi[..., None].exp()) @ S + (q[:, :, i] @ k[:, :, i].mT * decay[:, :, i]) @ v_new)
        S = Gi[..., -1, None, None].exp() * S + (k[:, :, i] * (Gi[..., -1:] - Gi).exp()[..., None]).mT @ v_new
    return torch.cat(outs, 2).to(out_dtype), S


CASES = {
    # name: (form, head-major, T, dtype, initial state, l2norm, floor on the relative error vs float64)
    "chunk_c64_head_major_bf16": (chunk_c64_head_major_bf16, True, 256, torch.bfloat16, True, True, 2e-2),
    # fp32 on a GPU: our op runs the reference (our kernels take bf16/fp16; FLA's route is test_fla_hopper's, and
    # its fp32 autotune would take minutes here)
    "recurrent_indexed_heads_fp32": (recurrent_indexed_heads_vk_state, False, 32, torch.float32, False, False, 5e-3),
}


@pytest.fixture
def reference_on_cuda(monkeypatch):
    """Our op's non-Hopper CUDA calls run the reference, not FLA's kernels (the collection's K = 16 is not our
    kernels'; FLA's fp32 Triton autotune would take minutes here): what is checked is the pass, proving on CUDA
    tensors."""
    monkeypatch.setattr(dispatch, "fla_op", lambda: None)


@pytest.mark.parametrize("name", CASES)
def test_unseen_form_is_proven_and_fused_on_cuda(name, reference_on_cuda):
    fn, head_major, T, dtype, h0, l2norm, floor = CASES[name]
    kw = make_inputs(B=2, T=T, H=2, HV=4, K=128, V=128, initial_state=h0, l2norm=l2norm, dtype=dtype,
                     device="cuda", seed=3)
    tokens = [kw[n] for n in ("q", "k", "v", "g", "beta")] + ([kw["initial_state"]] if h0 else [])
    args = [x.transpose(1, 2).contiguous() if head_major and i < 5 else x for i, x in enumerate(tokens)]

    def oracle(q, k, v, g, beta, *state):
        q, k, v, g, beta = (x.transpose(1, 2) if head_major else x for x in (q, k, v, g, beta))
        o, st = recurrent_gdr_reference(q, k, v, g, beta, initial_state=state[0] if state else None,
                                        output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
        return (o.transpose(1, 2) if head_major else o), st

    want, want_grads = outputs_and_grads(oracle, [x.double() for x in args])
    eager, eager_grads = outputs_and_grads(fn, args)
    torch._dynamo.reset()
    backend = qb.make_backend(inductor=False)
    ran_before = dispatch.choices()
    got, got_grads = outputs_and_grads(torch.compile(fn, backend=backend, fullgraph=True), args)
    (report,) = backend.reports
    assert [r.status for r in report.regions] == ["replaced"] and report.nodes_after < 20, report.summary()
    assert report.pass_seconds <= PASS_BUDGET_SECONDS, report.summary()
    ran = dispatch.choices() - ran_before
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability() == (9, 0):
        assert {impl for impl, _ in ran} == {"hopper"}, ran
    elif dtype == torch.float32:
        assert {impl for impl, _ in ran} == {"reference"}, ran
    for x, e, w in (*zip(got, eager, want), *zip(got_grads, eager_grads, want_grads)):
        assert x.device.type == "cuda" and torch.isfinite(x).all()
        assert rel_err(x, w) <= max(2 * rel_err(e, w), floor), (rel_err(x, w), rel_err(e, w))


@pytest.mark.parametrize("name", FORMS)
def test_collection_form_is_fused_on_cuda(name, reference_on_cuda):
    check_form_fused(name, "cuda")


@pytest.mark.parametrize("name", LOOK_ALIKES)
def test_collection_look_alike_is_left_alone_on_cuda(name, reference_on_cuda):
    check_look_alike_left_alone(name, "cuda")
