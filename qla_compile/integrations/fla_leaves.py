"""FLA's layer kernels inside compiled graphs: no graph break at ``GatedDeltaNet``'s convolution and output norm.

FLA (>= 0.6) wraps every function it dispatches through its backend registry in ``torch.compiler.disable`` (so
that backend selection stays out of graphs), among them the leaves that its layers' autograd functions call:
the short convolution's ``causal_conv1d_fwd`` / ``causal_conv1d_bwd`` (``fla/modules/causal_conv1d/ops.py``,
called by ``CausalConv1dFunction``) and the gated norm's ``layer_norm_gated_fwd`` / ``layer_norm_gated_bwd``
(``fla/modules/norm/fused_norm_gate.py``, called by ``LayerNormGatedFunction``). Under ``torch.compile`` each call
is a graph break, forward and backward. While dynamo traces, :func:`register` makes each leaf one ``qla::``
custom op instead, whose body calls FLA's own function eagerly (its backend choice, its kernels); FLA's autograd
functions around them are traced as they are. Eager calls are untouched.

The ops' fake implementations give FLA's output shapes, dtypes and layouts (as its leaves allocate them); the
bodies copy into that layout should a backend return another, so a compiled graph never reads a tensor laid out
otherwise than it was traced with; a body runs its fake on meta copies once per signature of its arguments, not on
every call (:func:`_wanted`). An output FLA returns as one of its inputs (the norm's ``residual_out`` = x, its
``dresidual_in`` = dx) is returned so by the substitute, outside the op. ``QLA_FLA_LEAVES=0`` turns this off.
"""
from __future__ import annotations

import inspect
import logging
import os
import sys

import torch
from torch import Tensor

log = logging.getLogger(__name__)
CONV, NORM = "fla.modules.causal_conv1d.ops", "fla.modules.norm.fused_norm_gate"
MODULES = (CONV, NORM)
_registered: dict[int, str] = {}  # id(FLA's function) -> its name, or "" where its parameters were not ours
_layouts: dict[tuple, tuple] = {}  # (fake, signature of its arguments) -> what _wanted gives
_MAX_LAYOUTS = 256  # cleared when full: new shapes (lengths, batch sizes) keep coming under dynamic shapes


def _leaf(name: str):
    """FLA's leaf function ``name``, as FLA's own code calls it (from whichever of :data:`MODULES` holds it)."""
    return getattr(sys.modules[NORM if name.startswith("layer_norm") else CONV], name)


def _wanted(fake, *args) -> tuple:
    """``(shape, stride, dtype)`` of each output of ``fake`` for ``args``: the fake run on meta copies once per
    signature (each tensor's shape, strides and dtype, every other argument as it is), then cached."""
    key = (fake, *((a.shape, a.stride(), a.dtype) if isinstance(a, Tensor) else a for a in args))
    wanted = _layouts.get(key)
    if wanted is None:
        if len(_layouts) >= _MAX_LAYOUTS:
            _layouts.clear()
        outs = fake(*(a.to("meta") if isinstance(a, Tensor) else a for a in args))
        wanted = _layouts[key] = tuple((o.shape, o.stride(), o.dtype) for o in outs)
    return wanted


def _as(t: Tensor | None, like: tuple, device) -> Tensor:
    """``t`` in the dtype and strides of ``like`` (``(shape, stride, dtype)``): ``t`` itself when it has them, else
    a copy (for ``t`` None, an uninitialised tensor of that layout: an absent output, empty)."""
    shape, stride, dtype = like
    if t is not None and t.dtype == dtype and t.stride() == stride:
        return t
    out = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    return out if t is None else out.copy_(t)


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
    want_y, want_state = _wanted(_fwd_fake, x, weight, bias, residual, initial_state, cu_seqlens, cu_seqlens_cpu,
                                 chunk_indices, output_final_state, activation, chunk_size, layout_fallback)
    return _as(y, want_y, x.device), _as(final_state, want_state, x.device)


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
    want = _wanted(_bwd_fake, x, dy, dht, weight, bias, has_residual, initial_state, cu_seqlens, cu_seqlens_cpu,
                   chunk_indices, activation, chunk_size, layout_fallback)
    return tuple(_as(got, w, x.device) for got, w in zip((dx, dw, db, dh0), want))


@conv_bwd.register_fake
def _bwd_fake(x, dy, dht, weight, bias, has_residual, initial_state, cu_seqlens, cu_seqlens_cpu, chunk_indices,
              activation, chunk_size, layout_fallback):
    return (_dx_like(x, weight), torch.empty_like(weight, memory_format=torch.contiguous_format),
            x.new_empty(0) if bias is None else torch.empty_like(bias, memory_format=torch.contiguous_format),
            x.new_empty(0) if initial_state is None else torch.empty_like(initial_state))


