"""Which implementation runs a call: decided from host-known facts only (device, arch, dtype, shapes).

- ``"hopper"``: the TileLang kernels in ``qla_compile.kernels`` (SM90, bf16/fp16, K = V = 128);
- ``"fla"``: FLA's ``chunk_gated_delta_rule`` (its Triton kernels), for CUDA calls our kernels do not serve
  when FLA is installed: never slower than what the user had;
- ``"reference"``: the chunked PyTorch implementation in ``qla_compile.reference`` (everything else).

Each fallback says so once in the log, and :func:`choices` counts what ran and why (``qla_compile.explain``).
FLA's layer options (q/k L2 norm, gate-in-kernel, beta sigmoid, ``state_v_first``) are applied around the
kernels: the activations by fused Triton passes (``kernels.input_activations``) in eager calls, the L2 norm's
backward inside the backward kernels (from the norms' rstd); traced calls have them as graph ops already
(``api.op_call``). Set ``QLA_FORCE_REFERENCE=1`` to run the reference everywhere (debugging).
Nothing here reads device data, so a dense call stays CUDA-graph capturable.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import importlib.util
import inspect
import logging
import os
from typing import NamedTuple

import torch

from .reference import (
    CHUNK,
    GDROptions,
    activation_bwd,
    activate_gates,
    chunk_gdr_bwd_reference,
    chunk_gdr_fwd_reference,
    l2norm_fp32,
)

log = logging.getLogger(__name__)
_choices: collections.Counter = collections.Counter()  # (implementation, reason) -> forward and backward calls


@functools.cache
def _kernels():
    """The Hopper kernels' host code, or None where TileLang is not installed (found without importing it)."""
    if importlib.util.find_spec("tilelang") is None:
        return None
    from .kernels import forward as kernels

    return kernels


@functools.cache
def input_activations():
    """The fused Triton input activations of eager Hopper calls (``kernels.input_activations``), or None where
    Triton does not import (then they run as torch ops, logged once)."""
    try:
        from .kernels import input_activations as module
    except ImportError as exc:
        log.warning("qla_compile: Triton does not import (%s); the q/k L2 norm, gate and beta activations of "
                    "eager calls run as torch ops, several passes slower", exc)
        return None
    return module


@functools.cache
def fla_op():
    """FLA's ``chunk_gated_delta_rule``, or None where FLA is not installed (imported on first use only)."""
    if importlib.util.find_spec("fla") is None:
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as exc:  # noqa: BLE001  (an FLA that does not import here is no FLA)
        log.warning("qla_compile: FLA is installed but does not import (%s); not using it", exc)
        return None
    return chunk_gated_delta_rule


def choose(q, k, v) -> tuple[str, str]:
    """``(implementation, why)`` for these inputs: ``"hopper"``, ``"fla"`` or ``"reference"``."""
    if os.environ.get("QLA_FORCE_REFERENCE") == "1":
        return "reference", "QLA_FORCE_REFERENCE=1"
    kernels = _kernels()
    why = "TileLang is not installed" if kernels is None else kernels.unsupported(q, k, v)
    if why is None:
        return "hopper", "our Hopper kernels (SM90, bf16/fp16, K = V = 128)"
    if q.device.type == "cuda" and fla_op() is not None:
        return "fla", f"our Hopper kernels do not take {why}; FLA's kernels run"
    return "reference", f"our Hopper kernels do not take {why}; the PyTorch reference runs" + (
        "" if q.device.type != "cuda" else " (install fla-core for FLA's kernels)")


def select(q, k, v) -> str:
    """The implementation that runs for these inputs (:func:`choose`); counted, and a fallback on a GPU logged
    once."""
    impl, why = choose(q, k, v)
    if impl != "hopper" and q.device.type == "cuda" and (impl, why) not in _choices:
        log.warning("qla_compile: %s", why)
    _choices[impl, why] += 1
    return impl


def choices() -> collections.Counter:
    """How often each ``(implementation, why)`` ran a forward or backward in this process."""
    return collections.Counter(_choices)


def _state_to_kv(state, opts: GDROptions):
    if state is None:
        return None
    state = state.float()
    return (state.mT if opts.state_v_first else state).contiguous()


