"""Fresh random GDN inputs for the tests, with a zero-decay head and a strong-decay head in every draw, and the
tests' measures: relative error, outputs with gradients, outputs of a replayed CUDA graph."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def make_inputs(
    B=1, T=64, H=2, HV=2, K=32, V=32, *, cu_seqlens=None, initial_state=False, l2norm=False,
    gate_in_kernel=False, beta_sigmoid=False, state_v_first=False, dtype=torch.float32, device="cpu",
    seed=None,
):
    """Keyword arguments for ``chunk_gated_delta_rule`` (q, k, v, g, beta, plus the requested options).

    Without ``l2norm`` the keys are unit-norm and the queries ~N(0, 1/K): the regime real models run in.
    Log gates ``-a * softplus(0.5 x + 1)``: head 0 has no decay (a = 0), the last head a = 16 (strong decay).
    """
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = randn(B, T, H, K), randn(B, T, H, K)
    if not l2norm:
        q, k = q * K**-0.5, F.normalize(k, dim=-1)
    kwargs = dict(q=q, k=k, v=randn(B, T, HV, V))
    if gate_in_kernel:
        kwargs["g"] = randn(B, T, HV)
        A_log = randn(HV)
        A_log[0], A_log[-1] = -30.0, math.log(16.0)  # ~no decay, and strong decay
        kwargs.update(use_gate_in_kernel=True, A_log=A_log, dt_bias=randn(HV))
    else:
        strength = 16 * torch.linspace(0.0, 1.0, HV) ** 4 if HV > 1 else torch.ones(1)
        kwargs["g"] = -strength * F.softplus(0.5 * randn(B, T, HV) + 1)
    if beta_sigmoid:
        kwargs.update(beta=randn(B, T, HV), use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    else:
        kwargs["beta"] = torch.rand(B, T, HV, generator=gen)
    if cu_seqlens is not None:
        kwargs["cu_seqlens"] = torch.tensor(cu_seqlens, dtype=torch.int64)
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    if initial_state:
        shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        kwargs["initial_state"] = randn(*shape)
    kwargs.update(use_qk_l2norm_in_kernel=l2norm, state_v_first=state_v_first)
    for name in ("q", "k", "v"):
        kwargs[name] = kwargs[name].to(dtype)
    return {n: (x.to(device) if isinstance(x, torch.Tensor) else x) for n, x in kwargs.items()}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error ||x - ref|| / ||ref|| in float64."""
    ref = ref.double()
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def outputs_and_grads(fn, args, differentiable=True):
    """Outputs of ``fn(*args)`` (a tensor or a tuple) and the gradients by each argument of a fixed random
    projection of all outputs (zero for an unused argument; none at all unless ``differentiable``)."""
    leaves = [a.detach().requires_grad_(differentiable) for a in args]
    with torch.set_grad_enabled(differentiable):
        out = fn(*leaves)
    outs = list(out) if isinstance(out, tuple) else [out]
    if not differentiable:
        return outs, []
    gen = torch.Generator().manual_seed(0)
    loss = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)).sum()
               for o in outs)
    return [o.detach() for o in outs], torch.autograd.grad(loss, leaves, materialize_grads=True)


def replayed(fn):
    """The outputs of ``fn`` captured in a CUDA graph, after one replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    graph.replay()
    torch.cuda.synchronize()
    return outputs
