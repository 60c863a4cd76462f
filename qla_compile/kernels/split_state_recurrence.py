"""The GDN forward chunk recurrence on SM90 with the state in registers, split over two warpgroups (chunk C = 64).

One CTA per (sequence, v-head) over all of V = 128, 512 threads, looping over the sequence's chunks; T~ and the
gate cumsum come from ``kkt_inverse`` (notation and chunk numbering there). State warpgroup w holds its half of
the state transposed, S^T[v, :] for v in [64 w, 64 w + 64) (fp32 registers), and uses it as the register A
operand of its wgmmas, so S never goes through shared memory. Per chunk, with tokens b as columns:

    U^T = S^T K^T, O^T = S^T Q^T            (k-step by k-step, so that the two accumulator chains overlap)
    W'^T = V^T - e_b U^T,  V'^T = W'^T A_g^T
    O^T = scale e_b O^T + V'^T P_g^T,  S^T <- e^{gamma_C} S^T + (r_b V'^T) K

V^T is read by ``ldmatrix.trans`` and O^T written by ``stmatrix.trans`` (fragments in the accumulator's layout,
seen transposed), then TMA-stored; the store's reads are waited for only before the tile is written again.

* WG0 "aux", a chunk ahead: the per-column tables e_b, scale e_b, r_b (0 past the sequence end);
  A_g = Gamma o T~ o beta_col in place over T~ (``ldmatrix`` / ``stmatrix``); then P_g = scale Gamma o Q K^T.
  It is warpgroup 0 because TileLang 0.1.15 binds an annotated fragment layout (``_acc``) to threads 0..127.
* WG1, WG2 "state": the chain above for the two halves of V; they share nothing but the input ring.
* WG3 "producer": one warp TMA-loads q and k, one v (a tile per state warpgroup), one T~ and [gamma; beta] into
  a two-stage ring (``pdl_sync`` first: the kernel is a programmatic dependent of ``kkt_inverse``).

Same call and outputs as ``chunk_recurrence.chunk_fwd_ws(block_dv=dv, pdl=True)``; chosen over it where every
(sequence, v-head) pair fills a CTA (``forward._state_kernel``). Precision: fp16 A_g, P_g, W' and V' for
P_g V', r o V' in the input dtype (the dtype of K it multiplies), S^T in the input dtype for the products with
K and Q, fp32 accumulators, state and gate tables. Rows of a partial chunk past the sequence end have beta = 0
and r = 0 (as in ``chunk_fwd_ws``) and are not stored.
"""

import tilelang.language as T
from tilelang.layout import Fragment, make_swizzled_layout

from ._build import compiled
from .chunk_recurrence import _PTX, _exp, _gamma_times, _lg2
from .chunking import CHUNK