def aux_like(q, k, v, cu_seqlens, opts: GDROptions | None = None, for_backward: bool = False):
    """Uninitialised tensors shaped like the forward's aux ``(tt, gb)``, flattened to 1-D (a dimension that may
    be 1 would cost a torch.compile guard and a recompile):

    - Hopper, for a backward: the forward's T~ (fp16 ``[n_slots, H_v, 64, 64]``) and [gamma; beta] (fp32
      ``[n_slots, H_v, 2, 64]``) with ``n_slots = B*T // 64 + N``; for a forward alone none (in those dtypes);
    - FLA's kernels, for a backward (:func:`_keeps_fla_aux`): FLA's A (``[B, T, H_v, 64]`` in k's dtype) and
      its chunk-local gate cumsum (fp32 ``[B, T, H_v]``), which FLA's backward takes;
    - else none: the backward recomputes."""
    impl = choose(q, k, v)[0]
    if impl == "hopper":
        n_seq = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        rows = (q.shape[0] * q.shape[1] // CHUNK + n_seq) * v.shape[2] * CHUNK if for_backward else 0
        return v.new_empty(rows * CHUNK, dtype=torch.float16), v.new_empty(rows * 2, dtype=torch.float32)
    n = q.shape[0] * q.shape[1] * v.shape[2] if impl == "fla" and _keeps_fla_aux(opts, for_backward) else 0
    return k.new_empty(n * CHUNK), v.new_empty(n, dtype=torch.float32)


def cp_cache_like(q, k, v, cu_seqlens, for_backward: bool):
    """A tensor shaped like the forward's ``cp_cache`` (fp32, 1-D): where the Hopper forward runs for a
    backward, :func:`kernels.cp_cache_numel` elements, a bound from shapes alone on what its context-parallel
    plan keeps (so the op has no data-dependent output size), else none."""
    n = 0
    if for_backward and choose(q, k, v)[0] == "hopper":
        n_seq = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        n = _kernels().cp_cache_numel(q.shape[0] * q.shape[1], n_seq, v.shape[2], k.shape[3], v.shape[3])
    return v.new_empty(n, dtype=torch.float32)


def forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts: GDROptions, for_backward=True,
            keys_normalised=False):
    """``(o, final_state, tt, gb, cp_cache)``; ``tt, gb`` as described by :func:`aux_like`, ``cp_cache`` the
    Hopper forward's context-parallel cache (``kernels.chunk_gdr_fwd_hopper_aux``; sized as
    :func:`cp_cache_like`, filled when the forward split; empty when ``for_backward`` is false, which also
    picks the forward-only splitting rule). ``keys_normalised``: k comes L2-normalised (the norm lifted out of the
    op into a traced graph), which spares a context-parallel Hopper forward a read of k."""
    return forward_keeping(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts, for_backward,
                           keys_normalised=keys_normalised)[0]


