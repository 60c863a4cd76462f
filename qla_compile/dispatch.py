"""Which implementation runs a call: decided from host-known facts only (device, arch, dtype, shapes).

Today every device runs the chunked PyTorch reference; the Hopper TileLang kernels plug in here.
Nothing in this module reads device data, so a dense call stays CUDA-graph capturable.
"""
from __future__ import annotations

from .reference import chunk_gdr_bwd_reference, chunk_gdr_fwd_reference

IMPLEMENTATIONS = ("reference",)


def select(q) -> str:
    """The name of the implementation that will run for inputs like ``q`` (shown by ``explain`` and tests)."""
    return "reference"


def forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts):
    return chunk_gdr_fwd_reference(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts)


def backward(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts):
    return chunk_gdr_bwd_reference(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts)
