"""Pure-PyTorch Gated DeltaNet: a float64 per-token oracle and a chunked (C = 64) implementation.

Conventions are FLA's (``fla.ops.gated_delta_rule.chunk_gated_delta_rule``): q, k ``[B,T,H_qk,K]``,
v ``[B,T,H_v,V]``, g and beta ``[B,T,H_v]``, value head ``h`` reads qk head ``h // (H_v // H_qk)``.
Per token the state decays first, then takes the delta update, and the output includes the token::

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = scale * S_t^T q_t

The chunked form is the gate-free UT/WY formulation the Hopper kernels use (see
``shared/docs/gdn-kernel-design.md`` §1.3): ``T~ = (I + strict_lower(diag(beta) K K^T))^-1`` depends only on
k and beta; the gated inverse is ``Gamma * T~``.  Its backward (``chunk_gdr_bwd_reference``) is written out
explicitly (§1.4) so that it can serve as the implementation behind the backward custom op, where
autograd is not available, and as an executable spec for the backward kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK = 64
L2NORM_EPS = 1e-6


@dataclass(frozen=True)
class GDROptions:
    """The non-tensor arguments of the op, as FLA names them."""

    scale: float
    use_qk_l2norm_in_kernel: bool = False
    use_gate_in_kernel: bool = False
    use_beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False
    state_v_first: bool = False


# --------------------------------------------------------------------------------------------------
# Input activations shared by every implementation (L2 norm, gate, beta) and their backward.
# --------------------------------------------------------------------------------------------------


def l2norm(x: Tensor) -> Tensor:
    """``x * rsqrt(sum(x^2) + 1e-6)`` over the last dim, FLA's and transformers' in-kernel L2 norm."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def l2norm_fp32(x: Tensor) -> Tensor:
    """:func:`l2norm` computed in fp32, in ``x``'s dtype: the q/k the Hopper kernels are fed."""
    return l2norm(x.float()).to(x.dtype)


def l2norm_bwd(x: Tensor, dy: Tensor) -> Tensor:
    rstd = torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)
    y = x * rstd
    return rstd * (dy - y * (dy * y).sum(-1, keepdim=True))


def gate_activation(g: Tensor, A_log: Tensor, dt_bias: Tensor | None) -> Tensor:
    """FLA's ``use_gate_in_kernel`` gate: ``-exp(A_log) * softplus(g + dt_bias)`` (per v-head A_log/dt_bias)."""
    x = g if dt_bias is None else g + dt_bias.to(g.dtype)
    return -A_log.to(g.dtype).exp() * F.softplus(x)


def activate_gates(g, beta, A_log, dt_bias, opts: GDROptions, dtype: torch.dtype):
    """The log gate and beta the recurrence uses (FLA's gate-in-kernel and beta-sigmoid), in ``dtype``."""
    g, beta = g.to(dtype), beta.to(dtype)
    if opts.use_gate_in_kernel:
        g = gate_activation(g, A_log.to(dtype), None if dt_bias is None else dt_bias.to(dtype))
    if opts.use_beta_sigmoid_in_kernel:
        beta = beta.sigmoid() * (2.0 if opts.allow_neg_eigval else 1.0)
    return g, beta


def activate(q, k, g, beta, A_log, dt_bias, opts: GDROptions, dtype: torch.dtype):
    """Cast to ``dtype`` and apply the optional in-kernel activations; returns (q, k, g, beta)."""
    q, k = q.to(dtype), k.to(dtype)
    if opts.use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    return (q, k, *activate_gates(g, beta, A_log, dt_bias, opts, dtype))


# --------------------------------------------------------------------------------------------------
# Layout helpers
# --------------------------------------------------------------------------------------------------


def _to_heads(x: Tensor, groups: int = 1) -> Tensor:
    """``[B,T,H,...]`` -> ``[B,H*groups,T,...]`` (GVA expansion: head h reads head h // groups)."""
    if groups > 1:
        x = x.repeat_interleave(groups, dim=2)
    return x.transpose(1, 2)


