"""Warp-specialised fused GDN forward on SM90 (chunk C = 64): the chunk recurrence, split over four
warpgroups that hand work to each other through shared memory and mbarriers.

One CTA per (sequence, v-head, DV slice), 512 threads, looping over the sequence's chunks; T~ and the
gate cumsum come from ``kkt_inverse`` (notation and chunk numbering there). Per chunk i:

* WG0 "state" holds S (fp32, registers). Publishes S_i to shared memory (input dtype), builds r o K in
  fp16, then S <- e^{gamma_C} S + (r o K)^T V'.
* WG1 "delta": A_g = Gamma o T~ o beta_col (in place over T~, before S_i is published), U0 = K S_i,
  W' = V - e o U0 (in registers), V' = A_g W'; hands V' to WG0 (the critical path) and WG2.
* WG2 "output": Q K^T is issued before S_i is ready, Q S_i right after; P_g = scale Gamma o Q K^T while
  Q S_i runs; O = scale e o Q S_i + P_g V' is staged over this chunk's (dead) Q tile and TMA-stored
  (a partial last chunk is stored by rows, masked).
* WG3 "producer": one warp TMA-loads q and k, one v, one T~ and [gamma; beta] into a two-stage ring.

One more mode shares this body: ``store_h`` (the backward's state recompute: no output; WG0 also writes S_i in
fp16, which WG2 TMA-stores per chunk).

The state chain per chunk is publish S -> K S -> W' -> A_g W' -> (r o K)^T V'; the rest runs beside it.
Every gate factor is one SFU ex2 of a difference of per-row and per-column terms that each thread
computes once per chunk (``_gamma_times``); the elementwise work per chunk, more than the tensor cores,
sets the time per chunk (``bench/NOTES-fwd.md``).

Rows of a partial chunk past the sequence end are loaded from the next sequence (or zero-filled past the
tensor): they have beta = 0 and r = 0, so they reach neither V' of valid rows nor S, and their outputs
are not stored. Precision (chosen with a CPU emulation of every rounding point against the float64
oracle, see ``bench/NOTES-fwd.md``): fp16 T~, A_g, P_g, W', V' and r o K; the S copy in the input dtype;
fp32 accumulators and gate tables.
"""

import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from ._build import compiled
from .chunking import CHUNK

# setmaxnreg per warpgroup (state, delta, output, producer): sums to 512 = 65536 registers / 128.
_NREG = (192, 136, 160, 24)
_LOG2E = 1.4426950408889634
# ex2 / lg2 on the SFU with denormals flushed: one instruction each (the non-ftz forms add range fix-ups).
_PTX = r"""
__device__ __forceinline__ float qla_ex2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ float qla_lg2(float x) { float y; asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
"""


# the SM's cycle counter, for the timeline variant (``trace``)
_CLOCK = "__device__ __forceinline__ long long qla_clock() { return clock64(); }\n"
TRACE_CTAS, TRACE_CHUNKS, TRACE_EVENTS = 4, 64, 8  # the timeline's shape per warpgroup


def _ex2(x):
    return T.call_extern("float32", "qla_ex2", x)


def _lg2(x):
    return T.call_extern("float32", "qla_lg2", x)


def _exp(x):
    return _ex2(x * _LOG2E)


def _gamma_times(gb_s, st, a, b, row_log2=0.0, col_log2=0.0):
    """Gamma_ab 2^(row_log2 + col_log2) for b <= a, else 0, as one ex2 (of -1e30: 0).

    Grouped so that the row and column terms are computed once per thread and reused for every element
    (the mask is added, not selected around the loads, which would keep them from being shared).
    """
    x = (gb_s[st, 0, a] * _LOG2E + row_log2) - (gb_s[st, 0, b] * _LOG2E - col_log2)
    return _ex2(x + T.Select(b <= a, T.float32(0), T.float32(-1e30)))


