"""Gate-driven intra-card context parallelism (CP) for the SM90 forward.

With few (sequence, v-head) pairs the fused kernel runs few CTAs and each walks its whole sequence,
so a single long sequence leaves most SMs idle. CP splits such sequences into pieces of ``L`` chunks
and gets every piece's initial state without walking the sequence:

1. **Warm-up plan** (:func:`warmup_plan`, on the device): the state recurrence is affine per piece,
   ``S_end = M S_start + E``. For a head whose gate decays the state by more than e^-10 over the
   piece's last chunks, ``M`` (whose norm is at most that decay when ``beta >= 0`` and ``beta |k|^2 <= 2``)
   is dropped and ``E`` is computed from a zero state over those last chunks only. Other heads run the
   whole piece and also form ``M`` (exact). It also lists the pairs that pass their state on, exact ones first.
2. :func:`transitions` computes ``E`` (and ``M`` where needed) for every piece, by the gate-free chunk map, one CTA
   per item of that list, so the long exact walks start first. An exact piece's walk is a chain of its chunks; a
   forward alone cuts each into as many sub-walks as keep them within one wave (chosen on the device, none shorter
   than ``chunking.MIN_SUB_WALK_CHUNKS``), run side by side, whose maps :func:`compose` folds into the piece's.
3. :func:`scan` chains the pieces of each sequence: ``h0[p + 1] = M[p] h0[p] + E[p]``.
4. The ordinary fused kernel runs over all pieces with these initial states.

Dropping ``M`` changes the result by less than e^-10 (4.5e-5) relative; the ``M`` path is exact up to
rounding (``M S`` is a TF32 tensor-core product, as are the compositions). Where to cut is host code
(``chunking.piece_chunks``, ``chunking.sub_walks``, ``chunking.pieces``) and needs the sequence lengths on the host;
``forward`` caches them and the piece tables, so that a CUDA-graph capture can reuse the plan of an earlier
uncaptured call.
"""

import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from ._build import compiled
from .chunk_recurrence import _PTX, _exp
from .chunking import CHUNK
from .split_state_recurrence import _acc

# log of the state decay over a warm-up window that lets the piece's transition M be dropped
_WARMUP_LOG_DECAY = -10.0
_SCAN_BLOCK_DV = 32
_NO_CHUNKS = 1 << 30  # skip value of a sequence's last piece: its E and M are not needed