class Activated(NamedTuple):
    """The Hopper kernels' inputs of one call: q and k (L2-normalised where asked), v, contiguous; the fp32 log
    gate and beta; q's and k's rows' rstd (fp32 ``[B*T*H]``; None without the norm)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    q_rstd: torch.Tensor | None
    k_rstd: torch.Tensor | None


def forward_keeping(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts: GDROptions,
                    for_backward=True, keys_normalised=False):
    """``(output, activated)``: :func:`forward`'s output and, for a Hopper call with the Triton activations, the
    kernels' inputs (:class:`Activated`), which :func:`backward_activated` takes instead of recomputing them
    (else None)."""
    impl = select(q, k, v)
    if impl == "fla" and _on_fla_leaves(opts):
        o, ht, *fla_aux = _fla_leaf_forward(q, k, v, g, beta, initial_state, cu_seqlens, opts)
        aux = fla_aux if for_backward else aux_like(q, k, v, cu_seqlens)
        return (o, ht, *aux, q.new_empty(0, dtype=torch.float32)), None
    if impl != "hopper":
        run = _fla_forward if impl == "fla" else chunk_gdr_fwd_reference
        o, ht = run(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts)
        return (o, ht, *aux_like(q, k, v, cu_seqlens), q.new_empty(0, dtype=torch.float32)), None
    act = _activated(q, k, v, g, beta, A_log, dt_bias, opts)
    o, ht, tt, gb, _, cp_cache = _kernels().chunk_gdr_fwd_hopper_aux(
        act.q, act.k, act.v, act.g, act.beta, opts.scale, _state_to_kv(initial_state, opts), cu_seqlens,
        for_backward=for_backward, keys_normalised=keys_normalised or opts.use_qk_l2norm_in_kernel,
    )
    output = o, (ht.mT.contiguous() if opts.state_v_first else ht), tt.view(-1), gb.view(-1), cp_cache
    return output, (act if input_activations() is not None else None)


def backward(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts: GDROptions, aux=None):
    """Every input gradient; ``aux``: the forward's flat ``(tt, gb, cp_cache)``, used on the Hopper path (None
    there recomputes them)."""
    impl = select(q, k, v)
    if impl == "fla" and aux is not None and aux[0].numel():
        return _fla_leaf_backward(do, dht, q, k, v, g, beta, initial_state, cu_seqlens, opts, aux)
    if impl != "hopper":
        run = _fla_backward if impl == "fla" else chunk_gdr_bwd_reference
        return run(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts)
    act = _activated(q, k, v, g, beta, A_log, dt_bias, opts)
    return _hopper_backward(do, dht, act, (q, k), g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts, aux)


def backward_activated(do, dht, act: Activated, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                       opts: GDROptions, aux=None):
    """:func:`backward` of a Hopper call from its kernels' inputs as :func:`forward_keeping` kept them (``g``,
    ``beta``: the raw ones), without recomputing them."""
    select(act.q, act.k, act.v)  # counted as every backward is
    return _hopper_backward(do, dht, act, None, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts, aux)


def _hopper_backward(do, dht, act: Activated, qk, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                     opts: GDROptions, aux):
    """The Hopper backward from the kernels' inputs ``act``, then the activations' (``qk``: the raw q and k,
    which the activations' backward as torch ops reads). The L2 norm's backward is formed in the kernels where
    ``act`` has the norms' rstd (the Triton activations normalised q and k)."""
    from .kernels.backward import chunk_gdr_bwd_hopper

    if aux is not None and aux[0].numel():  # empty: the forward ran alone, so the backward recomputes
        h_v = act.v.shape[2]
        aux = (aux[0].view(-1, h_v, CHUNK, CHUNK), aux[1].view(-1, h_v, 2, CHUNK), aux[2])
    else:
        aux = None
    rstd = None if act.q_rstd is None else (act.q_rstd, act.k_rstd)
    dq, dk, dv, dga, dba, dh0 = chunk_gdr_bwd_hopper(
        do.contiguous(), _state_to_kv(dht, opts), act.q, act.k, act.v, act.g, act.beta, opts.scale,
        _state_to_kv(initial_state, opts), cu_seqlens, aux=aux, rstd=rstd,
    )
    acts = input_activations()
    if acts is None:
        dq, dk, dg, dbeta, dA_log, ddt_bias = activation_bwd(
            *qk, g, beta, A_log, dt_bias, opts, dq.float(), dk.float(), dga.float(), dba.float()
        )
    else:
        dg, dbeta, dA_log, ddt_bias = acts.gates_bwd(g, beta, A_log, dt_bias, opts, dga, dba)
    if dh0 is not None:
        dh0 = (dh0.mT if opts.state_v_first else dh0).contiguous().to(initial_state.dtype)
    return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0


def _activated(q, k, v, g, beta, A_log, dt_bias, opts: GDROptions) -> Activated:
    """The inputs as the Hopper kernels take them, by :func:`input_activations` (q/k normalised and v made
    contiguous in one launch, the gates in another), or by torch ops where that is None (such a call is
    counted)."""
    acts = input_activations()
    if acts is None:
        _choices["hopper", "the input activations as torch ops (Triton does not import)"] += 1
        if opts.use_qk_l2norm_in_kernel:
            q, k = l2norm_fp32(q), l2norm_fp32(k)
        return Activated(q, k, v, *activate_gates(g, beta, A_log, dt_bias, opts, torch.float32), None, None)
    q_rstd = k_rstd = None
    if opts.use_qk_l2norm_in_kernel:
        (q, k), (q_rstd, k_rstd), v = acts.l2norm(q, k, copy=v)
    else:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return Activated(q, k, v, *acts.gates(g, beta, A_log, dt_bias, opts), q_rstd, k_rstd)


@functools.cache
def fla_leaves():
    """``(forward, backward)``: FLA's ``chunk_gated_delta_rule_fwd`` / ``_bwd``, what its autograd function calls
    between the input activations and the output, where FLA has them with the parameters called here; else None
    (logged once: such calls recompute FLA's forward in their backward)."""
    if fla_op() is None:
        return None
    try:
        from fla.ops.gated_delta_rule import chunk as module
    except Exception:  # noqa: BLE001
        module = None
    fns = tuple(getattr(module, f"chunk_gated_delta_rule_{d}", None) for d in ("fwd", "bwd"))
    if None in fns or not all(_FLA_LEAF_PARAMS[d] <= set(inspect.signature(fn).parameters)
                              for d, fn in zip(("fwd", "bwd"), fns)):
        log.warning("qla_compile: this FLA has no chunk_gated_delta_rule_fwd/_bwd as qla_compile knows them; "
                    "compiled calls on FLA's kernels run its forward again in their backward")
        return None
    return fns


_FLA_LEAF_PARAMS = {
    "fwd": {"q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "state_v_first", "cu_seqlens"},
    "bwd": {"q", "k", "v", "g", "beta", "A", "scale", "initial_state", "do", "dht", "state_v_first", "cu_seqlens"},
}


def _on_fla_leaves(opts: GDROptions | None) -> bool:
    """Whether a call on FLA's kernels runs FLA's forward leaf (:func:`fla_leaves`) rather than its public op: one
    with the input activations outside the op (as traced calls have them), so that FLA's leaves take exactly its
    inputs. The leaf skips the public op's backend dispatch and autograd function (``bench/fla_route_host.py``:
    ~45 us of host time a call on the development machine's CPU)."""
    plain = opts is not None and not (opts.use_qk_l2norm_in_kernel or opts.use_gate_in_kernel
                                      or opts.use_beta_sigmoid_in_kernel)
    return plain and fla_leaves() is not None


def _keeps_fla_aux(opts: GDROptions | None, for_backward: bool) -> bool:
    """Whether a call on FLA's kernels keeps FLA's own aux for its backward: one on FLA's leaves
    (:func:`_on_fla_leaves`) that a backward follows."""
    return for_backward and _on_fla_leaves(opts)


def _fla_leaf_forward(q, k, v, g, beta, initial_state, cu_seqlens, opts: GDROptions):
    """``(o, final_state, A, g_cumsum)`` from FLA's forward leaf, its A and gate cumsum flat (the aux). The
    inputs go contiguous and the call runs on their device, as FLA's ``input_guard`` has them for its leaves."""
    q, k, v, g, beta, initial_state = _guarded(q, k, v, g, beta, initial_state)
    with _on_device(q):
        g_cumsum, o, A, ht, *_ = fla_leaves()[0](
            q=q, k=k, v=v, g=g, beta=beta, scale=opts.scale, initial_state=initial_state, output_final_state=True,
            state_v_first=opts.state_v_first, cu_seqlens=cu_seqlens,
        )
    return o.to(v.dtype), ht.float(), A.to(k.dtype).reshape(-1), g_cumsum.float().reshape(-1)


def _fla_leaf_backward(do, dht, q, k, v, g, beta, initial_state, cu_seqlens, opts: GDROptions, aux):
    """Every input gradient from FLA's backward leaf, given the forward's aux (:func:`_fla_leaf_forward`)."""
    shape = v.shape[:3]
    q, k, v, beta, initial_state, do, dht = _guarded(q, k, v, beta, initial_state, do.to(v.dtype), dht)
    with _on_device(q):
        dq, dk, dv, db, dg, dh0, *_ = fla_leaves()[1](
            q=q, k=k, v=v, g=aux[1].view(shape), beta=beta, A=aux[0].view(*shape, CHUNK), scale=opts.scale,
            initial_state=initial_state, do=do, dht=dht, state_v_first=opts.state_v_first, cu_seqlens=cu_seqlens,
        )
    dh0 = None if dh0 is None else dh0.to(initial_state.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), db.to(beta.dtype), None, None, dh0


def _guarded(*tensors):
    return tuple(None if t is None else t.contiguous() for t in tensors)


def _on_device(t):
    """The CUDA device context of ``t`` (FLA's Triton kernels launch on the current device), or a no-op."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def _fla_call(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts: GDROptions):
    return fla_op()(
        q, k, v, g, beta, scale=opts.scale, initial_state=initial_state, output_final_state=True,
        use_qk_l2norm_in_kernel=opts.use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=opts.use_beta_sigmoid_in_kernel,
        allow_neg_eigval=opts.allow_neg_eigval, state_v_first=opts.state_v_first, cu_seqlens=cu_seqlens,
        use_gate_in_kernel=opts.use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
    )


def _fla_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts: GDROptions):
    """``(o, final_state)`` from FLA's op (the op's implementation runs below autograd: no graph recorded)."""
    o, ht = _fla_call(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts)
    return o.to(v.dtype), ht.float()


def _fla_backward(do, dht, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, opts: GDROptions):
    """Every input gradient through FLA's own backward, its forward run again under autograd: for calls whose
    forward kept no aux of FLA's (:func:`_keeps_fla_aux`: eager calls with the activations inside the op, or an
    FLA without the leaves)."""
    inputs = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    with _recording():
        leaves = [None if x is None else x.detach().requires_grad_() for x in inputs]
        o, ht = _fla_call(*leaves, cu_seqlens, opts)
        outs, grads_out = [o], [do.to(o.dtype)]
        if dht is not None:
            outs.append(ht)
            grads_out.append(dht.to(ht.dtype))
        present = [x for x in leaves if x is not None]
        grads = iter(torch.autograd.grad(outs, present, grads_out, allow_unused=True))
    return tuple(None if x is None else _or_zeros(next(grads), x) for x in leaves)


@contextlib.contextmanager
def _recording():
    """Autograd recording within an op's implementation, which the dispatcher runs with autograd excluded."""
    with torch.enable_grad(), torch._C._PreserveDispatchKeyGuard():
        for key in (torch._C.DispatchKey.ADInplaceOrView, torch._C.DispatchKey.AutogradFunctionality):
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
        yield


def _or_zeros(grad, like):
    return torch.zeros_like(like) if grad is None else grad
