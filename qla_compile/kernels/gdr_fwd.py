"""TileLang kernels for the GDN chunked forward on SM90 (chunk C = 64).

Notation as in ``shared/docs/gdn-kernel-design.md``: gamma = in-chunk inclusive cumsum of the log
gate g, e = exp(gamma), r = exp(gamma_C - gamma), L~ = strictly_lower(diag(beta) K K^T),
T~ = (I + L~)^-1 (gate-free), A_g = Gamma o T~ o beta_col.

Token-major tensors are flattened over the batch: a dense ``[B, T, ...]`` input is read as one
packed sequence of ``B*T`` tokens with ``cu_seqlens = [0, T, 2T, ...]``; one compile therefore serves
every batch layout and length.  Chunks are numbered globally: sequence n owns chunks
``chunk_offsets[n] .. chunk_offsets[n+1]-1`` (``chunk_offsets`` = exclusive cumsum of ceil(len/64)).

* :func:`kkt_inverse` -- one CTA per (chunk, v-head): K K^T on tensor cores, beta row scale,
  block inverse of I + L~ (16x16 diagonal blocks by forward substitution, then the exact
  nilpotent series for the block-strictly-lower rest), T~ stored per chunk as ``[chunk, H_v, 64, 64]``.
  Rows past a sequence's end have beta = 0, so their rows of T~ are unit rows.
* :func:`chunk_fwd` -- one CTA per (sequence, v-head): fp32 state in registers, loops over the
  sequence's chunks; gate cumsum, A_g, the delta update V' = A_g (V - e o K S), the output
  O = scale (e o Q S + (Gamma o Q K^T) V') and the state update S = e^{gamma_C} S + K^T (r o V').
"""


import tilelang.language as T

from ._build import compiled

CHUNK = 64
_SUB = 16  # diagonal block size of the inverse


