"""A candidate for ``kkt_inverse`` after FlashInfer 0.7's T precompute, timed and checked against the package's kernel.

Not in the package (``bench/NOTES-fwd.md``, session 13: written on the CPU, not yet run on a GPU). One 128-thread CTA
per (chunk, v-head), up to eight per SM (~30 KB of shared memory): K by TMA, K K^T by one wgmma, I + L~ into an fp16
tile (beta_i (K K^T)_ij below the diagonal), the tile inverted in place by block doubling (:data:`_TILE_INVERSE`: the
8x8 diagonal blocks by substitution, then the pairs [[A, 0], [C, D]] of 8, 16 and 32 rows get -D^-1 (C A^-1), fp32
sums over fp16 blocks, C A^-1 kept in fp32), T~ stored from the tile. Same call and outputs as
``kkt_inverse.kkt_inverse`` (T~, [gamma; beta], the contraction flags); K K^T is formed per v-head.

    python bench/kkt_candidate.py 32/32:4096x8 16/16:1x32768 16/64:4096x8 --out $OUT

For each row: both kernels' T~ against a float64 inverse of the same I + L~ (from the candidate's fp32 K K^T
recomputed in torch) on sampled chunk slots, gb and the flags bit for bit, each kernel alone and the forward with
each (CUDA-graph medians), and the forward's output against the float64 oracle on a prefix.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHUNK = 64
TILE_STRIDE = 72  # the tile's row stride in halves: rows 144 B apart, so a column's eight rows sit in distinct banks
# (I + L)^-1 in place on a 64x64 fp16 tile (row stride TILE_STRIDE): L strictly lower, ones on the diagonal, zeros
# above; called by all 128 threads of the CTA, ``ys`` 1024 floats of scratch
_TILE_INVERSE = r"""
#include <cuda_fp16.h>
#define QLA_TS TILE_STRIDE
// qla_tile_inverse(_mma): (I + L)^-1 in place on a 64x64 fp16 tile (row stride QLA_TS), L strictly lower, ones on
// the diagonal and zeros above it on entry; 128 threads call it; ys: 1024 floats of scratch.
__device__ __forceinline__ void qla_inv_diag8(__half* t, int tx) {
  float l[28];
  float x[8];
  int blk = tx >> 3, c = tx & 7, o = blk * 8;
  if (tx < 64) {
    int n = 0;
#pragma unroll
    for (int r = 1; r < 8; ++r)
#pragma unroll
      for (int j = 0; j < r; ++j) l[n++] = __half2float(t[(o + r) * QLA_TS + o + j]);
  }
  __syncthreads();
  if (tx < 64) {
    int n = 0;
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      float s = (r == c) ? 1.f : 0.f;
#pragma unroll
      for (int j = 0; j < r; ++j) s -= l[n++] * x[j];
      x[r] = s;
    }
#pragma unroll
    for (int r = 1; r < 8; ++r)
      if (r > c) t[(o + r) * QLA_TS + o + c] = __float2half(x[r]);
  }
  __syncthreads();
}

// one doubling level: every pair [[A, 0], [C, D]] of b x b diagonal blocks (A, D already inverted) gets its
// lower-left block -D^-1 (C A^-1); the thread's N = b / 4 outputs are consecutive columns of one row
template <int B>
__device__ __forceinline__ void qla_inv_level(__half* t, float* ys, int tx) {
  constexpr int N = B / 4;
  int p = tx / (4 * B), rem = tx % (4 * B), i = rem >> 2, j0 = (rem & 3) * N;
  int a0 = 2 * p * B, d0 = a0 + B;  // A at rows/cols [a0, a0 + B), D at [d0, d0 + B), C at rows d0.., cols a0..
  float acc[N];
#pragma unroll
  for (int n = 0; n < N; ++n) acc[n] = 0.f;
  for (int k = j0; k < B; ++k) {  // Y = C A^-1, A^-1 lower triangular: k >= j
    float cv = __half2float(t[(d0 + i) * QLA_TS + a0 + k]);
#pragma unroll
    for (int n = 0; n < N; ++n) acc[n] += cv * __half2float(t[(a0 + k) * QLA_TS + a0 + j0 + n]);
  }
#pragma unroll
  for (int n = 0; n < N; ++n) ys[(p * B + i) * B + j0 + n] = acc[n];
  __syncthreads();
#pragma unroll
  for (int n = 0; n < N; ++n) acc[n] = 0.f;
  for (int k = 0; k <= i; ++k) {  // -D^-1 Y, D^-1 lower triangular: k <= i
    float dv = __half2float(t[(d0 + i) * QLA_TS + d0 + k]);
#pragma unroll
    for (int n = 0; n < N; ++n) acc[n] -= dv * ys[(p * B + k) * B + j0 + n];
  }
#pragma unroll
  for (int n = 0; n < N; ++n) t[(d0 + i) * QLA_TS + a0 + j0 + n] = __float2half(acc[n]);  // C was read before the sync
  __syncthreads();
}

