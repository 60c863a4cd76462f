"""Host entry point of the GDN chunked backward on SM90: :func:`chunk_gdr_bwd_hopper`.

Pipeline (one packed token stream, chunks numbered as in ``kkt_inverse``; notation in ``chunk_grads``):

1. ``kkt_inverse`` -- T~ and [gamma; beta] per chunk (the forward's kernel), or the forward's own
   from ``chunk_gdr_fwd_hopper_aux`` when passed as ``aux``.
2. :func:`_chunk_states` -- every chunk-start state S in fp16 by the fused forward in its
   ``store_h`` mode, context-parallel under the forward's rule (the pieces' initial states and transitions
   from the forward's ``cp_cache`` when ``aux`` has it, else recomputed).
3. ``reverse_recurrence.chunk_dstates_ws`` -- the reverse recurrence of dS, storing each chunk's incoming dS' and
   dV' (input dtype), dh0 and the row sums of dS' o S that dg's gamma_C term needs; context-parallel over
   the same pieces as step 2, from the gradients entering them (:func:`_entering_gradients`, beside step 2
   on a second stream when the forward's transitions are given). It publishes each chunk in per-(chunk,
   qk-head) counters once written.
4. ``chunk_grads`` -- per (chunk, qk-head), looping over the GVA group's v-heads: dv, dg and dbeta
   per v-head, dq and dk summed over the group on chip. Launched as step 3's programmatic dependent, it
   runs beside it on the SMs the recurrence leaves idle, taking chunks in the order they are published
   and waiting for each (:func:`_reverse_and_grads`).
"""

import heapq

import torch

from . import chunking
from ._build import Kernels
from .chunking import CHUNK
from .forward import (_DTYPES, _block_dv, _cache_put, _capturing, _check, _check_context_parallel, _chunk_tables,
                      _cp_plan, _gate_inverse, _held, _host_lengths, _n_slots, _piece_initial_states, _sm_count,
                      _state_arg, _tables, cached_plan_views, lasting_copy)

# the kernel modules' kernels, through ``_build.kernel``: prebuilt binaries load without importing TileLang
chunk_grads = Kernels("chunk_grads")
chunk_recurrence = Kernels("chunk_recurrence")
context_parallel = Kernels("context_parallel")
reverse_recurrence = Kernels("reverse_recurrence")


def _chunk_states(q3, k3, v3, tt, gb, bad, cu, offsets, order, initial_state, dtype, cp, cached=None):
    """Every chunk-start state of the forward recurrence, fp16 ``[n_slots, H_v, K, V]`` (slot numbering
    of ``offsets``), by the fused forward in its ``store_h`` mode; context-parallel over the pieces ``cp``
    (a ``forward._Pieces``, whose tables ``cu, offsets, order`` then are) when given, their initial states and
    transitions taken from ``cached``, the views of the forward's ``cp_cache`` (``forward._cp_cache_views``),
    when given (else planned with the contraction flags ``bad`` of ``kkt_inverse``). Returns
    ``(h, transitions)``: None or the pieces' ``(skip, m)`` that the reverse pass reuses."""
    n_slots, h_v, dk, dv = tt.shape[0], v3.shape[1], k3.shape[2], v3.shape[2]
    h = torch.empty(n_slots, h_v, dk, dv, device=q3.device, dtype=torch.float16)
    transitions = None
    if cp is not None:
        n_p = cp.order.numel()
        if cached is None:
            h0, bv, skip, m, _ = _piece_initial_states(q3, k3, v3, tt, gb, bad, initial_state, dtype, cp,
                                                       backward=True)
        else:
            (h0, m, skip), bv = cached, _block_dv(n_p * h_v, dv)
        has_h0, transitions = True, (skip, m)
    else:
        has_h0 = initial_state is not None
        h0 = _state_arg(initial_state, h_v, dk, dv, q3.device)
        bv = _block_dv((cu.numel() - 1) * h_v, dv)
    chunk_recurrence.chunk_fwd_ws(dk=dk, dv=dv, dtype=dtype, has_h0=has_h0, block_dv=bv, store_h=True)(
        q3, k3, v3, tt, gb, cu, offsets, order, h0, h)
    return h, transitions


# chunk_grads' launch orders, per (device, lengths, piece length, V-heads, DV slices, SMs)
_ORDERS: dict = {}  # bounded as forward's caches (``_cache_put``)
# list-scheduling the reverse recurrence's grid is skipped past this many CTAs (its walks then count as
# starting together)
_SCHEDULED_CTAS = 8192


