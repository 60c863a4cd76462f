"""The GDN forward chunk recurrence on SM90 with the state in registers, split over two warpgroups (chunk C = 64).

One CTA per (sequence, v-head) over all of V = 128, 512 threads, looping over the sequence's chunks; T~ and the
gate cumsum come from ``kkt_inverse`` (notation and chunk numbering there). State warpgroup w holds its half of
the state transposed, S^T[v, :] for v in [64 w, 64 w + 64) (fp32 registers, as two 64-column halves of d), and
uses it as the register A operand of its wgmmas, so S never goes through shared memory. Per chunk, with tokens b
as columns:

    [U^T | O^T] = S^T [K; Q]^T              (one m64n128 chain: K and Q stacked, per half of d, in one tile)
    W'^T = V^T - e_b U^T,  V'^T = W'^T A_g^T
    O^T = scale e_b O^T + V'^T P_g^T,  S^T <- e^{gamma_C} S^T + (r_b V'^T) K   (two m64n64 products, one per half)

K and Q are TMA-loaded as [64 x 64] halves into the two row ranges of a [128 x 64] tile per half of d (TileLang
0.1.15 lowers TMA into a row range of a 64-column swizzled tile, not of a 128-column one), so the U and O products
are one dependent chain of eight m64n128k16 steps instead of sixteen m64n64k16 ones. V^T is read by
``ldmatrix.trans`` and O^T written by ``stmatrix.trans`` (fragments in the accumulator's layout, seen transposed),
then TMA-stored; the store's reads are waited for only before the tile is written again.

* WG0 "aux", a chunk ahead: the per-column tables e_b, scale e_b, r_b (0 past the sequence end);
  A_g = Gamma o T~ o beta_col in place over T~ (``ldmatrix`` / ``stmatrix``); then P_g = scale Gamma o Q K^T
  from the same stacked tiles.
  It is warpgroup 0 because TileLang 0.1.15 binds an annotated fragment layout (``_acc``) to threads 0..127.
* WG1, WG2 "state": the chain above for the two halves of V; they share nothing but the input ring.
* WG3 "producer": one warp TMA-loads the stacked K and Q tiles, one v (a tile per state warpgroup), one T~ and
  [gamma; beta] into a two-stage ring (``pdl_sync`` first: right after ``kkt_inverse`` the kernel is its
  programmatic dependent).

Same call and outputs as ``chunk_recurrence.chunk_fwd_ws(block_dv=dv, pdl=True)``; chosen over it where every
(sequence or piece, v-head) pair fills a CTA (``forward._state_kernel``, ``forward._forward_cp``). Precision: fp16
A_g, P_g, W' and V' for P_g V', r o V' in the input dtype (the dtype of K it multiplies), S^T in the input dtype for
the products with K and Q, fp32 accumulators, state and gate tables. Rows of a partial chunk past the sequence end
have beta = 0 and r = 0 (as in ``chunk_fwd_ws``) and are not stored.
"""

import tilelang.language as T
from tilelang.layout import Fragment, make_swizzled_layout

from ._build import compiled
from .chunk_recurrence import _PTX, _exp, _gamma_times, _lg2
from .chunking import CHUNK

# setmaxnreg per warpgroup (aux, state 0, state 1, producer): sums to 512 = 65536 registers / 128.
_NREG = (104, 192, 192, 24)