@compiled
def warmup_plan(*, need: bool = False):
    """Per (piece, v-head), the chunks the transition kernel skips (see ``chunk_fwd_ws``), in one launch.

    Call as ``kernel(gb, bad, chunk_offsets, final, skip, counts, pairs, listed)``: ``gb`` the forward's ``[slots, H_v,
    2, 64]`` gate table (row 0, column 63: a chunk's summed log gate), ``bad`` its int32 ``[slots, H_v]`` contraction
    flags (both from ``kkt_inverse``), ``chunk_offsets`` the pieces' int32 ``[P+1]`` table, ``final`` int32 ``[P]``
    (nonzero: E and M of that piece are not needed, skip = ``_NO_CHUNKS``); writes int32 ``skip`` ``[P, H_v]`` and the
    transitions' work list: ``pairs`` int32 ``[P H_v]`` gets each (piece, v-head) p H_v + hv that passes its state on,
    the exact ones (skip < 0) from the front, the others from the back, ``counts`` (int32 ``[2]``, zero on entry) their
    numbers; with ``listed`` 0 no list is made (``counts`` and ``pairs`` untouched, ``transitions`` then maps its CTAs
    to the pairs by their index). With ``need`` (``kernel(..., listed, need)``) it also writes int32 ``need[slot, hv]``,
    nonzero for the chunks the transitions run (those a piece does not skip), which
    ``kkt_inverse.kkt_inverse_tc(needed=True)`` reads (slots outside every piece are not written).

    A piece skips its chunks before the last ones whose gate sum drops below -10, provided every per-token
    map ``I - beta k k^T`` of the piece is a contraction (no chunk flagged in ``bad``), which the e^-10 bound
    on the dropped M needs; otherwise (or if the sum never drops that far) skip = -1: the whole piece runs
    and M is formed. One CTA per (v-head, piece): the chunks' flags and gate sums are loaded in parallel,
    the sums walked from shared memory by one thread.
    """
    n_chunk = T.dynamic("n_chunk")
    n_p1 = T.dynamic("n_p1")
    n_pairs = T.dynamic("n_pairs")
    h_v = T.dynamic("h_v")
    C, acc = CHUNK, "float32"
    threads = 128

    @T.macro
    def append(skip_v, final, counts, pairs, p, hv):
        """The pair (p, hv) into the work list: exact ones from the front, the others from the back (the place taken
        into a variable first: in an index TileLang's bounds checks would repeat the atomic)."""
        at = T.alloc_var("int32", init=-1)
        if final[p] == 0:
            if skip_v < 0:
                at = T.atomic_add(counts[0], 1, return_prev=True)
            else:
                at = (n_p1 - 1) * h_v - 1 - T.atomic_add(counts[1], 1, return_prev=True)
            pairs[at] = p * h_v + hv

    @T.macro
    def body(gb, bad, chunk_offsets, final, skip, counts, pairs, listed, need_out):
        with T.Kernel(h_v, n_p1 - 1, threads=threads) as (hv, p):
            bad_s = T.alloc_shared((1,), "int32")  # some token's map is not a contraction
            gs_s = T.alloc_shared((threads,), acc)  # gate sums of the chunks, the last chunk first
            tx = T.get_thread_binding()
            c0 = chunk_offsets[p]
            n_c = chunk_offsets[p + 1] - c0
            first = T.alloc_var("int32", init=-1)  # first chunk of the shortest tail decaying below -10
            if tx == 0:
                bad_s[0] = 0
            T.sync_threads()
            if final[p] == 0:
                decay = T.alloc_var(acc, init=T.float32(0))
                for blk in T.serial(T.ceildiv(n_c, threads)):
                    r = blk * threads + tx
                    if r < n_c:
                        if bad[c0 + n_c - 1 - r, hv] != 0:
                            bad_s[0] = 1
                    gs_s[tx] = T.if_then_else(r < n_c, gb[c0 + T.max(n_c - 1 - r, 0), hv, 0, C - 1], T.float32(0))
                    T.sync_threads()
                    if tx == 0:
                        for t in T.serial(T.min(n_c - blk * threads, threads)):
                            if first < 0:
                                decay = decay + gs_s[t]
                                if decay < _WARMUP_LOG_DECAY:
                                    first = n_c - 1 - (blk * threads + t)
                    T.sync_threads()
            T.sync_threads()
            skip_v = T.if_then_else(final[p] != 0, _NO_CHUNKS, T.if_then_else(bad_s[0] == 0, first, -1))
            if not need:
                if tx == 0:
                    skip[p, hv] = skip_v
                    if listed != 0:
                        append(skip_v, final, counts, pairs, p, hv)
            else:
                skip_s = T.alloc_shared((1,), "int32")
                if tx == 0:
                    skip_s[0] = skip_v
                    skip[p, hv] = skip_v
                    if listed != 0:
                        append(skip_v, final, counts, pairs, p, hv)
                T.sync_threads()
                for blk in T.serial(T.ceildiv(n_c, threads)):
                    r = blk * threads + tx
                    if r < n_c:
                        need_out[c0 + r, hv] = T.if_then_else(r >= skip_s[0], 1, 0)

    if need:
        @T.prim_func
        def kernel_need(
            gb: T.Tensor((n_chunk, h_v, 2, C), acc),
            bad: T.Tensor((n_chunk, h_v), "int32"),
            chunk_offsets: T.Tensor((n_p1,), "int32"),
            final: T.Tensor((n_p1 - 1,), "int32"),
            skip: T.Tensor((n_p1 - 1, h_v), "int32"),
            counts: T.Tensor((2,), "int32"),
            pairs: T.Tensor((n_pairs,), "int32"),
            listed: T.int32,
            need_out: T.Tensor((n_chunk, h_v), "int32"),
        ):
            body(gb, bad, chunk_offsets, final, skip, counts, pairs, listed, need_out)

        return kernel_need

    @T.prim_func
    def kernel(
        gb: T.Tensor((n_chunk, h_v, 2, C), acc),
        bad: T.Tensor((n_chunk, h_v), "int32"),
        chunk_offsets: T.Tensor((n_p1,), "int32"),
        final: T.Tensor((n_p1 - 1,), "int32"),
        skip: T.Tensor((n_p1 - 1, h_v), "int32"),
        counts: T.Tensor((2,), "int32"),
        pairs: T.Tensor((n_pairs,), "int32"),
        listed: T.int32,
    ):
        body(gb, bad, chunk_offsets, final, skip, counts, pairs, listed, None)

    return kernel


