"""The GDN forward chunk recurrence on SM90 with the state in registers, split over two warpgroups (chunk C = 64).

``n_cta`` CTAs of 512 threads walking (sequence, v-head) pairs over all of V = 128, each pair's chunks in turn, the
input ring running on from one pair into the next: a CTA's first pair is its own, the next ones tickets from the
launch's counter while n_cta is below the pair count (``_PAIRS``: longest first, as the hardware deals one CTA per
pair; ``forward._split_state`` picks n_cta); T~ and the gate cumsum come from ``kkt_inverse`` (notation and chunk
numbering there). State warpgroup w holds its half of the state transposed, S^T[v, :] for v in [64 w, 64 w + 64)
(fp32 registers, as two 64-column halves of d), and uses it as the register A operand of its wgmmas, so S never goes
through shared memory. Per chunk, with tokens b as columns:

    [U^T | O^T] = S^T [K; Q]^T              (one m64n128 chain: K and Q stacked, per half of d, in one tile)
    W'^T = V^T - e_b U^T,  V'^T = W'^T A_g^T
    O^T = scale e_b O^T + V'^T P_g^T,  S^T <- e^{gamma_C} S^T + (r_b V'^T) K   (two m64n64 products, one per half)

K and Q are TMA-loaded as [64 x 64] halves into the two row ranges of a [128 x 64] tile per half of d (TileLang
0.1.15 lowers TMA into a row range of a 64-column swizzled tile, not of a 128-column one), so the U and O products
are one dependent chain of eight m64n128k16 steps instead of sixteen m64n64k16 ones. V^T is read by
``ldmatrix.trans`` and O^T written by ``stmatrix.trans`` (fragments in the accumulator's layout, seen transposed),
then TMA-stored; the store's reads are waited for only before the tile is written again.

* WG0 "aux", up to two chunks ahead: the per-column tables e_b, scale e_b, r_b (0 past the sequence end);
  A_g = Gamma o T~ o beta_col in place over T~ (``ldmatrix`` / ``stmatrix``); then P_g = scale Gamma o Q K^T
  from the same stacked tiles.
  It is warpgroup 0 because TileLang 0.1.15 binds an annotated fragment layout (``_acc``) to threads 0..127.
  With ``inverse`` (a forward alone, ``forward._onchip_inverse``) it forms A_g itself instead: K K^T from the
  stacked tiles, diag(beta) K K^T into a padded fp16 tile, (I + L~)^-1 in place (``tile_inverse``, each warp its
  own 16 rows first), then Gamma o T~ o beta_col; no T~ is read.
* WG1, WG2 "state": one 256-thread consumer with one copy of the code (``GemmWarpPolicy.FullRow``): warpgroup w
  runs the chain above for rows v in [64 w, 64 w + 64); they share the input ring and the O tile.
* WG3 "producer": one warp TMA-loads the stacked K and Q tiles, one v (a [64 x 128] tile, two TMA boxes), one T~ and
  [gamma; beta] into a three-stage ring (``pdl_sync`` first: right after ``kkt_inverse`` the kernel is its
  programmatic dependent); with ``inverse`` that warp scans g and beta into [gamma; beta] and forms the column
  tables itself (``qla_gate_scan``).

Same call and outputs as ``chunk_recurrence.chunk_fwd_ws(block_dv=dv, pdl=True)``; chosen over it where every
(sequence or piece, v-head) pair fills a CTA (``forward._state_kernel``, ``forward._forward_cp``). Precision: fp16
A_g, P_g, W' and V' for P_g V', r o V' in the input dtype (the dtype of K it multiplies), S^T in the input dtype for
the products with K and Q, fp32 accumulators, state and gate tables. Rows of a partial chunk past the sequence end
have beta = 0 and r = 0 (as in ``chunk_fwd_ws``) and are not stored.
"""

import tilelang.language as T
from tilelang.layout import Fragment, make_swizzled_layout

from ._build import compiled
from .chunk_recurrence import (_CLOCK, _LOG2E, _PTX, TRACE_CHUNKS, TRACE_CTAS, TRACE_EVENTS, _ex2, _exp,
                               _gamma_times, _lg2)
from .chunking import CHUNK
from .tile_inverse import CUDA as TILE_INVERSE_CUDA
from .tile_inverse import TILE_STRIDE

