"""TileLang kernels for the GDN chunked backward on SM90 (chunk C = 64), and their host entry point.

Notation as in ``shared/docs/gdn-kernel-design.md`` §1.4 and ``reference._backward_chunks`` (the
executable spec): gamma = in-chunk inclusive cumsum of g, e = exp(gamma), r = exp(gamma_C - gamma),
a = exp(gamma_C), Gamma_ij = exp(gamma_i - gamma_j) (i >= j), A_g = Gamma o T~ o beta_col,
P_g = scale Gamma o Q K^T, U0 = K S, W' = V - e o U0, V' = A_g W'.

Pipeline (one packed token stream, chunks numbered globally as in ``gdr_fwd``):

1. ``gdr_fwd.kkt_inverse`` -- T~ per chunk (the forward's kernel, reused).
2. :func:`chunk_states` -- one CTA per (sequence, v-head, DV slice) runs the state recurrence and
   stores every chunk-start state S in fp16, ``h[chunk, H_v, K, V]``.
3. :func:`chunk_dstates` -- one CTA per (sequence, v-head, DV slice) runs the reverse recurrence of
   dS (fp32 in registers), storing each chunk's incoming dS' as ``dh`` (input dtype), dh0, and the
   row sums of dS' o S (fp32 dS' times the fp16 h) that dg's gamma_C term needs.
4. :func:`chunk_grads` -- one CTA per (chunk, qk-head), all chunks in parallel, looping over the GVA
   group's v-heads: dq, dk (summed over the group on chip), dv, dg and dbeta from q, k, v, dO, T~, S
   and dS'.

dg is formed without cancellation, as in the reference: dg_t = sum_{s>=t} de_s + sum_{s<t} dr_s
+ a <dS', S> + sum_{s>=t, j<t} Y_sj with Y = dP o P_g + dA o A_g, all in fp32.

Precision.  Accumulators are fp32.  The state recurrence (:func:`chunk_states`) runs with fp16 GEMM
operands (K, S, A_g, W', r o V') as the forward does: they are bounded by the scale of v (the forward
already keeps W' = V - e o K S in fp16) and fp16 has 3 more mantissa bits than bf16; h is stored in
fp16.  GEMMs with a gradient operand (dO, dS', dV', dU0, dT~, ...) stay in the input dtype, so that in
bf16 dO-sized values keep their range; :func:`chunk_grads` also keeps K S in the input dtype (its
shared memory is full).  The <dS', S> term of dg is summed in :func:`chunk_dstates` from the fp32 dS'.
dg of a no-decay head is what this is for: it is made of inner products of S and dS', so it carries
the relative error of both.  (FP64 emulation of the bf16 GPU test case with GVA, L2 norm and h0, 200
draws: dg's relative error RMS 5.9e-3 -> 4.4e-3 and draws above 1e-2 9.5% -> 2%; the bf16 rounding of
the L2-normalised q, k before the kernels alone gives 2.3e-3 RMS.)
"""

import torch
import tilelang.language as T

from . import _DTYPES, _block_dv, _check, _tables, gdr_fwd
from ._build import compiled
from .fused_fwd import _PTX, _ex2, _exp

CHUNK = gdr_fwd.CHUNK
_LOG2E = 1.4426950408889634


