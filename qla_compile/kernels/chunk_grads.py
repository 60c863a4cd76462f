"""The per-chunk gradient kernel of the GDN chunked backward on SM90 (chunk C = 64).

Notation as in ``shared/docs/gdn-kernel-design.md`` §1.4 and ``reference._backward_chunks`` (the
executable spec): gamma = in-chunk inclusive cumsum of g, e = exp(gamma), r = exp(gamma_C - gamma),
a = exp(gamma_C), Gamma_ij = exp(gamma_i - gamma_j) (i >= j), A_g = Gamma o T~ o beta_col,
P_g = scale Gamma o Q K^T, U0 = K S, W' = V - e o U0, V' = A_g W'. The pipeline around it is in
``backward``: :func:`chunk_grads` gets every chunk's start state S (fp16, ``h``), incoming state
gradient dS' and dV' = r o K dS' + P_g^T dO (input dtype, ``dh`` and ``dvp``) from the two recurrences
and, one CTA per (chunk, qk-head) looping over the GVA group's v-heads, forms dq, dk (summed over the
group on chip), dv, dg and dbeta.

dg is formed without cancellation, as in the reference: dg_t = sum_{s>=t} de_s + sum_{s<t} dr_s
+ a <dS', S> + sum_{s>=t, j<t} Y_sj with Y = dP o P_g + dA o A_g, all in fp32.

Precision.  Accumulators are fp32.  The state recompute (the fused forward's ``store_h`` mode) keeps
the forward's precision (S in the input dtype for K S; fp16 A_g, W', V', r o K) and stores h in fp16.
GEMMs with a gradient operand (dO, dS', dV', dU0, dT~, ...) stay in the input dtype, so that in bf16
dO-sized values keep their range; :func:`chunk_grads` also keeps K S in the input dtype (its shared
memory is full).  The <dS', S> term of dg is summed by ``reverse_recurrence.chunk_dstates_ws`` from the fp32 dS'.
dg of a no-decay head is what this is for: it is made of inner products of S and dS', so it carries
the relative error of both.  (FP64 emulation of the bf16 GPU test case with GVA, L2 norm and h0, 200
draws: dg's relative error RMS 5.9e-3 -> 4.4e-3 and draws above 1e-2 9.5% -> 2%; the bf16 rounding of
the L2-normalised q, k before the kernels alone gives 2.3e-3 RMS.)
"""

import tilelang.language as T

from ._build import compiled
from .chunk_recurrence import _PTX, _ex2, _exp
from .chunking import CHUNK
from .reverse_recurrence import _READY

_LOG2E = 1.4426950408889634


@T.macro
def _owning_sequence(chunk_offsets, n_seq, chunk):
    """The sequence owning chunk slot ``chunk`` (< ``chunk_offsets[n_seq]``): the largest s with
    ``chunk_offsets[s] <= chunk``, by bisection."""
    lo = T.alloc_var("int32", init=0)
    hi = T.alloc_var("int32", init=n_seq - 1)
    for _ in T.serial(31):
        if lo < hi:
            mid = (lo + hi + 1) // 2
            if chunk_offsets[mid] <= chunk:
                lo = mid
            else:
                hi = mid - 1
    return lo


def _gamma(gb_s, a, b):
    """Gamma_ab = exp(gamma_a - gamma_b) for b <= a, else 0, as one SFU ex2 (``chunk_recurrence._gamma_times``'s
    grouping: the row and column terms are loaded once per thread, the mask is added as -1e30)."""
    x = gb_s[0, a] * _LOG2E - gb_s[0, b] * _LOG2E
    return _ex2(x + T.Select(b <= a, T.float32(0), T.float32(-1e30)))


