"""Warp-specialised reverse state recurrence of the GDN backward on SM90 (chunk C = 64).

One CTA per (sequence, v-head, DV slice), 512 threads, walking the sequence's chunks backwards; T~
and [gamma; beta] come from ``kkt_inverse``, the chunk-start states S (fp16) from
``chunk_recurrence.chunk_fwd_ws(store_h=True)`` (notation in ``chunk_grads``). Per chunk, with dS' the gradient
arriving from the later chunks:

* WG0 "state" holds dS' (fp32, registers). Publishes it to shared memory (input dtype), sums the rows
  of dS' o S (dg's gamma_C term, from the fp32 dS'), then dS = e^{gamma_C} dS' + Q^T W + K^T dU0.
* WG1 "delta": dV' = r o (K dS') + P_g^T dO, dU0 = -e o (A_g^T dV') (dV' and dU0 are staged over
  this chunk's dO tile, dead by then); hands dU0 to WG0. This is the state chain. dV' also goes to
  ``dvp`` by a TMA store issued before A_g^T dV' and waited for only before dU0 overwrites the tile, so
  ``chunk_grads`` need not recompute K dS', P_g and P_g^T dO.
* WG2 "prep" (state-independent, a chunk ahead): P_g = scale Gamma o Q K^T and A_g = Gamma o T~ o
  beta_col, W = scale e o dO; stores the published dS' to ``dh`` by TMA.
* WG3 "producer": one warp TMA-loads q and k, one dO, one T~ and [gamma; beta] into a two-stage ring,
  one S into a single buffer.

Rows of a partial chunk past the sequence end hold the next sequence's tokens (or TMA zero fill):
they have beta = 0, so T~ has unit rows there and A_g zero columns, and the rows of P_g and W past
the end are masked to zero, so they reach no gradient of a valid row and no dS.
GEMM operands are in the input dtype (they carry gradients); accumulators and gate tables fp32.
"""

import tilelang.language as T

from ._build import compiled
from .chunk_recurrence import _PTX, _exp, _gamma_times, _lg2
from .context_parallel import _WARMUP_LOG_DECAY
from .chunking import CHUNK


@T.macro
def _transition_walk(gb, skip, first, piece, hv, coff, n_c, out):
    """Chunks of a piece the transition mode walks: none for a sequence's first piece (the reverse scan does
    not use what it passes back), all of them where the forward formed the piece's M (``skip < 0``), else the
    leading chunks up to the first whose gate sum from the piece's start drops below -10: a contracting
    piece's later chunks reach its start attenuated by less than e^-10 (the forward's warm-up bound).
    Into ``out[0]``; one thread."""
    walk = T.alloc_var("int32", init=n_c)
    if first[piece] != 0:
        walk = 0
    else:
        if skip[piece, hv] >= 0:
            decay = T.alloc_var("float32", init=T.float32(0))
            for c in T.serial(n_c):
                if walk == n_c:
                    decay = decay + gb[coff + c, hv, 0, CHUNK - 1]
                    if decay < _WARMUP_LOG_DECAY:
                        walk = c + 1
    out[0] = walk


# Chunk readiness for ``chunk_grads``, which is launched as a programmatic dependent of this kernel and
# runs beside it: every writer of a chunk arrives on an mbarrier once its writes are complete (a TMA store's
# issuing warp after waiting for it and an async-proxy fence), and an otherwise idle warp then publishes the
# chunk (lane 0 releases at GPU scope after a warp barrier); the reader spins on an acquiring load, then fences
# before its TMA loads.
_READY = r"""
__device__ __forceinline__ void qla_fence_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }
__device__ __forceinline__ void qla_ready_signal(int* counters, int i) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) asm volatile("red.release.gpu.global.add.s32 [%0], 1;" :: "l"(counters + i) : "memory");
}
__device__ __forceinline__ void qla_ready_wait(const int* p, int target) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  while (v < target) {
    __nanosleep(128);
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  }
  asm volatile("fence.proxy.async.global;" ::: "memory");
}
"""


