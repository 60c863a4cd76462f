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
* :func:`kkt_inverse_tc` -- the same outputs, one CTA per chunk and v-head (or a few v-heads of one qk-head), up
  to seven per SM: K K^T by one wgmma, I + L~ into an fp16 tile inverted in place on tensor cores
  (``tile_inverse``). Faster where every v-head has its own keys (1.4x at H_v = H_qk on the H200, one v-head per
  CTA); where v-heads share a qk-head ``forward._gate_inverse`` takes ``kkt_inverse`` (at one v-head per CTA the
  tensor-core kernel was level at two per qk-head and slower at four; two or four per CTA, measured on an H100, are
  at best level with the grouped kernel: ``bench/results/2026-12-05-fwd-onchip-inverse.md``).

The chunk recurrence that consumes T~ is ``chunk_recurrence.chunk_fwd_ws``.
"""

import tilelang.language as T

from ._build import compiled
from .chunking import CHUNK
from .tile_inverse import CUDA as TILE_INVERSE_CUDA
from .tile_inverse import TILE_STRIDE

_HALF = 32  # kkt_inverse works on two 32x32 diagonal blocks
_HEADS_PER_CTA = 4  # v-heads (of one qk-head) per CTA of kkt_inverse; even (they are processed in pairs)
_LD_STRIDE = 40  # fp32 row stride of the smem copies of K K^T (conflict-free fragment stores)
_LD_BLOCK = _HALF * _LD_STRIDE + 4  # offset of the second diagonal block: 4 banks away from the first
# |k|^2 bound of a key normalised in fp32 and rounded to bf16 or fp16 (each element within 2^-9 relative, so
# |k|^2 <= (1 + 2^-9)^2), with margin: (1 + 2^-8)^2
_UNIT_KEYS_NORM2 = 1.008


@T.macro
def split_kkt(p_f, ld_s, c_s):
    """K K^T (the fp32 wgmma fragment ``p_f``, 64x64) into the substitution's smem operands: its two diagonal
    32x32 blocks into ``ld_s`` (row stride ``_LD_STRIDE``) and the block below the diagonal into ``c_s``."""
    H, LS = _HALF, _LD_STRIDE
    for i, j in T.Parallel(CHUNK, CHUNK):
        if i // H == j // H:
            ld_s[i // H, (i % H) * LS + j % H] = p_f[i, j]
        elif i >= H:
            c_s[i - H, j] = p_f[i, j]


@T.macro
def _load_quad(ld_s, l4, blk, j, v):
    """Entries 4 v .. 4 v + 3 of row j of diagonal block ``blk`` of K K^T (one float4 broadcast) into ``l4``. K K^T is
    symmetric, so this is also column j: what the right-looking substitution step j subtracts. A quad at a time keeps
    four registers for the row, not 32 (five CTAs fit an SM)."""
    for q in T.vectorized(4):
        l4[q] = ld_s[blk, j * _LD_STRIDE + v * 4 + q]


@T.macro
def solve_diagonal(ld_s, bt_s, b_s, x, y, l4, hh, e, blk, c):
    """One lane's share of the diagonal blocks A^-1 (blk 0) or B^-1 (blk 1) of head ``hh``: column c (32 rows,
    into ``x``) and column c + 16 (its 16 rows below the diagonal, into ``y``) of the solution of
    x_r = delta_rc - beta_r sum_{j<r} KK_rj x_j, by fp32 right-looking substitution: once x_j is final, every
    later row's sum takes its term, so the dependent chain is two FMAs per row (a row-by-row dot product would
    chain all 496); stored, rounded to fp16, to rows 32 e .. 32 e + 31 of ``b_s`` ([[A_h^-1, B_h^-1], ...]).
    ``ld_s``: the two unscaled diagonal 32x32 blocks of K K^T; ``bt_s[hh]``: beta (0 for a head not there)."""
    H, Q = _HALF, _HALF // 2
    half = "float16"
    for r in T.unroll(H):
        x[r] = T.float32(0)
    for r in T.unroll(Q):
        y[r] = T.float32(0)
    for j in T.unroll(H):
        beta_j = bt_s[hh, blk * H + j]
        x[j] = T.if_then_else(j == c, T.float32(1), T.float32(0)) - beta_j * x[j]
        if j >= Q:
            y[j - Q] = T.if_then_else(j == c + Q, T.float32(1), T.float32(0)) - beta_j * y[j - Q]
        for v in T.unroll(H // 4):
            if v * 4 + 3 > j:
                _load_quad(ld_s, l4, blk, j, v)
                for q in T.unroll(4):
                    if v * 4 + q > j:
                        x[v * 4 + q] += l4[q] * x[j]
                        if j >= Q:
                            y[v * 4 + q - Q] += l4[q] * y[j - Q]
    for r in T.unroll(H):
        b_s[e * H + r, blk * H + c] = T.cast(x[r], half)
    for r in T.unroll(Q):
        b_s[e * H + r, blk * H + Q + c] = T.cast(0, half)
    for r in T.unroll(Q, H):
        b_s[e * H + r, blk * H + Q + c] = T.cast(y[r - Q], half)


@T.macro
def solve_off_diagonal(ld_s, c_s, bt_s, a_s, x, l4, hh, e, lane):
    """One lane's column ``lane`` of X = B^-1 C of head ``hh``, x_r = beta_r (C_r - sum_{j<r} KK_rj x_j) over the
    32 rows of block B (fp32, right-looking as in :func:`solve_diagonal`), stored to the diagonal block e of
    ``a_s`` ([[X_h0, 0], [0, X_h1]]). ``c_s``: K K^T [32:, :32] (unscaled)."""
    H = _HALF
    for r in T.unroll(H):
        x[r] = c_s[r, lane]
    for j in T.unroll(H):
        x[j] = bt_s[hh, H + j] * x[j]
        for v in T.unroll(H // 4):
            if v * 4 + 3 > j:
                _load_quad(ld_s, l4, 1, j, v)
                for q in T.unroll(4):
                    if v * 4 + q > j:
                        x[v * 4 + q] -= l4[q] * x[j]
    for r in T.unroll(H):
        a_s[e * H + r, e * H + lane] = T.cast(x[r], "float16")


@compiled
def kkt_inverse(*, dk: int, dtype: str, inverse: bool = True, unit_keys: bool = False):
    """Per chunk and v-head: T~ = (I + strictly_lower(diag(beta) K K^T))^-1 (fp16), the gate
    cumsum gamma with the masked beta (fp32 ``gb[chunk, hv] = [gamma; beta]``; rows past the
    sequence end get g = 0 and beta = 0, so their rows of T~ are unit rows) and int32
    ``bad[chunk, hv]``, nonzero when some token's map ``I - beta k k^T`` may not be a contraction
    (``beta < 0`` or ``beta |k|^2 > 2``, |k|^2 from the diagonal of K K^T): ``context_parallel.warmup_plan`` reads it.
    Without ``inverse`` only ``gb`` and ``bad`` (no ``tt`` argument), for a context-parallel forward that forms T~
    for the chunks its transitions run alone (``forward._sparse_inverse``); with ``unit_keys`` too (keys
    L2-normalised by the forward, so ``|k|^2 <= _UNIT_KEYS_NORM2`` after rounding) K is not read at all and the
    flags come from beta alone.

    One CTA (one warpgroup) per (chunk, qk-head, group of up to 4 v-heads of that qk-head): K and
    K K^T (fp32, wgmma) are computed once and kept in shared memory; only beta and the inverse differ
    per v-head. With A, B the two 32x32 diagonal blocks of I + L~ and C = L~[32:, :32]:

        T~ = [[A^-1, 0], [-X A^-1, B^-1]],   X = B^-1 C.

    The v-heads go in pairs (h0, h0 + 1); per pair, fp32 right-looking substitution on CUDA cores:
    warp e (e = 0, 1) solves A^-1 and B^-1 of head h0 + e (lane l: block l // 16, a 32-row chain for
    column l % 16 and, on the same row loads, a 16-row chain for column l % 16 + 16); warp 2 + e solves
    X of head h0 + e (lane l: column l, 32-row chain). The diagonal blocks of T~ are thus rounded to fp16
    once, straight from fp32, and written to global memory by the lanes that computed them (one row of
    16 columns per half-warp: two full 32-byte sectors per store). Then one m64n64k64 wgmma on fp16
    operands, [[X_h0, 0], [0, X_h1]] @ [A_h0^-1 | B_h0^-1 ; A_h1^-1 | B_h1^-1], gives X A^-1 of both heads
    (columns 0-31; the B^-1 columns are unused). Two block barriers per pair of v-heads.
    """
    n_tok = T.dynamic("n_tok")
    n_chunk = T.dynamic("n_chunk")
    h_qk = T.dynamic("h_qk")
    h_v = T.dynamic("h_v")
    C, H, GB, LS, LB = CHUNK, _HALF, _HEADS_PER_CTA, _LD_STRIDE, _LD_BLOCK
    Q = H // 2
    acc = "float32"
    half = "float16"
    assert GB % 2 == 0 and not (unit_keys and inverse)

    @T.macro
    def body(k, g, beta, spans, tt, gb, bad):
        with T.Kernel(n_chunk, h_qk, T.ceildiv(h_v // h_qk, GB), threads=128) as (chunk, hq, hz):
            T.annotate_min_blocks_per_sm(5)
            T.pdl_trigger()  # the next kernel, a programmatic dependent, may launch as this grid's last CTAs run
            k_s = T.alloc_shared((C, dk), dtype)
            ld_s = T.alloc_shared((2, LB), acc)  # the two diagonal 32x32 blocks of K K^T (unscaled)
            c_s = T.alloc_shared((H, LS), acc)  # K K^T [32:, :32] (unscaled)
            bt_s = T.alloc_shared((GB, C), acc)  # beta per v-head, 0 past the sequence end
            gt_s = T.alloc_shared((GB, C), acc)  # g per v-head, then gamma
            a_s = T.alloc_shared((C, C), half)  # [[X_h0, 0], [0, X_h1]]
            b_s = T.alloc_shared((C, C), half)  # [[A_h0^-1, B_h0^-1], [A_h1^-1, B_h1^-1]]
            p_f = T.alloc_fragment((C, C), acc)
            x = T.alloc_local((H,), acc)
            y = T.alloc_local((Q,), acc)
            l4 = T.alloc_local((4,), acc)
            span = T.alloc_local((2,), "int32")
            bad_s = T.alloc_shared((GB,), "int32")  # per v-head: some token's map is not a contraction
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
                if not unit_keys:  # K by TMA (rows past the sequence end have beta = 0; past n_tok zero-filled)
                    T.tma_copy(k[start : start + C, hq, :], k_s, barrier=k_ready)
                    T.barrier_arrive(k_ready)
                if tx < GB:
                    bad_s[tx] = 0
                for h, i in T.Parallel(GB, C):
                    valid = (i < length) & (h < cnt)
                    bt_s[h, i] = T.if_then_else(valid, beta[start + i, hv0 + h], T.float32(0))
                    gt_s[h, i] = T.if_then_else(valid, g[start + i, hv0 + h], T.float32(0))
                if inverse:  # b_s too: a pair's missing second head leaves its rows unsolved, and the X A^-1 wgmma
                    # multiplies them by the zeros of a_s, which must not meet a NaN
                    for i, j in T.Parallel(C, C):
                        b_s[i, j] = T.cast(0, half)
                        if i // H != j // H:
                            a_s[i, j] = T.cast(0, half)
                if not unit_keys:
                    T.barrier_wait(k_ready, 0)
                    T.gemm(k_s, k_s, p_f, transpose_B=True, clear_accum=True)
                    split_kkt(p_f, ld_s, c_s)
                else:
                    T.sync_threads()  # beta in shared memory
                if tx < C:  # row tx: |k|^2 from the diagonal of K K^T, or its bound for unit keys
                    kk = T.float32(_UNIT_KEYS_NORM2) if unit_keys else ld_s[tx // H, (tx % H) * LS + tx % H]
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

                if inverse:  # else the gate tables alone
                    for pair in T.serial(T.ceildiv(cnt, 2)):
                        h0 = pair * 2
                        # the previous pair's wgmma has finished reading a_s and b_s in every warp
                        T.sync_threads()
                        # Substitution, fp32 (solve_diagonal, solve_off_diagonal), by the warps of heads that are there
                        # (an odd count's last pair has one: the other head's rows of the product are not stored)
                        if tx < 64:
                            e = tx // 32
                            hh = h0 + e
                            blk = (tx % 32) // Q
                            c = tx % Q
                            if hh < cnt:
                                solve_diagonal(ld_s, bt_s, b_s, x, y, l4, hh, e, blk, c)
                                for r in T.unroll(H):
                                    tt[chunk, hv0 + hh, blk * H + r, blk * H + c] = T.cast(x[r], half)
                                for r in T.unroll(Q):
                                    tt[chunk, hv0 + hh, blk * H + r, blk * H + Q + c] = T.cast(0, half)
                                for r in T.unroll(Q, H):
                                    tt[chunk, hv0 + hh, blk * H + r, blk * H + Q + c] = T.cast(y[r - Q], half)
                        elif h0 + tx // 32 - 2 < cnt:
                            e = tx // 32 - 2
                            solve_off_diagonal(ld_s, c_s, bt_s, a_s, x, l4, h0 + e, e, tx % 32)
                        # rows 32 e .. 32 e + 31, columns 0..31: X A^-1 of head h0 + e
                        T.gemm(a_s, b_s, p_f, clear_accum=True)
                        for e, i, j in T.Parallel(2, H, H):
                            if h0 + e < cnt:
                                tt[chunk, hv0 + h0 + e, i, H + j] = T.cast(0, half)
                        for i, j in T.Parallel(C, C):
                            if (j < H) & (h0 + i // H < cnt):
                                tt[chunk, hv0 + h0 + i // H, H + i % H, j] = T.cast(-p_f[i, j], half)

    if inverse:
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
            body(k, g, beta, spans, tt, gb, bad)

        return kernel

    @T.prim_func
    def kernel_tables(
        k: T.Tensor((n_tok, h_qk, dk), dtype),
        g: T.Tensor((n_tok, h_v), acc),
        beta: T.Tensor((n_tok, h_v), acc),
        spans: T.Tensor((n_chunk, 2), "int32"),
        gb: T.Tensor((n_chunk, h_v, 2, C), acc),
        bad: T.Tensor((n_chunk, h_v), "int32"),
    ):
        body(k, g, beta, spans, None, gb, bad)

    return kernel_tables


@compiled
def kkt_inverse_tc(*, dk: int, dtype: str, heads: int = 1, needed: bool = False):
    """:func:`kkt_inverse`'s outputs (T~, ``gb``, ``bad``; same call), the inverse on tensor cores: one CTA (one
    warpgroup) per chunk and ``heads`` v-heads of one qk-head (1, 2 or 4, dividing H_v / H_qk). K by TMA, K K^T by
    one wgmma (fp32, kept in registers for the CTA's v-heads); per v-head, diag(beta) K K^T rounded to fp16 into a
    padded tile (unmasked: the inverse reads L~ only) and the contraction flags from the fragment's diagonal, then the
    tile inverted in place by ``tile_inverse`` (block doubling on tensor cores) and stored as T~. ~30 KB of shared
    memory and 58 registers (``heads`` = 1), so seven CTAs share an SM.

    With ``needed`` (``heads`` = 1; for a context-parallel forward alone, ``forward._sparse_inverse``) the call is
    ``kernel(k, beta, spans, need, tt)``: T~ only where the int32 ``need[chunk, hv]`` (``context_parallel.warmup_plan``)
    is nonzero, i.e. for the chunks the transitions run; no gate tables (:func:`kkt_inverse` without its inverse
    wrote them)."""
    n_tok = T.dynamic("n_tok")
    n_chunk = T.dynamic("n_chunk")
    h_qk = T.dynamic("h_qk")
    h_v = T.dynamic("h_v")
    C, TS, HB, acc, half = CHUNK, TILE_STRIDE, heads, "float32", "float16"
    assert HB in (1, 2, 4) and not (needed and HB > 1)

    @T.macro
    def body(k, g, beta, spans, need, tt, gb, bad):
        with T.Kernel(n_chunk, h_v // HB, threads=128) as (chunk, hz):
            if HB > 1:  # K K^T stays in registers across the v-heads: keep five CTAs per SM
                T.annotate_min_blocks_per_sm(5)
            T.import_source(TILE_INVERSE_CUDA)
            T.pdl_trigger()  # the next kernel, a programmatic dependent, may launch as this grid's last CTAs run
            k_s = T.alloc_shared((C, dk), dtype)
            t_s = T.alloc_shared((C * TS,), half)  # I + L~, then T~: row-major, unswizzled, rows TS halves apart
            scratch = T.alloc_shared((1024,), acc)  # the inverse's C A^-1
            bt_s = T.alloc_shared((HB, C), acc)  # beta per v-head, 0 past the sequence end
            gt_s = T.alloc_shared((HB, C), acc)  # g per v-head, then gamma
            bad_s = T.alloc_shared((HB,), "int32")
            p_f = T.alloc_fragment((C, C), acc)
            k_ready = T.alloc_barrier(128)
            span = T.alloc_local((2,), "int32")
            tx = T.get_thread_binding()
            hv0 = hz * HB
            hk = hv0 // (h_v // h_qk)
            for e in T.vectorized(2):
                span[e] = spans[chunk, e]
            start = T.alloc_var("int32", init=span[0])
            length = T.alloc_var("int32", init=span[1])
            if needed:
                if need[chunk, hv0] == 0:
                    length = 0
            if length > 0:
                # K by TMA (rows past the sequence end have beta = 0; past n_tok they are zero-filled)
                T.tma_copy(k[start : start + C, hk, :], k_s, barrier=k_ready)
                T.barrier_arrive(k_ready)
                for h, i in T.Parallel(HB, C):
                    bt_s[h, i] = T.if_then_else(i < length, beta[start + i, hv0 + h], T.float32(0))
                    if not needed:
                        gt_s[h, i] = T.if_then_else(i < length, g[start + i, hv0 + h], T.float32(0))
                if tx < HB:
                    bad_s[tx] = 0
                T.barrier_wait(k_ready, 0)
                T.sync_threads()
                T.gemm(k_s, k_s, p_f, transpose_B=True, clear_accum=True)
                if not needed:
                    T.cumsum(gt_s, dim=1)
                for h in T.serial(HB):
                    for i, j in T.Parallel(C, C):
                        t_s[i * TS + j] = T.cast(bt_s[h, i] * p_f[i, j], half)  # the inverse reads L~ only
                        if not needed:
                            if i == j:  # |k_i|^2 on the diagonal
                                if (bt_s[h, i] < 0) | (bt_s[h, i] * p_f[i, j] > 2):
                                    bad_s[h] = 1
                    T.sync_threads()
                    T.call_extern("handle", "qla_tile_inverse", T.address_of(t_s[0]), T.address_of(scratch[0]))
                    for i, j in T.Parallel(C, C):
                        tt[chunk, hv0 + h, i, j] = t_s[i * TS + j]
                    T.sync_threads()  # every lane has read the tile before the next v-head's fill
                if not needed:
                    for h, r, i in T.Parallel(HB, 2, C):
                        gb[chunk, hv0 + h, r, i] = T.if_then_else(r == 0, gt_s[h, i], bt_s[h, i])
                    if tx < HB:
                        bad[chunk, hv0 + tx] = bad_s[tx]

    if needed:
        @T.prim_func
        def kernel_needed(
            k: T.Tensor((n_tok, h_qk, dk), dtype),
            beta: T.Tensor((n_tok, h_v), acc),
            spans: T.Tensor((n_chunk, 2), "int32"),
            need: T.Tensor((n_chunk, h_v), "int32"),
            tt: T.Tensor((n_chunk, h_v, C, C), half),
        ):
            body(k, None, beta, spans, need, tt, None, None)

        return kernel_needed

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
        body(k, g, beta, spans, None, tt, gb, bad)

    return kernel


def variants():
    """``(kernel name, params)`` of both inverse kernels' variants and the gate tables alone (bf16 and fp16 k,
    K = 128)."""
    return [(name, dict(dk=128, dtype=dtype, **extra))
            for name, extra in (("kkt_inverse", {}), ("kkt_inverse_tc", {}), ("kkt_inverse", dict(inverse=False)),
                                ("kkt_inverse", dict(inverse=False, unit_keys=True)),
                                ("kkt_inverse_tc", dict(needed=True)))
            for dtype in ("bfloat16", "float16")]
