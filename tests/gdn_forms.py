"""A collection of eager Gated DeltaNet forms, each written independently, and look-alikes that are not GDN.

Every GDN form computes, per token (FLA's convention, see ``qla_compile.reference``)::

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = scale * S_t^T q_t

but each writes it differently: chunked WY/UT forms (chunk sizes 16/32/64; the triangular inverse by
``solve_triangular``, ``inv``, a forward-substitution loop or a Neumann series; the gate's cumulative sum by
``cumsum`` or by a triangular matmul) and token-by-token recurrences (GVA by ``repeat_interleave``, ``expand`` or
indexing; state ``[K, V]`` or ``[V, K]``; batch and heads apart or flattened), in fp32, fp16 or bf16, token- or
head-major, with or without L2 norm, scale, initial and final state.  ``tests/test_passes_forms.py`` checks each
against the float64 oracle, so a form that is itself wrong fails there.

The look-alikes share the GDN's shapes and much of its structure (chunk decay masks, a decayed state carried
token to token) but compute something else: the FX pass must leave them alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Form:
    """A GDN form and how to call it: ``fn(q, k, v, g, beta[, initial_state])`` -> ``o`` or ``(o, final_state)``."""

    fn: object
    T: int
    H: int = 2
    HV: int = 2
    head_major: bool = False        # inputs and output [B, H, T, D] (g, beta [B, H, T]) instead of [B, T, H, D]
    l2norm: bool = False            # q and k are L2-normalised inside
    scale: float | None = None      # None: K ** -0.5
    initial_state: bool = False     # takes a [B, HV, K, V] initial state
    final_state: bool = False       # returns (o, final_state [B, HV, K, V])
    dtype: torch.dtype = torch.float32
    differentiable: bool = True     # False: in-place updates of tensors autograd saved (inference code)


@dataclass(frozen=True)
class LookAlike:
    """Not a GDN: ``fn(q, k, v, g, beta)`` on token-major inputs; ``key_gate``: g is ``[B, T, H, K]``."""

    fn: object
    T: int
    HV: int = 2                     # v heads (q and k have 2)
    key_gate: bool = False


def _l2(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


# ------------------------------------------------------------------------------------------------------------
# Chunked forms
# ------------------------------------------------------------------------------------------------------------


def chunk_solve_c64(q, k, v, g, beta, initial_state):
    """Token-major in and out, matmul, C = 64 with padding, GVA by ``repeat_interleave``, L2 norm, initial and
    final state; u and w solved for directly with ``solve_triangular`` against the gated UT matrix."""
    C = 64
    B, T, H, K = q.shape
    HV = v.shape[2]
    q, k = (F.normalize(x, dim=-1, eps=1e-6).repeat_interleave(HV // H, dim=2) for x in (q, k))
    q = q * K ** -0.5
    pad = (-T) % C

    def blocks(x):  # [B, T, HV, D] -> [B, HV, N, C, D]
        x = F.pad(x.transpose(1, 2), (0, 0, 0, pad))
        return x.reshape(B, HV, -1, C, x.shape[-1])

    q, k, v = blocks(q), blocks(k), blocks(v)
    g, beta = (F.pad(x.transpose(1, 2), (0, pad)).reshape(B, HV, -1, C) for x in (g, beta))
    G = g.cumsum(-1)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb = k * beta[..., None]
    unit_lower = torch.eye(C, device=q.device) + (kb @ k.transpose(-1, -2) * decay).tril(-1)
    u = torch.linalg.solve_triangular(unit_lower, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(unit_lower, kb * G.exp()[..., None], upper=False, unitriangular=True)
    S = initial_state
    outs = []
    for n in range(q.shape[2]):
        qn, kn, Gn = q[:, :, n], k[:, :, n], G[:, :, n]
        v_new = u[:, :, n] - w[:, :, n] @ S
        outs.append((qn * Gn[..., None].exp()) @ S + (qn @ kn.transpose(-1, -2) * decay[:, :, n]) @ v_new)
        last = Gn[..., -1:]
        S = S * last[..., None].exp() + (kn * (last - Gn).exp()[..., None]).transpose(-1, -2) @ v_new
    return torch.cat(outs, dim=2)[:, :, :T].transpose(1, 2), S


def chunk_inverse_head_major_c32(q, k, v, g, beta):
    """Head-major in and out, einsum, C = 32, GVA by ``expand``, a custom scale (0.25) and a final state; the
    gate-free inverse ``inv(I + strict_lower(beta k k^T))`` times the decay mask is the gated one."""
    C = 32
    B, H, T, K = q.shape
    HV = v.shape[1]
    q, k = (x[:, :, None].expand(B, H, HV // H, T, K).reshape(B, HV, T, K) for x in (q, k))
    n = T // C
    q, k, v = (x.reshape(B, HV, n, C, x.shape[-1]) for x in (0.25 * q, k, v))
    g, beta = g.reshape(B, HV, n, C), beta.reshape(B, HV, n, C)
    G = torch.cumsum(g, dim=-1)
    decay = torch.tril(torch.exp(torch.tril(G.unsqueeze(-1) - G.unsqueeze(-2))))
    strict = torch.einsum("bhnc,bhncd,bhnsd->bhncs", beta, k, k).tril(-1)
    gated_inverse = torch.linalg.inv(torch.eye(C, dtype=q.dtype, device=q.device) + strict) * decay
    u = torch.einsum("bhncs,bhns,bhnsd->bhncd", gated_inverse, beta, v)
    w = torch.einsum("bhncs,bhns,bhnsd->bhncd", gated_inverse, beta * G.exp(), k)
    S = q.new_zeros(B, HV, K, v.shape[-1])
    outs = []
    for i in range(n):
        Gi = G[:, :, i]
        v_new = u[:, :, i] - torch.einsum("bhck,bhkv->bhcv", w[:, :, i], S)
        scores = torch.einsum("bhck,bhsk->bhcs", q[:, :, i], k[:, :, i]) * decay[:, :, i]
        outs.append(torch.einsum("bhck,bhkv->bhcv", q[:, :, i] * Gi.exp()[..., None], S)
                    + torch.einsum("bhcs,bhsv->bhcv", scores, v_new))
        tail = (Gi[..., -1:] - Gi).exp()
        S = torch.einsum("bh,bhkv->bhkv", Gi[..., -1].exp(), S) + torch.einsum("bhck,bhc,bhcv->bhkv", k[:, :, i],
                                                                                tail, v_new)
    return torch.stack(outs, 2).reshape(B, HV, T, -1), S


def chunk_forward_substitution_c16(q, k, v, g, beta, initial_state):
    """Token-major, C = 16, GVA by ``repeat_interleave``, rsqrt L2 norm, initial state; (I + A)^-1 row by row
    (forward substitution), the output written chunk by chunk into ``empty_like(v)``."""
    C = 16
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    q, k = (_l2(x).repeat_interleave(HV // H, 2).transpose(1, 2) for x in (q, k))
    q = q / K ** 0.5
    vh, gh, bh = v.transpose(1, 2), g.transpose(1, 2), beta.transpose(1, 2)
    eye = torch.eye(C, device=q.device)
    S = initial_state.clone()
    o = torch.empty_like(v)
    for s in range(0, T, C):
        qc, kc, vc = q[:, :, s:s + C], k[:, :, s:s + C], vh[:, :, s:s + C]
        Gc, bc = gh[:, :, s:s + C].cumsum(-1), bh[:, :, s:s + C]
        mask = eye.cumsum(0).bool()  # lower triangle, diagonal included
        decay = torch.where(mask, (Gc[..., :, None] - Gc[..., None, :]).clamp(max=0).exp(), 0.0)
        A = torch.where(mask.logical_not().T, bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * decay, 0.0)
        inv = eye[:1].expand(*A.shape[:-2], 1, C)
        for i in range(1, C):  # row i of (I + A)^-1 is e_i - sum_{j < i} A_ij (row j)
            inv = torch.cat([inv, eye[i] - A[..., i:i + 1, :i] @ inv], dim=-2)
        v_new = inv @ (bc[..., None] * vc) - inv @ (bc[..., None] * Gc.exp()[..., None] * kc) @ S
        o[:, s:s + C] = ((qc * Gc.exp()[..., None]) @ S + (qc @ kc.transpose(-1, -2) * decay) @ v_new).transpose(1, 2)
        S = Gc[..., -1, None, None].exp() * S + ((Gc[..., -1:] - Gc).exp()[..., None] * kc).transpose(-1, -2) @ v_new
    return o


def chunk_neumann_bf16_c16(q, k, v, g, beta):
    """bf16 in and out, fp32 inside, token-major chunks ``[B, N, C, H, D]`` with einsum, C = 16 with padding, a
    final state; (I + A)^-1 as the finite Neumann series sum_i (-A)^i (A is nilpotent)."""
    C = 16
    B, T, H, K = q.shape
    out_dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    pad = (-T) % C
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).reshape(B, -1, C, H, x.shape[-1]) for x in (q * K ** -0.5, k, v))
    g, beta = (F.pad(x, (0, 0, 0, pad)).reshape(B, -1, C, H) for x in (g, beta))
    G = g.cumsum(2)
    lower = torch.tril(torch.ones(C, C, device=q.device))
    decay = torch.exp((G[:, :, :, None] - G[:, :, None, :]).permute(0, 1, 4, 2, 3) * lower) * lower  # [B,N,H,C,C]
    A = torch.einsum("bnch,bnchd,bnshd,bnhcs->bnhcs", beta, k, k, decay).tril(-1)
    power = -A
    inverse = torch.eye(C, device=q.device) + power
    for _ in range(C - 2):
        power = power @ -A
        inverse = inverse + power
    u = torch.einsum("bnhcs,bnsh,bnshv->bnchv", inverse, beta, v)
    w = torch.einsum("bnhcs,bnsh,bnshk->bnchk", inverse, beta * G.exp(), k)
    S = q.new_zeros(B, H, K, v.shape[-1])
    outs = []
    for n in range(q.shape[1]):
        v_new = u[:, n] - torch.einsum("bchk,bhkv->bchv", w[:, n], S)
        o = torch.einsum("bchk,bch,bhkv->bchv", q[:, n], G[:, n].exp(), S)
        o = o + torch.einsum("bchk,bshk,bhcs,bshv->bchv", q[:, n], k[:, n], decay[:, n], v_new)
        outs.append(o)
        last = G[:, n, -1]
        S = last.exp()[..., None, None] * S + torch.einsum("bchk,bch,bchv->bhkv", k[:, n],
                                                           (last[:, None] - G[:, n]).exp(), v_new)
    return torch.cat(outs, 1)[:, :T].to(out_dtype), S


def chunk_matmul_cumsum_c32(q, k, v, g, beta):
    """Token-major, C = 32, no ``cumsum``: the in-chunk gate sums by a lower-triangular matmul; x / ||x|| L2 norm;
    the gate-free inverse by ``solve_triangular`` against the identity, then gated by the decay mask."""
    C = 32
    B, T, H, K = q.shape
    n = T // C
    q, k = (x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6) for x in (q, k))
    q = q * K ** -0.5
    q, k, v = (x.transpose(1, 2).reshape(B, H, n, C, -1) for x in (q, k, v))
    g, beta = (x.transpose(1, 2).reshape(B, H, n, C) for x in (g, beta))
    lower = torch.ones(C, C, device=q.device).tril()
    G = g @ lower.T  # G[..., i] = sum_{j <= i} g[..., j]
    decay = torch.where(lower == 1, G[..., :, None] - G[..., None, :], float("-inf")).exp()
    eye = torch.eye(C, device=q.device)
    gate_free = torch.linalg.solve_triangular(eye + (beta[..., None] * (k @ k.mT)).tril(-1), eye.expand(B, H, n, C, C),
                                              upper=False, unitriangular=True)
    A = gate_free * decay * beta[..., None, :]
    u, w = A @ v, A @ (k * G.exp()[..., None])
    S = torch.zeros(B, H, K, v.shape[-1], device=q.device)
    outs = []
    for i in range(n):
        qi, ki, Gi = q[:, :, i], k[:, :, i], G[:, :, i]
        v_new = u[:, :, i] - w[:, :, i] @ S
        outs.append(Gi[..., None].exp() * (qi @ S) + (decay[:, :, i] * (qi @ ki.mT)) @ v_new)
        S = Gi[..., -1, None, None].exp() * S + ki.mT @ ((Gi[..., -1:] - Gi).exp()[..., None] * v_new)
    return torch.stack(outs, 2).flatten(2, 3).transpose(1, 2)


def chunk_built_constants_c16(q, k, v, g, beta):
    """Token-major, C = 16, every constant built from the inputs' sizes, device and dtype: the scale as
    ``torch.tensor(K).rsqrt()``, padding by ``cat`` with ``new_zeros``/``zeros``, masks from ``arange`` and
    ``full(-inf).triu(1)``, the identity by ``eye``; (I + A)^-1 by ``solve_triangular``."""
    C = 16
    B, T, H, K = q.shape
    q = q * torch.tensor(K, dtype=q.dtype, device=q.device).rsqrt()
    pad = (-T) % C
    q, k, v = (torch.cat([x, x.new_zeros(B, pad, H, x.shape[-1])], 1).transpose(1, 2).reshape(B, H, -1, C, x.shape[-1])
               for x in (q, k, v))
    g, beta = (torch.cat([x, torch.zeros(B, pad, H, dtype=x.dtype, device=x.device)], 1).transpose(1, 2)
               .reshape(B, H, -1, C) for x in (g, beta))
    G = g.cumsum(-1)
    idx = torch.arange(C, device=q.device)
    decay = (G[..., :, None] - G[..., None, :] + torch.full((C, C), float("-inf"), device=q.device).triu(1)).exp()
    A = beta[..., None] * (k @ k.transpose(-1, -2)) * decay * (idx[:, None] > idx[None, :])
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    inverse = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    u, w = inverse @ (beta[..., None] * v), inverse @ ((beta * G.exp())[..., None] * k)
    S = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float32, device=q.device)
    outs = []
    for n in range(q.shape[2]):
        qn, kn, Gn = q[:, :, n], k[:, :, n], G[:, :, n]
        v_new = u[:, :, n] - w[:, :, n] @ S
        outs.append((qn * Gn[..., None].exp()) @ S + (qn @ kn.transpose(-1, -2) * decay[:, :, n]) @ v_new)
        S = S * Gn[..., -1, None, None].exp() + (kn * (Gn[..., -1:] - Gn).exp()[..., None]).transpose(-1, -2) @ v_new
    return torch.cat(outs, 2)[:, :, :T].transpose(1, 2)


# ------------------------------------------------------------------------------------------------------------
# Token-by-token recurrences
# ------------------------------------------------------------------------------------------------------------


def recurrent_repeat_interleave(q, k, v, g, beta):
    """Token-major, matmul, GVA by ``repeat_interleave``, ``F.normalize`` L2 norm, the scale folded into q."""
    G = v.shape[2] // q.shape[2]
    q = F.normalize(q, dim=-1) * q.shape[-1] ** -0.5
    k = F.normalize(k, dim=-1)
    q, k = q.repeat_interleave(G, 2), k.repeat_interleave(G, 2)
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        kt = k[:, t]
        delta = beta[:, t, :, None] * (v[:, t] - (kt[..., None, :] @ S).squeeze(-2))
        S = S + kt[..., :, None] * delta[..., None, :]
        outs.append((q[:, t, :, None, :] @ S).squeeze(-2))
    return torch.stack(outs, 1)


def recurrent_expand_head_major(q, k, v, g, beta, initial_state):
    """Head-major, einsum, GVA by ``expand``, initial and final state, the output written token by token into a
    preallocated buffer that is returned as it is."""
    B, H, T, K = q.shape
    HV = v.shape[1]
    q, k = (x.unsqueeze(2).expand(B, H, HV // H, T, K).reshape(B, HV, T, K) for x in (q, k))
    S = initial_state
    o = v.new_zeros(v.shape)
    for t in range(T):
        kt = k[:, :, t]
        S = torch.exp(g[:, :, t]).view(B, HV, 1, 1) * S
        err = v[:, :, t] - torch.einsum("bhk,bhkv->bhv", kt, S)
        S = S + torch.einsum("bhk,bh,bhv->bhkv", kt, beta[:, :, t], err)
        o[:, :, t] = torch.einsum("bhk,bhkv->bhv", q[:, :, t], S) * K ** -0.5
    return o, S


def recurrent_indexed_heads_vk_state(q, k, v, g, beta):
    """Token-major, GVA by indexing the heads, the state kept ``[V, K]`` (returned ``[K, V]``), the decay
    ``exp(g)`` computed once, tokens taken by ``unbind``, the scale applied to the output."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    heads = torch.arange(HV, device=q.device) // (HV // H)
    q, k = q[:, :, heads], k[:, :, heads]
    alpha = g.exp()
    S = torch.zeros(B, HV, V, K, dtype=q.dtype, device=q.device)
    outs = []
    for qt, kt, vt, at, bt in zip(q.unbind(1), k.unbind(1), v.unbind(1), alpha.unbind(1), beta.unbind(1)):
        S = at[:, :, None, None] * S
        S = S + (bt[..., None] * (vt - (S @ kt[..., None])[..., 0]))[..., None] * kt[:, :, None, :]
        outs.append((S @ qt[..., None])[..., 0] * K ** -0.5)
    return torch.stack(outs, dim=1), S.transpose(-1, -2)