# setmaxnreg per warpgroup (aux, state 0, state 1, producer): sums to 512 = 65536 registers / 128.
_NREG = (96, 192, 192, 32)
LV_BIT = 1 << 30  # i & LV_BIT is 0 (fewer chunks), but not provably: masks stay inside the chunk loop
_STAGES = 3  # the input ring's depth (``on_stage`` writes its branches out for three): the loads of chunk i
# wait for chunk i - 3 to be consumed
_AUX_BARRIER = 8  # the aux warpgroup's named barrier with ``inverse`` (TileLang's own are 0 and 3-5)
# with ``inverse``: a producer warp's gate tables, [gamma; beta] of one chunk and v-head by a warp scan, and the
# state warpgroups' column tables from them (``column_tables``'s e_b, scale e_b, r_b), off the aux warpgroup's path
_GATE_SCAN = r"""
__device__ __forceinline__ void qla_gate_scan(const float* g, const float* beta, int stride, int length, float scale,
                                              float* gb, float* cf, int lane) {
  int i0 = 2 * lane, i1 = i0 + 1;
  float g0 = i0 < length ? g[i0 * stride] : 0.f, g1 = i1 < length ? g[i1 * stride] : 0.f;
  float b0 = i0 < length ? beta[i0 * stride] : 0.f, b1 = i1 < length ? beta[i1 * stride] : 0.f;
  float s = g0 + g1;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    float t = __shfl_up_sync(0xffffffffu, s, o);
    if (lane >= o) s += t;
  }
  float last = __shfl_sync(0xffffffffu, s, 31), c0 = s - g1;
  gb[i0] = c0;
  gb[i1] = s;
  gb[64 + i0] = b0;
  gb[64 + i1] = b1;
  float e0 = qla_ex2(c0 * QLA_LOG2E), e1 = qla_ex2(s * QLA_LOG2E);
  cf[i0] = e0;
  cf[i1] = e1;
  cf[64 + i0] = e0 * scale;
  cf[64 + i1] = e1 * scale;
  cf[128 + i0] = i0 < length ? qla_ex2((last - c0) * QLA_LOG2E) : 0.f;
  cf[128 + i1] = i1 < length ? qla_ex2((last - s) * QLA_LOG2E) : 0.f;
}
""".replace("QLA_LOG2E", f"{_LOG2E!r}f")


# lines of one (sequence, v-head)'s h0 into L2, kept there (evict_last) until the state warpgroups load them
_PREFETCH = r"""
__device__ __forceinline__ void qla_prefetch_l2(const void* p, int bytes, int lane) {
  for (int o = 128 * lane; o < bytes; o += 32 * 128)
    asm volatile("prefetch.global.L2::evict_last [%0];" :: "l"(static_cast<const char*>(p) + o));
}
"""


# The CTA's queue of (sequence, v-head) pairs (launch ranks): the K/Q warp deals them (its first pair ``first``, then
# n_cta + tickets from the launch's counter while n_cta < the pairs, ``total`` ending the walk), one pair ahead, into
# eight slots with mbarriers of their own (static shared memory: outside TileLang's view, so no syncs are inserted);
# the other 480 threads (the producer's other three warps, aux, state warpgroups) read them in turn. The V warp also
# peeks at the next slot for its h0 prefetch (``leave`` 0: the slot stays held).
_PAIRS = r"""
struct QlaPairs { unsigned long long full[8], empty[8]; int pair[8]; };
__device__ __forceinline__ QlaPairs& qla_pairs() { __shared__ QlaPairs q; return q; }
__device__ __forceinline__ unsigned qla_smem(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void qla_mbar_wait(unsigned long long* bar, int parity) {
  asm volatile("{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT;\n}"
               :: "r"(qla_smem(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ void qla_mbar_arrive(unsigned long long* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(qla_smem(bar)) : "memory");
}
__device__ __forceinline__ void qla_pairs_init(int tx) {
  QlaPairs& q = qla_pairs();
  if (tx == 0)
    for (int s = 0; s < 8; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(qla_smem(&q.full[s])), "r"(1));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(qla_smem(&q.empty[s])), "r"(480));
    }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();
}
__device__ __forceinline__ int qla_pairs_deal(int w, int first, int n_cta, int total, int* ticket, int lane) {
  QlaPairs& q = qla_pairs();
  qla_mbar_wait(&q.empty[w & 7], ((w >> 3) & 1) ^ 1);
  int p = 0;
  if (lane == 0) {
    p = w == 0 ? first : (n_cta < total ? min(n_cta + atomicAdd(ticket, 1), total) : total);
    q.pair[w & 7] = p;
    qla_mbar_arrive(&q.full[w & 7]);
  }
  return __shfl_sync(0xffffffffu, p, 0);
}
__device__ __forceinline__ int qla_pairs_read(int w, int leave) {
  QlaPairs& q = qla_pairs();
  qla_mbar_wait(&q.full[w & 7], (w >> 3) & 1);
  int p = *reinterpret_cast<volatile int*>(&q.pair[w & 7]);
  if (leave) qla_mbar_arrive(&q.empty[w & 7]);
  return p;
}
"""