def _walk_starts(n_c, ctas_per_walk, n_sm):
    """When each walk of ``n_c`` chunks starts in ``chunk_dstates_ws`` (in chunk steps): its CTAs are
    dispatched longest walk first, one per SM, each busy for its chunks plus one step."""
    if len(n_c) * ctas_per_walk <= n_sm or len(n_c) * ctas_per_walk > _SCHEDULED_CTAS:
        return [0] * len(n_c)
    free, start = [0] * n_sm, [0] * len(n_c)
    for w in sorted(range(len(n_c)), key=lambda w: -n_c[w]):
        for _ in range(ctas_per_walk):
            t = heapq.heappop(free)
            start[w] = max(start[w], t)
            heapq.heappush(free, t + n_c[w] + 1)
    return start


def _publish_order(n_c, ctas_per_walk, n_sm):
    """Chunk slots (int64, on the host) in the order the reverse recurrence publishes them: walk ``w`` (its
    chunks in slots ``sum(n_c[:w])`` on) publishes them last to first, one per step, from when its CTAs start
    (:func:`_walk_starts`); ties in slot order."""
    n_c_t = torch.tensor(n_c, dtype=torch.int64)
    walk = torch.repeat_interleave(torch.arange(len(n_c)), n_c_t)
    ends = n_c_t.cumsum(0)
    published = torch.tensor(_walk_starts(n_c, ctas_per_walk, n_sm))[walk] + ends[walk] - torch.arange(walk.numel())
    return torch.argsort(published, stable=True)


def _chunk_table(lens, order):
    """Rows ``(slot, first token, length, 0)`` of the chunk slots ``order`` of sequences of ``lens`` tokens
    (int32, on the host): what ``chunk_grads`` would otherwise search ``cu_seqlens`` for."""
    lens_t = torch.tensor(lens, dtype=torch.int64)
    n_c = (lens_t + CHUNK - 1) // CHUNK
    seq = torch.repeat_interleave(torch.arange(len(lens)), n_c)[order]
    ci = order - (n_c.cumsum(0) - n_c)[seq]
    start = (lens_t.cumsum(0) - lens_t)[seq] + ci * CHUNK
    length = torch.minimum(lens_t[seq] - ci * CHUNK, torch.tensor(CHUNK))
    return torch.stack([order, start, length, torch.zeros_like(order)], 1).to(torch.int32)