@T.macro
def _stores_done(done, c, pending):
    """A storing warp's writes of chunk ``c`` are complete: its TMA stores but the last ``pending`` have finished
    writing (not only reading), are made visible to the async proxy, and the chunk's ``done`` phase counts them."""
    T.tma_store_wait(pending, read=False)
    T.call_extern("void", "qla_fence_async_global")
    T.barrier_arrive(done[c % 4])


@T.macro
def _signal(done, c, ready, slot, hk, h_qk):
    """Publish chunk ``c`` (slot ``slot``) of this CTA: wait for its ``done`` phase, then count it in
    ``ready[slot, hk]`` (one warp; the address formed in the helper, which keeps the producer warp's few
    registers)."""
    T.barrier_wait(done[c % 4], (c // 4) % 2)
    T.call_extern("void", "qla_ready_signal", T.address_of(ready[0, 0]), slot * h_qk + hk)


# setmaxnreg per warpgroup (state, delta, prep, producer): sums to 512 = 65536 registers / 128.
_NREG = (200, 128, 160, 24)


@compiled
def chunk_dstates_ws(*, dk: int, dv: int, dtype: str, has_h0: bool, has_dht: bool, block_dv: int = 128,
                     transition: bool = False):
    """Stores each chunk's incoming dS' and its dV' (input dtype) in ``dh`` and ``dvp``, dh0 (fp32) when asked,
    and ``sd``.

    ``kernel(q, k, do, tt, gb, h, cu_seqlens, chunk_offsets, order, dh0_rows, dht, scale, dh, dvp, dh0, sd, ready)``
    (``order`` as for ``chunk_recurrence.chunk_fwd_ws``, ``dh0_rows`` as its ``ht_rows``: the row of ``dh0`` each walk
    writes, -1 for none, or the one entry 0 for walk n to row n); ``dvp[chunk, hv]`` is the chunk's (C, V) dV'
    tile, its rows past the sequence's end unspecified;
    ``sd[chunk, hv, bv, :]`` are the row sums over DV slice ``bv`` of dS' o S with the fp32 dS' (slot 1
    is not written when V is not split).

    With ``transition`` (context parallelism, see ``backward``) it only returns, per piece, the state
    gradient the piece passes back from a zero one: ``kernel(q, k, do, tt, gb, cu_seqlens,
    chunk_offsets, order, skip, first, scale, dh0)`` with the forward's skip table ``[P, H_v]`` and ``first``
    ``[P]`` (nonzero: a sequence's first piece), walking only the chunks :func:`_transition_walk` says
    (``has_h0`` and ``has_dht`` are ignored).
    """
    if transition:
        has_h0, has_dht = True, False
    n_tok = T.dynamic("n_tok")
    n_chunk = T.dynamic("n_chunk")
    n_seq1 = T.dynamic("n_seq1")
    n_dht = T.dynamic("n_dht")
    n_rows = T.dynamic("n_rows")
    n_dh0 = T.dynamic("n_dh0")
    h_qk = T.dynamic("h_qk")
    h_v = T.dynamic("h_v")
    C, BV = CHUNK, block_dv
    acc, half = "float32", "float16"
    assert dv // BV <= 2, "sd has two DV-slice slots"

    @T.macro
    def body(q, k, do, tt, gb, h, cu_seqlens, chunk_offsets, order, dh0_rows, skip, first, dht, scale, dh, dvp, dh0, sd,
             ready):
        with T.Kernel(h_v, dv // BV, n_seq1 - 1, threads=512) as (hv, bv, rank):  # launch order as in the forward
            T.import_source(_PTX + _READY)
            if not transition:  # chunk_grads may start on the SMs this grid leaves free
                T.pdl_trigger()
            # two-stage input ring, filled by TMA (dO's slot later holds dV', then dU0)
            q_s = T.alloc_shared((2, C, dk), dtype)
            k_s = T.alloc_shared((2, C, dk), dtype)
            do_s = T.alloc_shared((2, C, BV), dtype)
            tt_s = T.alloc_shared((2, C, C), half)
            gb_s = T.alloc_shared((2, 2, C), acc)  # [gamma; beta]
            h_s = None if transition else T.alloc_shared((dk, BV), half)  # S of the chunk (single buffer)
            # hand-offs between warpgroups
            ds_s = T.alloc_shared((dk, BV), dtype)  # dS'
            p_s = T.alloc_shared((C, C), dtype)  # P_g
            a_s = T.alloc_shared((C, C), dtype)  # A_g
            w_s = T.alloc_shared((C, BV), dtype)  # W = scale e o dO
            eo_s = T.alloc_shared((C,), acc)  # scale e, 0 past the sequence end

            full = T.alloc_barrier([96, 96])  # 3 producer warps + TMA bytes
            empty = T.alloc_barrier([384, 384])  # every consumer thread
            if not transition:
                h_full = T.alloc_barrier(32)
                h_empty = T.alloc_barrier(128)
            ds_ready = T.alloc_barrier(128)  # WG0 published dS'
            ds_free = T.alloc_barrier(256)  # WG1 and WG2 have read it
            p_ready = T.alloc_barrier(128)
            p_free = T.alloc_barrier(128)
            a_ready = T.alloc_barrier(128)
            a_free = T.alloc_barrier(128)
            w_ready = T.alloc_barrier(128)  # WG2 wrote W (and has read dO)
            w_free = T.alloc_barrier(128)
            du_ready = T.alloc_barrier(128)  # WG1 wrote dU0
            if not transition:
                dvp_read = T.alloc_barrier(128)  # WG1's dV' store has read its tile
                # a chunk's sd rows (WG0), dV' and dS' (the storing warps of WG1 and WG2, once complete) are written.
                # The h-loading warp waits two chunks behind: with two barriers instead of four, the last chunk's
                # phase (its writers do not wait for the next chunk) could complete before that wait for the
                # chunk two before it on the same barrier, which then never returns.
                done = T.alloc_barrier([192] * 4)

            seq = T.alloc_var("int32", init=order[rank])
            hk = T.alloc_var("int32", init=hv // (h_v // h_qk))
            v0 = bv * BV
            bos = cu_seqlens[seq]
            seqlen = cu_seqlens[seq + 1] - bos
            coff = chunk_offsets[seq]
            tx = T.get_thread_binding()
            if transition:
                n_c = T.alloc_var("int32", init=T.ceildiv(seqlen, C))
                walk_s = T.alloc_shared((1,), "int32")
                if tx == 0:
                    _transition_walk(gb, skip, first, seq, hv, coff, n_c, walk_s)
                T.sync_threads()
                n_c = walk_s[0]
            else:
                n_c = T.ceildiv(seqlen, C)

            if tx < 128:  # WG0: dS
                T.set_max_nreg(_NREG[0], 1)
                ds_f = T.alloc_fragment((dk, BV), acc)
                if not transition:
                    sq_f = T.alloc_fragment((dk, BV), acc)
                    sd_f = T.alloc_fragment((dk,), acc)
                decay = T.alloc_var(acc)
                if has_dht:
                    T.copy(dht[seq, hv, :, v0 : v0 + BV], ds_f)
                else:
                    T.clear(ds_f)
                for j in T.serial(n_c):
                    ci = n_c - 1 - j
                    st = j % 2
                    T.barrier_wait(ds_free, (j + 1) % 2)
                    T.copy(ds_f, ds_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(ds_ready)
                    if not transition:  # <dS', S> row sums with the fp32 dS'
                        T.barrier_wait(h_full, j % 2)
                        for a, b in T.Parallel(dk, BV):
                            sq_f[a, b] = ds_f[a, b] * T.cast(h_s[a, b], acc)
                        # the arrive does not wait for loads in flight, and the next S lands right after it
                        T.fence_proxy_async()
                        T.barrier_arrive(h_empty)
                        T.reduce_sum(sq_f, sd_f, dim=1)
                        T.copy(sd_f, sd[coff + ci, hv, bv, :])
                        T.barrier_arrive(done[j % 4])
                    T.barrier_wait(full[st], (j // 2) % 2)
                    decay = _exp(gb_s[st, 0, C - 1])
                    for a, b in T.Parallel(dk, BV):
                        ds_f[a, b] = ds_f[a, b] * decay
                    T.barrier_wait(w_ready, j % 2)
                    T.gemm(q_s[st, :, :], w_s, ds_f, transpose_A=True)
                    T.barrier_arrive(w_free)
                    T.barrier_wait(du_ready, j % 2)
                    T.gemm(k_s[st, :, :], do_s[st, :, :], ds_f, transpose_A=True)
                    T.barrier_arrive(empty[st])
                if transition:
                    T.copy(ds_f, dh0[seq, hv, :, v0 : v0 + BV])
                elif has_h0:
                    row = T.alloc_var("int32", init=T.if_then_else(n_rows == n_seq1 - 1, dh0_rows[seq], seq))
                    if row >= 0:
                        T.copy(ds_f, dh0[row, hv, :, v0 : v0 + BV])

            elif tx < 256:  # WG1: dV' and dU0
                T.set_max_nreg(_NREG[1], 1)
                u_f = T.alloc_fragment((C, BV), acc)
                e_f = T.alloc_fragment((C,), acc)
                r_f = T.alloc_fragment((C,), acc)
                for j in T.serial(n_c):
                    st = j % 2
                    T.barrier_wait(full[st], (j // 2) % 2)
                    for a in T.Parallel(C):
                        e_f[a] = -_exp(gb_s[st, 0, a])
                        r_f[a] = _exp(gb_s[st, 0, C - 1] - gb_s[st, 0, a])
                    T.barrier_wait(ds_ready, j % 2)
                    T.gemm(k_s[st, :, :], ds_s, u_f, clear_accum=True)
                    T.barrier_arrive(ds_free)
                    for a, b in T.Parallel(C, BV):
                        u_f[a, b] = u_f[a, b] * r_f[a]
                    T.barrier_wait(p_ready, j % 2)
                    T.gemm(p_s, do_s[st, :, :], u_f, transpose_A=True)
                    T.barrier_arrive(p_free)
                    T.barrier_wait(w_ready, j % 2)  # WG2 has read dO: its slot takes dV'
                    T.copy(u_f, do_s[st, :, :])
                    T.fence_proxy_async()
                    if not transition:  # dV' for chunk_grads, stored under the GEMM
                        if tx < 160 and j > 0:  # the storing warp: the previous chunk's store is complete
                            _stores_done(done, j - 1, 0)
                        T.tma_copy(do_s[st, :, :], dvp[coff + n_c - 1 - j, hv, :, v0 : v0 + BV])
                    T.barrier_wait(a_ready, j % 2)
                    T.gemm(a_s, do_s[st, :, :], u_f, transpose_A=True, clear_accum=True)
                    T.barrier_arrive(a_free)
                    for a, b in T.Parallel(C, BV):
                        u_f[a, b] = u_f[a, b] * e_f[a]
                    if not transition:  # the store has read dV' before dU0 overwrites it
                        T.tma_store_wait(0)
                        T.barrier_arrive(dvp_read)
                        T.barrier_wait(dvp_read, j % 2)
                    T.copy(u_f, do_s[st, :, :])
                    T.fence_proxy_async()
                    T.barrier_arrive(du_ready)
                    T.barrier_arrive(empty[st])
                if not transition and tx < 160 and n_c > 0:
                    _stores_done(done, n_c - 1, 0)

            elif tx < 384:  # WG2: P_g, A_g, W; the dh stores
                T.set_max_nreg(_NREG[2], 1)
                p_f = T.alloc_fragment((C, C), acc)
                a_f = T.alloc_fragment((C, C), acc)
                log2_scale = _lg2(scale)
                for j in T.serial(n_c):
                    ci = n_c - 1 - j
                    st = j % 2
                    length = T.min(seqlen - ci * C, C)
                    T.barrier_wait(full[st], (j // 2) % 2)
                    T.wgmma_gemm(q_s[st, :, :], k_s[st, :, :], p_f, transpose_B=True, clear_accum=True)
                    T.copy(tt_s[st, :, :], a_f)
                    for a, b in T.Parallel(C, C):
                        a_f[a, b] = a_f[a, b] * _gamma_times(gb_s, st, a, b, col_log2=_lg2(gb_s[st, 1, b]))
                    T.barrier_wait(a_free, (j + 1) % 2)
                    T.copy(a_f, a_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(a_ready)
                    T.wait_wgmma(0)
                    for a, b in T.Parallel(C, C):  # rows past the end masked
                        p_f[a, b] = p_f[a, b] * _gamma_times(
                            gb_s, st, a, b, row_log2=T.if_then_else(a < length, log2_scale, T.float32(-1e30)))
                    T.barrier_wait(p_free, (j + 1) % 2)
                    T.copy(p_f, p_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(p_ready)
                    # (a shared table: with a (C,) fragment TileLang runs this loop on half the warpgroup at
                    # BV = 128, around a 128-thread named barrier, which deadlocks)
                    for a in T.Parallel(C):
                        eo_s[a] = _exp(gb_s[st, 0, a]) * scale * T.cast(a < length, acc)
                    T.barrier_wait(w_free, (j + 1) % 2)
                    for a, b in T.Parallel(C, BV):
                        w_s[a, b] = T.cast(T.cast(do_s[st, a, b], acc) * eo_s[a], dtype)
                    T.fence_proxy_async()
                    T.barrier_arrive(w_ready)
                    T.barrier_wait(ds_ready, j % 2)
                    if not transition:
                        T.copy(ds_s, dh[coff + ci, hv, :, v0 : v0 + BV])
                    T.barrier_arrive(ds_free)
                    T.barrier_arrive(empty[st])
                    if not transition and tx < 288 and j > 0:  # the storing warp: the previous chunk's dh is complete
                        _stores_done(done, j - 1, 1)
                if not transition and tx < 288 and n_c > 0:
                    _stores_done(done, n_c - 1, 0)

            else:  # WG3: producer warps
                T.set_max_nreg(_NREG[3], 0)
                for j in T.serial(n_c):
                    ci = n_c - 1 - j
                    st = j % 2
                    start = bos + ci * C
                    if tx < 416:
                        T.barrier_wait(empty[st], (j // 2 + 1) % 2)
                        T.tma_copy(q[start : start + C, hk, :], q_s[st, :, :], barrier=full[st])
                        T.tma_copy(k[start : start + C, hk, :], k_s[st, :, :], barrier=full[st])
                        T.barrier_arrive(full[st])
                    elif tx < 448:
                        T.barrier_wait(empty[st], (j // 2 + 1) % 2)
                        T.tma_copy(do[start : start + C, hv, v0 : v0 + BV], do_s[st, :, :], barrier=full[st])
                        T.barrier_arrive(full[st])
                    elif tx < 480:
                        T.barrier_wait(empty[st], (j // 2 + 1) % 2)
                        T.tma_copy(tt[coff + ci, hv, :, :], tt_s[st, :, :], barrier=full[st])
                        T.tma_copy(gb[coff + ci, hv, :, :], gb_s[st, :, :], barrier=full[st])
                        T.barrier_arrive(full[st])
                    elif not transition:
                        T.barrier_wait(h_empty, (j + 1) % 2)
                        T.tma_copy(h[coff + ci, hv, :, v0 : v0 + BV], h_s, barrier=h_full)
                        T.barrier_arrive(h_full)
                        if j >= 2:  # publishes chunks two behind (their writers are long done)
                            _signal(done, j - 2, ready, coff + ci + 2, hk, h_qk)
                if not transition and tx >= 480:
                    for c in T.serial(T.max(n_c - 2, 0), n_c):
                        _signal(done, c, ready, coff + n_c - 1 - c, hk, h_qk)

    if transition:

        @T.prim_func
        def kernel(
            q: T.Tensor((n_tok, h_qk, dk), dtype),
            k: T.Tensor((n_tok, h_qk, dk), dtype),
            do: T.Tensor((n_tok, h_v, dv), dtype),
            tt: T.Tensor((n_chunk, h_v, C, C), half),
            gb: T.Tensor((n_chunk, h_v, 2, C), acc),
            cu_seqlens: T.Tensor((n_seq1,), "int32"),
            chunk_offsets: T.Tensor((n_seq1,), "int32"),
            order: T.Tensor((n_seq1 - 1,), "int32"),
            skip: T.Tensor((n_seq1 - 1, h_v), "int32"),
            first: T.Tensor((n_seq1 - 1,), "int32"),
            scale: T.float32,
            dh0: T.Tensor((n_seq1 - 1, h_v, dk, dv), acc),
        ):
            body(q, k, do, tt, gb, None, cu_seqlens, chunk_offsets, order, None, skip, first, None, scale, None, None,
                 dh0, None, None)

    else:

        @T.prim_func
        def kernel(
            q: T.Tensor((n_tok, h_qk, dk), dtype),
            k: T.Tensor((n_tok, h_qk, dk), dtype),
            do: T.Tensor((n_tok, h_v, dv), dtype),
            tt: T.Tensor((n_chunk, h_v, C, C), half),
            gb: T.Tensor((n_chunk, h_v, 2, C), acc),
            h: T.Tensor((n_chunk, h_v, dk, dv), half),
            cu_seqlens: T.Tensor((n_seq1,), "int32"),
            chunk_offsets: T.Tensor((n_seq1,), "int32"),
            order: T.Tensor((n_seq1 - 1,), "int32"),
            dh0_rows: T.Tensor((n_rows,), "int32"),
            dht: T.Tensor((n_dht, h_v, dk, dv), acc),
            scale: T.float32,
            dh: T.Tensor((n_chunk, h_v, dk, dv), dtype),
            dvp: T.Tensor((n_chunk, h_v, C, dv), dtype),
            dh0: T.Tensor((n_dh0, h_v, dk, dv), acc),
            sd: T.Tensor((n_chunk, h_v, 2, dk), acc),
            ready: T.Tensor((n_chunk, h_qk), "int32"),
        ):
            body(q, k, do, tt, gb, h, cu_seqlens, chunk_offsets, order, dh0_rows, None, None, dht, scale, dh, dvp, dh0,
                 sd, ready)

    return kernel


def variants():
    """``(kernel name, params)`` of every variant the backward launches (K = V = 128)."""
    return [
        ("chunk_dstates_ws", dict(dk=128, dv=128, dtype=dtype, has_h0=has_h0, has_dht=has_dht, block_dv=block_dv))
        for dtype in ("bfloat16", "float16")
        for has_h0 in (True, False)
        for has_dht in (True, False)
        for block_dv in (128, 64)
    ] + [
        ("chunk_dstates_ws", dict(dk=128, dv=128, dtype=dtype, has_h0=True, has_dht=False, block_dv=block_dv,
                                  transition=True))
        for dtype in ("bfloat16", "float16")
        for block_dv in (128, 64)
    ]
