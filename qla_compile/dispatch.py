"""Which implementation runs a call: decided from host-known facts only (device, arch, dtype, shapes).

- ``"hopper"``: the TileLang kernels in ``qla_compile.kernels`` (SM90, bf16/fp16, K = V = 128);
- ``"reference"``: the chunked PyTorch implementation in ``qla_compile.reference`` (everything else).

FLA's layer options (gate-in-kernel, beta sigmoid, ``state_v_first``) are applied around the kernels
with torch ops. Set ``QLA_FORCE_REFERENCE=1`` to run the reference everywhere (debugging).
Nothing here reads device data, so a dense call stays CUDA-graph capturable.
"""
from __future__ import annotations

import functools
import os

import torch

from .reference import (
    CHUNK,
    GDROptions,
    activation_bwd,
    activate_gates,
    chunk_gdr_bwd_reference,
    chunk_gdr_fwd_reference,
)


@functools.cache
def _kernels():
    """The Hopper kernel package, or None where it cannot load (no tilelang, unsupported platform)."""
    try:
        from . import kernels
    except ImportError:
        return None
    return kernels


def select(q, k, v) -> str:
    """The implementation that runs for these inputs: ``"hopper"`` or ``"reference"``."""
    if os.environ.get("QLA_FORCE_REFERENCE") == "1" or q.device.type != "cuda":
        return "reference"
    kernels = _kernels()
    return "hopper" if kernels is not None and kernels.hopper_supported(q, k, v) else "reference"


def _state_to_kv(state, opts: GDROptions):
    if state is None:
        return None
    state = state.float()
    return (state.mT if opts.state_v_first else state).contiguous()


def aux_like(q, k, v, cu_seqlens):
    """Uninitialised tensors shaped like the forward's aux ``(tt, gb)``: the Hopper forward's T~ (fp16
    ``[n_slots, H_v, 64, 64]``) and [gamma; beta] (fp32 ``[n_slots, H_v, 2, 64]``) with
    ``n_slots = B*T // 64 + N``, flattened to 1-D (a dimension that may be 1, like n_slots, would cost a
    torch.compile guard and a recompile); no elements on the reference path, whose backward recomputes."""
    rows = 0
    if select(q, k, v) == "hopper":
        n_seq = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        rows = (q.shape[0] * q.shape[1] // CHUNK + n_seq) * v.shape[2] * CHUNK
    return v.new_empty(rows * CHUNK, dtype=torch.float16), v.new_empty(rows * 2, dtype=torch.float32)


def cp_cache_like(q, k, v, cu_seqlens, for_backward: bool):
    """A tensor shaped like the forward's ``cp_cache`` (fp32, 1-D): where the Hopper forward runs for a
    backward, :func:`kernels.cp_cache_numel` elements, a bound from shapes alone on what its context-parallel
    plan keeps (so the op has no data-dependent output size), else none."""
    n = 0
    if for_backward and select(q, k, v) == "hopper":
        n_seq = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        n = _kernels().cp_cache_numel(q.shape[0] * q.shape[1], n_seq, v.shape[2], k.shape[3], v.shape[3])
    return v.new_empty(n, dtype=torch.float32)


def forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts: GDROptions, for_backward=True):
    """``(o, final_state, tt, gb, cp_cache)``; ``tt, gb`` as described by :func:`aux_like`, ``cp_cache`` the
    Hopper forward's context-parallel cache (``kernels.chunk_gdr_fwd_hopper_aux``; sized as
    :func:`cp_cache_like`, filled when the forward split; empty when ``for_backward`` is false, which also
    picks the forward-only splitting rule)."""
    if select(q, k, v) == "reference":
        o, ht = chunk_gdr_fwd_reference(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts)
        return o, ht, *aux_like(q, k, v, cu_seqlens), q.new_empty(0, dtype=torch.float32)
    g, beta = activate_gates(g, beta, A_log, dt_bias, opts, torch.float32)
    o, ht, tt, gb, _, cp_cache = _kernels().chunk_gdr_fwd_hopper_aux(
        q, k, v, g, beta, opts.scale, _state_to_kv(initial_state, opts), cu_seqlens, opts.use_qk_l2norm_in_kernel,
        for_backward=for_backward,
    )
    return o, (ht.mT.contiguous() if opts.state_v_first else ht), tt.view(-1), gb.view(-1), cp_cache


def backward(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts: GDROptions, aux=None):
    """Every input gradient; ``aux``: the forward's flat ``(tt, gb, cp_cache)``, used on the Hopper path (None
    there recomputes them)."""
    if select(q, k, v) == "reference":
        return chunk_gdr_bwd_reference(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts)
    kernels = _kernels()
    from .kernels.backward import chunk_gdr_bwd_hopper

    if aux is not None:
        h_v = v.shape[2]
        aux = (aux[0].view(-1, h_v, CHUNK, CHUNK), aux[1].view(-1, h_v, 2, CHUNK), aux[2])

    qa, ka = (kernels._l2norm(q), kernels._l2norm(k)) if opts.use_qk_l2norm_in_kernel else (q, k)
    ga, ba = activate_gates(g, beta, A_log, dt_bias, opts, torch.float32)
    dqa, dka, dv, dga, dba, dh0 = chunk_gdr_bwd_hopper(
        do.contiguous(), _state_to_kv(dht, opts), qa, ka, v, ga, ba, opts.scale,
        _state_to_kv(initial_state, opts), cu_seqlens, aux=aux,
    )
    dq, dk, dg, dbeta, dA_log, ddt_bias = activation_bwd(
        q, k, g, beta, A_log, dt_bias, opts, dqa.float(), dka.float(), dga.float(), dba.float()
    )
    if dh0 is not None:
        dh0 = (dh0.mT if opts.state_v_first else dh0).contiguous().to(initial_state.dtype)
    return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0