# setmaxnreg per warpgroup (aux, state 0, state 1, producer): sums to 512 = 65536 registers / 128.
_NREG = (104, 192, 192, 24)
_KSTEP = 16  # the K extent of one bf16/fp16 wgmma


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
    assert dk == 8 * _KSTEP  # the U/O k-steps are spelled out below

    @T.macro
    def to_operand(a_k, s_f, kk):
        """k-step ``kk`` of S^T (columns [16 kk, 16 kk + 16)) in the input dtype, a wgmma A operand."""
        for a, d in T.Parallel(HW, _KSTEP):
            a_k[a, d] = T.cast(s_f[a, d + kk * _KSTEP], dtype)

    @T.macro
    def uo_step(a_k, k_s, q_s, st, kk, u_f, o_f):
        """k-step ``kk`` of U^T = S^T K^T and O^T = S^T Q^T."""
        cols = slice(kk * _KSTEP, (kk + 1) * _KSTEP)
        T.wgmma_gemm(a_k, k_s[st, :, cols], u_f, transpose_B=True, clear_accum=kk == 0)
        T.wgmma_gemm(a_k, q_s[st, :, cols], o_f, transpose_B=True, clear_accum=kk == 0)

    @T.macro
    def gate_inverse(t, a_h, gb_s, st):
        """T~ -> A_g = Gamma o T~ o beta_col in place, in fp16 (an fp32 copy's loop is dropped by TileLang 0.1.15)."""
        T.copy(t, a_h)
        for a, b in T.Parallel(C, C):
            a_h[a, b] = T.cast(T.cast(a_h[a, b], acc) * _gamma_times(gb_s, st, a, b, col_log2=_lg2(gb_s[st, 1, b])),
                               half)
        T.copy(a_h, t)

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
    def state_half(w, q_s, k_s, vb, ttb, gb_s, cf_s, pb, o_w, full, empty, ag_ready, p_ready, h0, o, ht, ht_rows,
                   seq, hv, bos, seqlen, n_iter):
        """State warpgroup ``w``: rows v in [w HW, (w + 1) HW) of S^T and O^T. ``vb``: its V tile of each stage,
        ``o_w``: its O tile (whole 2-D buffers: TileLang lowers copies of those to ldmatrix/stmatrix)."""
        T.set_max_nreg(_NREG[1 + w], 1)
        s_f = T.alloc_fragment((HW, dk), acc)  # S^T[v, d] = S[d, w HW + v]
        s_k = [T.alloc_fragment((HW, _KSTEP), dtype) for _ in range(dk // _KSTEP)]
        u_f = T.alloc_fragment((HW, C), acc)
        o_f = T.alloc_fragment((HW, C), acc)
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
            for a, d in T.Parallel(HW, dk):
                s_f[a, d] = h0[seq, hv, d, w * HW + a]
        else:
            T.clear(s_f)
        for i in T.serial(n_iter):
            st = i % 2
            ph = (i // 2) % 2
            start = bos + i * C
            length = T.min(seqlen - i * C, C)
            T.barrier_wait(full[st], ph)
            # spelled out: a loop in a macro becomes a TIR loop, which cannot index the list of fragments
            to_operand(s_k[0], s_f, 0)
            to_operand(s_k[1], s_f, 1)
            to_operand(s_k[2], s_f, 2)
            to_operand(s_k[3], s_f, 3)
            to_operand(s_k[4], s_f, 4)
            to_operand(s_k[5], s_f, 5)
            to_operand(s_k[6], s_f, 6)
            to_operand(s_k[7], s_f, 7)
            uo_step(s_k[0], k_s, q_s, st, 0, u_f, o_f)
            uo_step(s_k[1], k_s, q_s, st, 1, u_f, o_f)
            uo_step(s_k[2], k_s, q_s, st, 2, u_f, o_f)
            uo_step(s_k[3], k_s, q_s, st, 3, u_f, o_f)
            uo_step(s_k[4], k_s, q_s, st, 4, u_f, o_f)
            uo_step(s_k[5], k_s, q_s, st, 5, u_f, o_f)
            uo_step(s_k[6], k_s, q_s, st, 6, u_f, o_f)
            uo_step(s_k[7], k_s, q_s, st, 7, u_f, o_f)
            if st == 0:
                T.copy(vb[0], vt)
            else:
                T.copy(vb[1], vt)
            decay = _exp(gb_s[st, 0, C - 1])
            T.barrier_wait(ag_ready[st], ph)
            T.wait_wgmma(1)  # U done (O's last k-step may still run)
            for a, b in T.Parallel(HW, C):
                w_h[a, b] = T.cast(T.cast(vt[b, a], acc) - cf_s[st, 0, b] * u_f[a, b], half)
            if st == 0:
                T.wgmma_gemm(w_h, ttb[0], vp_f, transpose_B=True, clear_accum=True)
            else:
                T.wgmma_gemm(w_h, ttb[1], vp_f, transpose_B=True, clear_accum=True)
            for a, d in T.Parallel(HW, dk):
                s_f[a, d] = s_f[a, d] * decay
            T.wait_wgmma(0)
            for a, b in T.Parallel(HW, C):
                vp_h[a, b] = T.cast(vp_f[a, b], half)
                vr[a, b] = T.cast(vp_f[a, b] * cf_s[st, 2, b], dtype)
                o_f[a, b] = o_f[a, b] * cf_s[st, 1, b]
            T.barrier_wait(p_ready[st], ph)
            if st == 0:
                T.wgmma_gemm(vp_h, pb[0], o_f, transpose_B=True)
            else:
                T.wgmma_gemm(vp_h, pb[1], o_f, transpose_B=True)
            T.wgmma_gemm(vr, k_s[st, :, :], s_f)
            T.wait_wgmma(1)  # O done
            for a, b in T.Parallel(HW, C):
                ot[b, a] = T.cast(o_f[a, b], dtype)
            T.tma_store_wait(0)  # the previous chunk's store has read o_w
            T.copy(ot, o_w)
            store_o(o_w, o, start, length, hv, w)
            T.wait_wgmma(0)
            T.barrier_arrive(empty[st])
        T.tma_store_wait(0)
        row = T.alloc_var("int32", init=T.if_then_else(n_rows == n_seq1 - 1, ht_rows[seq], seq))
        if row >= 0:
            for a, d in T.Parallel(HW, dk):
                ht[row, hv, d, w * HW + a] = s_f[a, d]

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
            q_s = T.alloc_shared((2, C, dk), dtype)
            k_s = T.alloc_shared((2, C, dk), dtype)
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
                    T.wgmma_gemm(q_s[st, :, :], k_s[st, :, :], p_f, transpose_B=True, clear_accum=True)
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
                state_half(0, q_s, k_s, [vb[0][0], vb[1][0]], ttb, gb_s, cf_s, pb, ob[0], full, empty, ag_ready,
                           p_ready, h0, o, ht, ht_rows, seq, hv, bos, seqlen, n_iter)
            elif tx < 384:
                state_half(1, q_s, k_s, [vb[0][1], vb[1][1]], ttb, gb_s, cf_s, pb, ob[1], full, empty, ag_ready,
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
                        T.tma_copy(q[start : start + C, hk, :], q_s[st, :, :], barrier=full[st])
                        T.tma_copy(k[start : start + C, hk, :], k_s[st, :, :], barrier=full[st])
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