def _grads_order(lens, chunks, h_v, n_bv, device):
    """``chunk_grads``' launch table (int32 ``[slots, 4]``, on the device): the chunk slots in
    :func:`_publish_order` for the walks of the reverse recurrence (the sequences of ``lens`` tokens, or their
    pieces of ``chunks`` chunks, each with ``h_v * n_bv`` CTAs), as :func:`_chunk_table` rows. Built once per
    plan (a captured call reuses it, kept for good then); ``lens`` None (unknown without a synchronisation) or all
    zero, or a plan not built yet while a CUDA graph is captured, gives a placeholder row of -1: the kernel then
    takes the slots last to first and searches for their sequences."""
    capturing = _capturing(device)
    n_sm = _sm_count(device.index)
    key = None if lens is None or not any(lens) else (str(device), tuple(lens), chunks, h_v, n_bv, n_sm)
    if key is None or (capturing and key not in _ORDERS):
        return torch.full((1, 4), -1, device=device, dtype=torch.int32)
    if key not in _ORDERS:
        if chunks is None:
            n_c = [-(-n // CHUNK) for n in lens]
        else:
            offs = chunking.pieces(lens, chunks)[1]
            n_c = [b - a for a, b in zip(offs, offs[1:])]
        _cache_put(_ORDERS, key, lasting_copy(_chunk_table(lens, _publish_order(n_c, h_v * n_bv, n_sm)), device))
    return _held(_ORDERS, key, capturing)


def _entering_gradients(q3, k3, do3, tt, gb, dht, scale, dtype, cp, transitions, entering):
    """Into ``entering`` (fp32 ``[P, H_v, K, V]``): the state gradient entering each context-parallel piece of
    ``cp``, given the final-state gradient ``dht`` (fp32 or None) and the pieces' ``transitions`` ``(skip, m)``.
    Every piece but a sequence's first passes back the state gradient of a zero one
    (``reverse_recurrence.chunk_dstates_ws``' transition mode, over the leading chunks that reach the piece's start
    undecayed); a reverse scan (``context_parallel.scan``) chains them. Needs no chunk state, so it may run beside the
    state recompute."""
    h_v, dk, dv = do3.shape[1], q3.shape[2], do3.shape[2]
    skip, m = transitions
    passed = torch.empty_like(entering)
    reverse_recurrence.chunk_dstates_ws(dk=dk, dv=dv, dtype=dtype, has_h0=True, has_dht=False,
                               block_dv=_block_dv(cp.order.numel() * h_v, dv), transition=True)(
        q3, k3, do3, tt, gb, cp.cu, cp.offsets, cp.order, skip, cp.first, float(scale), passed)
    has_dht = dht is not None
    dht = _state_arg(dht, h_v, dk, dv, q3.device)
    context_parallel.scan(dk=dk, dv=dv, has_h0=has_dht, reverse=True)(passed, m, skip, cp.seq_pieces, dht, entering)


_SIDE_STREAMS: dict = {}


def _side_stream(device):
    """A second stream of ``device`` (one per device, made once)."""
    key = str(device)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[key]


def _states_and_entering(q3, k3, v3, do3, tt, gb, bad, walk, dht, initial_state, scale, dtype, cp, cached):
    """The chunk states ``h`` (:func:`_chunk_states` over ``walk``) and the state gradient the reverse recurrence
    starts its walks from: ``dht`` itself, or when split into the pieces ``cp`` the gradients entering them
    (:func:`_entering_gradients`). With the forward's transitions (``cached``, as for :func:`_chunk_states`)
    those run on a second stream beside the state recompute. They are submitted first: the transition pass takes the
    SMs first, the recompute fills those its short walks (contracting pieces) free, and the reverse scan (a few
    CTAs) runs beside the recompute rather than after it. What they read and write stays referenced here
    until the streams join."""
    if cp is None:
        return _chunk_states(q3, k3, v3, tt, gb, bad, *walk, initial_state, dtype, cp)[0], dht
    h_v, dk, dv = do3.shape[1], q3.shape[2], do3.shape[2]
    entering = torch.empty(cp.order.numel(), h_v, dk, dv, device=q3.device, dtype=torch.float32)
    if cached is None:
        h, transitions = _chunk_states(q3, k3, v3, tt, gb, bad, *walk, initial_state, dtype, cp)
        _entering_gradients(q3, k3, do3, tt, gb, dht, scale, dtype, cp, transitions, entering)
        return h, entering
    main, side = torch.cuda.current_stream(q3.device), _side_stream(q3.device)
    side.wait_stream(main)  # the fork
    with torch.cuda.stream(side):
        _entering_gradients(q3, k3, do3, tt, gb, dht, scale, dtype, cp, (cached[2], cached[1]), entering)
    h, _ = _chunk_states(q3, k3, v3, tt, gb, bad, *walk, initial_state, dtype, cp, cached)
    main.wait_stream(side)
    return h, entering


def _reverse_and_grads(q3, k3, v3, do3, tt, gb, h, walk, seqs, dht, has_h0, scale, dtype, cp, lens, rstd):
    """The reverse recurrence (``reverse_recurrence.chunk_dstates_ws``) and, launched as its programmatic dependent so
    that it fills the SMs the recurrence leaves idle, ``chunk_grads``: ``(dq, dk, dv, dg, dbeta, dh0)``
    in the kernels' layouts. The recurrence walks ``walk`` from ``dht`` (fp32 or None): the tables of the
    context-parallel pieces ``cp`` from their entering gradients (:func:`_entering_gradients`), all at once, or
    of the sequences ``seqs``. It publishes each chunk per qk-head in ``ready`` once its
    dS', dV' and sd rows are written for every v-head and DV slice; chunk_grads takes the chunks in the order
    of :func:`_grads_order` (``lens``: the sequence lengths, or None) and waits for each; with ``rstd`` (q's and
    k's, fp32 ``[n_tok, h_qk]``) it forms the L2 norm's backward too."""
    cu, offsets, order = walk
    n_slots, h_v, dk, dv = tt.shape[0], do3.shape[1], q3.shape[2], do3.shape[2]
    h_qk = q3.shape[1]
    f32 = dict(device=q3.device, dtype=torch.float32)
    has_dht = dht is not None
    dht = _state_arg(dht, h_v, dk, dv, q3.device)
    n_seq = cu.numel() - 1
    block_dv = _block_dv(n_seq * h_v, dv)
    dh = torch.empty(n_slots, h_v, dk, dv, device=q3.device, dtype=q3.dtype)
    dvp = torch.empty(n_slots, h_v, CHUNK, dv, device=q3.device, dtype=q3.dtype)
    # each sequence's dh0 from its first piece when split (cp.dh0_row), else walk n's to row n (cu[:1] = [0])
    dh0_rows = cu[:1] if cp is None else cp.dh0_row
    dh0 = torch.empty(n_seq if cp is None else cp.seq_pieces.numel() - 1, h_v, dk, dv, **f32)
    sd = torch.empty(n_slots, h_v, 2, dk, **f32)  # slot 1 unwritten and unread when V is not split
    ready = torch.zeros(n_slots, h_qk, device=q3.device, dtype=torch.int32)
    grads_order = _grads_order(lens, None if cp is None else cp.chunks, h_v, dv // block_dv, q3.device)
    # dq, dk summed over each GVA group in the kernel (fp32 through the scratch when G > 1) and written in the
    # input dtype; every row of every output is written (the spare chunk slots zero the rows past cu_seqlens[-1]).
    # Allocated before the recurrence starts: chunk_grads runs beside it, so nothing the recurrence reads may be
    # freed for them (every input here stays referenced until both are launched).
    n_tok = q3.shape[0]
    acc = torch.empty(n_slots if h_v > h_qk else 1, h_qk, 2, CHUNK, dk, **f32)
    dq, dkh, dvo = torch.empty_like(q3), torch.empty_like(k3), torch.empty_like(v3)
    dg = torch.empty(h_v, n_tok, **f32)
    db = torch.empty(h_v, n_tok, **f32)
    reverse_recurrence.chunk_dstates_ws(dk=dk, dv=dv, dtype=dtype, has_h0=has_h0, has_dht=has_dht, block_dv=block_dv)(
        q3, k3, do3, tt, gb, h, cu, offsets, order, dh0_rows, dht, float(scale), dh, dvp, dh0, sd, ready)
    norm = rstd is not None
    rstd = tuple(r.view(n_tok, h_qk) for r in rstd) if norm else (torch.empty(1, h_qk, **f32),) * 2  # (not read)
    chunk_grads.chunk_grads(dk=dk, dv=dv, dtype=dtype, pdl=True, l2norm=norm)(
        q3, k3, v3, do3, tt, gb, h, dh, dvp, sd, ready, (h_v // h_qk) * (dv // block_dv), seqs[0], seqs[1],
        grads_order, float(scale), *rstd, acc, dq, dkh, dvo, dg, db)
    return dq, dkh, dvo, dg, db, dh0


def _check_aux(aux, n_slots, h_v, device):
    if not isinstance(aux, (tuple, list)) or len(aux) not in (2, 3):
        raise TypeError(f"aux must be (tt, gb) or (tt, gb, cp_cache) from chunk_gdr_fwd_hopper_aux, got "
                        f"{type(aux).__name__}")
    for name, t, shape, dtype in zip(("tt", "gb"), aux, ((n_slots, h_v, CHUNK, CHUNK), (n_slots, h_v, 2, CHUNK)),
                                     (torch.float16, torch.float32)):
        if t.shape != shape or t.dtype != dtype or t.device != device or not t.is_contiguous():
            raise ValueError(f"aux {name} must be a contiguous {dtype} tensor of shape {shape} on {device}, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    if len(aux) == 3 and aux[2] is not None:
        c = aux[2]
        if c.dim() != 1 or c.dtype != torch.float32 or c.device != device or not c.is_contiguous():
            raise ValueError(f"aux cp_cache must be a contiguous 1-D float32 tensor on {device}, got {c.dtype} "
                             f"{tuple(c.shape)} on {c.device}")


def chunk_gdr_bwd_hopper(do, dht, q, k, v, g, beta, scale: float, initial_state=None, cu_seqlens=None,
                         context_parallel=None, aux=None, rstd=None):
    """GDN chunked backward on SM90: ``(dq, dk, dv, dg, dbeta, dh0)``.

    Inputs as for ``chunk_gdr_fwd_hopper`` with the activations already applied: q, k ``[B,T,H_qk,K]``
    (L2-normalised if that option is on), v and do ``[B,T,H_v,V]`` (bf16/fp16, one dtype), g ``[B,T,H_v]``
    the activated log gate (<= 0), beta ``[B,T,H_v]`` activated; dht and initial_state fp32 ``[N,H_v,K,V]``
    or None; cu_seqlens ``[N+1]`` (B == 1) or None; ``context_parallel`` as for the forward (it splits
    the state recompute and the reverse pass); ``aux``: ``(tt, gb)`` from ``chunk_gdr_fwd_hopper_aux`` on the
    same q, k, g, beta and cu_seqlens, used instead of recomputing them, or ``(tt, gb, cp_cache)`` with its
    context-parallel cache too (used when the forward filled it for this call's plan,
    ``forward.cached_plan_views``). ``rstd``: ``(q_rstd, k_rstd)``, fp32 ``[B*T*H_qk]``, where q and k are
    L2-normalised rows (``input_activations.l2norm``'s rstd): dq, dk are then the raw rows', the norm's backward
    formed in ``chunk_grads``. dq, dk, dv come back in q's dtype, dg and dbeta in g's and beta's dtypes as
    ``[B, T, H_v]`` views of head-major ``[H_v, B*T]`` storage (not contiguous), dh0 fp32 (None without an
    initial state). Tokens past ``cu_seqlens[-1]`` get zero gradients.
    """
    _check(q, k, v, g, beta, initial_state, cu_seqlens)
    _check_context_parallel(context_parallel)
    B, T_, h_qk, dk = q.shape
    h_v, dv = v.shape[2], v.shape[3]
    dtype = _DTYPES[q.dtype]
    n_tok = B * T_
    n_seq = B if cu_seqlens is None else cu_seqlens.numel() - 1
    dev = q.device
    if aux is not None:
        _check_aux(aux, _n_slots(n_tok, n_seq), h_v, dev)
    if rstd is not None and (len(rstd) != 2 or any(
            r.dtype != torch.float32 or r.numel() != n_tok * h_qk or r.device != dev or not r.is_contiguous()
            for r in rstd)):
        raise ValueError(f"rstd must be (q_rstd, k_rstd), contiguous float32 tensors of {n_tok * h_qk} elements on "
                         f"{dev}, got {[(r.dtype, tuple(r.shape), str(r.device)) for r in rstd]}")
    if n_tok == 0:  # nothing to launch; dh0 is dht passed straight through
        dh0 = None
        if initial_state is not None:
            dh0 = torch.zeros_like(initial_state, dtype=torch.float32) if dht is None else dht.float().clone()
        return tuple(torch.zeros_like(x) for x in (q, k, v, g, beta)) + (dh0,)
    q3 = q.reshape(n_tok, h_qk, dk).contiguous()
    k3 = k.reshape(n_tok, h_qk, dk).contiguous()
    v3 = v.reshape(n_tok, h_v, dv).contiguous()
    do3 = do.reshape(n_tok, h_v, dv).to(v.dtype).contiguous()
    cu, offsets, order, spans = _tables(cu_seqlens, B, T_, dev)

    cp_cache = aux[2] if aux is not None and len(aux) == 3 else None
    cp = _cp_plan(context_parallel, cu_seqlens, B, T_, h_v, dev, backward=True)
    # the views of the forward's context-parallel cache, when it holds this plan's pieces
    cached = None if cp is None else cached_plan_views(cp_cache, cp, h_v, dk, dv)
    if aux is None or (cp is not None and cached is None):
        # the gate inverse here: no aux, or a plan to make without the forward's contraction flags
        tt, gb, bad = _chunk_tables(n_tok, n_seq, h_v, dev)
        _gate_inverse(k3, g, beta, spans, (tt, gb, bad), dtype)
    else:
        tt, gb, bad = aux[0], aux[1], None
    # the two recurrences walk the pieces when split (they stand for the sequences there), else the sequences
    walk = (cu, offsets, order) if cp is None else (cp.cu, cp.offsets, cp.order)
    h, dht = _states_and_entering(q3, k3, v3, do3, tt, gb, bad, walk, dht, initial_state, scale, dtype, cp, cached)
    has_h0 = initial_state is not None
    lens = _host_lengths(cu_seqlens, B, T_, read=False)
    dq, dkh, dvo, dg, db, dh0 = _reverse_and_grads(q3, k3, v3, do3, tt, gb, h, walk, (cu, offsets), dht, has_h0,
                                                   scale, dtype, cp, lens, rstd)
    dq = dq.view(B, T_, h_qk, dk)
    dkh = dkh.view(B, T_, h_qk, dk)
    dg = dg.t().to(g.dtype).view(B, T_, h_v)
    db = db.t().to(beta.dtype).view(B, T_, h_v)
    return dq, dkh, dvo.view(B, T_, h_v, dv), dg, db, (dh0 if has_h0 else None)