@compiled
def chunk_states(*, dk: int, dv: int, dtype: str, has_h0: bool, block_dv: int = 128, threads: int = 256):
    """Chunk-start states ``h[chunk, hv] = S`` (fp16) of the forward recurrence.

    All GEMM operands are fp16 (K converted from the input dtype, S, A_g, W', r o V').
    """
    n_tok = T.dynamic("n_tok")
    n_chunk = T.dynamic("n_chunk")
    n_seq1 = T.dynamic("n_seq1")
    n_h0 = T.dynamic("n_h0")
    h_qk = T.dynamic("h_qk")
    h_v = T.dynamic("h_v")
    C = CHUNK
    acc = "float32"
    half = "float16"

    @T.prim_func
    def kernel(
        k: T.Tensor((n_tok, h_qk, dk), dtype),
        v: T.Tensor((n_tok, h_v, dv), dtype),
        g: T.Tensor((h_v, n_tok), acc),
        beta: T.Tensor((h_v, n_tok), acc),
        tt: T.Tensor((n_chunk, h_v, C, C), half),
        cu_seqlens: T.Tensor((n_seq1,), "int32"),
        chunk_offsets: T.Tensor((n_seq1,), "int32"),
        h0: T.Tensor((n_h0, h_v, dk, dv), acc),
        h: T.Tensor((n_chunk, h_v, dk, dv), half),
    ):
        with T.Kernel(n_seq1 - 1, h_v, dv // block_dv, threads=threads) as (seq, hv, bv):
            k_s = T.alloc_shared((C, dk), dtype)
            kh_s = T.alloc_shared((C, dk), half)
            v_s = T.alloc_shared((C, block_dv), dtype)
            tt_s = T.alloc_shared((C, C), half)
            g_s = T.alloc_shared((C,), acc)
            b_s = T.alloc_shared((C,), acc)
            gam_s = T.alloc_shared((C,), acc)
            e_s = T.alloc_shared((C,), acc)
            r_s = T.alloc_shared((C,), acc)
            s_s = T.alloc_shared((dk, block_dv), half)
            a_s = T.alloc_shared((C, C), half)
            w_s = T.alloc_shared((C, block_dv), half)
            s_f = T.alloc_fragment((dk, block_dv), acc)
            u_f = T.alloc_fragment((C, block_dv), acc)

            v0 = bv * block_dv
            bos = cu_seqlens[seq]
            seqlen = cu_seqlens[seq + 1] - bos
            coff = chunk_offsets[seq]
            if has_h0:
                T.copy(h0[seq, hv, :, v0 : v0 + block_dv], s_f)
            else:
                T.clear(s_f)

            for ci in T.serial(T.ceildiv(seqlen, C)):
                start = bos + ci * C
                length = T.min(seqlen - ci * C, C)
                T.copy(k[start : start + C, hv // (h_v // h_qk), :], k_s)
                T.copy(v[start : start + C, hv, v0 : v0 + block_dv], v_s)
                T.copy(tt[coff + ci, hv, :, :], tt_s)
                T.copy(g[hv, start : start + C], g_s)
                T.copy(beta[hv, start : start + C], b_s)
                # K in fp16 for the GEMMs (rows past the sequence's end are zero)
                for i, d in T.Parallel(C, dk):
                    kh_s[i, d] = T.if_then_else(i < length, T.cast(k_s[i, d], half), T.cast(0, half))
                if length < C:
                    for i, d in T.Parallel(C, block_dv):
                        v_s[i, d] = T.if_then_else(i < length, v_s[i, d], T.cast(0, dtype))
                for i in T.Parallel(C):
                    gam_s[i] = T.if_then_else(i < length, g_s[i], T.float32(0))
                    b_s[i] = T.if_then_else(i < length, b_s[i], T.float32(0))
                T.cumsum(gam_s, dim=0)
                for i in T.Parallel(C):
                    e_s[i] = T.exp2(gam_s[i] * _LOG2E)
                    r_s[i] = T.exp2((gam_s[C - 1] - gam_s[i]) * _LOG2E)
                T.copy(s_f, s_s)
                T.copy(s_s, h[coff + ci, hv, :, v0 : v0 + block_dv])
                for i, j in T.Parallel(C, C):
                    gm = T.if_then_else(j <= i, T.exp2((gam_s[i] - gam_s[j]) * _LOG2E), T.float32(0))
                    a_s[i, j] = T.cast(gm * T.cast(tt_s[i, j], acc) * b_s[j], half)
                # W' = V - e o K S;  V' = A_g W';  S = a S + K^T (r o V')
                T.gemm(kh_s, s_s, u_f, clear_accum=True)
                for i, d in T.Parallel(C, block_dv):
                    w_s[i, d] = T.cast(T.cast(v_s[i, d], acc) - e_s[i] * u_f[i, d], half)
                T.gemm(a_s, w_s, u_f, clear_accum=True)
                for i, d in T.Parallel(C, block_dv):
                    w_s[i, d] = T.cast(r_s[i] * u_f[i, d], half)
                for a, b in T.Parallel(dk, block_dv):
                    s_f[a, b] = s_f[a, b] * e_s[C - 1]
                T.gemm(kh_s, w_s, s_f, transpose_A=True)

    return kernel


@compiled
def chunk_dstates(*, dk: int, dv: int, dtype: str, has_h0: bool, has_dht: bool, block_dv: int = 128,
                  threads: int = 256):
    """The reverse recurrence dS = a dS' + scale Q^T (e o dO) + K^T dU0 per (sequence, v-head, DV slice).

    Stores each chunk's incoming dS' (input dtype) in ``dh[chunk, hv]`` and dh0 (fp32) when asked.
    dU0 = -e o A_g^T (r o K dS' + P_g^T dO) is the only state-dependent term, so the chain per chunk
    is three GEMMs on the state plus two off it.
    Also ``sd[chunk, hv, bv, :]``: the row sums over this DV slice of dS' o S, with dS' in fp32 and S
    from ``h`` (fp16), i.e. dg's <dS', S> term without the bf16 rounding of ``dh`` (slot 1 is zero when
    V is not split).
    """
    n_tok = T.dynamic("n_tok")
    n_chunk = T.dynamic("n_chunk")
    n_seq1 = T.dynamic("n_seq1")
    n_dht = T.dynamic("n_dht")
    h_qk = T.dynamic("h_qk")
    h_v = T.dynamic("h_v")
    C = CHUNK
    acc = "float32"
    assert dv // block_dv <= 2, "sd has two DV-slice slots"

    @T.prim_func
    def kernel(
        q: T.Tensor((n_tok, h_qk, dk), dtype),
        k: T.Tensor((n_tok, h_qk, dk), dtype),
        do: T.Tensor((n_tok, h_v, dv), dtype),
        g: T.Tensor((h_v, n_tok), acc),
        beta: T.Tensor((h_v, n_tok), acc),
        tt: T.Tensor((n_chunk, h_v, C, C), "float16"),
        h: T.Tensor((n_chunk, h_v, dk, dv), "float16"),
        cu_seqlens: T.Tensor((n_seq1,), "int32"),
        chunk_offsets: T.Tensor((n_seq1,), "int32"),
        dht: T.Tensor((n_dht, h_v, dk, dv), acc),
        scale: T.float32,
        dh: T.Tensor((n_chunk, h_v, dk, dv), dtype),
        dh0: T.Tensor((n_seq1 - 1, h_v, dk, dv), acc),
        sd: T.Tensor((n_chunk, h_v, 2, dk), acc),
    ):
        with T.Kernel(n_seq1 - 1, h_v, dv // block_dv, threads=threads) as (seq, hv, bv):
            q_s = T.alloc_shared((C, dk), dtype)
            k_s = T.alloc_shared((C, dk), dtype)
            do_s = T.alloc_shared((C, block_dv), dtype)
            h_s = T.alloc_shared((dk, block_dv), "float16")
            g_s = T.alloc_shared((C,), acc)
            b_s = T.alloc_shared((C,), acc)
            gam_s = T.alloc_shared((C,), acc)
            e_s = T.alloc_shared((C,), acc)
            r_s = T.alloc_shared((C,), acc)
            ds_s = T.alloc_shared((dk, block_dv), dtype)
            a_s = T.alloc_shared((C, C), dtype)
            p_s = T.alloc_shared((C, C), dtype)
            x_s = T.alloc_shared((C, block_dv), dtype)  # dV', then dU0
            w_s = T.alloc_shared((C, block_dv), dtype)  # scale e o dO
            ds_f = T.alloc_fragment((dk, block_dv), acc)
            u_f = T.alloc_fragment((C, block_dv), acc)
            p_f = T.alloc_fragment((C, C), acc)
            sq_f = T.alloc_fragment((dk, block_dv), acc)
            sd_f = T.alloc_fragment((dk,), acc)

            hk = hv // (h_v // h_qk)
            v0 = bv * block_dv
            bos = cu_seqlens[seq]
            seqlen = cu_seqlens[seq + 1] - bos
            coff = chunk_offsets[seq]
            n_c = T.ceildiv(seqlen, C)
            if has_dht:
                T.copy(dht[seq, hv, :, v0 : v0 + block_dv], ds_f)
            else:
                T.clear(ds_f)

            for it in T.serial(n_c):
                ci = n_c - 1 - it
                start = bos + ci * C
                length = T.min(seqlen - ci * C, C)
                T.copy(q[start : start + C, hk, :], q_s)
                T.copy(k[start : start + C, hk, :], k_s)
                T.copy(do[start : start + C, hv, v0 : v0 + block_dv], do_s)
                T.copy(h[coff + ci, hv, :, v0 : v0 + block_dv], h_s)
                T.copy(g[hv, start : start + C], g_s)
                T.copy(beta[hv, start : start + C], b_s)
                if length < C:  # rows past the sequence's end are zero
                    for i, d in T.Parallel(C, dk):
                        q_s[i, d] = T.if_then_else(i < length, q_s[i, d], T.cast(0, dtype))
                        k_s[i, d] = T.if_then_else(i < length, k_s[i, d], T.cast(0, dtype))
                    for i, d in T.Parallel(C, block_dv):
                        do_s[i, d] = T.if_then_else(i < length, do_s[i, d], T.cast(0, dtype))
                for i in T.Parallel(C):
                    gam_s[i] = T.if_then_else(i < length, g_s[i], T.float32(0))
                    b_s[i] = T.if_then_else(i < length, b_s[i], T.float32(0))
                T.cumsum(gam_s, dim=0)
                for i in T.Parallel(C):
                    e_s[i] = T.exp2(gam_s[i] * _LOG2E)
                    r_s[i] = T.exp2((gam_s[C - 1] - gam_s[i]) * _LOG2E)
                T.copy(ds_f, ds_s)
                T.copy(ds_s, dh[coff + ci, hv, :, v0 : v0 + block_dv])
                # <dS', S> row sums with the fp32 dS' (dg's gamma_C term)
                for a, b in T.Parallel(dk, block_dv):
                    sq_f[a, b] = ds_f[a, b] * T.cast(h_s[a, b], acc)
                T.reduce_sum(sq_f, sd_f, dim=1)
                T.copy(sd_f, sd[coff + ci, hv, bv, :])
                if block_dv == dv:
                    for a in T.Parallel(dk):
                        sd[coff + ci, hv, 1, a] = T.float32(0)
                T.gemm(q_s, k_s, p_f, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    gm = T.if_then_else(j <= i, T.exp2((gam_s[i] - gam_s[j]) * _LOG2E), T.float32(0))
                    p_s[i, j] = T.cast(scale * gm * p_f[i, j], dtype)
                    a_s[i, j] = T.cast(gm * T.cast(tt[coff + ci, hv, i, j], acc) * b_s[j], dtype)
                for i, d in T.Parallel(C, block_dv):
                    w_s[i, d] = T.cast(scale * e_s[i] * T.cast(do_s[i, d], acc), dtype)
                # dV' = r o K dS' + P_g^T dO;  dU0 = -e o A_g^T dV'
                T.gemm(k_s, ds_s, u_f, clear_accum=True)
                for i, d in T.Parallel(C, block_dv):
                    u_f[i, d] = r_s[i] * u_f[i, d]
                T.gemm(p_s, do_s, u_f, transpose_A=True)
                T.copy(u_f, x_s)
                T.gemm(a_s, x_s, u_f, transpose_A=True, clear_accum=True)
                for i, d in T.Parallel(C, block_dv):
                    x_s[i, d] = T.cast(-e_s[i] * u_f[i, d], dtype)
                # dS = a dS' + Q^T (scale e o dO) + K^T dU0
                for a, b in T.Parallel(dk, block_dv):
                    ds_f[a, b] = ds_f[a, b] * e_s[C - 1]
                T.gemm(q_s, w_s, ds_f, transpose_A=True)
                T.gemm(k_s, x_s, ds_f, transpose_A=True)

            if has_h0:
                T.copy(ds_f, dh0[seq, hv, :, v0 : v0 + block_dv])

    return kernel


def _gamma(gb_s, a, b):
    """Gamma_ab = exp(gamma_a - gamma_b) for b <= a, else 0, as one SFU ex2 (``fused_fwd._gamma_times``'s
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


def _ysw(i, j):
    """Column of Y[i, j] in y_s: 4-float groups XOR-swizzled by row, so that a warp reading one 4-float group
    from each of 32 rows hits every bank once per 8 rows."""
    return T.bitwise_xor(j // 4, i % 8) * 4 + j % 4


@compiled
def chunk_grads(*, dk: int, dv: int, dtype: str, threads: int = 256):
    """Per (chunk, qk-head), given S and dS' of the chunk for each of its G = h_v / h_qk v-heads: dq, dk
    (summed over the GVA group), and per v-head dv, dg, dbeta.

    Call as ``kernel(q, k, v, do, tt, gb, h, dh, sd, cu_seqlens, chunk_offsets, scale, acc, dq, dk, dv, dg,
    dbeta)`` with ``tt``, ``gb`` from ``gdr_fwd.kkt_inverse`` (gamma and the masked beta of the
    chunk), ``tt.shape[0] >= n_tok // 64 + n_seq`` chunk slots (as ``backward`` allocates), and the grid one
    slot longer than that. One CTA loads the q, k tiles once, then loops over the group's v-heads
    hv = hk G + g; every other input tile is TMA-loaded per v-head against one mbarrier (phase g % 2; h too
    in fp16; in bf16 its conversion copy runs while the TMA loads are in flight); rows of a partial chunk
    past the sequence end are zeroed in shared memory. dv is staged over dV' and stored as one tile (by
    rows when the chunk is partial).

    dq, dk sum over g = 0, 1, ..., G - 1 in that order in fp32 through ``acc`` (fp32 scratch
    ``[n_chunk, h_qk, 2, 64, dk]``, one [dq; dk] tile pair per CTA: g = 0 stores, later v-heads load (under
    the last GEMMs), add and store; the L2 keeps them), and the last v-head writes dq, dk in the input dtype.
    With G == 1 the scratch is not touched (pass ``[1, h_qk, 2, 64, dk]``).

    Every row of every output is written: the spare slots past the last chunk (at least
    ceil((n_tok - cu_seqlens[-1]) / 64) of them, counting the extra grid slot) zero the rows past
    ``cu_seqlens[-1]``, so all outputs may be allocated uninitialised (rows before ``cu_seqlens[0]`` are
    not written: cu_seqlens[0] must be 0).
    """
    n_tok = T.dynamic("n_tok")
    n_chunk = T.dynamic("n_chunk")
    n_seq1 = T.dynamic("n_seq1")
    n_acc = T.dynamic("n_acc")
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
        sd: T.Tensor((n_chunk, h_v, 2, dk), acc),
        cu_seqlens: T.Tensor((n_seq1,), "int32"),
        chunk_offsets: T.Tensor((n_seq1,), "int32"),
        scale: T.float32,
        acc_buf: T.Tensor((n_acc, h_qk, 2, C, dk), acc),
        dq_out: T.Tensor((n_tok, h_qk, dk), dtype),
        dk_out: T.Tensor((n_tok, h_qk, dk), dtype),
        dv_out: T.Tensor((n_tok, h_v, dv), dtype),
        dg_out: T.Tensor((h_v, n_tok), acc),
        db_out: T.Tensor((h_v, n_tok), acc),
    ):
        with T.Kernel(n_chunk + 1, h_qk, threads=threads) as (chunk, hk):
            T.import_source(_PTX)
            q_s = T.alloc_shared((C, dk), dtype)
            k_s = T.alloc_shared((C, dk), dtype)
            v_s = T.alloc_shared((C, dv), dtype)  # V, then e o U0, then dU0
            do_s = T.alloc_shared((C, dv), dtype)
            s_s = T.alloc_shared((dk, dv), dtype)  # S (from the fp16 h)
            ds_s = T.alloc_shared((dk, dv), dtype)  # dS'
            w_s = T.alloc_shared((C, dv), dtype)  # W'
            vn_s = T.alloc_shared((C, dv), dtype)
            dvn_s = T.alloc_shared((C, dv), dtype)  # dV', then dv (staged for the store)
            tt_s = T.alloc_shared((C, C), dtype)  # T~ in the GEMM dtype (fp16 values read from tt)
            a_s = T.alloc_shared((C, C), dtype)  # A_g, then T~^T dT~, then dQK
            p_s = T.alloc_shared((C, C), dtype)  # P_g, then dT~, then beta o dL
            y_s = T.alloc_shared((C, C), acc)  # the fp16 T~ (TMA), then Y (columns swizzled by _ysw)
            tt16 = T.view(y_s, (2, C, C), half)  # [0]: T~ as loaded, until Y is written
            gb_s = T.alloc_shared((2, C), acc)  # [gamma; beta]
            sd_s = T.alloc_shared((2, dk), acc)
            e_s = T.alloc_shared((C,), acc)
            r_s = T.alloc_shared((C,), acc)
            de_s = T.alloc_shared((C,), acc)
            dr_s = T.alloc_shared((C,), acc)
            db_s = T.alloc_shared((C,), acc)
            db2_s = T.alloc_shared((C,), acc)
            bar = T.alloc_barrier(threads)
            b1_f = T.alloc_fragment((C, dv), acc)
            b2_f = T.alloc_fragment((C, dv), acc)
            dk_f = T.alloc_fragment((C, dk), acc)
            pk_f = T.alloc_fragment((C, dk), acc)  # the running dk sum, loaded under the last GEMMs
            s1_f = T.alloc_fragment((C, C), acc)
            s2_f = T.alloc_fragment((C, C), acc)
            dr_f = T.alloc_fragment((C,), acc)
            deu_f = T.alloc_fragment((C,), acc)
            deq_f = T.alloc_fragment((C,), acc)
            db1_f = T.alloc_fragment((C,), acc)
            db2_f = T.alloc_fragment((C,), acc)
            yr = T.alloc_local((16,), acc)

            grp = T.alloc_var("int32", init=h_v // h_qk)  # G, once, not per access
            tx = T.get_thread_binding()
            n_seq = n_seq1 - 1
            n_real = chunk_offsets[n_seq]
            if chunk < n_real:
                # the owning sequence: the largest s with chunk_offsets[s] <= chunk
                seq = T.alloc_var("int32", init=0)
                hi = T.alloc_var("int32", init=n_seq - 1)
                for _ in T.serial(31):
                    if seq < hi:
                        mid = (seq + hi + 1) // 2
                        if chunk_offsets[mid] <= chunk:
                            seq = mid
                        else:
                            hi = mid - 1
                ci = chunk - chunk_offsets[seq]
                start = cu_seqlens[seq] + ci * C
                length = T.min(cu_seqlens[seq + 1] - start, C)
                for g in T.serial(grp):
                    hv = hk * grp + g
                    # every input tile in flight at once (q, k once); rows past n_tok are zero-filled by the TMA
                    # unit. The previous v-head's readers are done (the sync at the end of the loop).
                    if g == 0:
                        T.tma_copy(q[start : start + C, hk, :], q_s, barrier=bar)
                        T.tma_copy(k[start : start + C, hk, :], k_s, barrier=bar)
                    T.tma_copy(v[start : start + C, hv, :], v_s, barrier=bar)
                    T.tma_copy(do[start : start + C, hv, :], do_s, barrier=bar)
                    T.tma_copy(dh[chunk, hv, :, :], ds_s, barrier=bar)
                    T.tma_copy(tt[chunk, hv, :, :], tt16[0, :, :], barrier=bar)
                    T.tma_copy(gb[chunk, hv, :, :], gb_s, barrier=bar)
                    T.tma_copy(sd[chunk, hv, :, :], sd_s, barrier=bar)
                    if dtype == half:
                        T.tma_copy(h[chunk, hv, :, :], s_s, barrier=bar)
                    T.barrier_arrive(bar)
                    if dtype != half:
                        T.copy(h[chunk, hv, :, :], s_s)  # fp16 -> bf16 while the TMA loads are in flight
                    T.barrier_wait(bar, g % 2)
                    if length < C:  # rows past the sequence's end are zero (gb has g = beta = 0 there)
                        if g == 0:
                            for i, d in T.Parallel(C, dk):
                                q_s[i, d] = T.if_then_else(i < length, q_s[i, d], T.cast(0, dtype))
                                k_s[i, d] = T.if_then_else(i < length, k_s[i, d], T.cast(0, dtype))
                        for i, d in T.Parallel(C, dv):
                            v_s[i, d] = T.if_then_else(i < length, v_s[i, d], T.cast(0, dtype))
                            do_s[i, d] = T.if_then_else(i < length, do_s[i, d], T.cast(0, dtype))
                    for i in T.Parallel(C):
                        e_s[i] = _exp(gb_s[0, i])
                        r_s[i] = _exp(gb_s[0, C - 1] - gb_s[0, i])
                    # P_g = scale Gamma o Q K^T and A_g = Gamma o T~ o beta_col (stmatrix stores)
                    T.gemm(q_s, k_s, s1_f, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(C, C):
                        gm = _gamma(gb_s, i, j)
                        s2_f[i, j] = gm * T.cast(tt16[0, i, j], acc) * gb_s[1, j]
                        s1_f[i, j] = scale * gm * s1_f[i, j]
                    T.copy(s1_f, p_s)
                    T.copy(s2_f, a_s)
                    T.copy(tt16[0, :, :], tt_s)
                    # W' = V - e o U0 (v_s keeps e o U0);  V' = A_g W'
                    T.gemm(k_s, s_s, b1_f, clear_accum=True)
                    for i, d in T.Parallel(C, dv):
                        w_s[i, d] = T.cast(T.cast(v_s[i, d], acc) - e_s[i] * b1_f[i, d], dtype)
                        v_s[i, d] = T.cast(e_s[i] * b1_f[i, d], dtype)
                    T.gemm(a_s, w_s, b1_f, clear_accum=True)
                    T.copy(b1_f, vn_s)
                    # dV' = r o K dS' + P_g^T dO;  dr = rowsum(r o V' o K dS')
                    T.gemm(k_s, ds_s, b2_f, clear_accum=True)
                    for i, d in T.Parallel(C, dv):
                        b2_f[i, d] = r_s[i] * b2_f[i, d]
                        b1_f[i, d] = b1_f[i, d] * b2_f[i, d]
                    T.reduce_sum(b1_f, dr_f, dim=1)
                    T.copy(dr_f, dr_s)
                    T.gemm(p_s, do_s, b2_f, transpose_A=True)
                    T.copy(b2_f, dvn_s)
                    # dk starts with r o (V' dS'^T)
                    T.gemm(vn_s, ds_s, dk_f, transpose_B=True, clear_accum=True)
                    for i, d in T.Parallel(C, dk):
                        dk_f[i, d] = r_s[i] * dk_f[i, d]
                    # dv = dW' = A_g^T dV';  dA = dV' W'^T (both GEMMs read dV', then dv is staged over it)
                    T.gemm(a_s, dvn_s, b1_f, transpose_A=True, clear_accum=True)
                    T.gemm(dvn_s, w_s, s1_f, transpose_B=True, clear_accum=True)
                    T.copy(b1_f, dvn_s)
                    T.fence_proxy_async()
                    if length == C:
                        T.copy(dvn_s, dv_out[start : start + C, hv, :])
                    else:
                        for i, d in T.Parallel(C, dv):
                            if i < length:
                                dv_out[start + i, hv, d] = dvn_s[i, d]
                    # de -= rowsum(e o U0 o dW');  v_s <- dU0 = -e o dW'
                    for i, d in T.Parallel(C, dv):
                        b2_f[i, d] = T.cast(v_s[i, d], acc) * b1_f[i, d]
                    T.reduce_sum(b2_f, deu_f, dim=1)
                    for i, d in T.Parallel(C, dv):
                        v_s[i, d] = T.cast(-e_s[i] * b1_f[i, d], dtype)
                    # dbeta_j += sum_i dA o Gamma o T~;  dT~ = dA o Gamma o beta_col (p_s);  Y = dA o A_g
                    for i, j in T.Parallel(C, C):
                        gm = _gamma(gb_s, i, j)
                        s2_f[i, j] = s1_f[i, j] * gm * T.cast(tt16[0, i, j], acc)
                        s1_f[i, j] = s1_f[i, j] * gm * gb_s[1, j]
                    T.copy(s1_f, p_s)
                    T.reduce_sum(s2_f, db1_f, dim=0)
                    T.copy(db1_f, db_s)
                    T.sync_threads()  # every thread has read the fp16 T~ (tt16 is y_s's memory)
                    for i, j in T.Parallel(C, C):
                        y_s[i, _ysw(i, j)] = s2_f[i, j] * gb_s[1, j]
                    # dL = -(T~^T dT~ T~^T) strictly lower;  dbeta_i += rowsum(dL o K K^T);  p_s <- beta o dL
                    T.gemm(tt_s, p_s, s1_f, transpose_A=True, clear_accum=True)
                    T.copy(s1_f, a_s)
                    T.gemm(a_s, tt_s, s1_f, transpose_B=True, clear_accum=True)
                    T.gemm(k_s, k_s, s2_f, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(C, C):
                        dl = T.if_then_else(j < i, -s1_f[i, j], T.float32(0))
                        s2_f[i, j] = dl * s2_f[i, j]
                        s1_f[i, j] = gb_s[1, i] * dl
                    T.copy(s1_f, p_s)
                    T.reduce_sum(s2_f, db2_f, dim=1)
                    T.copy(db2_f, db2_s)
                    T.gemm(p_s, k_s, dk_f)
                    T.gemm(p_s, k_s, dk_f, transpose_A=True)
                    # dP = dO V'^T;  dQK = scale Gamma o dP (a_s);  Y += dP o P_g (Q K^T recomputed)
                    T.gemm(do_s, vn_s, s1_f, transpose_B=True, clear_accum=True)
                    T.gemm(q_s, k_s, s2_f, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(C, C):
                        s1_f[i, j] = scale * _gamma(gb_s, i, j) * s1_f[i, j]
                        y_s[i, _ysw(i, j)] += s1_f[i, j] * s2_f[i, j]
                    T.copy(s1_f, a_s)
                    # dq = scale e o (dO S^T) + dQK K;  de += rowsum(q o scale e o dO S^T)
                    T.gemm(do_s, s_s, b1_f, transpose_B=True, clear_accum=True)
                    for i, d in T.Parallel(C, dk):
                        b1_f[i, d] = scale * e_s[i] * b1_f[i, d]
                        b2_f[i, d] = b1_f[i, d] * T.cast(q_s[i, d], acc)
                    T.reduce_sum(b2_f, deq_f, dim=1)
                    # the group's running dq, dk sums (b2_f is free now), in flight under the GEMMs below (chunk <
                    # n_acc always holds where G > 1; the test spares a bounds check per element)
                    if g > 0 and chunk < n_acc:
                        for i, d in T.Parallel(C, dk):
                            b2_f[i, d] = acc_buf[chunk, hk, 0, i, d]
                            pk_f[i, d] = acc_buf[chunk, hk, 1, i, d]
                    T.gemm(a_s, k_s, b1_f)
                    # dk += dU0 S^T + dQK^T Q
                    T.gemm(v_s, s_s, dk_f, transpose_B=True)
                    T.gemm(a_s, q_s, dk_f, transpose_A=True)
                    # dq, dk summed over the group in the order g = 0, 1, ... in fp32; the running sums stay in this
                    # CTA's scratch slot (all 64 rows, partial chunk or not; the end-of-loop sync orders the reload)
                    if g > 0:
                        for i, d in T.Parallel(C, dk):
                            b1_f[i, d] = b2_f[i, d] + b1_f[i, d]
                            dk_f[i, d] = pk_f[i, d] + dk_f[i, d]
                    if g < grp - 1:
                        if chunk < n_acc:
                            for i, d in T.Parallel(C, dk):
                                acc_buf[chunk, hk, 0, i, d] = b1_f[i, d]
                                acc_buf[chunk, hk, 1, i, d] = dk_f[i, d]
                    else:
                        for i, d in T.Parallel(C, dk):
                            if i < length:
                                dq_out[start + i, hk, d] = T.cast(b1_f[i, d], dtype)
                                dk_out[start + i, hk, d] = T.cast(dk_f[i, d], dtype)
                    # dg_t = sum_s M_st, M_st = [s >= t] (de_s + left_st) + [s < t] dr_s + a (sd_s + sd_{s+C}) with
                    # left_st = sum_{j<t} Y_sj; the a <dS', S> term is folded into de_s and dr_s.
                    for i in T.Parallel(C):
                        sda = e_s[C - 1] * ((sd_s[0, i] + sd_s[1, i]) + (sd_s[0, i + C] + sd_s[1, i + C]))
                        de_s[i] = sda + (deq_f[i] - deu_f[i])
                        dr_s[i] = sda + dr_s[i]
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
                        db_out[hv, start + tx] = db_s[tx] + db2_s[tx]
                    # every reader of this v-head's tiles (y_s above, the wgmma operands, ...) is done before the
                    # next TMA loads overwrite them; generic writes ordered before those async-proxy writes
                    T.fence_proxy_async()
                    T.sync_threads()
            else:
                # a spare slot: the rows past cu_seqlens[-1] (padding), 64 per tile, spread over the spare slots
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
    """``(kernel name, params)`` of every variant :func:`chunk_gdr_bwd_hopper` can launch (for prebuild)."""
    out = [("chunk_grads", dict(dk=128, dv=128, dtype=dt)) for dt in _DTYPES.values()]
    for dt in _DTYPES.values():
        for block_dv in (64, 128):
            for has_h0 in (False, True):
                base = dict(dk=128, dv=128, dtype=dt, has_h0=has_h0, block_dv=block_dv)
                out.append(("chunk_states", base))
                out += [("chunk_dstates", dict(base, has_dht=has_dht)) for has_dht in (False, True)]
    return out


def chunk_gdr_bwd_hopper(do, dht, q, k, v, g, beta, scale: float, initial_state=None, cu_seqlens=None):
    """GDN chunked backward on SM90: ``(dq, dk, dv, dg, dbeta, dh0)``.

    Inputs as for ``chunk_gdr_fwd_hopper`` with the activations already applied: q, k ``[B,T,H_qk,K]``
    (L2-normalised if that option is on), v and do ``[B,T,H_v,V]`` (bf16/fp16, one dtype), g ``[B,T,H_v]``
    the activated log gate (<= 0), beta ``[B,T,H_v]`` activated; dht and initial_state fp32 ``[N,H_v,K,V]``
    or None; cu_seqlens ``[N+1]`` (B == 1) or None.  dq, dk, dv come back in q's dtype, dg and dbeta in
    g's and beta's dtypes, dh0 fp32 (None without an initial state).  Tokens past ``cu_seqlens[-1]``
    get zero gradients.
    """
    _check(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T_, h_qk, dk = q.shape
    h_v, dv = v.shape[2], v.shape[3]
    dtype = _DTYPES[q.dtype]
    n_tok = B * T_
    dev = q.device
    if n_tok == 0:  # nothing to launch; dh0 is dht passed straight through
        dh0 = None
        if initial_state is not None:
            dh0 = torch.zeros_like(initial_state, dtype=torch.float32) if dht is None else dht.float().clone()
        return tuple(torch.zeros_like(x) for x in (q, k, v, g, beta)) + (dh0,)
    q3 = q.reshape(n_tok, h_qk, dk).contiguous()
    k3 = k.reshape(n_tok, h_qk, dk).contiguous()
    v3 = v.reshape(n_tok, h_v, dv).contiguous()
    do3 = do.reshape(n_tok, h_v, dv).to(v.dtype).contiguous()
    g_tok = g.reshape(n_tok, h_v).to(torch.float32).contiguous()
    b_tok = beta.reshape(n_tok, h_v).to(torch.float32).contiguous()
    cu, offsets = _tables(cu_seqlens, B, T_, dev)
    n_seq = cu.numel() - 1
    n_slots = n_tok // CHUNK + n_seq

    tt = torch.empty(n_slots, h_v, CHUNK, CHUNK, device=dev, dtype=torch.float16)
    gb = torch.empty(n_slots, h_v, 2, CHUNK, device=dev, dtype=torch.float32)
    gdr_fwd.kkt_inverse(dk=dk, dtype=dtype)(k3, g_tok, b_tok, cu, offsets, tt, gb)
    g2, b2 = g_tok.t().contiguous(), b_tok.t().contiguous()  # head-major for the backward kernels

    has_h0 = initial_state is not None
    h0 = initial_state.to(torch.float32).contiguous() if has_h0 else torch.empty(1, h_v, dk, dv, device=dev)
    block_dv = _block_dv(n_seq * h_v, dv)  # the forward's rule: split V when few (sequence, head) pairs
    h = torch.empty(n_slots, h_v, dk, dv, device=dev, dtype=torch.float16)
    chunk_states(dk=dk, dv=dv, dtype=dtype, has_h0=has_h0, block_dv=block_dv)(k3, v3, g2, b2, tt, cu, offsets, h0, h)

    f32 = dict(device=dev, dtype=torch.float32)
    has_dht = dht is not None
    dht_ = dht.to(torch.float32).contiguous() if has_dht else torch.empty(1, h_v, dk, dv, device=dev)
    dh = torch.empty(n_slots, h_v, dk, dv, device=dev, dtype=q.dtype)
    dh0 = torch.empty(n_seq, h_v, dk, dv, **f32)
    sd = torch.empty(n_slots, h_v, 2, dk, **f32)
    chunk_dstates(dk=dk, dv=dv, dtype=dtype, has_h0=has_h0, has_dht=has_dht, block_dv=block_dv)(
        q3, k3, do3, g2, b2, tt, h, cu, offsets, dht_, float(scale), dh, dh0, sd)

    # dq, dk summed over each GVA group in the kernel (fp32 through the scratch when G > 1) and written in the
    # input dtype; every row of every output is written (the spare chunk slots zero the rows past cu_seqlens[-1])
    acc = torch.empty(n_slots if h_v > h_qk else 1, h_qk, 2, CHUNK, dk, **f32)
    dq, dkh = torch.empty_like(q3), torch.empty_like(k3)
    dvo = torch.empty_like(v3)
    dg = torch.empty(h_v, n_tok, **f32)
    db = torch.empty(h_v, n_tok, **f32)
    chunk_grads(dk=dk, dv=dv, dtype=dtype)(q3, k3, v3, do3, tt, gb, h, dh, sd, cu, offsets, float(scale),
                                           acc, dq, dkh, dvo, dg, db)
    dq = dq.view(B, T_, h_qk, dk)
    dkh = dkh.view(B, T_, h_qk, dk)
    dg = dg.t().to(g.dtype).reshape(B, T_, h_v)
    db = db.t().to(beta.dtype).reshape(B, T_, h_v)
    return dq, dkh, dvo.view(B, T_, h_v, dv), dg, db, (dh0 if has_h0 else None)