@compiled
def kkt_inverse(*, dk: int, dtype: str):
    """Per chunk and v-head: T~ = (I + strictly_lower(diag(beta) K K^T))^-1 (fp16) and the gate
    cumsum gamma with the masked beta (fp32 ``gb[chunk, hv] = [gamma; beta]``; rows past the
    sequence end get g = 0 and beta = 0, so their rows of T~ are unit rows)."""
    n_tok = T.dynamic("n_tok")
    n_chunk = T.dynamic("n_chunk")
    n_seq1 = T.dynamic("n_seq1")
    h_qk = T.dynamic("h_qk")
    h_v = T.dynamic("h_v")
    C, S = CHUNK, _SUB
    acc = "float32"
    half = "float16"

    @T.prim_func
    def kernel(
        k: T.Tensor((n_tok, h_qk, dk), dtype),
        g: T.Tensor((n_tok, h_v), acc),
        beta: T.Tensor((n_tok, h_v), acc),
        cu_seqlens: T.Tensor((n_seq1,), "int32"),
        chunk_offsets: T.Tensor((n_seq1,), "int32"),
        tt: T.Tensor((n_chunk, h_v, C, C), half),
        gb: T.Tensor((n_chunk, h_v, 2, C), acc),
    ):
        with T.Kernel(n_chunk, h_v, threads=128) as (chunk, hv):
            k_s = T.alloc_shared((C, dk), dtype)
            beta_s = T.alloc_shared((C,), acc)
            g_s = T.alloc_shared((C,), acc)
            ld_s = T.alloc_shared((C // S, S, S), acc)  # L~ on the diagonal blocks
            lo_s = T.alloc_shared((C, C), half)  # L~ off the diagonal blocks, later I + N^2
            dinv_s = T.alloc_shared((C, C), half)  # block-diagonal inverse
            n_s = T.alloc_shared((C, C), half)
            z_s = T.alloc_shared((C, C), half)
            kk_f = T.alloc_fragment((C, C), acc)
            z_f = T.alloc_fragment((C, C), acc)
            col = T.alloc_local((S,), acc)
            run = T.alloc_var(acc)

            n_seq = n_seq1 - 1
            if chunk < chunk_offsets[n_seq]:
                # the sequence owning this chunk: largest s with chunk_offsets[s] <= chunk
                lo = T.alloc_var("int32", init=0)
                hi = T.alloc_var("int32", init=n_seq - 1)
                for _ in T.serial(31):
                    if lo < hi:
                        mid = (lo + hi + 1) // 2
                        if chunk_offsets[mid] <= chunk:
                            lo = mid
                        else:
                            hi = mid - 1
                start = cu_seqlens[lo] + (chunk - chunk_offsets[lo]) * C
                length = T.min(cu_seqlens[lo + 1] - start, C)
                T.copy(k[start : start + C, hv // (h_v // h_qk), :], k_s)
                for i in T.Parallel(C):
                    beta_s[i] = T.if_then_else(i < length, beta[start + i, hv], T.float32(0))
                    g_s[i] = T.if_then_else(i < length, g[start + i, hv], T.float32(0))
                T.gemm(k_s, k_s, kk_f, transpose_B=True, clear_accum=True)
                tx = T.get_thread_binding()
                if tx < C:  # gamma_i = sum_{j <= i} g_j
                    run = T.float32(0)
                    for j in T.serial(C):
                        if j <= tx:
                            run += g_s[j]
                    gb[chunk, hv, 0, tx] = run
                    gb[chunk, hv, 1, tx] = beta_s[tx]
                for i, j in T.Parallel(C, C):
                    lower = T.if_then_else(i > j, kk_f[i, j] * beta_s[i], T.float32(0))
                    if i // S == j // S:
                        ld_s[i // S, i % S, j % S] = lower
                        lo_s[i, j] = T.cast(0, half)
                    else:
                        lo_s[i, j] = T.cast(lower, half)
                    dinv_s[i, j] = T.cast(0, half)
                # Diagonal blocks: thread t solves column t % 16 of block t // 16 by forward
                # substitution, x_r = delta_rc - sum_{j<r} L_rj x_j (zero above the diagonal).
                if tx < C:
                    blk = tx // S
                    c = tx % S
                    for r in T.unroll(S):
                        col[r] = T.if_then_else(r == c, T.float32(1), T.float32(0))
                        for j in T.unroll(S):
                            if j < r:
                                col[r] -= ld_s[blk, r, j] * col[j]
                    for r in T.unroll(S):
                        dinv_s[blk * S + r, blk * S + c] = T.cast(col[r], half)
                # (I + L~)^-1 = (I + N)^-1 Dinv with N = Dinv Lo block-strictly-lower, N^4 = 0:
                # (I + N)^-1 Dinv = Z - N Z with Z = (I + N^2) Dinv.
                T.gemm(dinv_s, lo_s, kk_f, clear_accum=True)
                T.copy(kk_f, n_s)
                T.gemm(n_s, n_s, kk_f, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    lo_s[i, j] = T.cast(kk_f[i, j] + T.if_then_else(i == j, T.float32(1), T.float32(0)), half)
                T.gemm(lo_s, dinv_s, z_f, clear_accum=True)
                T.copy(z_f, z_s)
                T.gemm(n_s, z_s, kk_f, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    tt[chunk, hv, i, j] = T.cast(z_f[i, j] - kk_f[i, j], half)

    return kernel


@compiled
def chunk_fwd(*, dk: int, dv: int, dtype: str, has_h0: bool, block_dv: int = 128, num_stages: int = 2, threads: int = 256):
    """The fused chunk recurrence: o and the final state per (sequence, v-head, DV slice).

    Operands of the state-independent GEMMs (W', A_g, P, V') are fp16 whatever the input dtype
    (3 more mantissa bits than bf16); the state copy used by K S and Q S is in the input dtype.
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
    log2e = 1.4426950408889634

    @T.prim_func
    def kernel(
        q: T.Tensor((n_tok, h_qk, dk), dtype),
        k: T.Tensor((n_tok, h_qk, dk), dtype),
        v: T.Tensor((n_tok, h_v, dv), dtype),
        tt: T.Tensor((n_chunk, h_v, C, C), half),
        gb: T.Tensor((n_chunk, h_v, 2, C), acc),
        cu_seqlens: T.Tensor((n_seq1,), "int32"),
        chunk_offsets: T.Tensor((n_seq1,), "int32"),
        h0: T.Tensor((n_h0, h_v, dk, dv), acc),
        scale: T.float32,
        o: T.Tensor((n_tok, h_v, dv), dtype),
        ht: T.Tensor((n_seq1 - 1, h_v, dk, dv), acc),
    ):
        with T.Kernel(n_seq1 - 1, h_v, dv // block_dv, threads=threads) as (seq, hv, bv):
            q_s = T.alloc_shared((C, dk), dtype)
            k_s = T.alloc_shared((C, dk), dtype)
            v_s = T.alloc_shared((C, block_dv), dtype)
            tt_s = T.alloc_shared((C, C), half)
            gb_s = T.alloc_shared((2, C), acc)
            e_s = T.alloc_shared((C,), acc)
            r_s = T.alloc_shared((C,), acc)
            kh_s = T.alloc_shared((C, dk), half)
            s_s = T.alloc_shared((dk, block_dv), dtype)
            a_s = T.alloc_shared((C, C), half)
            p_s = T.alloc_shared((C, C), half)
            w_s = T.alloc_shared((C, block_dv), half)
            vp_s = T.alloc_shared((C, block_dv), half)
            vr_s = T.alloc_shared((C, block_dv), half)
            s_f = T.alloc_fragment((dk, block_dv), acc)
            u_f = T.alloc_fragment((C, block_dv), acc)
            o_f = T.alloc_fragment((C, block_dv), acc)
            p_f = T.alloc_fragment((C, C), acc)

            hk = hv // (h_v // h_qk)
            v0 = bv * block_dv
            bos = cu_seqlens[seq]
            seqlen = cu_seqlens[seq + 1] - bos
            coff = chunk_offsets[seq]
            if has_h0:
                T.copy(h0[seq, hv, :, v0 : v0 + block_dv], s_f)
            else:
                T.clear(s_f)

            for ci in T.Pipelined(T.ceildiv(seqlen, C), num_stages=num_stages):
                start = bos + ci * C
                T.copy(q[start : start + C, hk, :], q_s)
                T.copy(k[start : start + C, hk, :], k_s)
                T.copy(v[start : start + C, hv, v0 : v0 + block_dv], v_s)
                T.copy(tt[coff + ci, hv, :, :], tt_s)
                T.copy(gb[coff + ci, hv, :, :], gb_s)

                length = T.min(seqlen - ci * C, C)
                for i in T.Parallel(C):
                    e_s[i] = T.exp2(gb_s[0, i] * log2e)
                    r_s[i] = T.if_then_else(i < length, T.exp2((gb_s[0, C - 1] - gb_s[0, i]) * log2e), T.float32(0))
                for i, d in T.Parallel(C, dk):
                    kh_s[i, d] = T.cast(k_s[i, d], half)
                T.copy(s_f, s_s)
                # Issue P = Q K^T, U0 = K S and Q S together; consume the first two while Q S runs.
                T.wgmma_gemm(q_s, k_s, p_f, transpose_B=True, clear_accum=True)
                T.wgmma_gemm(k_s, s_s, u_f, clear_accum=True)
                T.wgmma_gemm(q_s, s_s, o_f, clear_accum=True)
                T.wait_wgmma(1)
                # A_g = Gamma o T~ o beta_col, P_g = scale Gamma o P, W' = V - e o U0
                for i, j in T.Parallel(C, C):
                    gm = T.if_then_else(j <= i, T.exp2((gb_s[0, i] - gb_s[0, j]) * log2e), T.float32(0))
                    p_s[i, j] = T.cast(p_f[i, j] * gm * scale, half)
                    a_s[i, j] = T.cast(T.cast(tt_s[i, j], acc) * gm * gb_s[1, j], half)
                for i, d in T.Parallel(C, block_dv):
                    w_s[i, d] = T.cast(T.cast(v_s[i, d], acc) - e_s[i] * u_f[i, d], half)
                # V' = A_g W'
                T.wgmma_gemm(a_s, w_s, u_f, clear_accum=True)
                T.wait_wgmma(0)
                for i, d in T.Parallel(C, block_dv):
                    vp_s[i, d] = T.cast(u_f[i, d], half)
                    vr_s[i, d] = T.cast(r_s[i] * u_f[i, d], half)
                    o_f[i, d] = o_f[i, d] * (scale * e_s[i])
                for a, b in T.Parallel(dk, block_dv):
                    s_f[a, b] = s_f[a, b] * e_s[C - 1]
                # O = scale e o (Q S) + P_g V';  S = e^{gamma_C} S + K^T (r o V')
                T.wgmma_gemm(p_s, vp_s, o_f)
                T.wgmma_gemm(kh_s, vr_s, s_f, transpose_A=True)
                T.wait_wgmma(0)
                for i, d in T.Parallel(C, block_dv):
                    if i < length:
                        o[start + i, hv, v0 + d] = T.cast(o_f[i, d], dtype)

            T.copy(s_f, ht[seq, hv, :, v0 : v0 + block_dv])

    return kernel


def variants():
    """``(kernel name, params)`` of every forward kernel the host entry point can launch (K = V = 128)."""
    out = []
    for dtype in ("bfloat16", "float16"):
        out.append(("kkt_inverse", dict(dk=128, dtype=dtype)))
        for has_h0 in (True, False):
            for block_dv in (128, 64):
                out.append(("chunk_fwd", dict(dk=128, dv=128, dtype=dtype, has_h0=has_h0, block_dv=block_dv)))
    return out
