"""The gate-free inverse kernel of the GDN chunked forward on SM90 (chunk C = 64), and the chunk numbering.

Notation as in ``shared/docs/gdn-kernel-design.md``: gamma = in-chunk inclusive cumsum of the log
gate g, e = exp(gamma), r = exp(gamma_C - gamma), L~ = strictly_lower(diag(beta) K K^T),
T~ = (I + L~)^-1 (gate-free), A_g = Gamma o T~ o beta_col.

Token-major tensors are flattened over the batch: a dense ``[B, T, ...]`` input is read as one
packed sequence of ``B*T`` tokens with ``cu_seqlens = [0, T, 2T, ...]``; one compile therefore serves
every batch layout and length.  Chunks are numbered globally: sequence n owns chunks
``chunk_offsets[n] .. chunk_offsets[n+1]-1`` (``chunk_offsets`` = exclusive cumsum of ceil(len/64)); the int32
``spans[chunk] = (first token, length)`` of each chunk slot (length 0 for the unused tail slots) come from
``seq_tables`` with the offsets.

* :func:`kkt_inverse` -- one CTA per (chunk, qk-head, up to 4 of its v-heads): K K^T once on tensor
  cores, then per v-head the 32x32 diagonal blocks of (I + L~)^-1 and X = B^-1 C by fp32 right-looking
  substitution and the off-diagonal block -X A^-1 by one wgmma; T~ stored per chunk as
  ``[chunk, H_v, 64, 64]``. Rows past a sequence's end have beta = 0, so their rows of T~ are unit rows.

The chunk recurrence that consumes T~ is ``chunk_recurrence.chunk_fwd_ws``.
"""

import tilelang.language as T

from ._build import compiled
from .chunking import CHUNK

_BLK = 16  # the diagonal blocks inverted by substitution
_HEADS_PER_CTA = 4  # v-heads (of one qk-head) per CTA
_KD_STRIDE = 20  # fp32 row stride of the diagonal blocks' smem copy
_KD_BLOCK = _BLK * _KD_STRIDE + 4  # offset between diagonal blocks: two blocks' rows read together hit other banks
_CW_STRIDE = 36  # fp32 row stride of the smem copy of C: a half-row per lane, float4 loads without bank conflicts


