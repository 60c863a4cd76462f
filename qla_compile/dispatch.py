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


def forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts: GDROptions):
    if select(q, k, v) == "reference":
        return chunk_gdr_fwd_reference(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts)
    g, beta = activate_gates(g, beta, A_log, dt_bias, opts, torch.float32)
    o, ht = _kernels().chunk_gdr_fwd_hopper(
        q, k, v, g, beta, opts.scale, _state_to_kv(initial_state, opts), cu_seqlens, opts.use_qk_l2norm_in_kernel
    )
    return o, (ht.mT.contiguous() if opts.state_v_first else ht)


def backward(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts: GDROptions):
    if select(q, k, v) == "reference":
        return chunk_gdr_bwd_reference(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts)
    kernels = _kernels()
    from .kernels.backward import chunk_gdr_bwd_hopper

    qa, ka = (kernels._l2norm(q), kernels._l2norm(k)) if opts.use_qk_l2norm_in_kernel else (q, k)
    ga, ba = activate_gates(g, beta, A_log, dt_bias, opts, torch.float32)
    dqa, dka, dv, dga, dba, dh0 = chunk_gdr_bwd_hopper(
        do.contiguous(), _state_to_kv(dht, opts), qa, ka, v, ga, ba, opts.scale,
        _state_to_kv(initial_state, opts), cu_seqlens,
    )
    dq, dk, dg, dbeta, dA_log, ddt_bias = activation_bwd(
        q, k, g, beta, A_log, dt_bias, opts, dqa.float(), dka.float(), dga.float(), dba.float()
    )
    if dh0 is not None:
        dh0 = (dh0.mT if opts.state_v_first else dh0).contiguous().to(initial_state.dtype)
    return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0