def recurrent_fp16_inplace(q, k, v, g, beta, initial_state):
    """fp16 throughout (no fp32 inside), token-major, the state updated in place (``mul_``/``add_``) on a copy of
    the initial state, the scale folded into q: inference code (autograd cannot differentiate the writes)."""
    T = q.shape[1]
    q = q * q.shape[-1] ** -0.5
    S = initial_state.to(q.dtype).clone()
    outs = []
    for t in range(T):
        S.mul_(g[:, t, :, None, None].exp())
        kt = k[:, t]
        residual = v[:, t] - torch.einsum("bhk,bhkv->bhv", kt, S)
        S.add_(kt.unsqueeze(-1) * (beta[:, t, :, None] * residual).unsqueeze(-2))
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(outs, 1)


def recurrent_bmm_flat_heads(q, k, v, g, beta):
    """Batch and heads flattened into one ``[B*H]`` axis, ``bmm``, x / ||x|| L2 norm, a final state."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k = (x / torch.linalg.vector_norm(x, dim=-1, keepdim=True) for x in (q, k))
    q, k, v = (x.transpose(1, 2).reshape(B * H, T, x.shape[-1]) for x in (q * K ** -0.5, k, v))
    g, beta = (x.transpose(1, 2).reshape(B * H, T) for x in (g, beta))
    S = q.new_zeros(B * H, K, V)
    outs = []
    for t in range(T):
        kt = k[:, t:t + 1]  # [BH, 1, K]
        S = g[:, t].exp()[:, None, None] * S
        S = S + torch.bmm(kt.transpose(1, 2), beta[:, t, None, None] * (v[:, t:t + 1] - torch.bmm(kt, S)))
        outs.append(torch.bmm(q[:, t:t + 1], S))
    o = torch.cat(outs, 1).reshape(B, H, T, V).transpose(1, 2)
    return o, S.reshape(B, H, K, V)


FORMS = {
    "chunk_solve_c64": Form(chunk_solve_c64, T=80, HV=4, l2norm=True, initial_state=True, final_state=True),
    "chunk_inverse_head_major_c32": Form(chunk_inverse_head_major_c32, T=64, HV=4, head_major=True, scale=0.25,
                                         final_state=True),
    "chunk_forward_substitution_c16": Form(chunk_forward_substitution_c16, T=48, HV=4, l2norm=True,
                                           initial_state=True),
    "chunk_neumann_bf16_c16": Form(chunk_neumann_bf16_c16, T=40, final_state=True, dtype=torch.bfloat16),
    "chunk_matmul_cumsum_c32": Form(chunk_matmul_cumsum_c32, T=96, l2norm=True),
    "chunk_built_constants_c16": Form(chunk_built_constants_c16, T=40),
    "recurrent_repeat_interleave": Form(recurrent_repeat_interleave, T=16, HV=4, l2norm=True),
    "recurrent_expand_head_major": Form(recurrent_expand_head_major, T=12, HV=4, head_major=True,
                                        initial_state=True, final_state=True),
    "recurrent_indexed_heads_vk_state": Form(recurrent_indexed_heads_vk_state, T=12, HV=4, final_state=True),
    "recurrent_fp16_inplace": Form(recurrent_fp16_inplace, T=12, initial_state=True, dtype=torch.float16,
                                   differentiable=False),
    "recurrent_bmm_flat_heads": Form(recurrent_bmm_flat_heads, T=16, l2norm=True, final_state=True),
}


# ------------------------------------------------------------------------------------------------------------
# Look-alikes
# ------------------------------------------------------------------------------------------------------------


def gla_key_gate(q, k, v, g, beta):
    """Gated linear attention with a per-key-channel gate ``g [B, T, H, K]``, no delta rule."""
    S = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    outs = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * (beta[:, t, :, None] * v[:, t])[..., None, :]
        outs.append((q[:, t, :, None] @ S)[..., 0, :])
    return torch.stack(outs, 1)


def delta_rule_key_gate(q, k, v, g, beta):
    """The delta rule with a per-key-channel gate ``diag(exp(g_t)) S`` (as in Kimi's KDA), not a scalar one."""
    S = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    outs = []
    for t in range(q.shape[1]):
        kt = k[:, t]
        S = g[:, t].exp()[..., None] * S
        S = S + kt[..., None] * (beta[:, t, :, None] * (v[:, t] - (kt[..., None, :] @ S)[..., 0, :]))[..., None, :]
        outs.append((q[:, t, :, None] @ S)[..., 0, :])
    return torch.stack(outs, 1)


def delta_rule_decay_after_update(q, k, v, g, beta):
    """The scalar gate applied after the delta update, ``S_t = exp(g_t) (S + beta k (v - S^T k)^T)``: the GDN of
    ``exp(g_t) v_t``, not of ``v_t``."""
    S = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    outs = []
    for t in range(q.shape[1]):
        kt = k[:, t]
        S = S + kt[..., None] * (beta[:, t, :, None] * (v[:, t] - (kt[..., None, :] @ S)[..., 0, :]))[..., None, :]
        S = S * g[:, t].exp()[..., None, None]
        outs.append((q[:, t, :, None] @ S)[..., 0, :])
    return torch.stack(outs, 1)


def gdn_read_before_update(q, k, v, g, beta):
    """A GDN recurrence whose output reads the decayed state before the token's own delta update."""
    S = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    outs = []
    for t in range(q.shape[1]):
        kt = k[:, t]
        S = S * g[:, t].exp()[..., None, None]
        outs.append((q[:, t, :, None] @ S)[..., 0, :])
        S = S + kt[..., None] * (beta[:, t, :, None] * (v[:, t] - (kt[..., None, :] @ S)[..., 0, :]))[..., None, :]
    return torch.stack(outs, 1)


def gdn_tiled_heads(q, k, v, g, beta):
    """A GDN recurrence whose GVA maps v-head h to qk-head h % H (``repeat``), not h // (HV / H): not our op's."""
    q, k = (x.repeat(1, 1, v.shape[2] // x.shape[2], 1) for x in (q, k))
    S = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    outs = []
    for t in range(q.shape[1]):
        kt = k[:, t]
        S = S * g[:, t].exp()[..., None, None]
        S = S + kt[..., None] * (beta[:, t, :, None] * (v[:, t] - (kt[..., None, :] @ S)[..., 0, :]))[..., None, :]
        outs.append((q[:, t, :, None] @ S)[..., 0, :])
    return torch.stack(outs, 1)


def retention_scalar_gate(q, k, v, g, beta):
    """Linear attention with a scalar decay (RetNet, Mamba2's recurrent form): ``S_t = exp(g_t) S + k (beta v)^T``."""
    S = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    outs = []
    for t in range(q.shape[1]):
        S = g[:, t, :, None, None].exp() * S + k[:, t, :, :, None] * (beta[:, t, :, None] * v[:, t])[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(outs, 1)


def ssd_chunked(q, k, v, g, beta):
    """Mamba2's chunked SSD scan (C = 16): q as C, k as B, v as x, g as dt * A, beta as dt; a segment-sum decay
    mask from a ``cumsum`` and the chunk states carried with their decay."""
    C = 16
    B, T, H, N = q.shape
    n = T // C
    Cm, Bm, x = (y.reshape(B, n, C, H, y.shape[-1]) for y in (q, k, v * beta[..., None]))
    a = g.reshape(B, n, C, H).permute(0, 3, 1, 2)  # [B, H, n, C]
    seg = a[..., None].expand(B, H, n, C, C).masked_fill(~torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1), 0).cumsum(-2)
    L = seg.masked_fill(~torch.ones(C, C, dtype=torch.bool, device=q.device).tril(), float("-inf")).exp()
    y_diag = torch.einsum("bnlhd,bnshd,bhnls,bnshp->bnlhp", Cm, Bm, L, x)
    A_cum = a.cumsum(-1)
    states = torch.einsum("bnshd,bhns,bnshp->bnhdp", Bm, (A_cum[..., -1:] - A_cum).exp(), x)
    S = q.new_zeros(B, H, N, x.shape[-1])
    carried = []
    for i in range(n):
        carried.append(S)
        S = A_cum[:, :, i, -1, None, None].exp() * S + states[:, i]
    y_off = torch.einsum("bnlhd,bnhdp,bhnl->bnlhp", Cm, torch.stack(carried, 1), A_cum.exp())
    return (y_diag + y_off).reshape(B, T, H, -1)


def softmax_attention_with_decay(q, k, v, g, beta):
    """Causal softmax attention with an additive decay bias ``G_i - G_j`` (a forgetting transformer), by hand."""
    G = g.transpose(1, 2).cumsum(-1)
    T = q.shape[1]
    scores = torch.einsum("bthk,bshk->bhts", q, k) * q.shape[-1] ** -0.5 + (G[..., :, None] - G[..., None, :])
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    p = (scores - scores.amax(-1, keepdim=True)).exp()
    return torch.einsum("bhts,bshv->bthv", p / p.sum(-1, keepdim=True), v * beta[..., None])


def linear_attention(q, k, v, g, beta):
    """Causal linear attention without decay or delta rule."""
    scores = torch.einsum("bthk,bshk->bhts", q, k).tril()
    return torch.einsum("bhts,bshv->bthv", scores, v * beta[..., None])


LOOK_ALIKES = {
    "gla_key_gate": LookAlike(gla_key_gate, T=12, key_gate=True),
    "delta_rule_key_gate": LookAlike(delta_rule_key_gate, T=12, key_gate=True),
    "delta_rule_decay_after_update": LookAlike(delta_rule_decay_after_update, T=12),
    "gdn_read_before_update": LookAlike(gdn_read_before_update, T=12),
    "gdn_tiled_heads": LookAlike(gdn_tiled_heads, T=12, HV=4),
    "retention_scalar_gate": LookAlike(retention_scalar_gate, T=12),
    "ssd_chunked": LookAlike(ssd_chunked, T=32),
    "softmax_attention_with_decay": LookAlike(softmax_attention_with_decay, T=24),
    "linear_attention": LookAlike(linear_attention, T=24),
}