@T.macro
def _reduce_scatter(vals, lane, m, half):
    """Sum ``vals[:2 half]`` with lane ``lane ^ m``, keeping ``vals[:half]``: the lower half of the columns in
    the lane with bit m clear, the upper half in the other (each lane sends the half it does not keep)."""
    for u in T.unroll(half):
        up = (lane // m) % 2 == 1
        send = T.if_then_else(up, vals[u], vals[u + half])
        vals[u] = T.if_then_else(up, vals[u + half], vals[u]) + T.shfl_xor(send, m)


# Partial row and column sums of this kernel's wgmma accumulators (M = 64 rows over the 4 warps of a
# warpgroup, N split between the 2 warpgroups): element e of a thread with G groups of 8 columns per warpgroup
# is row 16 (warp % 4) + 8 ((e % 4) // 2) + lane // 4, column N / 2 (tx // 128) + 8 (e // 4) + 2 (lane % 4) + e % 2
# (the layout TileLang's own reduce_sum indexes). A row sum is complete within a warpgroup after the 4 lanes
# of a row are summed, a column sum within a warp after its 8 row lanes are: each warpgroup (warp) writes its
# partial to shared memory and the reader adds the 2 (4) partials in fixed order, instead of reduce_sum's
# cross-warpgroup exchange through a workspace (3 barriers per value, 40 for the 8 values of a column sum).
_RED = r"""
template <int G> __device__ __forceinline__ float qla_rowsum(const float* f, int h) {
  float s = 0.f;
  #pragma unroll
  for (int rv = 0; rv < 2 * G; ++rv) s += f[(rv % G) * 4 + h * 2 + rv / G];
  s += __shfl_xor_sync(0xffffffffu, s, 2);
  s += __shfl_xor_sync(0xffffffffu, s, 1);
  return s;
}
__device__ __forceinline__ float qla_colsum(const float* f, int c) {
  float s = f[(c >> 1) * 4 + (c & 1)] + f[(c >> 1) * 4 + 2 + (c & 1)];
  s += __shfl_xor_sync(0xffffffffu, s, 16);
  s += __shfl_xor_sync(0xffffffffu, s, 8);
  s += __shfl_xor_sync(0xffffffffu, s, 4);
  return s;
}
"""


@T.macro
def _row_partials(frag, groups, part, out_s, tx, base=0):
    """Row sums of the (64, 16 groups) accumulator ``frag`` per warpgroup: ``out_s[base + tx // 128, row]`` (every
    lane shuffles; lane % 4 == 0 writes)."""
    for h in T.unroll(2):
        part[h] = T.call_extern("float32", f"qla_rowsum<{groups}>", frag.data, h)
    if tx % 4 == 0:
        for h in T.unroll(2):
            out_s[base + tx // 128, (tx % 128) // 32 * 16 + h * 8 + (tx % 32) // 4] = part[h]


@T.macro
def _col_sums(frag, part):
    """Column sums of the (64, 64) accumulator ``frag`` over the 16 rows of each warp, into ``part[:8]`` (every
    lane shuffles; registers only)."""
    for c in T.unroll(8):
        part[c] = T.call_extern("float32", "qla_colsum", frag.data, c)


@T.macro
def _col_store(part, out_s, tx):
    """``out_s[warp % 4, column]`` = the warp's column sums from :func:`_col_sums` (lanes 0-3 write)."""
    if tx % 32 < 4:
        for c in T.unroll(8):
            out_s[(tx % 128) // 32, (tx // 128) * 32 + (c // 2) * 8 + (tx % 4) * 2 + c % 2] = part[c]


def _ysw(i, j):
    """Column of Y[i, j] in y_s: 4-float groups XOR-swizzled by row, so that a warp reading one 4-float group
    from each of 32 rows hits every bank once per 8 rows."""
    return T.bitwise_xor(j // 4, i % 8) * 4 + j % 4


@compiled
def chunk_grads(*, dk: int, dv: int, dtype: str, threads: int = 256, pdl: bool = True, l2norm: bool = False):
    """Per (chunk, qk-head), given S and dS' of the chunk for each of its G = h_v / h_qk v-heads: dq, dk
    (summed over the GVA group), and per v-head dv, dg, dbeta.

    Call as ``kernel(q, k, v, do, tt, gb, h, dh, dvp, sd, ready, target, cu_seqlens, chunk_offsets, order, scale,
    q_rstd, k_rstd, acc, dq, dk, dv, dg, dbeta)`` with ``tt``, ``gb`` from ``kkt_inverse`` (gamma and the masked beta of
    the chunk), ``tt.shape[0] >= n_tok // 64 + n_seq`` chunk slots (as ``backward`` allocates), and the grid one
    slot longer than that.

    Launched right behind ``reverse_recurrence.chunk_dstates_ws`` (with ``pdl``, as its programmatic dependent, so that
    it runs on the SMs the recurrence leaves idle): CTA (hk, rank) takes row ``rank`` of ``order``, int32
    ``(chunk slot, first token, length, 0)`` (``backward._grads_order``; with a placeholder row of -1 it takes
    the slots last to first and searches ``chunk_offsets`` for their sequences) and, before loading dS', sd and
    dV' (on the second mbarrier, first waited for after V'), waits until
    ``ready[chunk, hk]`` reaches ``target`` (the recurrence's CTAs of the group's v-heads and DV slices have each
    published the chunk; ``target`` is G times the recurrence's DV slices, and ``sd``'s second slice is read only
    when there are two). The spare slots come last and wait for the whole recurrence grid, so this grid
    completes after it. Without ``pdl`` it is an ordinary launch after the recurrence (the counters are then
    complete). One CTA loads the q, k tiles once, then loops over the group's v-heads
    hv = hk G + g; its other input tiles are TMA-loaded per v-head against one mbarrier (phase g % 2; h too
    in fp16; in bf16 h comes by cp.async into the free W'/dV' tiles and is converted after the wait) and the
    recurrence's dS', sd and dV' against a second (dV' in bf16 once the conversion has freed its tile); rows
    of a partial chunk past the sequence end are zeroed in shared memory. Independent GEMMs are issued
    together (``T.wgmma_gemm``) and waited for as late as their first reader. dv is staged over dV' and stored as
    one tile (by rows when the chunk is partial).

    dq, dk sum over g = 0, 1, ..., G - 1 in that order in fp32 through ``acc`` (fp32 scratch
    ``[n_chunk, h_qk, 2, 64, dk]``, one [dq; dk] tile pair per CTA; the L2 keeps them): g < G - 1 stores its
    running sums, and the next v-head loads them by cp.async into its dead dS' and W'/dV' tiles as soon as
    those are read, then adds them after its last GEMMs. The last v-head writes dq, dk in the input dtype.
    Every such store is staged in shared memory and written by whole rows. With G == 1 the scratch is not
    touched (pass ``[1, h_qk, 2, 64, dk]``).

    With ``l2norm``, q and k are the L2-normalised rows and ``q_rstd``, ``k_rstd`` (fp32 ``[n_tok, h_qk]``) their
    ``rsqrt(sum(x^2) + eps)``: dq, dk are then of the raw rows, ``rstd (d - y <d, y>)`` per row (y the normalised
    row, as ``reference.l2norm_bwd``), formed on chip before the store. Without it those two are not read
    (pass ``[1, h_qk]``).

    Every row of every output is written: the spare slots past the last chunk (at least
    ceil((n_tok - cu_seqlens[-1]) / 64) of them, counting the extra grid slot) zero the rows past
    ``cu_seqlens[-1]``, so all outputs may be allocated uninitialised (rows before ``cu_seqlens[0]`` are
    not written: cu_seqlens[0] must be 0).
    """
    n_tok = T.dynamic("n_tok")
    n_chunk = T.dynamic("n_chunk")
    n_seq1 = T.dynamic("n_seq1")
    n_acc = T.dynamic("n_acc")
    n_order = T.dynamic("n_order")
    n_rstd = T.dynamic("n_rstd")
    h_qk = T.dynamic("h_qk")
    h_v = T.dynamic("h_v")
    C = CHUNK
    acc = "float32"
    half = "float16"
    assert dk == 2 * C, "the <dS', S> row sums fold onto the chunk rows in pairs"

    @T.prim_func
    def kernel(
        q: T.Tensor((n_tok, h_qk, dk), dtype),
        k: T.Tensor((n_tok, h_qk, dk), dtype),
        v: T.Tensor((n_tok, h_v, dv), dtype),
        do: T.Tensor((n_tok, h_v, dv), dtype),
        tt: T.Tensor((n_chunk, h_v, C, C), half),
        gb: T.Tensor((n_chunk, h_v, 2, C), acc),
        h: T.Tensor((n_chunk, h_v, dk, dv), half),
        dh: T.Tensor((n_chunk, h_v, dk, dv), dtype),
        dvp: T.Tensor((n_chunk, h_v, C, dv), dtype),
        sd: T.Tensor((n_chunk, h_v, 2, dk), acc),
        ready: T.Tensor((n_chunk, h_qk), "int32"),
        target: T.int32,
        cu_seqlens: T.Tensor((n_seq1,), "int32"),
        chunk_offsets: T.Tensor((n_seq1,), "int32"),
        order: T.Tensor((n_order, 4), "int32"),
        scale: T.float32,
        q_rstd: T.Tensor((n_rstd, h_qk), acc),
        k_rstd: T.Tensor((n_rstd, h_qk), acc),
        acc_buf: T.Tensor((n_acc, h_qk, 2, C, dk), acc),
        dq_out: T.Tensor((n_tok, h_qk, dk), dtype),
        dk_out: T.Tensor((n_tok, h_qk, dk), dtype),
        dv_out: T.Tensor((n_tok, h_v, dv), dtype),
        dg_out: T.Tensor((h_v, n_tok), acc),
        db_out: T.Tensor((h_v, n_tok), acc),
    ):
        with T.Kernel(h_qk, n_chunk + 1, threads=threads) as (hk, rank):  # qk-heads fastest, chunks in rank order
            T.import_source(_PTX + _RED + _READY)
            q_s = T.alloc_shared((C, dk), dtype)
            k_s = T.alloc_shared((C, dk), dtype)
            v_s = T.alloc_shared((C, dv), dtype)  # V, then e o U0, then dU0
            do_s = T.alloc_shared((C, dv), dtype)
            s_s = T.alloc_shared((dk, dv), dtype)  # S (from the fp16 h)
            ds_s = T.alloc_shared((dk, dv), dtype)  # dS'
            wd_s = T.alloc_shared((2, C, dv), dtype)  # [0]: W';  [1]: dV', then dv (staged for the store)
            vn_s = T.alloc_shared((C, dv), dtype)
            tt_s = T.alloc_shared((C, C), dtype)  # T~ in the GEMM dtype (fp16 values read from tt)
            a_s = T.alloc_shared((C, C), dtype)  # A_g, then T~^T dT~, then dQK
            p_s = T.alloc_shared((C, C), dtype)  # dT~, then beta o dL
            y_s = T.alloc_shared((C, C), acc)  # the fp16 T~ (TMA), then Y (columns swizzled by _ysw)
            tt16 = T.view(y_s, (2, C, C), half)  # [0]: T~ as loaded, until Y is written
            gb_s = T.alloc_shared((2, C), acc)  # [gamma; beta]
            sd_s = T.alloc_shared((2, dk), acc)
            e_s = T.alloc_shared((C,), acc)
            r_s = T.alloc_shared((C,), acc)
            de_s = T.alloc_shared((C,), acc)
            dr_s = T.alloc_shared((C,), acc)
            pr_s = T.alloc_shared((2, C), acc)  # per-warpgroup partial row sums: dr, de (dU0 and dq parts), dbeta (dL)
            pu_s = T.alloc_shared((2, C), acc)
            pq_s = T.alloc_shared((2, C), acc)
            pb2_s = T.alloc_shared((2, C), acc)
            pb1_s = T.alloc_shared((4, C), acc)  # per-warp partial column sums: dbeta (dA)
            bar = T.alloc_barrier(threads)
            bar_dvp = T.alloc_barrier(threads)  # dV', loaded once W'/dV' tiles are free
            # views of tiles while they are dead (same memory and layout as their parent; each switch is synced)
            pq32 = T.view(ds_s, (C, dk), acc)  # running dq sum, once dS' is read
            pk32 = T.view(wd_s, (C, dk), acc)  # running dk sum, once W' and dv are read
            h16 = T.view(wd_s, (dk, dv), half) if dtype != half else None  # S as loaded, until W' is written
            out_s = T.view(ds_s, (2, C, dk), dtype)  # dq, dk staged for the store
            nrm_s = T.view(a_s, (C // 2, C), acc)  # l2norm: [dq; dk] o [q; k] row partials (rows 0-3), rstd (4-5)
            b1_f = T.alloc_fragment((C, dv), acc)
            b2_f = T.alloc_fragment((C, dv), acc)
            dk_f = T.alloc_fragment((C, dk), acc)
            s1_f = T.alloc_fragment((C, C), acc)
            s2_f = T.alloc_fragment((C, C), acc)
            y_f = T.alloc_fragment((C, C), acc)  # Y in registers between reading and writing y_s
            part = T.alloc_local((8,), acc)
            yr = T.alloc_local((16,), acc)

            grp = T.alloc_var("int32", init=h_v // h_qk)  # G, once, not per access
            tx = T.get_thread_binding()
            n_seq = n_seq1 - 1
            n_real = chunk_offsets[n_seq]  # (an expression: loaded where used)
            # this rank's (chunk slot, first token, length) from the table in one load, else (a placeholder table)
            # slots last to first, each one's sequence searched for; the spare slots come after the real ones
            entry = T.alloc_local((4,), "int32")
            for e in T.vectorized(4):
                entry[e] = order[T.min(rank, n_order - 1), e]
            chunk = T.alloc_var("int32", init=entry[0])
            start = T.alloc_var("int32", init=entry[1])
            length = T.alloc_var("int32", init=entry[2])
            if rank >= n_order or entry[0] < 0:
                chunk = T.if_then_else(rank < n_real, n_real - 1 - rank, rank)
                if chunk < n_real:
                    seq = _owning_sequence(chunk_offsets, n_seq, chunk)
                    start = cu_seqlens[seq] + (chunk - chunk_offsets[seq]) * C
                    length = T.min(cu_seqlens[seq + 1] - start, C)
                else:
                    length = 0
            if length > 0:
                for g in T.serial(grp):
                    hv = hk * grp + g
                    # every input tile in flight at once (q, k once); rows past n_tok are zero-filled by the TMA
                    # unit. The previous v-head's readers are done (the sync at the end of the loop).
                    if g == 0:
                        T.tma_copy(q[start : start + C, hk, :], q_s, barrier=bar)
                        T.tma_copy(k[start : start + C, hk, :], k_s, barrier=bar)
                    T.tma_copy(v[start : start + C, hv, :], v_s, barrier=bar)
                    T.tma_copy(do[start : start + C, hv, :], do_s, barrier=bar)
                    T.tma_copy(tt[chunk, hv, :, :], tt16[0, :, :], barrier=bar)
                    T.tma_copy(gb[chunk, hv, :, :], gb_s, barrier=bar)
                    if dtype == half:
                        T.tma_copy(h[chunk, hv, :, :], s_s, barrier=bar)
                    # what the reverse recurrence writes, once it has published the chunk for every v-head of the
                    # group (the loading warp waits, under the loads above), on the second mbarrier: dS' is first
                    # read after V'
                    if g == 0 and tx < 32:
                        T.call_extern("void", "qla_ready_wait", T.address_of(ready[chunk, hk]), target)
                    T.tma_copy(dh[chunk, hv, :, :], ds_s, barrier=bar_dvp)
                    T.tma_copy(sd[chunk, hv, :, :], sd_s, barrier=bar_dvp)
                    if dtype == half:
                        T.tma_copy(dvp[chunk, hv, :, :], wd_s[1, :, :], barrier=bar_dvp)
                        T.barrier_arrive(bar_dvp)
                    T.barrier_arrive(bar)
                    if dtype != half:
                        T.async_copy(h[chunk, hv, :, :], h16)
                    T.barrier_wait(bar, g % 2)
                    if dtype != half:
                        T.ptx_wait_group(0)
                        T.sync_threads()
                        # fp16 -> bf16 (through fp32 explicitly: TileLang then converts pairs, __half22float2 +
                        # __float22bfloat162_rn, instead of one element at a time)
                        for i, d in T.Parallel(dk, dv):
                            s_s[i, d] = T.cast(T.cast(h16[i, d], acc), dtype)
                        T.fence_proxy_async()
                        T.sync_threads()  # h16 is read: dV' lands in its second half under the first GEMMs
                        T.tma_copy(dvp[chunk, hv, :, :], wd_s[1, :, :], barrier=bar_dvp)
                        T.barrier_arrive(bar_dvp)
                    if length < C:  # rows past the sequence's end are zero (gb has g = beta = 0 there)
                        # stores only (a loop that reads what it writes gets a __syncthreads per unrolled iteration)
                        if g == 0:
                            for i, d in T.Parallel(C, dk):
                                if i >= length:
                                    q_s[i, d] = T.cast(0, dtype)
                                    k_s[i, d] = T.cast(0, dtype)
                        for i, d in T.Parallel(C, dv):
                            if i >= length:
                                v_s[i, d] = T.cast(0, dtype)
                                do_s[i, d] = T.cast(0, dtype)
                    for i in T.Parallel(C):
                        e_s[i] = _exp(gb_s[0, i])
                        r_s[i] = _exp(gb_s[0, C - 1] - gb_s[0, i])
                    # A_g = Gamma o T~ o beta_col (stmatrix store) under U0 = K S
                    T.wgmma_gemm(k_s, s_s, b1_f, clear_accum=True)
                    for i, j in T.Parallel(C, C):
                        s2_f[i, j] = _gamma(gb_s, i, j) * T.cast(tt16[0, i, j], acc) * gb_s[1, j]
                    T.copy(s2_f, a_s)
                    if dtype == half:
                        T.copy(tt16[0, :, :], tt_s)
                    else:
                        for i, j in T.Parallel(C, C):  # through fp32, as for h above
                            tt_s[i, j] = T.cast(T.cast(tt16[0, i, j], acc), dtype)
                    T.wait_wgmma(0)
                    # W' = V - e o U0 (v_s keeps e o U0);  V' = A_g W'. No loop writes shared memory that it also
                    # reads (W' goes through b2_f, stmatrix): TileLang puts a __syncthreads in every unrolled iteration
                    # of such loops.
                    for i, d in T.Parallel(C, dv):
                        b2_f[i, d] = T.cast(v_s[i, d], acc) - e_s[i] * b1_f[i, d]
                    T.copy(b2_f, wd_s[0, :, :])
                    for i, d in T.Parallel(C, dv):
                        v_s[i, d] = T.cast(e_s[i] * b1_f[i, d], dtype)
                    T.wgmma_gemm(a_s, wd_s[0, :, :], b1_f, clear_accum=True)
                    T.wait_wgmma(0)
                    T.copy(b1_f, vn_s)
                    # dS', sd and dV' = r o K dS' + P_g^T dO from the reverse recurrence
                    T.barrier_wait(bar_dvp, g % 2)
                    # dk starts with r o (V' dS'^T)
                    T.wgmma_gemm(vn_s, ds_s, dk_f, transpose_B=True, clear_accum=True)
                    if length < C:  # dV' rows past the sequence's end zeroed
                        for i, d in T.Parallel(C, dv):
                            if i >= length:
                                wd_s[1, i, d] = T.cast(0, dtype)
                        T.fence_proxy_async()
                        T.sync_threads()
                    # dv = dW' = A_g^T dV';  dA = dV' W'^T (both GEMMs read dV', then dv is staged over it)
                    T.wgmma_gemm(a_s, wd_s[1, :, :], b1_f, transpose_A=True, clear_accum=True)
                    T.wgmma_gemm(wd_s[1, :, :], wd_s[0, :, :], s1_f, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(2)
                    # dr = rowsum(r o V' o K dS') = rowsum(K o r o (V' dS'^T))
                    for i, d in T.Parallel(C, dk):
                        dk_f[i, d] = r_s[i] * dk_f[i, d]
                        b2_f[i, d] = dk_f[i, d] * T.cast(k_s[i, d], acc)
                    _row_partials(b2_f, dk // 16, part, pr_s, tx)
                    T.wait_wgmma(0)
                    T.copy(b1_f, wd_s[1, :, :])
                    T.fence_proxy_async()
                    if length == C:  # waited for before the tile is next written
                        T.tma_copy(wd_s[1, :, :], dv_out[start : start + C, hv, :])
                    else:
                        for i, d in T.Parallel(C, dv):
                            if i < length:
                                dv_out[start + i, hv, d] = wd_s[1, i, d]
                    # de -= rowsum(e o U0 o dW');  v_s <- dU0 = -e o dW'
                    for i, d in T.Parallel(C, dv):
                        b2_f[i, d] = T.cast(v_s[i, d], acc) * b1_f[i, d]
                    _row_partials(b2_f, dv // 16, part, pu_s, tx)
                    for i, d in T.Parallel(C, dv):
                        v_s[i, d] = T.cast(-e_s[i] * b1_f[i, d], dtype)
                    # dbeta_j += sum_i dA o Gamma o T~;  dT~ = dA o Gamma o beta_col (p_s);  Y = dA o A_g
                    for i, j in T.Parallel(C, C):
                        gm = _gamma(gb_s, i, j)
                        s2_f[i, j] = s1_f[i, j] * gm * T.cast(tt16[0, i, j], acc)
                        s1_f[i, j] = s1_f[i, j] * gm * gb_s[1, j]
                    # register work first, then the shared-memory writes behind one sync (TileLang fences every
                    # shared-memory write that follows other shared-memory accesses)
                    _col_sums(s2_f, part)
                    for i, j in T.Parallel(C, C):
                        s2_f[i, j] = s2_f[i, j] * gb_s[1, j]
                    T.copy(s1_f, p_s)
                    T.fence_proxy_async()
                    T.tma_store_wait(0)
                    T.sync_threads()  # every thread has read the fp16 T~ (tt16 is y_s's memory), dS', W' and dv
                    if g > 0:  # the group's running sums (cp.async), landing under the rest of this v-head
                        T.async_copy(acc_buf[chunk, hk, 0, :, :], pq32)
                        T.async_copy(acc_buf[chunk, hk, 1, :, :], pk32)
                    _col_store(part, pb1_s, tx)
                    for i, j in T.Parallel(C, C):
                        y_s[i, _ysw(i, j)] = s2_f[i, j]
                    # dL = -(T~^T dT~ T~^T) strictly lower;  dbeta_i += rowsum(dL o K K^T);  p_s <- beta o dL
                    T.gemm(tt_s, p_s, s1_f, transpose_A=True, clear_accum=True)
                    T.copy(s1_f, a_s)
                    T.wgmma_gemm(a_s, tt_s, s1_f, transpose_B=True, clear_accum=True)
                    T.wgmma_gemm(k_s, k_s, s2_f, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(0)
                    for i, j in T.Parallel(C, C):
                        dl = T.if_then_else(j < i, -s1_f[i, j], T.float32(0))
                        s2_f[i, j] = dl * s2_f[i, j]
                        s1_f[i, j] = gb_s[1, i] * dl
                    T.copy(s1_f, p_s)
                    _row_partials(s2_f, C // 16, part, pb2_s, tx)
                    T.wgmma_gemm(p_s, k_s, dk_f)
                    T.wgmma_gemm(p_s, k_s, dk_f, transpose_A=True)
                    # dP = dO V'^T;  dQK = scale Gamma o dP (a_s);  Y += dP o P_g (fp32 Q K^T);  dO S^T under them
                    T.wgmma_gemm(do_s, vn_s, s1_f, transpose_B=True, clear_accum=True)
                    T.wgmma_gemm(q_s, k_s, s2_f, transpose_B=True, clear_accum=True)
                    T.wgmma_gemm(do_s, s_s, b1_f, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(1)
                    for i, j in T.Parallel(C, C):
                        s1_f[i, j] = scale * _gamma(gb_s, i, j) * s1_f[i, j]
                        y_f[i, j] = y_s[i, _ysw(i, j)] + s1_f[i, j] * s2_f[i, j]
                    for i, j in T.Parallel(C, C):
                        y_s[i, _ysw(i, j)] = y_f[i, j]
                    T.copy(s1_f, a_s)
                    T.wait_wgmma(0)
                    # dq = scale e o (dO S^T) + dQK K;  de += rowsum(q o scale e o dO S^T)
                    for i, d in T.Parallel(C, dk):
                        b1_f[i, d] = scale * e_s[i] * b1_f[i, d]
                        b2_f[i, d] = b1_f[i, d] * T.cast(q_s[i, d], acc)
                    _row_partials(b2_f, dk // 16, part, pq_s, tx)
                    T.wgmma_gemm(a_s, k_s, b1_f)
                    # dk += dU0 S^T + dQK^T Q
                    T.wgmma_gemm(v_s, s_s, dk_f, transpose_B=True)
                    T.wgmma_gemm(a_s, q_s, dk_f, transpose_A=True)
                    T.wait_wgmma(0)
                    # dq, dk summed over the group in the order g = 0, 1, ... in fp32: the running sums go through this
                    # CTA's scratch slot (stored from registers, loaded by cp.async under this v-head's work)
                    if g > 0:
                        T.ptx_wait_group(0)
                        T.sync_threads()
                        for i, d in T.Parallel(C, dk):
                            b1_f[i, d] = pq32[i, d] + b1_f[i, d]
                            dk_f[i, d] = pk32[i, d] + dk_f[i, d]
                        T.sync_threads()
                    # stores staged in shared memory (16-byte accesses, whole rows)
                    if g < grp - 1:
                        T.copy(b1_f, pq32)
                        T.copy(dk_f, pk32)
                        T.sync_threads()
                        T.copy(pq32, acc_buf[chunk, hk, 0, :, :], annotations={"disable_tma": True})
                        T.copy(pk32, acc_buf[chunk, hk, 1, :, :], annotations={"disable_tma": True})
                    else:
                        if l2norm:
                            # the raw rows' dq, dk: rstd (d - y <d, y>), y the normalised q, k as loaded. a_s (dQK)
                            # is dead once both warpgroups' last GEMMs are done
                            T.sync_threads()
                            for i, d in T.Parallel(C, dk):
                                b2_f[i, d] = b1_f[i, d] * T.cast(q_s[i, d], acc)
                            _row_partials(b2_f, dk // 16, part, nrm_s, tx)
                            for i, d in T.Parallel(C, dk):
                                b2_f[i, d] = dk_f[i, d] * T.cast(k_s[i, d], acc)
                            _row_partials(b2_f, dk // 16, part, nrm_s, tx, 2)
                            if tx < C:
                                nrm_s[4, tx] = T.float32(0)
                                nrm_s[5, tx] = T.float32(0)
                                if tx < length:
                                    nrm_s[4, tx] = q_rstd[start + tx, hk]
                                    nrm_s[5, tx] = k_rstd[start + tx, hk]
                            T.sync_threads()
                            for i, d in T.Parallel(C, dk):
                                b1_f[i, d] = nrm_s[4, i] * (
                                    b1_f[i, d] - T.cast(q_s[i, d], acc) * (nrm_s[0, i] + nrm_s[1, i]))
                                dk_f[i, d] = nrm_s[5, i] * (
                                    dk_f[i, d] - T.cast(k_s[i, d], acc) * (nrm_s[2, i] + nrm_s[3, i]))
                        T.copy(b1_f, out_s[0, :, :])
                        T.copy(dk_f, out_s[1, :, :])
                        T.sync_threads()
                        if length == C:
                            T.copy(out_s[0, :, :], dq_out[start : start + C, hk, :], annotations={"disable_tma": True})
                            T.copy(out_s[1, :, :], dk_out[start : start + C, hk, :], annotations={"disable_tma": True})
                        else:
                            for i, d in T.Parallel(C, dk):
                                if i < length:
                                    dq_out[start + i, hk, d] = out_s[0, i, d]
                                    dk_out[start + i, hk, d] = out_s[1, i, d]
                    # dg_t = sum_s M_st, M_st = [s >= t] (de_s + left_st) + [s < t] dr_s + a (sd_s + sd_{s+C}) with
                    # left_st = sum_{j<t} Y_sj; the a <dS', S> term is folded into de_s and dr_s.
                    for i in T.Parallel(C):  # sd's second DV slice only when the recurrence split V (target = G x 2)
                        sda = e_s[C - 1] * (
                            (sd_s[0, i] + T.if_then_else(target > grp, sd_s[1, i], T.float32(0)))
                            + (sd_s[0, i + C] + T.if_then_else(target > grp, sd_s[1, i + C], T.float32(0))))
                        de_s[i] = sda + ((pq_s[0, i] + pq_s[1, i]) - (pu_s[0, i] + pu_s[1, i]))
                        dr_s[i] = sda + (pr_s[0, i] + pr_s[1, i])
                    T.sync_threads()
                    # thread (row i = tx % 64, column quarter qq = tx // 64): its 16 Y values, their prefix sums, and
                    # the row sums of the quarters to its left
                    ii = tx % C
                    qq = tx // C
                    for v4 in T.unroll(4):
                        for c in T.vectorized(4):
                            yr[v4 * 4 + c] = y_s[ii, T.bitwise_xor(qq * 4 + v4, ii % 8) * 4 + c]
                    for kk in T.unroll(1, 16):
                        yr[kk] = yr[kk - 1] + yr[kk]
                    # y_s is read: its rows 0-3 take the quarter sums (tq), rows 4-5 the column sums per half of the
                    # rows
                    T.sync_threads()
                    y_s[qq, ii] = yr[15]
                    T.sync_threads()
                    off = T.alloc_var(acc, init=T.float32(0))
                    for qb in T.unroll(3):
                        off = off + T.if_then_else(qb < qq, y_s[qb, ii], T.float32(0))
                    # M_it for t = 16 qq + kk (yr[kk - 1] is the inclusive prefix: left = off + yr[kk - 1])
                    for kr in T.unroll(16):  # descending: yr[kk - 1] is still the prefix
                        kk = 15 - kr
                        left = off + T.if_then_else(kk > 0, yr[T.max(kk - 1, 0)], T.float32(0))
                        yr[kk] = T.if_then_else(ii >= qq * 16 + kk, de_s[ii] + left, dr_s[ii])
                    # sum over the 32 rows of this warp: reduce-scatter, halving the 16 columns per step
                    lane = tx % 32
                    _reduce_scatter(yr, lane, 16, 8)
                    _reduce_scatter(yr, lane, 8, 4)
                    _reduce_scatter(yr, lane, 4, 2)
                    _reduce_scatter(yr, lane, 2, 1)
                    yr[0] = yr[0] + T.shfl_xor(yr[0], 1)
                    # lane pair (2 k, 2 k + 1) holds column t = 16 qq + k of this warp's 32 rows
                    if lane % 2 == 0:
                        y_s[4 + (tx // 32) % 2, qq * 16 + lane // 2] = yr[0]
                    T.sync_threads()
                    if tx < length:
                        dg_out[hv, start + tx] = y_s[4, tx] + y_s[5, tx]
                        db_out[hv, start + tx] = ((pb1_s[0, tx] + pb1_s[1, tx]) + (pb1_s[2, tx] + pb1_s[3, tx])) + (
                            pb2_s[0, tx] + pb2_s[1, tx]
                        )
                    # every reader of this v-head's tiles (y_s above, the wgmma operands, ...) is done before the
                    # next TMA loads overwrite them; generic writes ordered before those async-proxy writes
                    T.fence_proxy_async()
                    T.sync_threads()
            else:
                # a spare slot: the rows past cu_seqlens[-1] (padding), 64 per tile, spread over the spare slots.
                # The spare slots run last and wait for the reverse recurrence to finish, so that this grid completes
                # after it.
                if pdl:
                    T.pdl_sync()
                tail = n_tok - cu_seqlens[n_seq]
                n_spare = n_chunk + 1 - n_real
                u = chunk - n_real
                for it in T.serial(T.ceildiv(T.max(T.ceildiv(tail, C) - u, 0), n_spare)):
                    z0 = cu_seqlens[n_seq] + (u + it * n_spare) * C
                    for i, d in T.Parallel(C, dk):
                        if z0 + i < n_tok:
                            dq_out[z0 + i, hk, d] = T.cast(0, dtype)
                            dk_out[z0 + i, hk, d] = T.cast(0, dtype)
                    for g in T.serial(grp):
                        for i, d in T.Parallel(C, dv):
                            if z0 + i < n_tok:
                                dv_out[z0 + i, hk * grp + g, d] = T.cast(0, dtype)
                        if tx < C:
                            if z0 + tx < n_tok:
                                dg_out[hk * grp + g, z0 + tx] = T.float32(0)
                                db_out[hk * grp + g, z0 + tx] = T.float32(0)
    return kernel




def variants():
    """``(kernel name, params)`` of every :func:`chunk_grads` variant (for prebuild)."""
    return [("chunk_grads", dict(dk=128, dv=128, dtype=dt, pdl=pdl, l2norm=norm))
            for dt in ("bfloat16", "float16") for pdl, norm in ((True, False), (False, False), (True, True))]