// levels 16 and 32 on tensor cores: mma.sync m16n8k16 (fp16 in, fp32 sums); Y = C A^-1 rounded to fp16 in the
// scratch (row stride B + 8 halves), then -D^-1 Y over C's place; each warp takes whole 16x8 output tiles
__device__ __forceinline__ unsigned qla_pack(__half lo, __half hi) {
  __half2 h = __halves2half2(lo, hi);
  return *reinterpret_cast<unsigned*>(&h);
}

__device__ __forceinline__ void qla_mma(float* d, const unsigned* a, const unsigned* b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// A operand: rows r0..r0+15, cols c0..c0+15 of a row-major fp16 matrix (row stride ld)
__device__ __forceinline__ void qla_frag_a(unsigned* a, const __half* m, int ld, int r0, int c0, int lane) {
  int r = r0 + (lane >> 2), c = c0 + 2 * (lane & 3);
  a[0] = *reinterpret_cast<const unsigned*>(&m[r * ld + c]);
  a[1] = *reinterpret_cast<const unsigned*>(&m[(r + 8) * ld + c]);
  a[2] = *reinterpret_cast<const unsigned*>(&m[r * ld + c + 8]);
  a[3] = *reinterpret_cast<const unsigned*>(&m[(r + 8) * ld + c + 8]);
}

// B operand (k x n = 16 x 8): rows k0.. (k), cols n0.. (n) of a row-major fp16 matrix (row stride ld)
__device__ __forceinline__ void qla_frag_b(unsigned* b, const __half* m, int ld, int k0, int n0, int lane) {
  int k = k0 + 2 * (lane & 3), n = n0 + (lane >> 2);
  b[0] = qla_pack(m[k * ld + n], m[(k + 1) * ld + n]);
  b[1] = qla_pack(m[(k + 8) * ld + n], m[(k + 9) * ld + n]);
}

template <int B>
__device__ __forceinline__ void qla_inv_level_mma(__half* t, __half* yh, int tx) {
  constexpr int YS = B + 8, NT = B / 8, PER_PAIR = (B / 16) * NT, PER_WARP = (64 / (2 * B)) * PER_PAIR / 4;
  int warp = tx >> 5, lane = tx & 31, row = lane >> 2, col = 2 * (lane & 3);
  float acc[PER_WARP][4];
#pragma unroll
  for (int w = 0; w < PER_WARP; ++w) {  // Y = C A^-1
    int q = warp * PER_WARP + w, p = q / PER_PAIR, mt = (q % PER_PAIR) / NT, nt = q % NT;
    int a0 = 2 * p * B, d0 = a0 + B;
    unsigned a[4], b[2];
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[w][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < B / 16; ++ks) {
      qla_frag_a(a, t, QLA_TS, d0 + 16 * mt, a0 + 16 * ks, lane);
      qla_frag_b(b, t, QLA_TS, a0 + 16 * ks, a0 + 8 * nt, lane);
      qla_mma(acc[w], a, b);
    }
    int y = (p * B + 16 * mt + row) * YS + 8 * nt + col;
    *reinterpret_cast<__half2*>(&yh[y]) = __floats2half2_rn(acc[w][0], acc[w][1]);
    *reinterpret_cast<__half2*>(&yh[y + 8 * YS]) = __floats2half2_rn(acc[w][2], acc[w][3]);
  }
  __syncthreads();
#pragma unroll
  for (int w = 0; w < PER_WARP; ++w) {  // -D^-1 Y into C's place (C was read before the sync)
    int q = warp * PER_WARP + w, p = q / PER_PAIR, mt = (q % PER_PAIR) / NT, nt = q % NT;
    int a0 = 2 * p * B, d0 = a0 + B;
    unsigned a[4], b[2];
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[w][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < B / 16; ++ks) {
      qla_frag_a(a, t, QLA_TS, d0 + 16 * mt, d0 + 16 * ks, lane);
      qla_frag_b(b, yh, YS, p * B + 16 * ks, 8 * nt, lane);
      qla_mma(acc[w], a, b);
    }
    int x = (d0 + 16 * mt + row) * QLA_TS + a0 + 8 * nt + col;
    *reinterpret_cast<__half2*>(&t[x]) = __floats2half2_rn(-acc[w][0], -acc[w][1]);
    *reinterpret_cast<__half2*>(&t[x + 8 * QLA_TS]) = __floats2half2_rn(-acc[w][2], -acc[w][3]);
  }
  __syncthreads();
}

__device__ __forceinline__ void qla_tile_inverse(void* tile, float* ys) {
  __half* t = reinterpret_cast<__half*>(tile);
  int tx = threadIdx.x & 127;
  qla_inv_diag8(t, tx);
  qla_inv_level<8>(t, ys, tx);
  qla_inv_level<16>(t, ys, tx);
  qla_inv_level<32>(t, ys, tx);
}

__device__ __forceinline__ void qla_tile_inverse_mma(void* tile, float* ys) {
  __half* t = reinterpret_cast<__half*>(tile);
  __half* yh = reinterpret_cast<__half*>(ys);
  int tx = threadIdx.x & 127;
  qla_inv_diag8(t, tx);
  qla_inv_level<8>(t, ys, tx);
  qla_inv_level_mma<16>(t, yh, tx);
  qla_inv_level_mma<32>(t, yh, tx);
}
""".replace("TILE_STRIDE", str(TILE_STRIDE))


def candidate(dk=128, dtype="bfloat16", mma=True):
    """The candidate kernel (a TileLang JIT kernel): ``kernel(k, g, beta, spans, tt, gb, bad)``; ``mma``: the
    inverse's levels 16 and 32 by mma.sync (else all on CUDA cores)."""
    import tilelang
    import tilelang.language as T

    from qla_compile.kernels._build import TARGET, pass_configs

    n_tok = T.dynamic("n_tok")
    n_chunk = T.dynamic("n_chunk")
    h_qk = T.dynamic("h_qk")
    h_v = T.dynamic("h_v")
    C, acc, half = CHUNK, "float32", "float16"

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
        with T.Kernel(n_chunk, h_v, threads=128) as (chunk, hv):
            T.import_source(_TILE_INVERSE)
            k_s = T.alloc_shared((C, dk), dtype)
            t_s = T.alloc_shared((C * TILE_STRIDE,), half)  # I + L~, then T~: row-major, unswizzled, padded rows
            ys = T.alloc_shared((1024,), acc)
            bt_s = T.alloc_shared((C,), acc)
            gt_s = T.alloc_shared((1, C), acc)
            bad_s = T.alloc_shared((1,), "int32")
            p_f = T.alloc_fragment((C, C), acc)
            k_ready = T.alloc_barrier(128)
            span = T.alloc_local((2,), "int32")
            tx = T.get_thread_binding()
            hk = hv // (h_v // h_qk)
            for e in T.vectorized(2):
                span[e] = spans[chunk, e]
            start = T.alloc_var("int32", init=span[0])
            length = T.alloc_var("int32", init=span[1])
            if length > 0:
                T.tma_copy(k[start : start + C, hk, :], k_s, barrier=k_ready)
                T.barrier_arrive(k_ready)
                if tx < C:
                    bt_s[tx] = T.if_then_else(tx < length, beta[start + tx, hv], T.float32(0))
                    gt_s[0, tx] = T.if_then_else(tx < length, g[start + tx, hv], T.float32(0))
                if tx == 0:
                    bad_s[0] = 0
                T.barrier_wait(k_ready, 0)
                T.sync_threads()
                T.gemm(k_s, k_s, p_f, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    t_s[i * TILE_STRIDE + j] = T.cast(T.if_then_else(i > j, bt_s[i] * p_f[i, j],
                                                           T.if_then_else(i == j, T.float32(1), T.float32(0))), half)
                    if i == j:
                        if (bt_s[i] < 0) | (bt_s[i] * p_f[i, j] > 2):
                            bad_s[0] = 1
                T.cumsum(gt_s, dim=1)
                T.sync_threads()
                T.call_extern("handle", "qla_tile_inverse_mma" if mma else "qla_tile_inverse", T.address_of(t_s[0]), T.address_of(ys[0]))
                for i, j in T.Parallel(C, C):
                    tt[chunk, hv, i, j] = t_s[i * TILE_STRIDE + j]
                for r, i in T.Parallel(2, C):
                    gb[chunk, hv, r, i] = T.if_then_else(r == 0, gt_s[0, i], bt_s[i])
                if tx == 0:
                    bad[chunk, hv] = bad_s[0]

    return tilelang.compile(kernel, target=TARGET, pass_configs=pass_configs())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", nargs="+", help="H_qk/H_v:seqs items, e.g. 32/32:4096x8")
    ap.add_argument("--samples", type=int, default=64, help="chunk slots checked against float64 per row")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    from bench.common import make_inputs, parse_seqs, rel_l2, time_graph, write_results
    from qla_compile.kernels import forward as F
    from qla_compile.reference import recurrent_gdr_reference

    kernels = {"cuda": candidate(mma=False), "mma": candidate(mma=True)}  # bf16 keys, as make_inputs gives

    def candidate_inverse(kernel):
        def call(k3, g, beta, spans, tables, dtype):
            n_tok, h_v = k3.shape[0], tables[1].shape[1]
            kernel(k3, g.reshape(n_tok, h_v).float().contiguous(), beta.reshape(n_tok, h_v).float().contiguous(),
                   spans, *tables)
        return call

    inverses = {"package": F._gate_inverse, **{name: candidate_inverse(kern) for name, kern in kernels.items()}}
    package_inverse = inverses["package"]
    rows = []
    for spec in args.rows:
        heads, seqs = spec.split(":")
        hk, hv = (int(h) for h in heads.split("/"))
        lens = parse_seqs(seqs)
        x = make_inputs(hk, hv, lens)
        k3 = x["k"][0].contiguous()
        n_tok = k3.shape[0]
        _, _, _, spans = F._tables(x["cu"], 1, n_tok, k3.device)
        outs = {}
        row = dict(row=spec)
        for name, fn in inverses.items():
            tables = F._chunk_tables(n_tok, len(lens), hv, k3.device)
            fn(k3, x["g"], x["beta"], spans, tables, "bfloat16")
            torch.cuda.synchronize()
            outs[name] = [t.clone() for t in tables]
            row[name + "_kernel_us"] = time_graph(lambda: fn(k3, x["g"], x["beta"], spans, tables, "bfloat16")) * 1e3
        n_slots = int(spans[:, 1].gt(0).sum())
        for name in kernels:
            row[name + "_gb_equal"] = bool(torch.equal(outs["package"][1][:n_slots], outs[name][1][:n_slots]))
            row[name + "_bad_equal"] = bool(torch.equal(outs["package"][2][:n_slots], outs[name][2][:n_slots]))
        # T~ of sampled slots and v-heads against a float64 inverse of I + strictly_lower(diag(beta) K K^T)
        gen = torch.Generator().manual_seed(0)
        errs = {name: [] for name in inverses}
        beta = x["beta"][0].double()
        for s in torch.randint(0, n_slots, (args.samples,), generator=gen).tolist():
            a, n = spans[s].tolist()
            h = int(torch.randint(0, hv, (1,), generator=gen))
            kk = k3[a : a + n, h // (hv // hk)].double()
            lt = torch.zeros(CHUNK, CHUNK, dtype=torch.float64, device=k3.device)
            lt[:n, :n] = torch.tril(beta[a : a + n, h, None] * (kk @ kk.T), -1)
            ref = torch.linalg.inv(torch.eye(CHUNK, dtype=torch.float64, device=k3.device) + lt)
            for name in errs:
                errs[name].append(rel_l2(outs[name][0][s, h].double(), ref))
        for name in errs:
            row[name + "_tt_vs_fp64_max"] = max(errs[name])

        def forward():
            return F.chunk_gdr_fwd_hopper(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["h0"], x["cu"])

        for name, fn in inverses.items():
            F._gate_inverse = fn
            o, _ = forward()
            row[name + "_forward_us"] = time_graph(forward) * 1e3
            t = min(lens[0], 2048)  # a prefix of the first sequence
            ref_o, _ = recurrent_gdr_reference(x["q"][:, :t], x["k"][:, :t], x["v"][:, :t], x["g"][:, :t],
                                               x["beta"][:, :t], scale=x["scale"], initial_state=x["h0"][:1],
                                               output_final_state=True, cu_seqlens=torch.tensor([0, t], device="cuda"))
            row[name + "_o_vs_fp64_prefix"] = rel_l2(o[:, :t], ref_o)
        F._gate_inverse = package_inverse
        rows.append(row)
        print(json.dumps(row), flush=True)
    names = list(inverses)
    print("\n| row | " + " | ".join(f"{n} kernel us | {n} forward us | {n} T~ err" for n in names) + " | gb, flags equal |")
    print("|---" * (2 + 3 * len(names)) + "|")
    for r in rows:
        cells = [f"{r[n + '_kernel_us']:.1f} | {r[n + '_forward_us']:.1f} | {r[n + '_tt_vs_fp64_max']:.1e}" for n in names]
        eq = all(r[f"{n}_{w}_equal"] for n in kernels for w in ("gb", "bad"))
        print(f"| {r['row']} | " + " | ".join(cells) + f" | {eq} |")
    if args.out:
        write_results(args.out, "kkt-candidate.json", rows)


if __name__ == "__main__":
    main()
