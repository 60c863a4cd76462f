"""The GDN forward chunk recurrence on SM90 with the state in registers, split over two warpgroups (chunk C = 64).

One CTA per (sequence, v-head) over all of V = 128, 512 threads, looping over the sequence's chunks; T~ and the
gate cumsum come from ``kkt_inverse`` (notation and chunk numbering there). Each state warpgroup holds half of
the state transposed, S^T[v, :] for its 64 values of v (fp32, registers), and runs the whole chain of its half
with S^T as the register A operand of its wgmmas, so that S never goes through shared memory and no other
warpgroup waits on it. Per chunk, for its rows v:

    U^T = S^T K^T,  O^T = S^T Q^T                    (issued together, S^T rounded to the input dtype)
    W'^T = V^T - U^T o e_col,  V'^T = W'^T A_g^T     (A_g from the aux warpgroup)
    O^T = scale O^T o e_col + V'^T P_g^T,  S^T <- e^{gamma_C} S^T + V'^T (r o K)

then O^T is staged (transposed) in shared memory and TMA-stored. The two state warpgroups share nothing but
the input ring, so one's tensor-core work overlaps the other's elementwise steps.

* WG0, WG1 "state": the chain above for v in [0, 64) and [64, 128).
* WG2 "aux": per chunk, ahead of the state warpgroups: A_g = Gamma o T~ o beta_col (in place over T~),
  P_g = scale Gamma o Q K^T and r o K in fp16, into two-stage buffers (barrier ``aux_ready``).
* WG3 "producer": one warp TMA-loads q and k, one v, one T~ and [gamma; beta] into a two-stage ring.

It computes what ``chunk_recurrence.chunk_fwd_ws`` does without a V split (same call, same outputs; rows past
a sequence's end handled the same way) and is chosen over it where every (sequence, v-head) pair has a CTA of
its own (``forward._state_kernel``). Precision: fp16 A_g, P_g, W', V' and r o K, S^T in the input dtype for
the products with K and Q, fp32 accumulators, state and gate tables (as ``chunk_fwd_ws``).
"""

import tilelang.language as T

from ._build import compiled
from .chunk_recurrence import _PTX, _exp, _gamma_times, _lg2
from .chunking import CHUNK

# setmaxnreg per warpgroup (state 0, state 1, aux, producer): sums to 512 = 65536 registers / 128.
_NREG = (192, 192, 104, 24)