@T.macro
def split_kkt(p_f, kd_s, lw_s, cw_s):
    """K K^T (the fp32 wgmma fragment ``p_f``, 64x64, unscaled) into the smem operands: its four diagonal 16x16
    blocks (``kd_s``, the substitution's), the two blocks below them inside each 32-block (``lw_s``: L10, L32) and
    the 32x32 block below the diagonal (``cw_s``: C)."""
    B, S = _BLK, _KD_STRIDE
    for i, j in T.Parallel(CHUNK, CHUNK):
        if i // B == j // B:
            kd_s[i // B * _KD_BLOCK + (i % B) * S + j % B] = p_f[i, j]
        elif (i // B == j // B + 1) & (i // B % 2 == 1):
            lw_s[i // (2 * B), i % B, j % B] = p_f[i, j]
        if (i >= 2 * B) & (j < 2 * B):
            cw_s[i - 2 * B, j] = p_f[i, j]


@T.macro
def solve_diagonal(kd_s, bt_s, x, l4, h, b, c):
    """Column c of D_b = (I + strictly_lower(diag(beta) K K^T)_bb)^-1, the diagonal 16x16 block b of head h, into
    ``x`` (its 16 rows) by fp32 right-looking substitution: once x_j is final every later row takes its term
    (K K^T is symmetric, so row j of ``kd_s``'s block is its column j: one float4 broadcast per quad)."""
    B, S = _BLK, _KD_STRIDE
    for r in T.unroll(B):
        x[r] = T.float32(0)
    for j in T.unroll(B):
        x[j] = T.if_then_else(j == c, T.float32(1), T.float32(0)) - bt_s[h, b * B + j] * x[j]
        for v in T.unroll(B // 4):
            if v * 4 + 3 > j:
                for q in T.vectorized(4):
                    l4[q] = kd_s[b * _KD_BLOCK + j * S + v * 4 + q]
                for q in T.unroll(4):
                    if v * 4 + q > j:
                        x[v * 4 + q] += l4[q] * x[j]


@compiled
def kkt_inverse(*, dk: int, dtype: str):
    """Per chunk and v-head: T~ = (I + strictly_lower(diag(beta) K K^T))^-1 (fp16), the gate
    cumsum gamma with the masked beta (fp32 ``gb[chunk, hv] = [gamma; beta]``; rows past the
    sequence end get g = 0 and beta = 0, so their rows of T~ are unit rows) and int32
    ``bad[chunk, hv]``, nonzero when some token's map ``I - beta k k^T`` may not be a contraction
    (``beta < 0`` or ``beta |k|^2 > 2``, |k|^2 from the diagonal of K K^T): ``context_parallel.warmup_plan`` reads it.

    One CTA (one warpgroup) per (chunk, qk-head, group of up to 4 v-heads of that qk-head): K and
    K K^T (fp32, wgmma) once; per v-head, with L = strictly_lower(diag(beta) K K^T) in 16x16 blocks L_ij,
    D_b = (I + L_bb)^-1 and the 32-blocks A = I + L[:32, :32], B = I + L[32:, 32:], C = L[32:, :32]:

        A^-1 = [[D0, 0], [-D1 L10 D0, D1]],  B^-1 = [[D2, 0], [-D3 L32 D2, D3]],
        T~ = [[A^-1, 0], [-B^-1 C A^-1, B^-1]].

    The D_b by fp32 substitution on CUDA cores (warps 0-1: a lane per column, 16-row chains) while warps 2-3
    scale L10, L32, C by beta into fp16; then four small wgmmas on fp16 operands (fp32 accumulation; both
    32-blocks' products share one wgmma by their row ranges): L10 D0 | L32 D2, then D1 (L10 D0) | D3 (L32 D2),
    then Z = C A^-1, then B^-1 Z. Each product is rounded to fp16 once (``bench/blocked_inverse_precision.py``:
    T~ within 1.0e-4 of float64 on the tests' inputs). T~ is assembled in shared memory and stored by 16-byte rows.
    """
    n_tok = T.dynamic("n_tok")
    n_chunk = T.dynamic("n_chunk")
    h_qk = T.dynamic("h_qk")
    h_v = T.dynamic("h_v")
    C, B, GB, S, KB = CHUNK, _BLK, _HEADS_PER_CTA, _KD_STRIDE, _KD_BLOCK
    H = 2 * B  # a 32-block
    acc = "float32"
    half = "float16"

    @T.prim_func
    def kernel(
        k: T.Tensor((n_tok, h_qk, dk), dtype),
        g: T.Tensor((n_tok, h_v), acc),
        beta: T.Tensor((n_tok, h_v), acc),
        spans: T.Tensor((n_chunk, 2), "int32"),
        tt: T.Tensor((n_chunk, h_v, C, C), half),
        gb: T.Tensor((n_chunk, h_v, 2, C), acc),
        bad: T.Tensor((n_chunk, h_v), "int32"),
    ):
        with T.Kernel(n_chunk, h_qk, T.ceildiv(h_v // h_qk, GB), threads=128) as (chunk, hq, hz):
            T.annotate_min_blocks_per_sm(5)
            k_s = T.alloc_shared((C, dk), dtype)
            kd_s = T.alloc_shared((4 * KB,), acc)  # the diagonal 16x16 blocks of K K^T (unscaled)
            lw_s = T.alloc_shared((2, B, B), acc)  # L10, L32 of K K^T (unscaled)
            cw_s = T.alloc_shared((H, _CW_STRIDE), acc)  # K K^T [32:, :32] (unscaled)
            bt_s = T.alloc_shared((GB, C), acc)  # beta per v-head, 0 past the sequence end
            gt_s = T.alloc_shared((GB, C), acc)  # g per v-head, then gamma
            bad_s = T.alloc_shared((GB,), "int32")  # per v-head: some token's map is not a contraction
            # fp16 operands of the four products (the right-hand ones transposed: K-major); rows outside the ranges
            # named are zero
            l1_s = T.alloc_shared((C, B), half)  # rows 16-31: L10, rows 48-63: L32
            d1t_s = T.alloc_shared((H, B), half)  # [D0 | D2]^T
            d2_s = T.alloc_shared((C, H), half)  # rows 16-31: [D1, 0], rows 48-63: [0, D3]
            y1t_s = T.alloc_shared((B, H), half)  # [L10 D0; L32 D2]^T
            c_s = T.alloc_shared((C, H), half)  # rows 32-63: C (beta-scaled)
            ait_s = T.alloc_shared((H, H), half)  # (A^-1)^T
            bi_s = T.alloc_shared((C, H), half)  # rows 32-63: B^-1
            zt_s = T.alloc_shared((H, H), half)  # (C A^-1)^T
            t21_s = T.alloc_shared((H, H), half)  # -B^-1 C A^-1
            p_f = T.alloc_fragment((C, C), acc)
            f1 = T.alloc_fragment((C, H), acc)
            f2 = T.alloc_fragment((C, B), acc)
            x = T.alloc_local((B,), acc)
            l4 = T.alloc_local((4,), acc)
            lv = T.alloc_local((8,), acc)
            cv = T.alloc_local((B,), acc)
            bv = T.alloc_local((3,), acc)
            span = T.alloc_local((2,), "int32")
            k_ready = T.alloc_barrier(128)

            # per-CTA scalars computed once (the dynamic floor division is not re-evaluated per use)
            n_grp = T.alloc_var("int32", init=h_v // h_qk)
            hv0 = T.alloc_var("int32", init=hq * n_grp + hz * GB)  # first v-head of this CTA
            cnt = T.alloc_var("int32", init=T.min(n_grp - hz * GB, GB))  # v-heads of this CTA
            tx = T.get_thread_binding()
            for e in T.vectorized(2):
                span[e] = spans[chunk, e]
            start = T.alloc_var("int32", init=span[0])
            length = T.alloc_var("int32", init=span[1])
            if length > 0:
                # K by TMA (rows past the sequence end have beta = 0; past n_tok they are zero-filled)
                T.tma_copy(k[start : start + C, hq, :], k_s, barrier=k_ready)
                T.barrier_arrive(k_ready)
                if tx < GB:
                    bad_s[tx] = 0
                for h, i in T.Parallel(GB, C):
                    valid = (i < length) & (h < cnt)
                    bt_s[h, i] = T.if_then_else(valid, beta[start + i, hv0 + h], T.float32(0))
                    gt_s[h, i] = T.if_then_else(valid, g[start + i, hv0 + h], T.float32(0))
                # the zeros of the operands (no head writes them)
                for i, j in T.Parallel(C, H):
                    d2_s[i, j] = T.cast(0, half)
                    c_s[i, j] = T.cast(0, half)
                    bi_s[i, j] = T.cast(0, half)
                for i, j in T.Parallel(C, B):
                    l1_s[i, j] = T.cast(0, half)
                for i, j in T.Parallel(H, H):
                    ait_s[i, j] = T.cast(0, half)
                T.barrier_wait(k_ready, 0)
                T.gemm(k_s, k_s, p_f, transpose_B=True, clear_accum=True)
                split_kkt(p_f, kd_s, lw_s, cw_s)
                if tx < C:  # row tx: |k|^2 from the diagonal of K K^T
                    kk = kd_s[tx // B * KB + (tx % B) * S + tx % B]
                    for h in T.unroll(GB):
                        if (bt_s[h, tx] < 0) | (bt_s[h, tx] * kk > 2):
                            bad_s[h] = 1
                T.cumsum(gt_s, dim=1)
                for h, r, i in T.Parallel(GB, 2, C):
                    if h < cnt:
                        gb[chunk, hv0 + h, r, i] = T.if_then_else(r == 0, gt_s[h, i], bt_s[h, i])
                T.sync_threads()
                if tx < cnt:
                    bad[chunk, hv0 + tx] = bad_s[tx]

                for h in T.serial(cnt):
                    # the previous head's products and stores are done in every warp
                    T.sync_threads()
                    if tx < C:
                        # lane (b, c): column c of D_b, written where the products and T~ read it
                        b = tx // B
                        c = tx % B
                        solve_diagonal(kd_s, bt_s, x, l4, h, b, c)
                        for r in T.unroll(B):
                            xr = T.cast(x[r], half)
                            if b % 2 == 0:
                                d1t_s[b // 2 * B + c, r] = xr
                            else:
                                d2_s[b * B + r, b // 2 * B + c] = xr
                            if b < 2:
                                ait_s[b * B + c, b * B + r] = xr
                            else:
                                bi_s[b * B + r, (b - 2) * B + c] = xr
                    else:
                        # beta-scaled fp16 L10, L32 (4 columns per lane) and C (16 columns per lane): all loads
                        # first, so that no store is followed by a shared load (which would take a barrier)
                        u = tx - C
                        for p in T.unroll(2):
                            bv[p] = bt_s[h, (2 * p + 1) * B + u // 4]
                            for q in T.vectorized(4):
                                lv[p * 4 + q] = lw_s[p, u // 4, u % 4 * 4 + q]
                        bv[2] = bt_s[h, H + u // 2]
                        for q in T.vectorized(B):
                            cv[q] = cw_s[u // 2, u % 2 * B + q]
                        for p in T.unroll(2):
                            for q in T.unroll(4):
                                l1_s[(2 * p + 1) * B + u // 4, u % 4 * 4 + q] = T.cast(bv[p] * lv[p * 4 + q], half)
                        for q in T.unroll(B):
                            c_s[H + u // 2, u % 2 * B + q] = T.cast(bv[2] * cv[q], half)
                    # L10 D0 (rows 16-31, columns 0-15) and L32 D2 (rows 48-63, columns 16-31)
                    T.gemm(l1_s, d1t_s, f1, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(C, H):
                        if (i // B % 2 == 1) & (j // B == i // H):
                            y1t_s[j % B, i // H * B + i % B] = T.cast(f1[i, j], half)
                    # D1 L10 D0 (rows 16-31) and D3 L32 D2 (rows 48-63): the off-diagonal blocks of A^-1, B^-1
                    T.gemm(d2_s, y1t_s, f2, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(C, B):
                        if i // B == 1:
                            ait_s[j, i] = T.cast(-f2[i, j], half)
                        elif i // B == 3:
                            bi_s[i, j] = T.cast(-f2[i, j], half)
                    # Z = C A^-1 (rows 32-63)
                    T.gemm(c_s, ait_s, f1, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(C, H):
                        if i >= H:
                            zt_s[j, i - H] = T.cast(f1[i, j], half)
                    # B^-1 Z (rows 32-63)
                    T.gemm(bi_s, zt_s, f1, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(C, H):
                        if i >= H:
                            t21_s[i - H, j] = T.cast(-f1[i, j], half)
                    T.sync_threads()
                    for i, j in T.Parallel(H, H):
                        tt[chunk, hv0 + h, i, j] = ait_s[j, i]
                    for i, j in T.Parallel(H, H):
                        tt[chunk, hv0 + h, i, H + j] = T.cast(0, half)
                    for i, j in T.Parallel(H, H):
                        tt[chunk, hv0 + h, H + i, j] = t21_s[i, j]
                    for i, j in T.Parallel(H, H):
                        tt[chunk, hv0 + h, H + i, H + j] = bi_s[H + i, j]

    return kernel


def variants():
    """``(kernel name, params)`` of both inverse variants (bf16 and fp16 k, K = 128)."""
    return [("kkt_inverse", dict(dk=128, dtype=dtype)) for dtype in ("bfloat16", "float16")]