def _acc(rows, cols, transposed=False):
    """A warpgroup's wgmma accumulator layout for ``[rows = 64, cols]`` (the one TileLang infers), or, with
    ``transposed``, the same threads and registers indexed ``[cols, rows]``: the layouts ``ldmatrix`` and
    ``stmatrix`` (``.trans`` for the transposed one) fill and drain."""

    def thread(m, n):
        return (m // 16) * 32 + (m % 8) * 4 + (n % 8) // 2

    def index(m, n):
        return (n // 8) * 4 + ((m % 16) // 8) * 2 + n % 2

    if transposed:
        return Fragment((cols, rows), forward_thread_fn=lambda n, m: thread(m, n),
                        forward_index_fn=lambda n, m: index(m, n))
    return Fragment((rows, cols), forward_thread_fn=thread, forward_index_fn=index)


@compiled
def chunk_fwd_split(*, dk: int, dv: int, dtype: str, has_h0: bool):
    """o and the final state; call as ``kernel(q, k, v, tt, gb, cu_seqlens, chunk_offsets, order, ht_rows, h0,
    scale, o, ht)``, the arguments of ``chunk_recurrence.chunk_fwd_ws`` in output mode."""
    n_tok = T.dynamic("n_tok")
    n_chunk = T.dynamic("n_chunk")
    n_seq1 = T.dynamic("n_seq1")
    n_h0 = T.dynamic("n_h0")
    n_rows = T.dynamic("n_rows")
    n_ht = T.dynamic("n_ht")
    h_qk = T.dynamic("h_qk")
    h_v = T.dynamic("h_v")
    C, HW = CHUNK, dv // 2  # HW: the values of v per state warpgroup
    acc, half = "float32", "float16"
    DH = dk // 2  # a half of d: the stacked [K; Q] tiles are 64 columns wide

    @T.macro
    def uo_products(a_lo, a_hi, kq_st, uo_f):
        """[U^T | O^T] = S^T [K; Q]^T as one m64n128 chain over the two K halves."""
        T.wgmma_gemm(a_lo, kq_st[0], uo_f, transpose_B=True, clear_accum=True)
        T.wgmma_gemm(a_hi, kq_st[1], uo_f, transpose_B=True)

    @T.macro
    def update(vr, kq_st, s_lo, s_hi):
        """S^T += (r o V'^T) K, K's two column halves from the stacked tiles."""
        T.wgmma_gemm(vr, kq_st[0][0:C, :], s_lo)
        T.wgmma_gemm(vr, kq_st[1][0:C, :], s_hi)

    @T.macro
    def qk_product(kq_st, p_f):
        """Q K^T from the stacked tiles, over the two halves of d."""
        T.wgmma_gemm(kq_st[0][C : 2 * C, :], kq_st[0][0:C, :], p_f, transpose_B=True, clear_accum=True)
        T.wgmma_gemm(kq_st[1][C : 2 * C, :], kq_st[1][0:C, :], p_f, transpose_B=True)

    @T.macro
    def gate_inverse(t, a_h, gb_s, st):
        """T~ -> A_g = Gamma o T~ o beta_col in place, in fp16 (an fp32 copy's loop is dropped by TileLang 0.1.15)."""
        T.copy(t, a_h)
        for a, b in T.Parallel(C, C):
            a_h[a, b] = T.cast(T.cast(a_h[a, b], acc) * _gamma_times(gb_s, st, a, b, col_log2=_lg2(gb_s[st, 1, b])),
                               half)
        T.copy(a_h, t)

    @T.macro
    def load_kq(q, k, tiles, start, hk, full, st):
        """The stage's K and Q, each half of d into the row ranges [0, C) and [C, 2 C) of that half's tile."""
        T.tma_copy(k[start : start + C, hk, 0:DH], tiles[0][0:C, :], barrier=full[st])
        T.tma_copy(q[start : start + C, hk, 0:DH], tiles[0][C : 2 * C, :], barrier=full[st])
        T.tma_copy(k[start : start + C, hk, DH:dk], tiles[1][0:C, :], barrier=full[st])
        T.tma_copy(q[start : start + C, hk, DH:dk], tiles[1][C : 2 * C, :], barrier=full[st])

    @T.macro
    def load_v(v, tiles, start, hv, full, st):
        T.tma_copy(v[start : start + C, hv, 0:HW], tiles[0], barrier=full[st])
        T.tma_copy(v[start : start + C, hv, HW:dv], tiles[1], barrier=full[st])

    @T.macro
    def store_o(o_w, o, start, length, hv, w):
        """O's tile to global: by TMA (its reads waited for before ``o_w`` is written again), a partial last
        chunk by rows."""
        T.fence_proxy_async()
        if length == C:
            T.tma_copy(o_w, o[start : start + C, hv, w * HW : (w + 1) * HW])
        else:
            for a, b in T.Parallel(C, HW):
                if a < length:
                    o[start + a, hv, w * HW + b] = o_w[a, b]

    @T.macro
    def state_half(w, kq, vb, ttb, gb_s, cf_s, pb, o_w, full, empty, ag_ready, p_ready, h0, o, ht, ht_rows,
                   seq, hv, bos, seqlen, n_iter):
        """State warpgroup ``w``: rows v in [w HW, (w + 1) HW) of S^T and O^T. ``vb``: its V tile of each stage,
        ``o_w``: its O tile (whole 2-D buffers: TileLang lowers copies of those to ldmatrix/stmatrix)."""
        T.set_max_nreg(_NREG[1 + w], 1)
        s_lo = T.alloc_fragment((HW, DH), acc)  # S^T[v, d], d in [0, DH)
        s_hi = T.alloc_fragment((HW, DH), acc)  # d in [DH, dk)
        a_lo = T.alloc_fragment((HW, DH), dtype)
        a_hi = T.alloc_fragment((HW, DH), dtype)
        uo_f = T.alloc_fragment((HW, 2 * C), acc)  # [U^T | O^T]
        o2_f = T.alloc_fragment((HW, C), acc)  # V'^T P_g^T
        vp_f = T.alloc_fragment((HW, C), acc)
        w_h = T.alloc_fragment((HW, C), half)
        vp_h = T.alloc_fragment((HW, C), half)
        vr = T.alloc_fragment((HW, C), dtype)
        vt = T.alloc_fragment((C, HW), dtype)
        ot = T.alloc_fragment((C, HW), dtype)
        T.annotate_layout({vt: _acc(HW, C, transposed=True), ot: _acc(HW, C, transposed=True)})
        decay = T.alloc_var(acc)
        T.pdl_sync()
        if has_h0:
            for a, d in T.Parallel(HW, DH):
                s_lo[a, d] = h0[seq, hv, d, w * HW + a]
                s_hi[a, d] = h0[seq, hv, DH + d, w * HW + a]
        else:
            T.clear(s_lo)
            T.clear(s_hi)
        for i in T.serial(n_iter):
            st = i % 2
            ph = (i // 2) % 2
            start = bos + i * C
            length = T.min(seqlen - i * C, C)
            T.barrier_wait(full[st], ph)
            for a, d in T.Parallel(HW, DH):
                a_lo[a, d] = T.cast(s_lo[a, d], dtype)
                a_hi[a, d] = T.cast(s_hi[a, d], dtype)
            if st == 0:
                uo_products(a_lo, a_hi, kq[0], uo_f)
                T.copy(vb[0], vt)
            else:
                uo_products(a_lo, a_hi, kq[1], uo_f)
                T.copy(vb[1], vt)
            decay = _exp(gb_s[st, 0, C - 1])
            T.barrier_wait(ag_ready[st], ph)
            T.wait_wgmma(0)
            for a, b in T.Parallel(HW, C):
                w_h[a, b] = T.cast(T.cast(vt[b, a], acc) - cf_s[st, 0, b] * uo_f[a, b], half)
            if st == 0:
                T.wgmma_gemm(w_h, ttb[0], vp_f, transpose_B=True, clear_accum=True)
            else:
                T.wgmma_gemm(w_h, ttb[1], vp_f, transpose_B=True, clear_accum=True)
            for a, d in T.Parallel(HW, DH):
                s_lo[a, d] = s_lo[a, d] * decay
                s_hi[a, d] = s_hi[a, d] * decay
            T.wait_wgmma(0)
            for a, b in T.Parallel(HW, C):
                vp_h[a, b] = T.cast(vp_f[a, b], half)
                vr[a, b] = T.cast(vp_f[a, b] * cf_s[st, 2, b], dtype)
            T.barrier_wait(p_ready[st], ph)
            if st == 0:
                T.wgmma_gemm(vp_h, pb[0], o2_f, transpose_B=True, clear_accum=True)
                update(vr, kq[0], s_lo, s_hi)
            else:
                T.wgmma_gemm(vp_h, pb[1], o2_f, transpose_B=True, clear_accum=True)
                update(vr, kq[1], s_lo, s_hi)
            T.wait_wgmma(2)  # P_g V' done (the two state products may still run)
            for a, b in T.Parallel(HW, C):
                ot[b, a] = T.cast(uo_f[a, C + b] * cf_s[st, 1, b] + o2_f[a, b], dtype)
            T.tma_store_wait(0)  # the previous chunk's store has read o_w
            T.copy(ot, o_w)
            store_o(o_w, o, start, length, hv, w)
            T.wait_wgmma(0)
            T.barrier_arrive(empty[st])
        T.tma_store_wait(0)
        row = T.alloc_var("int32", init=T.if_then_else(n_rows == n_seq1 - 1, ht_rows[seq], seq))
        if row >= 0:
            for a, d in T.Parallel(HW, DH):
                ht[row, hv, d, w * HW + a] = s_lo[a, d]
                ht[row, hv, DH + d, w * HW + a] = s_hi[a, d]

    @T.prim_func
    def kernel(
        q: T.Tensor((n_tok, h_qk, dk), dtype),
        k: T.Tensor((n_tok, h_qk, dk), dtype),
        v: T.Tensor((n_tok, h_v, dv), dtype),
        tt: T.Tensor((n_chunk, h_v, C, C), half),
        gb: T.Tensor((n_chunk, h_v, 2, C), acc),
        cu_seqlens: T.Tensor((n_seq1,), "int32"),
        chunk_offsets: T.Tensor((n_seq1,), "int32"),
        order: T.Tensor((n_seq1 - 1,), "int32"),
        ht_rows: T.Tensor((n_rows,), "int32"),
        h0: T.Tensor((n_h0, h_v, dk, dv), acc),
        scale: T.float32,
        o: T.Tensor((n_tok, h_v, dv), dtype),
        ht: T.Tensor((n_ht, h_v, dk, dv), acc),
    ):
        # the sequence is the slowest grid dimension: CTAs start in ``order``, every head of a sequence together
        with T.Kernel(h_v, n_seq1 - 1, threads=512) as (hv, rank):
            T.import_source(_PTX)
            # two-stage input ring, filled by TMA
            kq = [[T.alloc_shared((2 * C, DH), dtype) for _ in range(2)] for _ in range(2)]  # [stage][half of d]
            vb = [[T.alloc_shared((C, HW), dtype) for _ in range(2)] for _ in range(2)]  # [stage][half] V
            ttb = [T.alloc_shared((C, C), half) for _ in range(2)]  # T~ per stage, overwritten by A_g
            gb_s = T.alloc_shared((2, 2, C), acc)  # [gamma; beta]
            # the aux warpgroup's products, per stage: the column tables e_b, scale e_b, r_b; P_g
            cf_s = T.alloc_shared((2, 3, C), acc)
            pb = [T.alloc_shared((C, C), half) for _ in range(2)]
            ob = [T.alloc_shared((C, HW), dtype) for _ in range(2)]  # O per state warpgroup
            T.annotate_layout({b: make_swizzled_layout(b) for b in vb[0] + vb[1] + ttb + pb + ob})

            full = T.alloc_barrier([96, 96])  # 3 producer warps + TMA bytes
            empty = T.alloc_barrier([384, 384])  # every consumer thread
            ag_ready = T.alloc_barrier([128, 128])  # the column tables and A_g of the stage
            p_ready = T.alloc_barrier([128, 128])  # P_g of the stage

            seq = T.alloc_var("int32", init=order[rank])
            hk = hv // (h_v // h_qk)
            bos = cu_seqlens[seq]
            seqlen = cu_seqlens[seq + 1] - bos
            coff = chunk_offsets[seq]
            n_iter = T.ceildiv(seqlen, C)
            tx = T.get_thread_binding()

            if tx < 128:  # WG0: the aux warpgroup
                T.set_max_nreg(_NREG[0], 0)
                a_h = T.alloc_fragment((C, C), half)
                p_f = T.alloc_fragment((C, C), acc)
                T.annotate_layout({a_h: _acc(C, C)})
                log2_scale = _lg2(scale)
                for i in T.serial(n_iter):
                    st = i % 2
                    length = T.min(seqlen - i * C, C)
                    T.barrier_wait(full[st], (i // 2) % 2)
                    for b in T.Parallel(C):
                        cf_s[st, 0, b] = _exp(gb_s[st, 0, b])
                        cf_s[st, 1, b] = _exp(gb_s[st, 0, b]) * scale
                        cf_s[st, 2, b] = _exp(gb_s[st, 0, C - 1] - gb_s[st, 0, b]) * T.cast(b < length, acc)
                    if st == 0:
                        gate_inverse(ttb[0], a_h, gb_s, st)
                    else:
                        gate_inverse(ttb[1], a_h, gb_s, st)
                    T.fence_proxy_async()
                    T.barrier_arrive(ag_ready[st])
                    # Q K^T only now: a wgmma issued earlier waits behind the state warpgroups' in the tensor
                    # pipe and holds up everything after it
                    if st == 0:
                        qk_product(kq[0], p_f)
                    else:
                        qk_product(kq[1], p_f)
                    T.wait_wgmma(0)
                    for a, b in T.Parallel(C, C):
                        p_f[a, b] = p_f[a, b] * _gamma_times(gb_s, st, a, b, row_log2=log2_scale)
                    if st == 0:
                        T.copy(p_f, pb[0])
                    else:
                        T.copy(p_f, pb[1])
                    T.fence_proxy_async()
                    T.barrier_arrive(p_ready[st])
                    T.barrier_arrive(empty[st])
            elif tx < 256:
                state_half(0, kq, [vb[0][0], vb[1][0]], ttb, gb_s, cf_s, pb, ob[0], full, empty, ag_ready,
                           p_ready, h0, o, ht, ht_rows, seq, hv, bos, seqlen, n_iter)
            elif tx < 384:
                state_half(1, kq, [vb[0][1], vb[1][1]], ttb, gb_s, cf_s, pb, ob[1], full, empty, ag_ready,
                           p_ready, h0, o, ht, ht_rows, seq, hv, bos, seqlen, n_iter)
            else:  # WG3: producer warps
                T.set_max_nreg(_NREG[3], 0)
                if (tx >= 448) & (tx < 480):  # the T~ warp (q, k, v may load before the previous kernel ends)
                    T.pdl_sync()
                for i in T.serial(n_iter):
                    st = i % 2
                    start = bos + i * C
                    if tx < 416:
                        T.barrier_wait(empty[st], (i // 2 + 1) % 2)
                        if st == 0:
                            load_kq(q, k, kq[0], start, hk, full, st)
                        else:
                            load_kq(q, k, kq[1], start, hk, full, st)
                        T.barrier_arrive(full[st])
                    elif tx < 448:
                        T.barrier_wait(empty[st], (i // 2 + 1) % 2)
                        if st == 0:
                            load_v(v, vb[0], start, hv, full, st)
                        else:
                            load_v(v, vb[1], start, hv, full, st)
                        T.barrier_arrive(full[st])
                    elif tx < 480:
                        T.barrier_wait(empty[st], (i // 2 + 1) % 2)
                        if st == 0:
                            T.tma_copy(tt[coff + i, hv, :, :], ttb[0], barrier=full[st])
                        else:
                            T.tma_copy(tt[coff + i, hv, :, :], ttb[1], barrier=full[st])
                        T.tma_copy(gb[coff + i, hv, :, :], gb_s[st, :, :], barrier=full[st])
                        T.barrier_arrive(full[st])

    return kernel


def variants():
    """``(kernel name, params)`` of every variant (K = V = 128, bf16/fp16, with and without an initial state)."""
    return [("chunk_fwd_split", dict(dk=128, dv=128, dtype=dtype, has_h0=has_h0))
            for dtype in ("bfloat16", "float16") for has_h0 in (True, False)]
