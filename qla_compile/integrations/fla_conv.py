"""FLA's short convolution inside compiled graphs: no graph break at each of ``GatedDeltaNet``'s convolutions.

FLA (>= 0.6) wraps every function it dispatches through its backend registry in ``torch.compiler.disable`` (so
that backend selection stays out of graphs), among them the two leaves of its causal convolution,
``causal_conv1d_fwd`` and ``causal_conv1d_bwd`` (``fla/modules/causal_conv1d/ops.py``), which its
``CausalConv1dFunction`` calls. Under ``torch.compile`` each call is a graph break, forward and backward, three
per ``GatedDeltaNet`` layer. While dynamo traces, :func:`register` makes each leaf one ``qla::`` custom op
instead, whose body calls FLA's own function eagerly (its backend choice, its kernels); FLA's autograd function
around them is traced as it is. Eager calls are untouched.

The ops' fake implementations give FLA's output shapes, dtypes and layouts (contiguous outputs, ``dx`` laid out
as ``torch.empty_like(x)``); the bodies copy into that layout should a backend return another, so a compiled
graph never reads a tensor laid out otherwise than it was traced with. ``QLA_FLA_CONV=0`` turns this off.
"""
from __future__ import annotations

import logging
import os
import sys

import torch
from torch import Tensor

log = logging.getLogger(__name__)
MODULE = "fla.modules.causal_conv1d.ops"
_registered: set[int] = set()


def _leaf(name: str):
    """FLA's function ``name`` of :data:`MODULE`, as FLA's own code calls it."""
    return getattr(sys.modules[MODULE], name)


def _meta(*args):
    """``args`` with each tensor as a meta tensor (shape, dtype, strides; no data): what a fake implementation
    needs to say how an output is laid out."""
    return [a.to("meta") if isinstance(a, Tensor) else a for a in args]


def _as(t: Tensor, like: Tensor) -> Tensor:
    """``t`` in the dtype and strides of ``like`` (a meta tensor): ``t`` itself when it has them, else a copy."""
    if t.dtype == like.dtype and t.stride() == like.stride():
        return t
    return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=t.device).copy_(t)


def _dx_like(x: Tensor, weight: Tensor) -> Tensor:
    """``dx`` as FLA's backward allocates it: ``empty_like`` of ``x`` (viewed ``[B, T, D]``), viewed as ``x``."""
    flat = x if x.shape[-1] == weight.shape[0] else x.flatten(2)
    return torch.empty_like(flat).view(x.shape)


@torch.library.custom_op("qla::fla_causal_conv1d_fwd", mutates_args=())
def conv_fwd(
    x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None, initial_state: Tensor | None,
    cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None, chunk_indices: Tensor | None,
    output_final_state: bool, activation: str | None, chunk_size: int, layout_fallback: bool,
) -> tuple[Tensor, Tensor]:
    """FLA's ``causal_conv1d_fwd``: ``(y, final_state)``, the final state empty unless asked for."""
    y, final_state = _leaf("causal_conv1d_fwd")(
        x=x, weight=weight, bias=bias, residual=residual, initial_state=initial_state,
        output_final_state=output_final_state, activation=activation, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices, chunk_size=chunk_size,
        layout_fallback=layout_fallback,
    )
    want_y, want_state = _fwd_fake(*_meta(x, weight, bias, residual, initial_state, cu_seqlens, cu_seqlens_cpu,
                                          chunk_indices, output_final_state, activation, chunk_size, layout_fallback))
    final_state = x.new_empty(0) if final_state is None else _as(final_state, want_state)
    return _as(y, want_y), final_state


@conv_fwd.register_fake
def _fwd_fake(x, weight, bias, residual, initial_state, cu_seqlens, cu_seqlens_cpu, chunk_indices,
              output_final_state, activation, chunk_size, layout_fallback):
    n = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    state = (n, weight.shape[0], weight.shape[1]) if output_final_state else (0,)
    return x.new_empty(x.shape), x.new_empty(state)


