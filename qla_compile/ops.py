"""The ``qla::`` custom ops: forward and backward of chunked Gated DeltaNet, with fake impls and autograd.

``qla::chunk_gdr_fwd`` returns ``(o, final_state, tt, gb, cp_cache)``; the final state is always produced (fp32)
and the public function drops it when it was not asked for.  ``tt, gb`` are the Hopper forward's gate-free
inverse T~ and per-chunk [gamma; beta], or on FLA's kernels FLA's A and gate cumsum (for a traced call that a
backward follows), flat and not differentiable (``dispatch.aux_like``; else empty); ``cp_cache`` holds the
context-parallel pieces' initial states and transitions when the Hopper forward split its sequences and its last
argument ``for_backward`` says a backward will follow (the public function passes whether autograd will
differentiate the call); its length is a bound known from shapes (``dispatch.cp_cache_like``), so no output of
either op has a data-dependent size.
``qla::chunk_gdr_bwd`` takes what the forward took plus ``do``/``dht`` (and optionally ``tt``/``gb``/``cp_cache``)
and returns every input gradient; gradients of absent optional inputs (``A_log``, ``dt_bias``,
``initial_state``) come back as empty tensors, since an op cannot return ``None``.
The forward saves its inputs, ``tt, gb`` (together about half the size of a bf16 ``v``) and ``cp_cache`` (128 KB
per piece and v-head, at most 64 MB beyond 128 KB per sequence and v-head: ``kernels.cp_cache_numel``): the
Hopper backward reuses them and recomputes the chunk states, FLA's backward leaf takes FLA's aux, and the
reference backward recomputes all.
Eager calls run the same forward and backward through :class:`EagerChunkGDR`, without the ops' dispatch.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from . import dispatch
from .reference import GDROptions


def _state_shape(v: Tensor, k: Tensor, cu_seqlens: Tensor | None, v_first: bool):
    n = v.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    K, HV, V = k.shape[-1], v.shape[2], v.shape[-1]
    return (n, HV, V, K) if v_first else (n, HV, K, V)


@torch.library.custom_op("qla::chunk_gdr_fwd", mutates_args=())
def chunk_gdr_fwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Tensor | None, dt_bias: Tensor | None, initial_state: Tensor | None, cu_seqlens: Tensor | None,
    scale: float, use_qk_l2norm: bool, use_gate: bool, use_beta_sigmoid: bool, allow_neg_eigval: bool,
    state_v_first: bool, for_backward: bool = True, keys_normalised: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    opts = GDROptions(scale, use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval, state_v_first)
    return dispatch.forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts, for_backward,
                            keys_normalised=keys_normalised)


@chunk_gdr_fwd.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, use_qk_l2norm, use_gate,
      use_beta_sigmoid, allow_neg_eigval, state_v_first, for_backward=True, keys_normalised=False):
    ht = v.new_empty(_state_shape(v, k, cu_seqlens, state_v_first), dtype=torch.float32)
    o = torch.empty_like(v, memory_format=torch.contiguous_format)
    opts = GDROptions(scale, use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval, state_v_first)
    return (o, ht, *dispatch.aux_like(q, k, v, cu_seqlens, opts, for_backward),
            dispatch.cp_cache_like(q, k, v, cu_seqlens, for_backward))


@torch.library.custom_op("qla::chunk_gdr_bwd", mutates_args=())
def chunk_gdr_bwd(
    do: Tensor, dht: Tensor | None,
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    A_log: Tensor | None, dt_bias: Tensor | None, initial_state: Tensor | None, cu_seqlens: Tensor | None,
    scale: float, use_qk_l2norm: bool, use_gate: bool, use_beta_sigmoid: bool, allow_neg_eigval: bool,
    state_v_first: bool, tt: Tensor | None = None, gb: Tensor | None = None, cp_cache: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    opts = GDROptions(scale, use_qk_l2norm, use_gate, use_beta_sigmoid, allow_neg_eigval, state_v_first)
    aux = None if tt is None else (tt, gb, cp_cache)
    grads = dispatch.backward(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts, aux)
    return tuple(q.new_empty(0) if x is None else x.contiguous() for x in grads)


@chunk_gdr_bwd.register_fake
def _(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, use_qk_l2norm, use_gate,
      use_beta_sigmoid, allow_neg_eigval, state_v_first, tt=None, gb=None, cp_cache=None):
    def like(x):
        return q.new_empty(0) if x is None else torch.empty_like(x, memory_format=torch.contiguous_format)

    return tuple(like(x) for x in (q, k, v, g, beta, A_log, dt_bias, initial_state))


_N_FLAGS = 6  # scale and the five booleans after cu_seqlens


def _setup_context(ctx, inputs, output):
    _keep(ctx, inputs[:9], inputs[9:], output)  # q .. cu_seqlens, then the flags, for_backward, keys_normalised


def _keep(ctx, saved, flags, output):
    """Saves ``saved`` and the forward's aux for the backward, and the flags."""
    _, _, tt, gb, cp_cache = output
    ctx.mark_non_differentiable(tt, gb, cp_cache)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the aux (nor for an unused o or final state)
    ctx.save_for_backward(*saved, tt, gb, cp_cache)
    ctx.flags = flags[:_N_FLAGS]