@T.macro
def _times_m(m_s, st_s, e, s_f):
    """S <- M S + E (a TF32 product), M in ``m_s`` (K-major), S^T staged in ``st_s``; E a region of a global tensor or
    a shared tile, or None for S <- M S."""
    for a, b in T.Parallel(*s_f.shape):
        st_s[b, a] = s_f[a, b]
    if e is None:
        T.gemm(m_s, st_s, s_f, transpose_B=True, clear_accum=True)
    else:
        T.copy(e, s_f)
        T.gemm(m_s, st_s, s_f, transpose_B=True)


@compiled
def scan(*, dk: int, dv: int, has_h0: bool, block_dv: int = _SCAN_BLOCK_DV, reverse: bool = False):
    """Initial state of every piece, ``h0p[p + 1] = M[p] h0p[p] + E[p]`` within each sequence.

    Call as ``kernel(ht, mt, skip, seq_pieces, h0, h0p)``: ``ht`` = E and ``mt`` = M per piece (fp32, as
    written by the transition kernel; M is read only where ``skip < 0``, elsewhere it counts as 0),
    ``seq_pieces`` the first piece of each sequence, ``h0`` the sequences' initial states.
    One CTA per (sequence, v-head, ``block_dv`` columns) walks that sequence's pieces. Only the state's product
    with M is on the walk's chain: E and M of the next piece are TMA-loaded into a two-stage ring while this
    piece's product runs, and each piece's ``skip`` two pieces ahead.

    With ``reverse`` (the backward) it walks each sequence's pieces from the last:
    ``h0p[p - 1] = M[p]^T h0p[p] + E[p]``, ``h0`` the gradients of the sequences' final states and E the
    state gradient each piece passes back from a zero one; ``h0p[p]`` is the gradient entering piece p. (M^T is
    transposed on its way to shared memory, so it is not loaded by TMA ahead of its step.)
    """
    n_p = T.dynamic("n_p")
    n_seq1 = T.dynamic("n_seq1")
    n_h0 = T.dynamic("n_h0")
    h_v = T.dynamic("h_v")
    BS, acc = block_dv, "float32"

    @T.macro
    def walk_back(ht, mt, skip, h0p, hv, c0, p0, p1, s_f):
        """The reverse walk, from the last piece: each M^T is read (transposed into shared memory) at its own step."""
        m_s = T.alloc_shared((dk, dk), acc)
        st_s = T.alloc_shared((BS, dk), acc)  # S^T: the TF32 product wants both operands K-major
        for j in T.serial(p1 - p0):
            p = p1 - 1 - j  # this piece; the one before takes from it
            T.copy(s_f, h0p[p, hv, :, c0 : c0 + BS])
            if p > p0:
                if skip[p, hv] < 0:
                    for a, b in T.Parallel(dk, dk):  # M^T, K-major
                        m_s[b, a] = mt[p, hv, a, b]
                    _times_m(m_s, st_s, ht[p, hv, :, c0 : c0 + BS], s_f)
                else:
                    T.copy(ht[p, hv, :, c0 : c0 + BS], s_f)

    @T.macro
    def load(ht, mt, p, hv, c0, with_m, e_s, m_s, ready, st):
        """E's columns and (``with_m``) M of piece ``p`` into stage ``st`` of the ring."""
        T.tma_copy(ht[p, hv, :, c0 : c0 + BS], e_s, barrier=ready[st])
        if with_m:
            T.tma_copy(mt[p, hv, :, :], m_s, barrier=ready[st])
        T.barrier_arrive(ready[st])

    @T.macro
    def walk_forward(ht, mt, skip, h0p, hv, c0, p0, p1, s_f):
        """The forward walk: E and M of the next piece load into a two-stage ring during this piece's product."""
        m_s = [T.alloc_shared((dk, dk), acc) for _ in range(2)]
        e_s = [T.alloc_shared((dk, BS), acc) for _ in range(2)]
        st_s = T.alloc_shared((BS, dk), acc)
        ready = T.alloc_barrier([128, 128])
        n = p1 - p0 - 1  # pieces that pass their state on
        sk = T.alloc_var("int32", init=-1)  # skip of this piece and of the next (loaded a piece ahead)
        sk_next = T.alloc_var("int32", init=-1)
        if n > 0:
            sk = skip[p0, hv]
            load(ht, mt, p0, hv, c0, sk < 0, e_s[0], m_s[0], ready, 0)
        if n > 1:
            sk_next = skip[p0 + 1, hv]
        for j in T.serial(n):
            p = p0 + j
            st = j % 2
            T.sync_threads()  # the previous piece is done with the stage the next one loads into
            if j + 1 < n:
                if st == 0:
                    load(ht, mt, p + 1, hv, c0, sk_next < 0, e_s[1], m_s[1], ready, 1)
                else:
                    load(ht, mt, p + 1, hv, c0, sk_next < 0, e_s[0], m_s[0], ready, 0)
            T.copy(s_f, h0p[p, hv, :, c0 : c0 + BS])
            T.barrier_wait(ready[st], (j // 2) % 2)
            if st == 0:
                if sk < 0:
                    _times_m(m_s[0], st_s, e_s[0], s_f)
                else:
                    T.copy(e_s[0], s_f)
            else:
                if sk < 0:
                    _times_m(m_s[1], st_s, e_s[1], s_f)
                else:
                    T.copy(e_s[1], s_f)
            sk = sk_next
            if j + 2 < n:
                sk_next = skip[p + 2, hv]
        T.copy(s_f, h0p[p0 + T.max(n, 0), hv, :, c0 : c0 + BS])

    @T.prim_func
    def kernel(
        ht: T.Tensor((n_p, h_v, dk, dv), acc),
        mt: T.Tensor((n_p, h_v, dk, dk), acc),
        skip: T.Tensor((n_p, h_v), "int32"),
        seq_pieces: T.Tensor((n_seq1,), "int32"),
        h0: T.Tensor((n_h0, h_v, dk, dv), acc),
        h0p: T.Tensor((n_p, h_v, dk, dv), acc),
    ):
        with T.Kernel(n_seq1 - 1, h_v, dv // BS, threads=128) as (seq, hv, bs):
            s_f = T.alloc_fragment((dk, BS), acc)
            c0 = bs * BS
            if has_h0:
                T.copy(h0[seq, hv, :, c0 : c0 + BS], s_f)
            else:
                T.clear(s_f)
            if reverse:
                walk_back(ht, mt, skip, h0p, hv, c0, seq_pieces[seq], seq_pieces[seq + 1], s_f)
            else:
                walk_forward(ht, mt, skip, h0p, hv, c0, seq_pieces[seq], seq_pieces[seq + 1], s_f)

    return kernel


def _sub_walks(n_exact, n_sub_max, n_sm):
    """Sub-walks of each exact walk (device expression, the same in :func:`transitions` and :func:`compose`): as many
    as keep the exact walks' E and M CTAs within one per SM, at most ``n_sub_max``, at least 1."""
    return T.max(1, T.min(n_sub_max, n_sm // T.max(2 * n_exact, 1)))


@compiled
def compose(*, dk: int, dv: int):
    """Each exact walk's map from its sub-walks' (:func:`transitions`), into its pair's slot.

    Call as ``kernel(ht, mt, counts, pairs, n_sub_max, n_sm, n_cta)``: ``ht`` = E and ``mt`` = M fp32 ``[slots, K,
    V]`` and ``[slots, K, K]`` as :func:`transitions` wrote them, the work list from :func:`warmup_plan`, ``n_cta``
    >= ``n_sm`` // 4 (the most exact pairs that get sub-walks). With n_sub > 1 (:func:`_sub_walks`) the i-th listed
    exact pair's maps compose in order, ``M <- M_j M`` and ``E <- M_j E + E_j`` for j = 1 .. n_sub - 1 from its own
    slot's, and are written over it. Two CTAs of two warpgroups per pair, one for M and one for E, each reading
    every M_j once; the products as the scan's (TF32).
    """
    n_slot = T.dynamic("n_slot")
    n_pairs = T.dynamic("n_pairs")
    acc = "float32"
    assert dk == dv, "M and E compose in one layout"

    @T.prim_func
    def kernel(
        ht: T.Tensor((n_slot, dk, dv), acc),
        mt: T.Tensor((n_slot, dk, dk), acc),
        counts: T.Tensor((2,), "int32"),
        pairs: T.Tensor((n_pairs,), "int32"),
        n_sub_max: T.int32,
        n_sm: T.int32,
        n_cta: T.int32,
    ):
        with T.Kernel(n_cta, 2, threads=256) as (i, is_e):
            m_s = T.alloc_shared((dk, dk), acc)
            st_s = T.alloc_shared((dv, dk), acc)
            s_f = T.alloc_fragment((dk, dv), acc)
            n_sub = _sub_walks(counts[0], n_sub_max, n_sm)
            if (n_sub > 1) & (i < counts[0]):
                pair = pairs[i]
                if is_e == 1:
                    T.copy(ht[pair, :, :], s_f)
                else:
                    T.copy(mt[pair, :, :], s_f)
                for j in T.serial(n_sub - 1):
                    slot = n_pairs + i * (n_sub - 1) + j
                    T.copy(mt[slot, :, :], m_s)
                    if is_e == 1:
                        _times_m(m_s, st_s, ht[slot, :, :], s_f)
                    else:
                        _times_m(m_s, st_s, None, s_f)
                if is_e == 1:
                    T.copy(s_f, ht[pair, :, :])
                else:
                    T.copy(s_f, mt[pair, :, :])

    return kernel


# setmaxnreg per warpgroup of ``transitions`` (aux, state 0, state 1, producer): sums to 512 = 65536 registers / 128.
_TRANSITION_NREG = (112, 184, 192, 24)


@compiled
def transitions(*, dk: int, dv: int, dtype: str):
    """The affine map ``S_end = M S_start + E`` of every (piece, v-head), by the gate-free form of the chunk map.

    Call as ``kernel(k, v, tt, gb, cu_seqlens, chunk_offsets, skip, counts, pairs, listed, n_sub_max, n_sm, n_cta, ht,
    mt)``: the pieces' token bounds and first chunk slots (``forward._Pieces``), ``skip`` and the work list ``counts``,
    ``pairs`` from :func:`warmup_plan` (made where ``listed``), ``n_cta`` CTAs (at least 2 P H_v + ``n_sm``, without a
    list 2 P H_v); writes E and, where ``skip < 0``, M of (piece p, v-head hv) to slot ``p H_v + hv`` of ``ht`` (fp32
    ``[slots, K, V]``) and ``mt`` (fp32 ``[slots, K, K]``). ``skip >= 0`` runs only the piece's chunks from ``skip`` on,
    from a zero state, and forms no M. An exact walk (``skip < 0``) is a chain of its piece's chunks: with few of them
    for the SMs it is cut into n_sub = :func:`_sub_walks` sub-walks of ``ceil(chunks / n_sub)`` chunks run side by side,
    sub-walk j > 0 of the i-th listed exact pair into slot ``P H_v + i (n_sub - 1) + j - 1`` (``slots`` >= P H_v +
    ``n_sm`` // 2 then), which :func:`compose` folds in. CTA z takes the z-th item of the list: the exact pairs' walks
    first (E and M of a pair and its sub-walks side by side), then the other pairs' E, in the order listed; the rest
    exit at once. Without a list (``listed`` 0, ``n_sub_max`` 1: where all the CTAs run in one wave the order gains
    nothing, and the list's zeroed counters and reads cost more) CTA z forms E (z even) or M of pair z // 2.
    Per chunk, with X = K^T T~ diag(beta) (``kkt_inverse``'s T~: the gates drop out of it, design doc 1.3),

        E <- e^{gamma_C} E + X (r o V - e^{gamma_C} K E),    M <- e^{gamma_C} M - X (e^{gamma_C} K M)

    (M is the same walk from the identity with V = 0). Each CTA has the split-state layout of
    ``split_state_recurrence``: state
    warpgroup w holds rows [64 w, 64 w + 64) of S^T in fp32 registers (as two 64-column halves of d) and per chunk
    runs Y^T = r_b V^T - e^{gamma_C} S^T K^T (an m64n64 chain over d) and S^T <- e^{gamma_C} S^T + Y^T X^T. The aux
    warpgroup forms X^T = diag(beta) T~^T K (fp16, ``stmatrix``) a stage ahead; the producer warpgroup TMA-loads K,
    V, T~ and [gamma; beta] into a two-stage ring. Precision: S^T in the input dtype for the product with K; Y^T and
    X^T in fp16 (K converted to fp16 for X^T); fp32 accumulators, state and gate tables.
    """
    n_tok = T.dynamic("n_tok")
    n_chunk = T.dynamic("n_chunk")
    n_p1 = T.dynamic("n_p1")
    n_pairs = T.dynamic("n_pairs")  # P H_v
    n_slot = T.dynamic("n_slot")  # P H_v and the sub-walks'
    h_qk = T.dynamic("h_qk")
    h_v = T.dynamic("h_v")
    C, HW, DH = CHUNK, dv // 2, dk // 2
    acc, half = "float32", "float16"
    assert dk == dv, "M and E share the state warpgroups' layout"

    @T.macro
    def x_half(k_h, tt_s, kh, x_f):
        """T~^T K for one half of d (K converted to fp16 first, unless it is fp16)."""
        if dtype == half:
            T.wgmma_gemm(tt_s, k_h, x_f, transpose_A=True, clear_accum=True)
        else:
            for r, d in T.Parallel(C, DH):
                kh[r, d] = T.cast(k_h[r, d], half)
            T.fence_proxy_async()
            T.wgmma_gemm(tt_s, kh, x_f, transpose_A=True, clear_accum=True)

    @T.macro
    def x_stage(kt_st, tt_s, kh, x_f, x_h, gb_s, st, xb_st):
        """X^T = diag(beta) T~^T K of one stage into ``xb_st`` (fp16)."""
        x_half(kt_st[0], tt_s, kh[0], x_f[0])
        x_half(kt_st[1], tt_s, kh[1], x_f[1])
        T.wait_wgmma(0)
        for a, d in T.Parallel(C, DH):
            x_h[0][a, d] = T.cast(x_f[0][a, d] * gb_s[st, 1, a], half)
            x_h[1][a, d] = T.cast(x_f[1][a, d] * gb_s[st, 1, a], half)
        T.copy(x_h[0], xb_st[0])
        T.copy(x_h[1], xb_st[1])

    @T.macro
    def load_halves(x, tiles, start, head, full, st):
        """Rows [start, start + C) of head ``head`` of ``x`` as two 64-column tiles (TMA)."""
        T.tma_copy(x[start : start + C, head, 0:DH], tiles[0], barrier=full[st])
        T.tma_copy(x[start : start + C, head, DH : 2 * DH], tiles[1], barrier=full[st])

    @T.macro
    def load_stage(x, tiles, start, head, full, st):
        """Stage ``st``'s two tiles of ``x`` (``tiles[stage][half]``), by :func:`load_halves`."""
        if st == 0:
            load_halves(x, tiles[0], start, head, full, st)
        else:
            load_halves(x, tiles[1], start, head, full, st)

    @T.macro
    def store_half(dst, slot, w, s_lo, s_hi):
        """State warpgroup ``w``'s rows of S^T to the columns [w HW, (w + 1) HW) of ``dst[slot]``."""
        for a, d in T.Parallel(HW, DH):
            dst[slot, d, w * HW + a] = s_lo[a, d]
            dst[slot, DH + d, w * HW + a] = s_hi[a, d]

    @T.macro
    def u_product(a_lo, a_hi, kt_st, u_f, vb_st, vt):
        """U^T = S^T K^T over the two halves of d, and this warpgroup's V^T (``ldmatrix.trans``) of one stage."""
        T.wgmma_gemm(a_lo, kt_st[0], u_f, transpose_B=True, clear_accum=True)
        T.wgmma_gemm(a_hi, kt_st[1], u_f, transpose_B=True)
        T.copy(vb_st, vt)

    @T.macro
    def update(y_h, xb_st, s_lo, s_hi):
        """S^T += Y^T X^T, X^T's two column halves from one stage."""
        T.wgmma_gemm(y_h, xb_st[0], s_lo)
        T.wgmma_gemm(y_h, xb_st[1], s_hi)

    @T.macro
    def state_half(w, is_m, kt, vb, xb, gb_s, r_s, full, empty, x_ready, ht, mt, slot, n_run, keep):
        """State warpgroup ``w``: rows [w HW, (w + 1) HW) of S^T (E^T, or M^T from the identity) into ``slot``,
        where ``keep``."""
        T.set_max_nreg(_TRANSITION_NREG[1 + w], 1)
        s_lo = T.alloc_fragment((HW, DH), acc)  # S^T[a, d], d in [0, DH)
        s_hi = T.alloc_fragment((HW, DH), acc)  # d in [DH, dk)
        a_lo = T.alloc_fragment((HW, DH), dtype)
        a_hi = T.alloc_fragment((HW, DH), dtype)
        u_f = T.alloc_fragment((HW, C), acc)
        y_h = T.alloc_fragment((HW, C), half)
        vt = T.alloc_fragment((C, HW), dtype)
        T.annotate_layout({vt: _acc(HW, C, transposed=True)})
        decay = T.alloc_var(acc)
        for a, d in T.Parallel(HW, DH):
            s_lo[a, d] = T.cast(is_m & (d == w * HW + a), acc)
            s_hi[a, d] = T.cast(is_m & (DH + d == w * HW + a), acc)
        for j in T.serial(n_run):
            st = j % 2
            ph = (j // 2) % 2
            T.barrier_wait(full[st], ph)
            for a, d in T.Parallel(HW, DH):
                a_lo[a, d] = T.cast(s_lo[a, d], dtype)
                a_hi[a, d] = T.cast(s_hi[a, d], dtype)
            if st == 0:
                u_product(a_lo, a_hi, kt[0], u_f, vb[0], vt)
            else:
                u_product(a_lo, a_hi, kt[1], u_f, vb[1], vt)
            decay = _exp(gb_s[st, 0, C - 1])
            T.barrier_wait(x_ready[st], ph)  # r_b too
            T.wait_wgmma(0)
            for a, b in T.Parallel(HW, C):
                y_h[a, b] = T.cast(T.if_then_else(is_m, T.float32(0), T.cast(vt[b, a], acc) * r_s[st, b])
                                   - decay * u_f[a, b], half)
            for a, d in T.Parallel(HW, DH):
                s_lo[a, d] = s_lo[a, d] * decay
                s_hi[a, d] = s_hi[a, d] * decay
            if st == 0:
                update(y_h, xb[0], s_lo, s_hi)
            else:
                update(y_h, xb[1], s_lo, s_hi)
            T.wait_wgmma(0)
            T.barrier_arrive(empty[st])
        if keep:
            if is_m:
                store_half(mt, slot, w, s_lo, s_hi)
            else:
                store_half(ht, slot, w, s_lo, s_hi)

    @T.prim_func
    def kernel(
        k: T.Tensor((n_tok, h_qk, dk), dtype),
        v: T.Tensor((n_tok, h_v, dv), dtype),
        tt: T.Tensor((n_chunk, h_v, C, C), half),
        gb: T.Tensor((n_chunk, h_v, 2, C), acc),
        cu_seqlens: T.Tensor((n_p1,), "int32"),
        chunk_offsets: T.Tensor((n_p1,), "int32"),
        skip: T.Tensor((n_p1 - 1, h_v), "int32"),
        counts: T.Tensor((2,), "int32"),
        pairs: T.Tensor((n_pairs,), "int32"),
        listed: T.int32,
        n_sub_max: T.int32,
        n_sm: T.int32,
        n_cta: T.int32,
        ht: T.Tensor((n_slot, dk, dv), acc),
        mt: T.Tensor((n_slot, dk, dk), acc),
    ):
        with T.Kernel(n_cta, threads=512) as z:
            T.import_source(_PTX)
            kt = [[T.alloc_shared((C, DH), dtype) for _ in range(2)] for _ in range(2)]  # [stage][half of d] K
            vb = [[T.alloc_shared((C, HW), dtype) for _ in range(2)] for _ in range(2)]  # [stage][half] V
            ttb = [T.alloc_shared((C, C), half) for _ in range(2)]  # T~ per stage
            gb_s = T.alloc_shared((2, 2, C), acc)  # [gamma; beta]
            r_s = T.alloc_shared((2, C), acc)  # r_b, 0 past the piece's end
            kh = [T.alloc_shared((C, DH), half) for _ in range(2)]  # K in fp16 (the aux's, one stage)
            xb = [[T.alloc_shared((C, DH), half) for _ in range(2)] for _ in range(2)]  # [stage][half] X^T
            T.annotate_layout({b: make_swizzled_layout(b) for b in vb[0] + vb[1] + ttb + kh + xb[0] + xb[1]})

            full = T.alloc_barrier([96, 96])  # 3 producer warps + TMA bytes
            empty = T.alloc_barrier([384, 384])  # every consumer thread
            x_ready = T.alloc_barrier([128, 128])  # X^T and r of the stage

            # the z-th item of the work list: exact walks (E, M, each in n_sub sub-walks), then skipping pairs' E;
            # without a list E and M of pair z // 2
            n_exact = T.if_then_else(listed != 0, counts[0], 0)
            n_sub = _sub_walks(n_exact, n_sub_max, n_sm)
            n_x = 2 * n_sub * n_exact  # exact items
            in_list = (listed != 0) & (z < n_x + counts[1])
            pair = T.alloc_var("int32", init=T.if_then_else(
                listed == 0, T.min(z // 2, n_pairs - 1), T.if_then_else(
                    z < n_x, pairs[T.min(z // (2 * n_sub), n_pairs - 1)],
                    T.if_then_else(in_list, pairs[T.max(n_pairs - 1 - (z - n_x), 0)], 0))))
            sub = T.if_then_else(z < n_x, z % n_sub, 0)
            is_m = T.alloc_var("bool", init=T.if_then_else(listed == 0, z % 2 == 1,
                                                           (z < n_x) & ((z // n_sub) % 2 == 1)))
            p = pair // h_v
            hv = pair % h_v
            hk = hv // (h_v // h_qk)
            bos = cu_seqlens[p]
            seqlen = cu_seqlens[p + 1] - bos
            coff = chunk_offsets[p]
            n_iter = T.ceildiv(seqlen, C)
            sk = skip[p, hv]
            # without a list: E where the piece passes its state on, M where it is exact too
            live = T.if_then_else(listed == 0, (z < 2 * n_pairs) & (sk != _NO_CHUNKS) & ((sk < 0) | (z % 2 == 0)),
                                  in_list)
            n_each = T.ceildiv(n_iter, n_sub)  # chunks per sub-walk where skip < 0
            # chunks [i0, i0 + n_run) run: with skip < 0 the sub-walk's; else those from skip on
            i0 = T.alloc_var("int32", init=T.if_then_else(sk < 0, T.min(sub * n_each, n_iter), T.min(sk, n_iter)))
            n_run = T.if_then_else(live, T.if_then_else(sk < 0, T.min(n_each, n_iter - i0), n_iter - i0), 0)
            slot = T.if_then_else(sub == 0, pair, n_pairs + (z // (2 * n_sub)) * (n_sub - 1) + sub - 1)
            keep = T.alloc_var("bool", init=live)
            # (is_m and keep are variables: as expressions TileLang asks for a barrier inside the aux warpgroup's
            # branch)
            tx = T.get_thread_binding()

            if tx < 128:  # WG0: the aux warpgroup, X^T = diag(beta) T~^T K and r
                T.set_max_nreg(_TRANSITION_NREG[0], 0)
                x_f = [T.alloc_fragment((C, DH), acc) for _ in range(2)]
                x_h = [T.alloc_fragment((C, DH), half) for _ in range(2)]
                for j in T.serial(n_run):
                    st = j % 2
                    length = T.min(seqlen - (i0 + j) * C, C)
                    T.barrier_wait(full[st], (j // 2) % 2)
                    for b in T.Parallel(C):
                        r_s[st, b] = _exp(gb_s[st, 0, C - 1] - gb_s[st, 0, b]) * T.cast(b < length, acc)
                    if st == 0:
                        x_stage(kt[0], ttb[0], kh, x_f, x_h, gb_s, st, xb[0])
                    else:
                        x_stage(kt[1], ttb[1], kh, x_f, x_h, gb_s, st, xb[1])
                    T.fence_proxy_async()
                    T.barrier_arrive(x_ready[st])
                    T.barrier_arrive(empty[st])
            elif tx < 256:
                state_half(0, is_m, kt, [vb[0][0], vb[1][0]], xb, gb_s, r_s, full, empty, x_ready, ht, mt, slot,
                           n_run, keep)
            elif tx < 384:
                state_half(1, is_m, kt, [vb[0][1], vb[1][1]], xb, gb_s, r_s, full, empty, x_ready, ht, mt, slot,
                           n_run, keep)
            else:  # WG3: producer warps
                T.set_max_nreg(_TRANSITION_NREG[3], 0)
                for j in T.serial(n_run):
                    st = j % 2
                    start = bos + (i0 + j) * C
                    if tx < 416:
                        T.barrier_wait(empty[st], (j // 2 + 1) % 2)
                        load_stage(k, kt, start, hk, full, st)
                        T.barrier_arrive(full[st])
                    elif tx < 448:
                        T.barrier_wait(empty[st], (j // 2 + 1) % 2)
                        if not is_m:  # M's walk has V = 0
                            load_stage(v, vb, start, hv, full, st)
                        T.barrier_arrive(full[st])
                    elif tx < 480:
                        T.barrier_wait(empty[st], (j // 2 + 1) % 2)
                        if st == 0:
                            T.tma_copy(tt[coff + i0 + j, hv, :, :], ttb[0], barrier=full[st])
                        else:
                            T.tma_copy(tt[coff + i0 + j, hv, :, :], ttb[1], barrier=full[st])
                        T.tma_copy(gb[coff + i0 + j, hv, :, :], gb_s[st, :, :], barrier=full[st])
                        T.barrier_arrive(full[st])

    return kernel


def variants():
    """``(kernel name, params)`` of every scan, compose and transition variant (K = V = 128)."""
    return ([("scan", dict(dk=128, dv=128, has_h0=has_h0, reverse=reverse))
             for has_h0 in (True, False) for reverse in (False, True)]
            + [("scan", dict(dk=128, dv=128, has_h0=has_h0, block_dv=block_dv))
               for has_h0 in (True, False) for block_dv in (8, 16)]
            + [("warmup_plan", dict(need=need)) for need in (False, True)]
            + [("compose", dict(dk=128, dv=128))]
            + [("transitions", dict(dk=128, dv=128, dtype=dtype)) for dtype in ("bfloat16", "float16")])