@compiled
def chunk_fwd_split(*, dk: int, dv: int, dtype: str, has_h0: bool):
    """o and the final state; call as ``kernel(q, k, v, tt, gb, cu_seqlens, chunk_offsets, order, ht_rows, h0,
    scale, o, ht)``, the arguments of ``chunk_recurrence.chunk_fwd_ws`` (``order``: the sequences in launch
    order; ``ht_rows``: the row of ``ht`` each walk's final state goes to, -1 none, or the one entry 0 for walk
    n to row n)."""
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

    @T.macro
    def state_half(w, q_s, k_s, v_s, tt_s, gb_s, p_s, kh_s, o_s, full, empty, aux_ready, h0, o, ht, ht_rows,
                   seq, hv, bos, seqlen, n_iter, scale):
        """State warpgroup ``w``: rows v in [w HW, (w + 1) HW) of S^T, O^T."""
        T.set_max_nreg(_NREG[w], 1)
        s_f = T.alloc_fragment((HW, dk), acc)  # S^T[v, d] = S[d, w HW + v]
        sb = T.alloc_fragment((HW, dk), dtype)
        u_f = T.alloc_fragment((HW, C), acc)
        wf = T.alloc_fragment((HW, C), half)
        nv_f = T.alloc_fragment((HW, C), acc)
        nvh = T.alloc_fragment((HW, C), half)
        o_f = T.alloc_fragment((HW, C), acc)
        decay = T.alloc_var(acc)
        if has_h0:
            for a, d in T.Parallel(HW, dk):
                s_f[a, d] = h0[seq, hv, d, w * HW + a]
        else:
            T.clear(s_f)
        for i in T.serial(n_iter):
            st = i % 2
            start = bos + i * C
            length = T.min(seqlen - i * C, C)
            T.barrier_wait(full[st], (i // 2) % 2)
            T.copy(s_f, sb)
            T.wgmma_gemm(sb, k_s[st, :, :], u_f, transpose_B=True, clear_accum=True)
            T.wgmma_gemm(sb, q_s[st, :, :], o_f, transpose_B=True, clear_accum=True)
            decay = _exp(gb_s[st, 0, C - 1])
            T.wait_wgmma(1)
            for a, b in T.Parallel(HW, C):
                wf[a, b] = T.cast(T.cast(v_s[st, b, w * HW + a], acc) - _exp(gb_s[st, 0, b]) * u_f[a, b], half)
            T.barrier_wait(aux_ready[st], (i // 2) % 2)
            T.wgmma_gemm(wf, tt_s[st, :, :], nv_f, transpose_B=True, clear_accum=True)
            for a, d in T.Parallel(HW, dk):
                s_f[a, d] = s_f[a, d] * decay
            T.wait_wgmma(0)
            T.copy(nv_f, nvh)
            for a, b in T.Parallel(HW, C):
                o_f[a, b] = o_f[a, b] * (_exp(gb_s[st, 0, b]) * scale)
            T.wgmma_gemm(nvh, p_s[st, :, :], o_f, transpose_B=True)
            T.wgmma_gemm(nvh, kh_s[st, :, :], s_f)
            T.wait_wgmma(0)
            T.barrier_arrive(empty[st])
            # O^T staged transposed, then stored by TMA (a partial last chunk by rows, masked)
            for a, b in T.Parallel(HW, C):
                o_s[st, w, b, a] = T.cast(o_f[a, b], dtype)
            T.fence_proxy_async()
            if length == C:
                T.copy(o_s[st, w, :, :], o[start : start + C, hv, w * HW : (w + 1) * HW])
            else:
                for a, b in T.Parallel(C, HW):
                    if a < length:
                        o[start + a, hv, w * HW + b] = o_s[st, w, a, b]
                T.fence_proxy_async()
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
            v_s = T.alloc_shared((2, C, dv), dtype)
            tt_s = T.alloc_shared((2, C, C), half)  # T~, overwritten by A_g
            gb_s = T.alloc_shared((2, 2, C), acc)  # [gamma; beta]
            # the aux warpgroup's products, per stage
            p_s = T.alloc_shared((2, C, C), half)  # P_g
            kh_s = T.alloc_shared((2, C, dk), half)  # r o K
            # O per stage and state warpgroup, staged for its store: a stage is written again only after the
            # warpgroup's next store, which its elected thread reaches after this one has been read
            o_s = T.alloc_shared((2, 2, C, HW), dtype)

            full = T.alloc_barrier([96, 96])  # 3 producer warps + TMA bytes
            empty = T.alloc_barrier([384, 384])  # every consumer thread
            aux_ready = T.alloc_barrier([128, 128])  # A_g, P_g and r o K of the stage are written

            seq = T.alloc_var("int32", init=order[rank])
            hk = hv // (h_v // h_qk)
            bos = cu_seqlens[seq]
            seqlen = cu_seqlens[seq + 1] - bos
            coff = chunk_offsets[seq]
            n_iter = T.ceildiv(seqlen, C)
            tx = T.get_thread_binding()

            if tx < 128:
                state_half(0, q_s, k_s, v_s, tt_s, gb_s, p_s, kh_s, o_s, full, empty, aux_ready, h0, o, ht, ht_rows,
                           seq, hv, bos, seqlen, n_iter, scale)
            elif tx < 256:
                state_half(1, q_s, k_s, v_s, tt_s, gb_s, p_s, kh_s, o_s, full, empty, aux_ready, h0, o, ht, ht_rows,
                           seq, hv, bos, seqlen, n_iter, scale)
            elif tx < 384:  # WG2: A_g, P_g, r o K
                T.set_max_nreg(_NREG[2], 0)
                a_f = T.alloc_fragment((C, C), acc)
                p_f = T.alloc_fragment((C, C), acc)
                log2_scale = _lg2(scale)
                for i in T.serial(n_iter):
                    st = i % 2
                    length = T.min(seqlen - i * C, C)
                    T.barrier_wait(full[st], (i // 2) % 2)
                    T.copy(tt_s[st, :, :], a_f)
                    for a, b in T.Parallel(C, C):
                        a_f[a, b] = a_f[a, b] * _gamma_times(gb_s, st, a, b, col_log2=_lg2(gb_s[st, 1, b]))
                    T.copy(a_f, tt_s[st, :, :])
                    for r, d in T.Parallel(C, dk):
                        kh_s[st, r, d] = T.cast(
                            T.cast(k_s[st, r, d], acc)
                            * (_exp(gb_s[st, 0, C - 1] - gb_s[st, 0, r]) * T.cast(r < length, acc)), half)
                    T.gemm(q_s[st, :, :], k_s[st, :, :], p_f, transpose_B=True, clear_accum=True)
                    for a, b in T.Parallel(C, C):
                        p_f[a, b] = p_f[a, b] * _gamma_times(gb_s, st, a, b, row_log2=log2_scale)
                    T.copy(p_f, p_s[st, :, :])
                    T.fence_proxy_async()
                    T.barrier_arrive(aux_ready[st])
                    T.barrier_arrive(empty[st])

            else:  # WG3: producer warps
                T.set_max_nreg(_NREG[3], 0)
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
                        T.tma_copy(v[start : start + C, hv, :], v_s[st, :, :], barrier=full[st])
                        T.barrier_arrive(full[st])
                    elif tx < 480:
                        T.barrier_wait(empty[st], (i // 2 + 1) % 2)
                        T.tma_copy(tt[coff + i, hv, :, :], tt_s[st, :, :], barrier=full[st])
                        T.tma_copy(gb[coff + i, hv, :, :], gb_s[st, :, :], barrier=full[st])
                        T.barrier_arrive(full[st])

    return kernel


def variants():
    """``(kernel name, params)`` of every variant (K = V = 128, bf16/fp16, with and without an initial state)."""
    return [("chunk_fwd_split", dict(dk=128, dv=128, dtype=dtype, has_h0=has_h0))
            for dtype in ("bfloat16", "float16") for has_h0 in (True, False)]