@torch.library.custom_op("qla::fla_layer_norm_gated_fwd", mutates_args=())
def norm_fwd(
    x: Tensor, g: Tensor, weight: Tensor | None, bias: Tensor | None, activation: str, eps: float,
    residual: Tensor | None, out_dtype: torch.dtype | None, residual_dtype: torch.dtype | None, is_rms_norm: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """FLA's ``layer_norm_gated_fwd``: ``(y, mean, rstd, residual_out)``, mean empty for an RMS norm and
    residual_out empty where FLA returns ``x`` itself (:func:`_norm_keeps_x`)."""
    y, mean, rstd, residual_out = _leaf("layer_norm_gated_fwd")(
        x=x, g=g, weight=weight, bias=bias, activation=activation, eps=eps, residual=residual, out_dtype=out_dtype,
        residual_dtype=residual_dtype, is_rms_norm=is_rms_norm,
    )
    want = _wanted(_norm_fwd_fake, x, g, weight, bias, activation, eps, residual, out_dtype, residual_dtype,
                   is_rms_norm)
    got = (y, mean, rstd, None if _norm_keeps_x(x, residual, residual_dtype) else residual_out)
    return tuple(_as(t, w, x.device) for t, w in zip(got, want))


def _norm_keeps_x(x, residual, residual_dtype) -> bool:
    """Whether FLA's norm forward returns ``x`` itself as ``residual_out`` (no residual, no other dtype)."""
    return residual is None and (residual_dtype is None or residual_dtype == x.dtype)


@norm_fwd.register_fake
def _norm_fwd_fake(x, g, weight, bias, activation, eps, residual, out_dtype, residual_dtype, is_rms_norm):
    n = x.shape[0]
    residual_dtype = residual.dtype if residual is not None else residual_dtype
    keeps_x = _norm_keeps_x(x, residual, residual_dtype)
    return (torch.empty_like(x, dtype=x.dtype if out_dtype is None else out_dtype),
            x.new_empty(0 if is_rms_norm else n, dtype=torch.float32), x.new_empty(n, dtype=torch.float32),
            x.new_empty(0) if keeps_x else x.new_empty(x.shape, dtype=residual_dtype))


@torch.library.custom_op("qla::fla_layer_norm_gated_bwd", mutates_args=())
def norm_bwd(
    dy: Tensor, x: Tensor, g: Tensor, weight: Tensor | None, bias: Tensor | None, activation: str, eps: float,
    mean: Tensor | None, rstd: Tensor | None, dresidual: Tensor | None, has_residual: bool, is_rms_norm: bool,
    x_dtype: torch.dtype | None, recompute_output: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """FLA's ``layer_norm_gated_bwd``: ``(dx, dg, dw, db, dresidual_in, y)``, each absent one empty (and
    dresidual_in empty where FLA returns ``dx`` itself: :func:`_norm_reuses_dx`)."""
    out = _leaf("layer_norm_gated_bwd")(
        dy=dy, x=x, g=g, weight=weight, bias=bias, activation=activation, eps=eps, mean=mean, rstd=rstd,
        dresidual=dresidual, has_residual=has_residual, is_rms_norm=is_rms_norm, x_dtype=x_dtype,
        recompute_output=recompute_output,
    )
    dx, dg, dw, db, dres = out[:5]
    want = _wanted(_norm_bwd_fake, dy, x, g, weight, bias, activation, eps, mean, rstd, dresidual, has_residual,
                   is_rms_norm, x_dtype, recompute_output)
    got = (dx, dg, dw, db, None if _norm_reuses_dx(x, has_residual, x_dtype) else dres,
           out[5] if recompute_output else None)
    return tuple(_as(t, w, x.device) for t, w in zip(got, want))


def _norm_reuses_dx(x, has_residual, x_dtype) -> bool:
    """Whether FLA's norm backward returns ``dx`` itself as ``dresidual_in``."""
    return has_residual and (x_dtype is None or x_dtype == x.dtype)


@norm_bwd.register_fake
def _norm_bwd_fake(dy, x, g, weight, bias, activation, eps, mean, rstd, dresidual, has_residual, is_rms_norm,
                   x_dtype, recompute_output):
    n, d = x.shape
    dx = torch.empty_like(x) if x_dtype is None else x.new_empty((n, d), dtype=x_dtype)
    dg = torch.empty_like(g) if x_dtype is None else x.new_empty((n, d), dtype=x_dtype)
    dres = torch.empty_like(x) if has_residual and not _norm_reuses_dx(x, has_residual, x_dtype) else x.new_empty(0)
    return (dx, dg, x.new_empty(0) if weight is None else weight.new_empty(weight.shape),
            x.new_empty(0) if bias is None else bias.new_empty(bias.shape), dres,
            dy.new_empty((n, d)) if recompute_output else x.new_empty(0))


def conv_fwd_substitute(x, weight, bias, residual, initial_state=None, output_final_state=False, activation=None,
                        cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, chunk_size=64,
                        layout_fallback=False, **kwargs):
    """What dynamo traces for FLA's ``causal_conv1d_fwd``: one ``qla::fla_causal_conv1d_fwd``."""
    chunk_size = kwargs.pop("BT", chunk_size)  # FLA's deprecated name
    y, final_state = conv_fwd(x, weight, bias, residual, initial_state, cu_seqlens, cu_seqlens_cpu, chunk_indices,
                              output_final_state, activation, chunk_size, layout_fallback)
    return y, (final_state if output_final_state else None)


def conv_bwd_substitute(x, dy, dht, weight=None, bias=None, residual=None, initial_state=None, activation=None,
                        cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, chunk_size=64,
                        layout_fallback=False, **kwargs):
    """What dynamo traces for FLA's ``causal_conv1d_bwd``: one ``qla::fla_causal_conv1d_bwd``."""
    chunk_size = kwargs.pop("BT", chunk_size)
    dx, dw, db, dh0 = conv_bwd(x, dy, dht, weight, bias, residual is not None, initial_state, cu_seqlens,
                               cu_seqlens_cpu, chunk_indices, activation, chunk_size, layout_fallback)
    return (dx, dw, None if bias is None else db, dy if residual is not None else None,
            None if initial_state is None else dh0)


def norm_fwd_substitute(x, g, weight, bias, activation="swish", eps=1e-5, residual=None, out_dtype=None,
                        residual_dtype=None, is_rms_norm=False):
    """What dynamo traces for FLA's ``layer_norm_gated_fwd``: one ``qla::fla_layer_norm_gated_fwd``."""
    y, mean, rstd, residual_out = norm_fwd(x, g, weight, bias, activation, eps, residual, out_dtype, residual_dtype,
                                           is_rms_norm)
    residual_dtype = residual.dtype if residual is not None else residual_dtype
    return (y, None if is_rms_norm else mean, rstd,
            x if _norm_keeps_x(x, residual, residual_dtype) else residual_out)


def norm_bwd_substitute(dy, x, g, weight, bias, activation="swish", eps=1e-5, mean=None, rstd=None, dresidual=None,
                        has_residual=False, is_rms_norm=False, x_dtype=None, recompute_output=False):
    """What dynamo traces for FLA's ``layer_norm_gated_bwd``: one ``qla::fla_layer_norm_gated_bwd``."""
    dx, dg, dw, db, dres, y = norm_bwd(dy, x, g, weight, bias, activation, eps, mean, rstd, dresidual, has_residual,
                                       is_rms_norm, x_dtype, recompute_output)
    dres = dx if _norm_reuses_dx(x, has_residual, x_dtype) else (dres if has_residual else None)
    out = (dx, dg, None if weight is None else dw, None if bias is None else db, dres)
    return (*out, y) if recompute_output else out


_SUBSTITUTES = {
    CONV: (("causal_conv1d_fwd", conv_fwd_substitute), ("causal_conv1d_bwd", conv_bwd_substitute)),
    NORM: (("layer_norm_gated_fwd", norm_fwd_substitute), ("layer_norm_gated_bwd", norm_bwd_substitute)),
}


def _parameters(fn) -> list[str]:
    """``fn``'s named parameters (through ``__wrapped__``; not ``**kwargs``)."""
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind != p.VAR_KEYWORD]


def register() -> list[str]:
    """Substitute FLA's leaves while dynamo traces, for each of :data:`MODULES` imported (and ``QLA_FLA_LEAVES``
    not ``0``); idempotent. Returns the names registered by this call."""
    if os.environ.get("QLA_FLA_LEAVES") == "0":
        return []
    added = []
    for module_name, substitutes in _SUBSTITUTES.items():
        module = sys.modules.get(module_name)
        for name, substitute in substitutes if module is not None else ():
            original = getattr(module, name, None)
            if original is None or id(original) in _registered:
                continue
            if _parameters(original) != _parameters(substitute):  # another FLA than the one these ops mirror
                log.warning("qla_compile: FLA's %s.%s takes %s, not the parameters qla_compile knows; its graph "
                            "break under torch.compile stays", module_name, name, _parameters(original))
                _registered[id(original)] = ""
                continue
            torch.compiler.substitute_in_graph(original, skip_signature_check=True)(substitute)
            _registered[id(original)] = f"{module_name}.{name}"
            added.append(_registered[id(original)])
            log.info("qla_compile: dynamo substitution registered for %s.%s (no graph break there)", module_name,
                     name)
    return added


def registered() -> list[str]:
    """Names of FLA's leaves substituted so far."""
    return [name for name in _registered.values() if name]