def _from_heads(x: Tensor, groups: int = 1) -> Tensor:
    """Inverse of ``_to_heads`` for gradients: sum each GVA group back onto its qk head."""
    x = x.transpose(1, 2)
    if groups > 1:
        B, T, H, *rest = x.shape
        x = x.reshape(B, T, H // groups, groups, *rest).sum(3)
    return x


def sequence_bounds(cu_seqlens: Tensor | None, batch: int, length: int) -> list[tuple[int, int, int]]:
    """``(state index, start, end)`` of each sequence; one per batch row when ``cu_seqlens`` is None."""
    if cu_seqlens is None:
        return [(b, 0, length) for b in range(batch)]
    bounds = cu_seqlens.tolist()
    return [(i, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


# --------------------------------------------------------------------------------------------------
# Float64 per-token oracle
# --------------------------------------------------------------------------------------------------


def recurrent_gdr_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The recurrence token by token in float64: the independent oracle for tests.

    Differentiable with ordinary autograd. Returns float64 ``o`` and (if asked) the float64 final state.
    """
    K, V = k.shape[-1], v.shape[-1]
    opts = GDROptions(
        K**-0.5 if scale is None else scale, use_qk_l2norm_in_kernel, use_gate_in_kernel,
        use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
    )
    f64 = torch.float64
    q, k, g, beta = activate(q, k, g, beta, A_log, dt_bias, opts, f64)
    groups = v.shape[2] // q.shape[2]
    q, k = _to_heads(q, groups), _to_heads(k, groups)
    v, g, beta = _to_heads(v.to(f64)), g.transpose(1, 2), beta.transpose(1, 2)
    B, H, T, _ = v.shape
    outs, finals = [], []
    for idx, start, end in sequence_bounds(cu_seqlens, B, T):
        row = 0 if cu_seqlens is not None else idx
        if initial_state is None:
            S = v.new_zeros(H, K, V)
        else:
            S = initial_state[idx].to(f64)
            S = S.mT if state_v_first else S
        for t in range(start, end):
            kt, vt, bt = k[row, :, t], v[row, :, t], beta[row, :, t, None]
            S = g[row, :, t, None, None].exp() * S
            S = S + (bt * kt)[..., None] * (vt - (kt[..., None] * S).sum(1))[:, None, :]
            outs.append(opts.scale * (q[row, :, t, :, None] * S).sum(1))
        finals.append(S.mT if state_v_first else S)
    o = torch.stack(outs, 0) if outs else v.new_zeros(0, H, V)
    o = o.reshape(B, T, H, V)
    return o, (torch.stack(finals) if output_final_state else None)


# --------------------------------------------------------------------------------------------------
# Chunked form (float32 internally): per-sequence core on [1 or B, H, T, D] head-major tensors
# --------------------------------------------------------------------------------------------------


@dataclass
class _Chunks:
    """State-independent per-chunk quantities of one dense block ``[B,H,NT,C,...]``."""

    q: Tensor
    k: Tensor
    v: Tensor
    beta: Tensor
    Gam: Tensor  # exp(gam_i - gam_j) for i >= j, else 0 (gam: in-chunk inclusive cumsum of g)
    Tt: Tensor  # gate-free inverse T~
    A: Tensor  # Gam * T~ * beta_j: the gated, beta-scaled inverse
    QK: Tensor  # q k^T
    P: Tensor  # scale * Gam * q k^T
    e: Tensor  # exp(gam)
    r: Tensor  # exp(gam_C - gam)
    a: Tensor  # exp(gam_C)
    length: int


def _split_chunks(q, k, v, g, beta, scale: float) -> _Chunks:
    B, H, T, _ = q.shape
    nt = max(1, -(-T // CHUNK))
    pad = nt * CHUNK - T

    def blocks(x: Tensor) -> Tensor:
        x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 4 else F.pad(x, (0, pad))
        return x.reshape(B, H, nt, CHUNK, *x.shape[3:])

    q, k, v, g, beta = map(blocks, (q, k, v, g, beta))
    # The cumsum and its differences in float64: with strong decay gam reaches -1e3 within a chunk, and
    # float32 differences of such sums would lose the small per-token gates (relative error ~1e-4).
    gam = g.double().cumsum(-1)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    Gam = torch.where(causal, gam[..., :, None] - gam[..., None, :], float("-inf")).exp().to(q.dtype)
    eye = torch.eye(CHUNK, dtype=q.dtype, device=q.device)
    KK = k @ k.mT
    L = (beta[..., :, None] * KK).tril(-1)
    Tt = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
    QK = q @ k.mT
    return _Chunks(
        q, k, v, beta, Gam, Tt,
        A=Gam * Tt * beta[..., None, :],
        QK=QK,
        P=scale * Gam * QK,
        e=gam.exp().to(q.dtype),
        r=(gam[..., -1:] - gam).exp().to(q.dtype),
        a=gam[..., -1].exp().to(q.dtype),
        length=T,
    )


def _forward_chunks(c: _Chunks, h0: Tensor, scale: float) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Run the state recurrence; returns o ``[B,H,T,V]``, the final state and each chunk's start state."""
    S, starts, outs = h0, [], []
    for n in range(c.q.shape[2]):
        starts.append(S)
        e, r = c.e[:, :, n, :, None], c.r[:, :, n, :, None]
        vn = c.A[:, :, n] @ (c.v[:, :, n] - e * (c.k[:, :, n] @ S))
        outs.append(scale * e * (c.q[:, :, n] @ S) + c.P[:, :, n] @ vn)
        S = c.a[:, :, n, None, None] * S + c.k[:, :, n].mT @ (r * vn)
    o = torch.stack(outs, 2).flatten(2, 3)[:, :, : c.length]
    return o, S, starts


def _exclusive_cumsum(x: Tensor) -> Tensor:
    return F.pad(x[..., :-1], (1, 0)).cumsum(-1)


def _backward_chunks(c: _Chunks, starts: list[Tensor], do: Tensor, dht: Tensor, scale: float):
    """Explicit backward of ``_forward_chunks``; returns dq, dk, dv, dg, dbeta (head-major) and dh0."""
    B, H, nt, C, _ = c.q.shape
    pad = nt * C - c.length
    do = F.pad(do, (0, 0, 0, pad)).reshape(B, H, nt, C, -1)
    dq, dk, dv, dVn_all, W_all, dP_all, dg = [], [], [], [], [], [], []
    dS = dht
    for n in reversed(range(nt)):
        S, dOn = starts[n], do[:, :, n]
        qn, kn = c.q[:, :, n], c.k[:, :, n]
        e, r, a = c.e[:, :, n, :, None], c.r[:, :, n, :, None], c.a[:, :, n, None, None]
        U0 = kn @ S
        W = c.v[:, :, n] - e * U0
        Vn = c.A[:, :, n] @ W
        KdS = kn @ dS
        dVn = c.P[:, :, n].mT @ dOn + r * KdS
        dW = c.A[:, :, n].mT @ dVn
        dU0 = -e * dW
        de_e = scale * (e * (qn @ S) * dOn).sum(-1) - (e * U0 * dW).sum(-1)
        dr_r = (r * Vn * KdS).sum(-1)
        da_a = a[..., 0, 0] * (dS * S).sum((-2, -1))
        dq.append(scale * e * (dOn @ S.mT))
        dk.append((r * Vn) @ dS.mT + dU0 @ S.mT)
        dv.append(dW)
        dVn_all.append(dVn)
        W_all.append(W)
        dP_all.append(dOn @ Vn.mT)
        # gam = cumsum(g): dg_t gets each exp(gam_s) term for s >= t, each exp(gam_C - gam_s) term for
        # s < t and the exp(gam_C) term always; written so that nothing cancels (strong decay needs it).
        dg.append(de_e.flip(-1).cumsum(-1).flip(-1) + _exclusive_cumsum(dr_r) + da_a[..., None])
        dS = a * dS + scale * qn.mT @ (e * dOn) + kn.mT @ dU0

    def stack(xs):
        return torch.stack(xs[::-1], 2)

    dq, dk, dv, dVn, W, dP, dg = map(stack, (dq, dk, dv, dVn_all, W_all, dP_all, dg))
    # State-independent part, all chunks at once: through P = scale*Gam*QK and A = Gam*T~*beta_j.
    dQK = scale * dP * c.Gam
    dq = dq + dQK @ c.k
    dk = dk + dQK.mT @ c.q
    dA = dVn @ W.mT
    beta_col = c.beta[..., None, :]
    dbeta = (dA * c.Gam * c.Tt).sum(-2)
    dTt = dA * c.Gam * beta_col
    dL = -(c.Tt.mT @ dTt @ c.Tt.mT).tril(-1)
    dbeta = dbeta + (dL * (c.k @ c.k.mT)).sum(-1)
    dKK = c.beta[..., :, None] * dL
    dk = dk + (dKK + dKK.mT) @ c.k
    # Through Gam_sj = exp(gam_s - gam_j): dg_t = sum of Y_sj over s >= t > j, the block below-left of t.
    Y = (scale * dP * c.QK + dA * c.Tt * beta_col) * c.Gam
    left_of_t = _exclusive_cumsum(Y)  # [s, t] = sum_{j < t} Y_sj
    dg = dg + (left_of_t * c.Gam.new_ones(C, C).tril()).sum(-2)

    def unchunk(x):
        return x.flatten(2, 3)[:, :, : c.length]

    return (*map(unchunk, (dq, dk, dv, dg, dbeta)), dS)


def _state_in(initial_state: Tensor | None, idx, n: int, H: int, K: int, V: int, opts: GDROptions, like: Tensor):
    if initial_state is None:
        return like.new_zeros(n, H, K, V)
    h0 = initial_state[idx].float()
    return h0.mT if opts.state_v_first else h0


def _prepared(q, k, v, g, beta, A_log, dt_bias, opts: GDROptions):
    """fp32, activated, GVA-expanded, head-major ``[B,H,T,...]`` inputs of the chunked core."""
    qa, ka, ga, ba = activate(q, k, g, beta, A_log, dt_bias, opts, torch.float32)
    groups = v.shape[2] // q.shape[2]
    return (_to_heads(qa, groups), _to_heads(ka, groups), _to_heads(v.float()),
            ga.transpose(1, 2), ba.transpose(1, 2))


def chunk_gdr_fwd_reference(
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts: GDROptions
) -> tuple[Tensor, Tensor]:
    """Chunked forward; returns ``o`` (v's dtype) and the fp32 final state (layout per ``state_v_first``)."""
    qh, kh, vh, gh, bh = _prepared(q, k, v, g, beta, A_log, dt_bias, opts)
    B, H, T, K = qh.shape
    V = vh.shape[-1]
    o = vh.new_zeros(B, H, T, V)
    finals = []
    if cu_seqlens is None:
        c = _split_chunks(qh, kh, vh, gh, bh, opts.scale)
        o, ht, _ = _forward_chunks(c, _state_in(initial_state, slice(None), B, H, K, V, opts, vh), opts.scale)
        finals = [ht]
    else:
        for idx, s, e in sequence_bounds(cu_seqlens, B, T):
            c = _split_chunks(*(x[:, :, s:e] for x in (qh, kh, vh, gh, bh)), opts.scale)
            o[:, :, s:e], ht, _ = _forward_chunks(c, _state_in(initial_state, [idx], 1, H, K, V, opts, vh), opts.scale)
            finals.append(ht)
    ht = torch.cat(finals) if finals else vh.new_zeros(0, H, K, V)
    return o.transpose(1, 2).to(v.dtype).contiguous(), (ht.mT if opts.state_v_first else ht).contiguous()


def chunk_gdr_bwd_reference(
    do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts: GDROptions
):
    """Gradients of ``chunk_gdr_fwd_reference``: (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0).

    ``dA_log``/``ddt_bias`` are None unless ``use_gate_in_kernel``; ``dh0`` is None without an initial state.
    Each gradient has its input's dtype.
    """
    qh, kh, vh, gh, bh = _prepared(q, k, v, g, beta, A_log, dt_bias, opts)
    B, H, T, K = qh.shape
    V = vh.shape[-1]
    doh = _to_heads(do.float())
    if dht is not None:
        dht = dht.float()
        dht = dht.mT if opts.state_v_first else dht
    grads = [torch.zeros_like(x) for x in (qh, kh, vh, gh, bh)]
    dh0 = []
    if cu_seqlens is None:
        pieces = [(slice(None), slice(None), B)]
    else:
        pieces = [([i], slice(s, e), 1) for i, s, e in sequence_bounds(cu_seqlens, B, T)]
    for idx, span, n in pieces:
        c = _split_chunks(*(x[:, :, span] for x in (qh, kh, vh, gh, bh)), opts.scale)
        _, _, starts = _forward_chunks(c, _state_in(initial_state, idx, n, H, K, V, opts, vh), opts.scale)
        d_end = vh.new_zeros(n, H, K, V) if dht is None else dht[idx]
        *piece_grads, dS = _backward_chunks(c, starts, doh[:, :, span], d_end, opts.scale)
        for acc, grad in zip(grads, piece_grads):
            acc[:, :, span] = grad
        dh0.append(dS)
    dqa, dka, dv, dga, dba = grads
    groups = v.shape[2] // q.shape[2]
    dqa, dka = _from_heads(dqa, groups), _from_heads(dka, groups)
    dv, dga, dba = _from_heads(dv), dga.transpose(1, 2), dba.transpose(1, 2)
    dq, dk, dg, dbeta, dA_log, ddt_bias = activation_bwd(q, k, g, beta, A_log, dt_bias, opts, dqa, dka, dga, dba)
    dh0 = None if initial_state is None else _state_out(dh0, opts).to(initial_state.dtype)
    return dq, dk, dv.to(v.dtype), dg, dbeta, dA_log, ddt_bias, dh0


def _state_out(states: list[Tensor], opts: GDROptions) -> Tensor:
    s = torch.cat(states)
    return (s.mT if opts.state_v_first else s).contiguous()


def activation_bwd(q, k, g, beta, A_log, dt_bias, opts: GDROptions, dqa, dka, dga, dba):
    """Chain the activated-input gradients back through L2 norm, gate and beta sigmoid."""
    f32 = torch.float32
    if opts.use_qk_l2norm_in_kernel:
        dqa, dka = l2norm_bwd(q.to(f32), dqa), l2norm_bwd(k.to(f32), dka)
    dA_log = ddt_bias = None
    if opts.use_gate_in_kernel:
        x = g.to(f32) if dt_bias is None else g.to(f32) + dt_bias.to(f32)
        neg_a = -A_log.to(f32).exp()
        dA_log = (dga * neg_a * F.softplus(x)).double().sum((0, 1)).to(A_log.dtype)
        dga = dga * neg_a * torch.sigmoid(x)
        if dt_bias is not None:
            ddt_bias = dga.double().sum((0, 1)).to(dt_bias.dtype)
    if opts.use_beta_sigmoid_in_kernel:
        s = torch.sigmoid(beta.to(f32))
        dba = dba * s * (1 - s) * (2.0 if opts.allow_neg_eigval else 1.0)
    return dqa.to(q.dtype), dka.to(k.dtype), dga.to(g.dtype), dba.to(beta.dtype), dA_log, ddt_bias