def _input_grads(ctx, do, dht, eager: bool):
    """The backward of the op's autograd and (``eager``) of :class:`EagerChunkGDR`, which calls
    ``dispatch.backward`` directly instead of the op ``qla::chunk_gdr_bwd``: the saved inputs' gradients, None for
    absent ones, then None for cu_seqlens, the flags, for_backward and keys_normalised."""
    *inputs, tt, gb, cp_cache = ctx.saved_tensors  # q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens
    do = torch.zeros_like(inputs[2]) if do is None else do
    if eager:
        grads = dispatch.backward(do, dht, *inputs, GDROptions(*ctx.flags), (tt, gb, cp_cache))
    else:
        grads = chunk_gdr_bwd(do, dht, *inputs, *ctx.flags, tt, gb, cp_cache)
    return _returned(inputs[:8], grads)


def _returned(inputs, grads):
    """The gradients of the present ones of ``inputs`` (q .. initial_state), None for absent ones and for
    cu_seqlens, the flags, for_backward and keys_normalised."""
    return tuple(None if x is None else d for x, d in zip(inputs, grads)) + (None,) * (3 + _N_FLAGS)


def _backward(ctx, do, dht, _dtt, _dgb, _dcp):
    return _input_grads(ctx, do, dht, eager=False)


chunk_gdr_fwd.register_autograd(_backward, setup_context=_setup_context)


def _profiled(name: str):
    """A profiler range named ``name`` while a profiler records, else nothing (a range costs ~10 us of host time)."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


class EagerChunkGDR(torch.autograd.Function):
    """``qla::chunk_gdr_fwd`` and its backward for eager calls, without the custom-op dispatch around them:
    the same forward and backward (``dispatch``), about 60 us less host time per forward on a CPU core (an eager
    layer at batch 1 waits on its host). On the Hopper path it keeps the kernels' inputs (``dispatch.Activated``:
    q and k normalised, v contiguous, the activated gates, the norms' rstd) instead of the raw ones, so the
    backward recomputes no activation and copies nothing (as FLA's layer keeps its normalised q and k). Profiled
    under the ops' names. Traced calls keep the ops (``api.op_call``)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, *flags):
        with _profiled("qla::chunk_gdr_fwd"):
            output, act = dispatch.forward_keeping(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                                                   GDROptions(*flags[:_N_FLAGS]), flags[_N_FLAGS],
                                                   keys_normalised=flags[_N_FLAGS + 1])
        rest = (g, beta, A_log, dt_bias, initial_state, cu_seqlens)
        _keep(ctx, (q, k, v, *rest) if act is None else (*act, *rest), flags, output)
        ctx.activated = act is not None
        return output

    @staticmethod
    def backward(ctx, do, dht, _dtt, _dgb, _dcp):
        with _profiled("qla::chunk_gdr_bwd"):
            if not ctx.activated:
                return _input_grads(ctx, do, dht, eager=True)
            saved = ctx.saved_tensors  # Activated's seven, g .. cu_seqlens, tt, gb, cp_cache
            act, rest = dispatch.Activated(*saved[:7]), saved[7:13]
            do = torch.zeros_like(act.v) if do is None else do
            grads = dispatch.backward_activated(do, dht, act, *rest, GDROptions(*ctx.flags), saved[13:])
            return _returned((act.q, act.k, act.v, *rest[:5]), grads)