@compiled
def chunk_fwd_ws(*, dk: int, dv: int, dtype: str, has_h0: bool, block_dv: int = 128, store_h: bool = False,
                 trace: bool = False, pdl: bool = False):
    """o and the final state; call as ``kernel(q, k, v, tt, gb, cu_seqlens, chunk_offsets, order, ht_rows, h0,
    scale, o, ht)``, ``order`` the sequences in launch order (``forward._tables``: longest first, so that the
    longest walks start first). ``ht_rows`` int32: the row of ``ht`` each walk's final state goes to (-1: none;
    context-parallel pieces, ``forward._Pieces.ht_row``), or the one entry 0 (``cu_seqlens[:1]``) for walk n to
    row n.

    With ``store_h`` (the backward's state recompute) it computes no output but stores every chunk's
    start state in fp16: ``kernel(q, k, v, tt, gb, cu_seqlens, chunk_offsets, order, h0, h)`` with
    ``h[chunk_offsets[n] + j, hv]`` the state before chunk j of sequence n (q is not read).

    With ``pdl`` (the output call only) it is launched as a programmatic dependent of the kernel before it, which
    lets it start while ``kkt_inverse``'s last CTAs run (that kernel triggers the launch as it starts): it reads
    ``tt``, ``gb`` and ``h0`` after ``pdl_sync``, but loads q, k and v before, so they must not come from the kernel
    launched just before it (the forward makes them before ``kkt_inverse``).

    With ``trace`` (a diagnostic, ``bench/timeline_fwd.py``; not a shipped variant) the output call takes one more
    argument, int64 ``tr[TRACE_CTAS, 4, TRACE_CHUNKS, TRACE_EVENTS]``: the first thread of each warpgroup of the CTAs
    of v-heads 0..3 of the first walk (DV slice 0) writes the SM's clock at fixed points of each chunk (``mark``).
    """
    assert not (trace and store_h)
    assert not (pdl and store_h)
    n_tok = T.dynamic("n_tok")
    n_chunk = T.dynamic("n_chunk")
    n_seq1 = T.dynamic("n_seq1")
    n_h0 = T.dynamic("n_h0")
    n_rows = T.dynamic("n_rows")
    n_ht = T.dynamic("n_ht")
    h_qk = T.dynamic("h_qk")
    h_v = T.dynamic("h_v")
    C, BV = CHUNK, block_dv
    acc, half = "float32", "float16"
    n_slices = dv // BV
    has_out = not store_h

    if trace:

        @T.macro
        def mark(tr, hv, bv, rank, tx, wg, j, event):
            """The SM's clock into the timeline: warpgroup ``wg``, chunk ``j``, event ``event`` (``trace``)."""
            if (tx % 128 == 0) & (rank == 0) & (bv == 0) & (hv < TRACE_CTAS) & (j < TRACE_CHUNKS):
                tr[hv, wg, j, event] = T.call_extern("int64", "qla_clock")

    else:

        def mark(*_):
            """No timeline: nothing enters the kernel."""

    @T.macro
    def body(q, k, v, tt, gb, cu_seqlens, chunk_offsets, order, ht_rows, h0, scale, o, ht, h, tr):
        # the sequence is the slowest grid dimension: CTAs start in ``order``, every head of a sequence together
        with T.Kernel(h_v, n_slices, n_seq1 - 1, threads=512) as (hv, bv, rank):
            T.import_source(_PTX + (_CLOCK if trace else ""))
            # two-stage input ring, filled by TMA
            q_s = T.alloc_shared((2, C, dk), dtype) if has_out else None
            k_s = T.alloc_shared((2, C, dk), dtype)
            v_s = T.alloc_shared((2, C, BV), dtype)
            # swizzled (TMA writes it so): WG1's reads in the wgmma fragment's pattern, 8 rows x 4 words per warp,
            # hit one bank per row in the plain layout
            T.annotate_layout({v_s: make_swizzled_layout(v_s)})
            tt_s = T.alloc_shared((2, C, C), half)  # T~, overwritten by A_g
            gb_s = T.alloc_shared((2, 2, C), acc)  # [gamma; beta]
            # hand-offs between warpgroups
            s_s = T.alloc_shared((dk, BV), dtype)  # S_i
            kh_s = T.alloc_shared((C, dk), half)  # r o K in fp16 for (r o K)^T V'
            w_s = T.alloc_shared((C, BV), half)  # W'
            vp_s = T.alloc_shared((C, BV), half)  # V'
            p_s = T.alloc_shared((C, C), half) if has_out else None  # P_g
            hs_s = T.alloc_shared((dk, BV), half) if store_h else None  # S_i in fp16 for h
            rk_s = T.alloc_shared((C,), acc)  # r, 0 past the sequence end

            full = T.alloc_barrier([96, 96])  # 3 producer warps + TMA bytes
            empty = T.alloc_barrier([384, 384])  # every consumer thread
            s_ready = T.alloc_barrier(128)  # WG0 published S_i
            s_free = T.alloc_barrier(256)  # WG1 and WG2 have read S_i
            vp_ready = T.alloc_barrier(128)  # WG1 wrote V' (WG0 and WG2 wait)
            vp_free = T.alloc_barrier(128)  # WG2 has read V'
            if store_h:
                h_ready = T.alloc_barrier(128)  # WG0 wrote hs_s
                h_free = T.alloc_barrier(128)  # WG2's store has read hs_s

            seq = T.alloc_var("int32", init=order[rank])
            hk = hv // (h_v // h_qk)
            v0 = bv * BV
            bos = cu_seqlens[seq]
            seqlen = cu_seqlens[seq + 1] - bos
            coff = chunk_offsets[seq]
            n_iter = T.ceildiv(seqlen, C)
            tx = T.get_thread_binding()

            if tx < 128:  # WG0: the state
                T.set_max_nreg(_NREG[0], 1)
                s_f = T.alloc_fragment((dk, BV), acc)
                decay = T.alloc_var(acc)
                if pdl:
                    T.pdl_sync()
                if has_h0:
                    T.copy(h0[seq, hv, :, v0 : v0 + BV], s_f)
                else:
                    T.clear(s_f)
                for j in T.serial(n_iter):
                    st = j % 2
                    length = T.min(seqlen - j * C, C)
                    mark(tr, hv, bv, rank, tx, 0, j, 0)
                    T.barrier_wait(s_free, (j + 1) % 2)
                    mark(tr, hv, bv, rank, tx, 0, j, 1)
                    T.copy(s_f, s_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(s_ready)
                    mark(tr, hv, bv, rank, tx, 0, j, 2)
                    if store_h:
                        T.barrier_wait(h_free, (j + 1) % 2)
                        T.copy(s_f, hs_s)
                        T.fence_proxy_async()
                        T.barrier_arrive(h_ready)
                    T.barrier_wait(full[st], (j // 2) % 2)
                    mark(tr, hv, bv, rank, tx, 0, j, 3)
                    for r in T.Parallel(C):
                        rk_s[r] = _exp(gb_s[st, 0, C - 1] - gb_s[st, 0, r]) * T.cast(r < length, acc)
                    for r, d in T.Parallel(C, dk):
                        kh_s[r, d] = T.cast(T.cast(k_s[st, r, d], acc) * rk_s[r], half)
                    T.fence_proxy_async()
                    decay = _exp(gb_s[st, 0, C - 1])
                    for a, b in T.Parallel(dk, BV):
                        s_f[a, b] = s_f[a, b] * decay
                    mark(tr, hv, bv, rank, tx, 0, j, 4)
                    T.barrier_wait(vp_ready, j % 2)
                    mark(tr, hv, bv, rank, tx, 0, j, 5)
                    T.gemm(kh_s, vp_s, s_f, transpose_A=True)
                    mark(tr, hv, bv, rank, tx, 0, j, 6)
                    T.barrier_arrive(empty[st])
                if has_out:
                    row = T.alloc_var("int32", init=T.if_then_else(n_rows == n_seq1 - 1, ht_rows[seq], seq))
                    if row >= 0:
                        T.copy(s_f, ht[row, hv, :, v0 : v0 + BV])

            elif tx < 256:  # WG1: the delta rule
                T.set_max_nreg(_NREG[1], 1)
                u_f = T.alloc_fragment((C, BV), acc)
                a_f = T.alloc_fragment((C, C), acc)
                e_f = T.alloc_fragment((C,), acc)
                for j in T.serial(n_iter):
                    st = j % 2
                    mark(tr, hv, bv, rank, tx, 1, j, 0)
                    T.barrier_wait(full[st], (j // 2) % 2)
                    mark(tr, hv, bv, rank, tx, 1, j, 1)
                    T.copy(tt_s[st, :, :], a_f)
                    for a, b in T.Parallel(C, C):
                        a_f[a, b] = a_f[a, b] * _gamma_times(gb_s, st, a, b, col_log2=_lg2(gb_s[st, 1, b]))
                    T.copy(a_f, tt_s[st, :, :])
                    T.fence_proxy_async()
                    for a in T.Parallel(C):
                        e_f[a] = _exp(gb_s[st, 0, a])
                    mark(tr, hv, bv, rank, tx, 1, j, 2)
                    T.barrier_wait(s_ready, j % 2)
                    mark(tr, hv, bv, rank, tx, 1, j, 3)
                    T.gemm(k_s[st, :, :], s_s, u_f, clear_accum=True)
                    T.barrier_arrive(s_free)
                    mark(tr, hv, bv, rank, tx, 1, j, 4)
                    for a, b in T.Parallel(C, BV):
                        u_f[a, b] = T.cast(v_s[st, a, b], acc) - e_f[a] * u_f[a, b]
                    T.copy(u_f, w_s)
                    T.fence_proxy_async()
                    mark(tr, hv, bv, rank, tx, 1, j, 5)
                    T.gemm(tt_s[st, :, :], w_s, u_f, clear_accum=True)
                    mark(tr, hv, bv, rank, tx, 1, j, 6)
                    # WG0 has read the previous V' (before publishing the S this chunk's K S used); WG2 says so
                    T.barrier_wait(vp_free, (j + 1) % 2)
                    T.copy(u_f, vp_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(vp_ready)
                    mark(tr, hv, bv, rank, tx, 1, j, 7)
                    T.barrier_arrive(empty[st])

            elif tx < 384:  # WG2: the output
                T.set_max_nreg(_NREG[2], 1)
                if not has_out:  # no output: the hand-off protocol, and the h stores
                    for j in T.serial(n_iter):
                        T.barrier_wait(s_ready, j % 2)
                        T.barrier_arrive(s_free)
                        if store_h:
                            T.barrier_wait(h_ready, j % 2)
                            T.copy(hs_s, h[coff + j, hv, :, v0 : v0 + BV])
                            T.barrier_arrive(h_free)
                        T.barrier_wait(vp_ready, j % 2)
                        T.barrier_arrive(vp_free)
                        T.barrier_arrive(empty[j % 2])
                else:
                    o_f = T.alloc_fragment((C, BV), acc)
                    p_f = T.alloc_fragment((C, C), acc)
                    eo_f = T.alloc_fragment((C,), acc)
                    log2_scale = _lg2(scale)
                    for i in T.serial(n_iter):
                        st = i % 2
                        start = bos + i * C
                        length = T.min(seqlen - i * C, C)
                        mark(tr, hv, bv, rank, tx, 2, i, 0)
                        T.barrier_wait(full[st], (i // 2) % 2)
                        mark(tr, hv, bv, rank, tx, 2, i, 1)
                        T.wgmma_gemm(q_s[st, :, :], k_s[st, :, :], p_f, transpose_B=True, clear_accum=True)
                        T.barrier_wait(s_ready, i % 2)
                        mark(tr, hv, bv, rank, tx, 2, i, 2)
                        T.wgmma_gemm(q_s[st, :, :], s_s, o_f, clear_accum=True)
                        T.wait_wgmma(1)
                        for a, b in T.Parallel(C, C):
                            p_f[a, b] = p_f[a, b] * _gamma_times(gb_s, st, a, b, row_log2=log2_scale)
                        T.copy(p_f, p_s)
                        T.fence_proxy_async()
                        T.wait_wgmma(0)
                        T.barrier_arrive(s_free)
                        mark(tr, hv, bv, rank, tx, 2, i, 3)
                        for a in T.Parallel(C):
                            eo_f[a] = _exp(gb_s[st, 0, a]) * scale
                        for a, b in T.Parallel(C, BV):
                            o_f[a, b] = o_f[a, b] * eo_f[a]
                        T.barrier_wait(vp_ready, i % 2)
                        mark(tr, hv, bv, rank, tx, 2, i, 4)
                        T.gemm(p_s, vp_s, o_f)
                        T.barrier_arrive(vp_free)
                        mark(tr, hv, bv, rank, tx, 2, i, 5)
                        # O is staged over this chunk's Q (dead now) and stored by rows, 16 bytes per access
                        T.copy(o_f, q_s[st, :, 0:BV])
                        T.fence_proxy_async()
                        if length == C:
                            T.copy(q_s[st, :, 0:BV], o[start : start + C, hv, v0 : v0 + BV])
                        else:
                            for a, b in T.Parallel(C, BV):
                                if a < length:
                                    o[start + a, hv, v0 + b] = q_s[st, a, b]
                            T.fence_proxy_async()
                        mark(tr, hv, bv, rank, tx, 2, i, 6)
                        T.barrier_arrive(empty[st])

            else:  # WG3: producer warps
                T.set_max_nreg(_NREG[3], 0)
                if pdl:
                    if (tx >= 448) & (tx < 480):  # the T~ warp (q, k, v may load before the previous kernel ends)
                        T.pdl_sync()
                for j in T.serial(n_iter):
                    st = j % 2
                    start = bos + j * C
                    if tx < 416:
                        mark(tr, hv, bv, rank, tx, 3, j, 0)
                        T.barrier_wait(empty[st], (j // 2 + 1) % 2)
                        mark(tr, hv, bv, rank, tx, 3, j, 1)
                        if has_out:
                            T.tma_copy(q[start : start + C, hk, :], q_s[st, :, :], barrier=full[st])
                        T.tma_copy(k[start : start + C, hk, :], k_s[st, :, :], barrier=full[st])
                        T.barrier_arrive(full[st])
                    elif tx < 448:
                        T.barrier_wait(empty[st], (j // 2 + 1) % 2)
                        T.tma_copy(v[start : start + C, hv, v0 : v0 + BV], v_s[st, :, :], barrier=full[st])
                        T.barrier_arrive(full[st])
                    elif tx < 480:
                        T.barrier_wait(empty[st], (j // 2 + 1) % 2)
                        T.tma_copy(tt[coff + j, hv, :, :], tt_s[st, :, :], barrier=full[st])
                        T.tma_copy(gb[coff + j, hv, :, :], gb_s[st, :, :], barrier=full[st])
                        T.barrier_arrive(full[st])

    if store_h:

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
            h0: T.Tensor((n_h0, h_v, dk, dv), acc),
            h: T.Tensor((n_chunk, h_v, dk, dv), half),
        ):
            body(q, k, v, tt, gb, cu_seqlens, chunk_offsets, order, None, h0, None, None, None, h, None)

    elif trace:

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
            tr: T.Tensor((TRACE_CTAS, 4, TRACE_CHUNKS, TRACE_EVENTS), "int64"),
        ):
            body(q, k, v, tt, gb, cu_seqlens, chunk_offsets, order, ht_rows, h0, scale, o, ht, None, tr)

    else:

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
            body(q, k, v, tt, gb, cu_seqlens, chunk_offsets, order, ht_rows, h0, scale, o, ht, None, None)

    return kernel


def variants():
    """``(kernel name, params)`` of every warp-specialised forward variant (K = V = 128)."""
    full = [
        dict(dk=128, dv=128, dtype=dtype, has_h0=has_h0, block_dv=block_dv)
        for dtype in ("bfloat16", "float16")
        for has_h0 in (True, False)
        for block_dv in (128, 64)
    ]
    states = [dict(p, store_h=True) for p in full]
    # the output call right after kkt_inverse is a programmatic dependent launch, after the CP scan it is not (over
    # all of V the forward takes split_state_recurrence instead of either)
    after_kkt = [dict(p, pdl=True) for p in full if p["block_dv"] < p["dv"]]
    after_scan = [p for p in full if p["has_h0"] and p["block_dv"] < p["dv"]]
    return [("chunk_fwd_ws", params) for params in after_kkt + after_scan + states]