def _acc(rows, cols, transposed=False):
    """The wgmma accumulator layout for ``[rows, cols]`` (the one TileLang infers): one warpgroup's for 64 rows, two
    warpgroups' (rows 64 w.., ``GemmWarpPolicy.FullRow``) for 128; or, with ``transposed``, the same threads and
    registers indexed ``[cols, rows]``: the layouts ``ldmatrix`` and ``stmatrix`` (``.trans`` for the transposed
    one) fill and drain."""

    def thread(m, n):
        return (m // 64) * 128 + ((m % 64) // 16) * 32 + (m % 8) * 4 + (n % 8) // 2

    def index(m, n):
        return (n // 8) * 4 + ((m % 16) // 8) * 2 + n % 2

    if transposed:
        return Fragment((cols, rows), forward_thread_fn=lambda n, m: thread(m, n),
                        forward_index_fn=lambda n, m: index(m, n))
    return Fragment((rows, cols), forward_thread_fn=thread, forward_index_fn=index)


@compiled
def chunk_fwd_split(*, dk: int, dv: int, dtype: str, has_h0: bool, inverse: bool = False, trace: bool = False,
                    cu_dtype: str = "int32"):
    """o and the final state; call as ``kernel(q, k, v, tt, gb, cu_seqlens, chunk_offsets, order, ht_rows, h0,
    scale, o, ht)``, the arguments of ``chunk_recurrence.chunk_fwd_ws`` in output mode. With ``inverse`` the kernel
    forms the gate tables and A_g itself, from the fp32 ``g`` and ``beta`` ``[n_tok, H_v]``: call as ``kernel(q, k,
    v, g, beta, cu_seqlens, order, ht_rows, h0, scale, o, ht)``, ``cu_seqlens`` of ``cu_dtype`` (int32 or int64: the
    caller's own, no conversion launch)."""
    assert inverse or not trace, "the timeline (trace) is of the kernel with its inverse on chip"
    assert inverse or cu_dtype == "int32", "the T~ path reads seq_tables' int32 bounds"
    n_tok = T.dynamic("n_tok")
    n_chunk = T.dynamic("n_chunk")
    n_seq1 = T.dynamic("n_seq1")
    n_h0 = T.dynamic("n_h0")
    n_rows = T.dynamic("n_rows")
    n_ht = T.dynamic("n_ht")
    h_qk = T.dynamic("h_qk")
    h_v = T.dynamic("h_v")
    C, TS, ROWS = CHUNK, TILE_STRIDE, T.GemmWarpPolicy.FullRow  # ROWS: the state warpgroups split S^T's rows

    if trace:

        @T.macro
        def mark(tr, cta, wg, j, event):
            """The SM's clock into the timeline of CTA ``cta``: slot ``wg``, the ``j``-th chunk the CTA walked, event
            ``event``, by the first thread of the calling warpgroup (of the state warpgroups, the first's)."""
            tx = T.get_thread_binding()
            if (tx % 128 == 0) & ((wg != 1) | (tx == 128)) & (cta < TRACE_CTAS) & (j < TRACE_CHUNKS):
                tr[cta, wg, j, event] = T.call_extern("int64", "qla_clock")

        @T.macro
        def note(tr, cta, wg, j, i):
            """Beside ``mark``'s events, in the last slot: the walked chunk's index ``i`` in its pair."""
            tx = T.get_thread_binding()
            if (tx % 128 == 0) & ((wg != 1) | (tx == 128)) & (cta < TRACE_CTAS) & (j < TRACE_CHUNKS):
                tr[cta, wg, j, TRACE_EVENTS - 1] = T.cast(i, "int64")

    else:

        def mark(*_):
            """No timeline: nothing enters the kernel."""

        note = mark
    acc, half = "float32", "float16"
    DH = dk // 2  # a half of d: the stacked [K; Q] tiles are 64 columns wide

    @T.macro
    def on_stage(st, emit):
        """``emit(s)`` for the ring stage s = ``st``, as one chain of exclusive branches (with ifs in sequence ptxas
        sees a path through none of them and serializes the wgmmas): the per-stage buffers, written out for three."""
        if st == 0:
            emit(0)
        elif st == 1:
            emit(1)
        else:
            emit(2)

    def bound(cu_seqlens, i):
        """Bound ``i`` of ``cu_seqlens`` as int32."""
        return cu_seqlens[i] if cu_dtype == "int32" else T.cast(cu_seqlens[i], "int32")

    @T.macro
    def load_pair(pv, order, cu_seqlens, p):
        """``pv`` = (v-head, launch rank, sequence, first token, length) of pair ``p`` of the launch order
        (``order``'s sequences, each with its v-heads in turn)."""
        pv[0] = T.truncmod(p, h_v)
        pv[1] = T.truncdiv(p, h_v)
        pv[2] = order[pv[1]]
        pv[3] = bound(cu_seqlens, pv[2])
        pv[4] = bound(cu_seqlens, pv[2] + 1) - pv[3]

    @T.macro
    def producer_pair(pi, w, cta, n_cta, total, ticket):
        """``pi[0]``: the producer warp's w-th pair from the queue (``_PAIRS``); the K/Q warp deals the next one
        into ``pi[1]`` first."""
        tx = T.get_thread_binding()
        if tx < 416:
            pi[0] = pi[1]
            if pi[0] < total:
                pi[1] = T.call_extern("int32", "qla_pairs_deal", w + 1, cta, n_cta, total, T.address_of(ticket[0]),
                                      tx % 32)
        else:
            pi[0] = T.call_extern("int32", "qla_pairs_read", w, 1)

    @T.macro
    def prefetch_next_h0(h0, order, pi, w, total, last):
        """With the ``last`` chunk of the w-th pair: the (w + 1)-th pair's h0 into L2 (``qla_prefetch_l2``), its
        launch rank peeked at in the queue into ``pi[1]``."""
        if last:
            pi[1] = T.call_extern("int32", "qla_pairs_read", w + 1, 0)
            if pi[1] < total:
                T.call_extern("handle", "qla_prefetch_l2",
                              T.address_of(h0[order[T.truncdiv(pi[1], h_v)], T.truncmod(pi[1], h_v), 0, 0]),
                              dk * dv * 4, T.get_thread_binding() % 32)

    @T.macro
    def uo_products(a_lo, a_hi, kq, r, uo_f):
        """[U^T | O^T] = S^T [K; Q]^T as one m64n128 chain per warpgroup over the two K halves (the stage's rows
        from ``r``)."""
        T.wgmma_gemm(a_lo, kq[0][r : r + 2 * C, :], uo_f, transpose_B=True, policy=ROWS, clear_accum=True)
        T.wgmma_gemm(a_hi, kq[1][r : r + 2 * C, :], uo_f, transpose_B=True, policy=ROWS)

    @T.macro
    def update(vr, kq, r, s_lo, s_hi):
        """S^T += (r o V'^T) K, K's two column halves from the stacked tiles."""
        T.wgmma_gemm(vr, kq[0][r : r + C, :], s_lo, policy=ROWS)
        T.wgmma_gemm(vr, kq[1][r : r + C, :], s_hi, policy=ROWS)

    @T.macro
    def qk_product(kq, r, p_f, r0=C):
        """Q K^T (``r0`` = C), or K K^T (``r0`` = 0), from the stacked tiles, over the two halves of d."""
        T.wgmma_gemm(kq[0][r + r0 : r + r0 + C, :], kq[0][r : r + C, :], p_f, transpose_B=True, clear_accum=True)
        T.wgmma_gemm(kq[1][r + r0 : r + r0 + C, :], kq[1][r : r + C, :], p_f, transpose_B=True)

    @T.macro
    def gate_inverse(t, a_h, gb_s, st):
        """T~ -> A_g = Gamma o T~ o beta_col in place, in fp16 (an fp32 copy's loop is dropped by TileLang 0.1.15)."""
        T.copy(t, a_h)
        for a, b in T.Parallel(C, C):
            a_h[a, b] = T.cast(T.cast(a_h[a, b], acc) * _gamma_times(gb_s, st, a, b, col_log2=_lg2(gb_s[st, 1, b])),
                               half)
        T.copy(a_h, t)

    @T.macro
    def column_tables(cf_s, gb_s, st, length, scale):
        """The state warpgroups' per-column tables of the stage's chunk: e_b, scale e_b, r_b (0 past the end); with
        ``inverse`` the tables' warp forms them in ``qla_gate_scan`` instead."""
        for b in T.Parallel(C):
            cf_s[st, 0, b] = _exp(gb_s[st, 0, b])
            cf_s[st, 1, b] = _exp(gb_s[st, 0, b]) * scale
            cf_s[st, 2, b] = _exp(gb_s[st, 0, C - 1] - gb_s[st, 0, b]) * T.cast(b < length, acc)

    @T.macro
    def load_kq(q, k, kq, start, hk, full, st):
        """The stage's K and Q, each half of d into the rows [2 C st, 2 C st + C) and [2 C st + C, 2 C st + 2 C) of
        that half's ring."""
        r = st * 2 * C
        T.tma_copy(k[start : start + C, hk, 0:DH], kq[0][r : r + C, :], barrier=full[st])
        T.tma_copy(q[start : start + C, hk, 0:DH], kq[0][r + C : r + 2 * C, :], barrier=full[st])
        T.tma_copy(k[start : start + C, hk, DH:dk], kq[1][r : r + C, :], barrier=full[st])
        T.tma_copy(q[start : start + C, hk, DH:dk], kq[1][r + C : r + 2 * C, :], barrier=full[st])

    @T.macro
    def store_o(ob, o, start, length, hv):
        """O's tile to global: by TMA (its reads waited for before ``ob`` is written again), a partial last chunk
        by rows."""
        T.fence_proxy_async()
        if length == C:
            T.tma_copy(ob, o[start : start + C, hv, :])
        else:
            for a, b in T.Parallel(C, dv):
                if a < length:
                    o[start + a, hv, b] = ob[a, b]

    @T.macro
    def state(kq, vb, ttb, gb_s, cf_s, pb, ob, full, empty, ag_ready, p_ready, h0, o, ht, ht_rows, order,
              cu_seqlens, total, cta, tr):
        """The two state warpgroups as one 256-thread consumer, one copy of the code: warpgroup w holds rows v in
        [64 w, 64 w + 64) of S^T and O^T (``ROWS``). ``vb``: the V tile of each stage, ``ob``: the O tile (whole
        2-D buffers: TileLang lowers copies of those to ldmatrix/stmatrix)."""
        T.set_max_nreg(_NREG[1], 1)
        s_lo = T.alloc_fragment((dv, DH), acc)  # S^T[v, d], d in [0, DH)
        s_hi = T.alloc_fragment((dv, DH), acc)  # d in [DH, dk)
        a_lo = T.alloc_fragment((dv, DH), dtype)
        a_hi = T.alloc_fragment((dv, DH), dtype)
        uo_f = T.alloc_fragment((dv, 2 * C), acc)  # [U^T | O^T]
        o2_f = T.alloc_fragment((dv, C), acc)  # V'^T P_g^T
        vp_f = T.alloc_fragment((dv, C), acc)
        w_h = T.alloc_fragment((dv, C), half)
        vp_h = T.alloc_fragment((dv, C), half)
        vr = T.alloc_fragment((dv, C), dtype)
        vt = T.alloc_fragment((C, dv), dtype)
        ot = T.alloc_fragment((C, dv), dtype)
        T.annotate_layout({vt: _acc(dv, C, transposed=True), ot: _acc(dv, C, transposed=True)})
        decay = T.alloc_var(acc)
        ring = T.alloc_var("int32", init=0)  # chunks walked before this pair's: the ring's stage and phase
        pv = T.alloc_local((5,), "int32")  # the pair (``load_pair``)
        pi = T.alloc_local((1,), "int32")  # its launch rank, from the queue
        T.pdl_sync()
        for w in T.serial(total):
            pi[0] = T.call_extern("int32", "qla_pairs_read", w, 1)
            if pi[0] >= total:
                T.loop_break()
            load_pair(pv, order, cu_seqlens, pi[0])
            hv, rank, seq, bos, seqlen = pv[0], pv[1], pv[2], pv[3], pv[4]
            mark(tr, cta, 1, ring, 6)
            n_iter = T.ceildiv(seqlen, C)
            if has_h0:
                for a, d in T.Parallel(dv, DH):
                    s_lo[a, d] = h0[seq, hv, d, a]
                    s_hi[a, d] = h0[seq, hv, DH + d, a]
            else:
                T.clear(s_lo)
                T.clear(s_hi)
            for i in T.serial(n_iter):
                st = (ring + i) % _STAGES
                ph = ((ring + i) // _STAGES) % 2
                start = bos + i * C
                length = T.min(seqlen - i * C, C)
                mark(tr, cta, 1, ring + i, 0)
                note(tr, cta, 1, ring + i, i)
                T.barrier_wait(full[st], ph)
                mark(tr, cta, 1, ring + i, 1)
                for a, d in T.Parallel(dv, DH):
                    a_lo[a, d] = T.cast(s_lo[a, d], dtype)
                    a_hi[a, d] = T.cast(s_hi[a, d], dtype)
                uo_products(a_lo, a_hi, kq, st * 2 * C, uo_f)
                on_stage(st, lambda s: T.copy(vb[s], vt))
                decay = _exp(gb_s[st, 0, C - 1])
                T.barrier_wait(ag_ready[st], ph)
                mark(tr, cta, 1, ring + i, 2)
                T.wait_wgmma(0)
                for a, b in T.Parallel(dv, C):
                    w_h[a, b] = T.cast(T.cast(vt[b, a], acc) - cf_s[st, 0, b] * uo_f[a, b], half)
                on_stage(st, lambda s: T.wgmma_gemm(w_h, ttb[s], vp_f, transpose_B=True, policy=ROWS, clear_accum=True))
                for a, d in T.Parallel(dv, DH):
                    s_lo[a, d] = s_lo[a, d] * decay
                    s_hi[a, d] = s_hi[a, d] * decay
                T.wait_wgmma(0)
                for a, b in T.Parallel(dv, C):
                    vp_h[a, b] = T.cast(vp_f[a, b], half)
                    vr[a, b] = T.cast(vp_f[a, b] * cf_s[st, 2, b], dtype)
                T.barrier_wait(p_ready[st], ph)
                mark(tr, cta, 1, ring + i, 3)
                on_stage(st, lambda s: T.wgmma_gemm(vp_h, pb[s], o2_f, transpose_B=True, policy=ROWS, clear_accum=True))
                update(vr, kq, st * 2 * C, s_lo, s_hi)
                T.wait_wgmma(2)  # P_g V' done (the two state products may still run)
                for a, b in T.Parallel(dv, C):
                    ot[b, a] = T.cast(uo_f[a, C + b] * cf_s[st, 1, b] + o2_f[a, b], dtype)
                T.tma_store_wait(0)  # the previous chunk's store has read ob
                T.copy(ot, ob)
                store_o(ob, o, start, length, hv)
                T.wait_wgmma(0)
                T.barrier_arrive(empty[st])
                mark(tr, cta, 1, ring + i, 4)
            ring = ring + n_iter
            row = T.if_then_else(n_rows == n_seq1 - 1, ht_rows[seq], seq)
            if row >= 0:
                for a, d in T.Parallel(dv, DH):
                    ht[row, hv, d, a] = s_lo[a, d]
                    ht[row, hv, DH + d, a] = s_hi[a, d]
            mark(tr, cta, 1, ring, 5)
        T.tma_store_wait(0)

    @T.macro
    def fill_tile(t_s, p_f, gb_s, st):
        """diag(beta) K K^T rounded to fp16 into the padded tile ``t_s`` from K K^T in ``p_f``: whole, as the tile
        inverse reads only its strictly lower triangle, L~."""
        for a, b in T.Parallel(C, C):  # in registers first: stores into shared memory would force reloading beta
            p_f[a, b] = p_f[a, b] * gb_s[st, 1, a]
        for a, b in T.Parallel(C, C):
            t_s[a * TS + b] = T.cast(p_f[a, b], half)

    @T.macro
    def invert_tile(t_s, scratch, tr, cta, ring, i):
        """(I + L~)^-1 in place over the tile, by ``tile_inverse``."""
        if trace:
            idx = T.if_then_else((cta < TRACE_CTAS) & (ring + i < TRACE_CHUNKS),
                                 ((cta * 4 + 2) * TRACE_CHUNKS + ring + i) * TRACE_EVENTS, -1)
            T.call_extern("handle", f"qla_tile_inverse<{_AUX_BARRIER}>", T.address_of(t_s[0]),
                          T.address_of(scratch[0]), T.address_of(tr[0, 0, 0, 0]), idx)
        else:
            T.call_extern("handle", f"qla_tile_inverse<{_AUX_BARRIER}>", T.address_of(t_s[0]),
                          T.address_of(scratch[0]))

    @T.macro
    def gate_factors(e_h, gb_s, st, lv):
        """Gamma of the stage's chunk in fp16, 0 above the diagonal, into ``e_h``: A_g's and P_g's factors both."""
        for a, b in T.Parallel(C, C):
            e_h[a, b] = T.cast(_ex2(T.min(gb_s[st, 0, a] * _LOG2E - gb_s[st, 0, b] * _LOG2E, T.float32(0))
                                    + T.Select(b <= a + lv, T.float32(0), T.float32(-1e30))), half)

    @T.macro
    def gate_tile(t_s, a_h, e_h, gb_s, st, tr, cta, ring, i):
        """A_g = Gamma o T~ o beta_col of the inverted tile into the fragment ``a_h``."""
        for a, b in T.Parallel(C, C):  # the tile into registers first (pairs of columns per load)
            a_h[a, b] = t_s[a * TS + b]
        for a, b in T.Parallel(C, C):
            a_h[a, b] = a_h[a, b] * e_h[a, b] * T.cast(gb_s[st, 1, b], half)
        mark(tr, cta, 2, ring + i, 6)

    @T.macro
    def body(q, k, v, tt, gb, g, beta, cu_seqlens, chunk_offsets, order, ht_rows, h0, scale, n_cta, ticket, o, ht,
             tr):
        # n_cta CTAs (one per SM at most where they walk), each taking (sequence, v-head) pairs of the launch order as
        # its queue deals them (``_PAIRS``): CTAs running at once take neighbouring pairs (every v-head of a sequence
        # together), and one pair's first loads and inverse go under the last chunks of the one before
        with T.Kernel(n_cta, threads=512) as cta:
            T.import_source(_PTX + _PAIRS + (TILE_INVERSE_CUDA + _GATE_SCAN if inverse else "")
                            + (_PREFETCH if has_h0 else "") + (_CLOCK if trace else ""))
            # three-stage input ring, filled by TMA (and with ``inverse`` the tables' warp)
            # [half of d]: per stage, K in rows [2 C st, 2 C st + C) and Q in the next C (wgmma operands and TMA
            # destinations at a row offset, so the products are issued from one copy of the code for all stages)
            kq = [T.alloc_shared((2 * C * _STAGES, DH), dtype) for _ in range(2)]
            vb = [T.alloc_shared((C, dv), dtype) for _ in range(_STAGES)]  # V (TMA'd as two 64-column boxes)
            ttb = [T.alloc_shared((C, C), half) for _ in range(_STAGES)]  # A_g (over T~, which the ring loads)
            gb_s = T.alloc_shared((_STAGES, 2, C), acc)  # [gamma; beta]
            # the aux warpgroup's products, per stage: the column tables e_b, scale e_b, r_b; P_g
            cf_s = T.alloc_shared((_STAGES, 3, C), acc)
            pb = [T.alloc_shared((C, C), half) for _ in range(_STAGES)]
            ob = T.alloc_shared((C, dv), dtype)  # O
            T.annotate_layout({b: make_swizzled_layout(b) for b in vb + ttb + pb + [ob]})

            full = T.alloc_barrier([96] * _STAGES)  # 3 producer warps + TMA bytes
            empty = T.alloc_barrier([384] * _STAGES)  # every consumer thread
            ag_ready = T.alloc_barrier([128] * _STAGES)  # the column tables and A_g of the stage
            p_ready = T.alloc_barrier([128] * _STAGES)  # P_g of the stage

            total = (n_seq1 - 1) * h_v  # pairs in the launch
            tx = T.get_thread_binding()
            T.call_extern("handle", "qla_pairs_init", tx)
            if inverse:  # after whatever came before (a fill, seq_tables, a caller's kernel): every thread waits for
                T.pdl_sync()  # it before reading anything (the tables, the ticket, the inputs)

            if tx < 128:  # WG0: the aux warpgroup
                T.set_max_nreg(_NREG[0], 0)
                a_h = T.alloc_fragment((C, C), half)
                p_f = T.alloc_fragment((C, C), acc)
                T.annotate_layout({a_h: _acc(C, C)})
                if inverse:
                    e_h = T.alloc_fragment((C, C), half)  # Gamma of the chunk
                    T.annotate_layout({e_h: _acc(C, C)})
                    t_s = T.alloc_shared((C * TS,), half)  # I + L~, then its inverse: rows TS halves apart
                    scratch = T.alloc_shared((1024,), acc)  # the inverse's C A^-1
                else:
                    log2_scale = _lg2(scale)
                ring = T.alloc_var("int32", init=0)  # chunks walked before this pair's (as ``state``)
                pv = T.alloc_local((5,), "int32")
                pi = T.alloc_local((1,), "int32")
                for w in T.serial(total):
                    pi[0] = T.call_extern("int32", "qla_pairs_read", w, 1)
                    if pi[0] >= total:
                        T.loop_break()
                    load_pair(pv, order, cu_seqlens, pi[0])
                    hv, rank, seq, bos, seqlen = pv[0], pv[1], pv[2], pv[3], pv[4]
                    for i in T.serial(T.ceildiv(seqlen, C)):
                        st = (ring + i) % _STAGES
                        mark(tr, cta, 0, ring + i, 0)
                        note(tr, cta, 0, ring + i, i)
                        T.barrier_wait(full[st], ((ring + i) // _STAGES) % 2)
                        mark(tr, cta, 0, ring + i, 1)
                        if inverse:  # the tables' warp formed the column tables; K K^T first: the fill waits for it
                            qk_product(kq, st * 2 * C, p_f, 0)
                            lv = i & LV_BIT
                            T.wait_wgmma(0)
                            mark(tr, cta, 0, ring + i, 2)
                            fill_tile(t_s, p_f, gb_s, st)
                            gate_factors(e_h, gb_s, st, lv)
                            # ring only where traced: a macro binds a variable argument to a new name, which would
                            # change the untraced kernels' TIR (and the prebuilt keys)
                            invert_tile(t_s, scratch, tr, cta, ring if trace else 0, i)
                            gate_tile(t_s, a_h, e_h, gb_s, st, tr, cta, ring if trace else 0, i)
                            mark(tr, cta, 0, ring + i, 3)
                            on_stage(st, lambda s: T.copy(a_h, ttb[s]))
                            T.fence_proxy_async()
                            T.barrier_arrive(ag_ready[st])
                            mark(tr, cta, 0, ring + i, 4)
                            qk_product(kq, st * 2 * C, p_f)
                        else:
                            column_tables(cf_s, gb_s, st, T.min(seqlen - i * C, C), scale)
                            on_stage(st, lambda s: gate_inverse(ttb[s], a_h, gb_s, st))
                            T.fence_proxy_async()
                            T.barrier_arrive(ag_ready[st])
                            # Q K^T only now: a wgmma issued earlier waits behind the state warpgroups' in the tensor
                            # pipe and holds up everything after it
                            qk_product(kq, st * 2 * C, p_f)
                        T.wait_wgmma(0)
                        if inverse:  # P_g in fp16 (as the tile it goes to), into A_g's fragment
                            for a, b in T.Parallel(C, C):
                                a_h[a, b] = T.cast(p_f[a, b] * scale, half) * e_h[a, b]
                            on_stage(st, lambda s: T.copy(a_h, pb[s]))
                        else:
                            for a, b in T.Parallel(C, C):
                                p_f[a, b] = p_f[a, b] * _gamma_times(gb_s, st, a, b, row_log2=log2_scale)
                            on_stage(st, lambda s: T.copy(p_f, pb[s]))
                        T.fence_proxy_async()
                        T.barrier_arrive(p_ready[st])
                        T.barrier_arrive(empty[st])
                        mark(tr, cta, 0, ring + i, 5)
                    ring = ring + T.ceildiv(seqlen, C)
            elif tx < 384:
                state(kq, vb, ttb, gb_s, cf_s, pb, ob, full, empty, ag_ready, p_ready, h0, o, ht, ht_rows, order,
                      cu_seqlens, total, cta, tr)
            else:  # WG3: producer warps (the fourth only reads the queue)
                T.set_max_nreg(_NREG[3], 0)
                if (tx >= 448) & (tx < 480):  # the tables' warp (q, k, v may load before the previous kernel ends)
                    T.pdl_sync()
                ring = T.alloc_var("int32", init=0)
                pv = T.alloc_local((5,), "int32")
                pi = T.alloc_local((2,), "int32")  # this pair's launch rank and (the K/Q warp's) the next one's
                if tx < 416:  # the K/Q warp deals the pairs, one ahead
                    pi[1] = T.call_extern("int32", "qla_pairs_deal", 0, cta, n_cta, total, T.address_of(ticket[0]),
                                          tx % 32)
                for w in T.serial(total):
                    producer_pair(pi, w, cta, n_cta, total, ticket)
                    if pi[0] >= total:
                        T.loop_break()
                    load_pair(pv, order, cu_seqlens, pi[0])
                    hv, rank, seq, bos, seqlen = pv[0], pv[1], pv[2], pv[3], pv[4]
                    hk = T.truncdiv(hv, T.truncdiv(h_v, h_qk))
                    if not inverse:
                        coff = chunk_offsets[seq]
                    for i in T.serial(T.ceildiv(seqlen, C)):
                        st = (ring + i) % _STAGES
                        start = bos + i * C
                        if tx < 416:
                            mark(tr, cta, 3, ring + i, 0)
                            T.barrier_wait(empty[st], ((ring + i) // _STAGES + 1) % 2)
                            mark(tr, cta, 3, ring + i, 1)
                            load_kq(q, k, kq, start, hk, full, st)
                            T.barrier_arrive(full[st])
                        elif tx < 448:
                            T.barrier_wait(empty[st], ((ring + i) // _STAGES + 1) % 2)
                            on_stage(st, lambda s: T.tma_copy(v[start : start + C, hv, :], vb[s], barrier=full[st]))
                            T.barrier_arrive(full[st])
                            if has_h0:  # the next pair's h0 into L2 with its last chunk's V: its load then waits less
                                prefetch_next_h0(h0, order, pi, w, total, i == T.ceildiv(seqlen, C) - 1)
                        elif tx < 480:
                            T.barrier_wait(empty[st], ((ring + i) // _STAGES + 1) % 2)
                            if inverse:
                                T.call_extern("handle", "qla_gate_scan", T.address_of(g[start, hv]),
                                              T.address_of(beta[start, hv]), h_v, T.min(seqlen - i * C, C), scale,
                                              T.address_of(gb_s[st, 0, 0]), T.address_of(cf_s[st, 0, 0]), tx % 32)
                            else:
                                on_stage(st, lambda s: T.tma_copy(tt[coff + i, hv, :, :], ttb[s], barrier=full[st]))
                                T.tma_copy(gb[coff + i, hv, :, :], gb_s[st, :, :], barrier=full[st])
                            T.barrier_arrive(full[st])
                    ring = ring + T.ceildiv(seqlen, C)

    if inverse and trace:
        @T.prim_func
        def kernel_onchip_traced(
            q: T.Tensor((n_tok, h_qk, dk), dtype),
            k: T.Tensor((n_tok, h_qk, dk), dtype),
            v: T.Tensor((n_tok, h_v, dv), dtype),
            g: T.Tensor((n_tok, h_v), acc),
            beta: T.Tensor((n_tok, h_v), acc),
            cu_seqlens: T.Tensor((n_seq1,), cu_dtype),
            order: T.Tensor((n_seq1 - 1,), "int32"),
            ht_rows: T.Tensor((n_rows,), "int32"),
            h0: T.Tensor((n_h0, h_v, dk, dv), acc),
            scale: T.float32,
            n_cta: T.int32,
            ticket: T.Tensor((1,), "int32"),
            o: T.Tensor((n_tok, h_v, dv), dtype),
            ht: T.Tensor((n_ht, h_v, dk, dv), acc),
            tr: T.Tensor((TRACE_CTAS, 4, TRACE_CHUNKS, TRACE_EVENTS), "int64"),
        ):
            body(q, k, v, None, None, g, beta, cu_seqlens, None, order, ht_rows, h0, scale, n_cta, ticket, o, ht, tr)

        return kernel_onchip_traced

    if inverse:
        @T.prim_func
        def kernel_onchip(
            q: T.Tensor((n_tok, h_qk, dk), dtype),
            k: T.Tensor((n_tok, h_qk, dk), dtype),
            v: T.Tensor((n_tok, h_v, dv), dtype),
            g: T.Tensor((n_tok, h_v), acc),
            beta: T.Tensor((n_tok, h_v), acc),
            cu_seqlens: T.Tensor((n_seq1,), cu_dtype),
            order: T.Tensor((n_seq1 - 1,), "int32"),
            ht_rows: T.Tensor((n_rows,), "int32"),
            h0: T.Tensor((n_h0, h_v, dk, dv), acc),
            scale: T.float32,
            n_cta: T.int32,
            ticket: T.Tensor((1,), "int32"),
            o: T.Tensor((n_tok, h_v, dv), dtype),
            ht: T.Tensor((n_ht, h_v, dk, dv), acc),
        ):
            body(q, k, v, None, None, g, beta, cu_seqlens, None, order, ht_rows, h0, scale, n_cta, ticket, o, ht, None)

        return kernel_onchip

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
        n_cta: T.int32,
        ticket: T.Tensor((1,), "int32"),
        o: T.Tensor((n_tok, h_v, dv), dtype),
        ht: T.Tensor((n_ht, h_v, dk, dv), acc),
    ):
        body(q, k, v, tt, gb, None, None, cu_seqlens, chunk_offsets, order, ht_rows, h0, scale, n_cta, ticket, o, ht,
             None)

    return kernel


def variants():
    """``(kernel name, params)`` of every variant (K = V = 128, bf16/fp16, with and without an initial state, T~ read
    or the inverse on chip, the latter over int32 or int64 ``cu_seqlens``)."""
    return [("chunk_fwd_split", dict(dk=128, dv=128, dtype=dtype, has_h0=has_h0, inverse=inverse, cu_dtype=cu))
            for dtype in ("bfloat16", "float16") for has_h0 in (True, False)
            for inverse, cu in ((False, "int32"), (True, "int32"), (True, "int64"))]