@torch.library.custom_op("qla::fla_causal_conv1d_bwd", mutates_args=())
def conv_bwd(
    x: Tensor, dy: Tensor, dht: Tensor | None, weight: Tensor, bias: Tensor | None, has_residual: bool,
    initial_state: Tensor | None, cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None,
    chunk_indices: Tensor | None, activation: str | None, chunk_size: int, layout_fallback: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """FLA's ``causal_conv1d_bwd``: ``(dx, dw, db, dh0)``, db/dh0 empty where there is no bias/initial state
    (the residual's gradient is ``dy`` itself: the caller takes it)."""
    dx, dw, db, _, dh0 = _leaf("causal_conv1d_bwd")(
        x=x, dy=dy, dht=dht, weight=weight, bias=bias, residual=dy if has_residual else None,
        initial_state=initial_state, activation=activation, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
        chunk_indices=chunk_indices, chunk_size=chunk_size, layout_fallback=layout_fallback,
    )
    want = _bwd_fake(*_meta(x, dy, dht, weight, bias, has_residual, initial_state, cu_seqlens, cu_seqlens_cpu,
                            chunk_indices, activation, chunk_size, layout_fallback))
    return tuple(x.new_empty(0) if got is None else _as(got, w) for got, w in zip((dx, dw, db, dh0), want))


@conv_bwd.register_fake
def _bwd_fake(x, dy, dht, weight, bias, has_residual, initial_state, cu_seqlens, cu_seqlens_cpu, chunk_indices,
              activation, chunk_size, layout_fallback):
    return (_dx_like(x, weight), torch.empty_like(weight, memory_format=torch.contiguous_format),
            x.new_empty(0) if bias is None else torch.empty_like(bias, memory_format=torch.contiguous_format),
            x.new_empty(0) if initial_state is None else torch.empty_like(initial_state))


def fwd_substitute(x, weight, bias, residual, initial_state=None, output_final_state=False, activation=None,
                   cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, chunk_size=64, layout_fallback=False,
                   **kwargs):
    """What dynamo traces for FLA's ``causal_conv1d_fwd``: one ``qla::fla_causal_conv1d_fwd``."""
    chunk_size = kwargs.pop("BT", chunk_size)  # FLA's deprecated name
    y, final_state = conv_fwd(x, weight, bias, residual, initial_state, cu_seqlens, cu_seqlens_cpu, chunk_indices,
                              output_final_state, activation, chunk_size, layout_fallback)
    return y, (final_state if output_final_state else None)


def bwd_substitute(x, dy, dht, weight=None, bias=None, residual=None, initial_state=None, activation=None,
                   cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, chunk_size=64, layout_fallback=False,
                   **kwargs):
    """What dynamo traces for FLA's ``causal_conv1d_bwd``: one ``qla::fla_causal_conv1d_bwd``."""
    chunk_size = kwargs.pop("BT", chunk_size)
    dx, dw, db, dh0 = conv_bwd(x, dy, dht, weight, bias, residual is not None, initial_state, cu_seqlens,
                               cu_seqlens_cpu, chunk_indices, activation, chunk_size, layout_fallback)
    return (dx, dw, None if bias is None else db, dy if residual is not None else None,
            None if initial_state is None else dh0)


def register() -> list[str]:
    """Substitute FLA's two convolution leaves while dynamo traces (when FLA's module is imported and
    ``QLA_FLA_CONV`` is not ``0``); idempotent. Returns the names registered by this call."""
    module = sys.modules.get(MODULE)
    if module is None or os.environ.get("QLA_FLA_CONV") == "0":
        return []
    added = []
    for name, substitute in (("causal_conv1d_fwd", fwd_substitute), ("causal_conv1d_bwd", bwd_substitute)):
        original = getattr(module, name, None)
        if original is None or id(original) in _registered:
            continue
        torch.compiler.substitute_in_graph(original, skip_signature_check=True)(substitute)
        _registered.add(id(original))
        added.append(f"{MODULE}.{name}")
        log.info("qla_compile: dynamo substitution registered for %s.%s (no graph break there)", MODULE, name)
    return added
