"""``chunk_gated_delta_rule``: FLA's public signature and semantics, backed by the ``qla::`` custom ops."""
from __future__ import annotations

import torch
from torch import Tensor

from . import ops
from .reference import GDROptions, activate_gates, l2norm_fp32
from .validation import check_cu_seqlens_values, check_inputs

_ACCEPTED_CHUNK_SIZES = (16, 32, 64)


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    *,
    use_gate_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None]:
    """Chunked Gated DeltaNet, a drop-in for ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``.

    Args:
        q, k: ``[B, T, H, K]``. v: ``[B, T, HV, V]`` with ``HV % H == 0`` (GVA: v-head h reads qk-head h // (HV/H)).
        g: ``[B, T, HV]`` log-space forget gate, or the raw gate input when ``use_gate_in_kernel``
            (then ``g <- -exp(A_log) * softplus(g + dt_bias)`` with ``A_log``/``dt_bias`` of shape ``[HV]``).
        beta: ``[B, T, HV]``, or logits when ``use_beta_sigmoid_in_kernel`` (``sigmoid``, doubled with
            ``allow_neg_eigval``).
        scale: output scale, default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``), N = B or len(cu_seqlens) - 1.
        output_final_state: also return the final state (fp32, same layout as ``initial_state``).
        use_qk_l2norm_in_kernel: L2-normalise q and k over the last dim first.
        cu_seqlens: ``[N + 1]`` int32/int64 boundaries of packed sequences (B must be 1).
        cu_seqlens_cpu: optional host copy of ``cu_seqlens``, used for the value checks instead of a sync.
        chunk_size: accepted for FLA compatibility (16, 32 or 64); the result does not depend on it.

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in the input dtype; final_state or None.
    """
    if chunk_size not in _ACCEPTED_CHUNK_SIZES:
        raise ValueError(f"`chunk_size` must be 16, 32 or 64, got {chunk_size}")
    check_inputs(
        q, k, v, g, beta, scale, initial_state, cu_seqlens, use_gate_in_kernel, A_log, dt_bias,
        use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
    )
    if cu_seqlens is not None and not torch.compiler.is_compiling() and _may_read(cu_seqlens, cu_seqlens_cpu):
        check_cu_seqlens_values(cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu, q.shape[1])
    if scale is None:
        scale = k.shape[-1] ** -0.5
    # a forward that a backward will follow keeps what its backward can reuse (and plans for the pair)
    for_backward = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, A_log, dt_bias, initial_state))
    opts = GDROptions(float(scale), use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                      allow_neg_eigval, state_v_first)
    o, final_state = op_call(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts, for_backward,
                             lift=torch.compiler.is_compiling())
    return o, (final_state if output_final_state else None)


def op_call(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts: GDROptions, for_backward: bool,
            lift: bool):
    """``(o, final_state)`` of one ``qla::chunk_gdr_fwd`` call (eagerly: of the same forward and backward without
    the op's dispatch, ``ops.EagerChunkGDR``).

    With ``lift`` (a graph is being traced) the L2 norm of q/k, the gate activation, beta's sigmoid and the
    contiguous copies run as torch ops of the traced graph rather than inside the op: Inductor fuses them into
    the kernels that produce q, k, v, g and beta, and differentiates them with the rest of the model (the same
    math as the op's own, which serves eager calls); the op is told that k comes normalised."""
    keys_normalised = lift and opts.use_qk_l2norm_in_kernel
    if lift:
        if opts.use_qk_l2norm_in_kernel:
            q, k = l2norm_fp32(q), l2norm_fp32(k)
        g, beta = activate_gates(g, beta, A_log, dt_bias, opts, torch.float32)
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        A_log = dt_bias = None
        opts = GDROptions(opts.scale, state_v_first=opts.state_v_first)
    op = ops.chunk_gdr_fwd if lift else ops.EagerChunkGDR.apply
    o, final_state, *_ = op(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts.scale, opts.use_qk_l2norm_in_kernel,
        opts.use_gate_in_kernel, opts.use_beta_sigmoid_in_kernel, opts.allow_neg_eigval, opts.state_v_first,
        for_backward, keys_normalised,
    )
    return o, final_state


def _may_read(cu_seqlens: Tensor, cu_seqlens_cpu: Tensor | None) -> bool:
    """Reading device values would break CUDA-graph capture: skip the value check while capturing."""
    if cu_seqlens_cpu is not None or cu_seqlens.device.type != "cuda":
        return True
    return not torch.cuda.is_current_stream_capturing()
