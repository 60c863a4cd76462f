"""CUDA device code, for ``T.import_source``: (I + L)^-1 of one 64x64 fp16 tile in shared memory, in place, by a
warpgroup (128 threads), for ``kkt_inverse.kkt_inverse_tc``.

The tile is row-major and unswizzled, rows :data:`TILE_STRIDE` halves apart (144 B: the eight rows a lane group
reads down a column fall in eight different banks); on entry L is strictly lower, the diagonal ones and the upper
triangle zeros. Block doubling: the eight 8x8 diagonal blocks by substitution (64 threads, a column each, fp32), then
for b = 8, 16, 32 every pair [[A, 0], [C, D]] of b x b diagonal blocks (A^-1, D^-1 already in place) gets
-D^-1 (C A^-1) over C. Level 8 runs on CUDA cores (fp32 sums, C A^-1 kept in fp32 in the scratch), levels 16 and 32
by ``mma.sync`` m16n8k16 (fp16 operands, fp32 sums, C A^-1 rounded to fp16 in the scratch between the two
products, as FlashInfer 0.7's T precompute does). Every product reads whole tiles: the upper triangles are zeros.
Entry point: ``qla_tile_inverse(void* tile, void* scratch)``, ``scratch`` 4 KB of shared memory.
"""

TILE_STRIDE = 72

CUDA = r"""
#include <cuda_fp16.h>

// the eight 8x8 diagonal blocks: thread tx < 64 solves column tx % 8 of block tx / 8 (its rows of L read first)
__device__ __forceinline__ void qla_inv_diag8(__half* t, int tx) {
  float l[28];
  float x[8];
  int c = tx & 7, o = (tx >> 3) * 8;
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

// level 8 on CUDA cores: warp p takes pair p; lane: row i of C, two consecutive columns j0, j0 + 1
__device__ __forceinline__ void qla_inv_level8(__half* t, float* ys, int tx) {
  int p = tx >> 5, i = (tx & 31) >> 2, j0 = (tx & 3) * 2;
  int a0 = 16 * p, d0 = a0 + 8;
  float acc0 = 0.f, acc1 = 0.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) {  // Y = C A^-1 (A^-1 lower triangular: its zeros above the diagonal add nothing)
    float cv = __half2float(t[(d0 + i) * QLA_TS + a0 + k]);
    acc0 += cv * __half2float(t[(a0 + k) * QLA_TS + a0 + j0]);
    acc1 += cv * __half2float(t[(a0 + k) * QLA_TS + a0 + j0 + 1]);
  }
  ys[(p * 8 + i) * 8 + j0] = acc0;
  ys[(p * 8 + i) * 8 + j0 + 1] = acc1;
  __syncthreads();
  acc0 = 0.f;
  acc1 = 0.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) {  // -D^-1 Y
    float dv = __half2float(t[(d0 + i) * QLA_TS + d0 + k]);
    acc0 -= dv * ys[(p * 8 + k) * 8 + j0];
    acc1 -= dv * ys[(p * 8 + k) * 8 + j0 + 1];
  }
  t[(d0 + i) * QLA_TS + a0 + j0] = __float2half(acc0);  // C was read before the sync
  t[(d0 + i) * QLA_TS + a0 + j0 + 1] = __float2half(acc1);
  __syncthreads();
}

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

// acc = A[ra.., ca..] (16 x 16 KS) B[kb.., nb..] (16 KS x 8), both fp16 row-major (row strides lda, ldb)
template <int KS>
__device__ __forceinline__ void qla_tile_mma(float* acc, const __half* a, int lda, int ra, int ca, const __half* b,
                                             int ldb, int kb, int nb, int lane) {
  unsigned fa[4], fb[2];
#pragma unroll
  for (int e = 0; e < 4; ++e) acc[e] = 0.f;
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    qla_frag_a(fa, a, lda, ra, ca + 16 * ks, lane);
    qla_frag_b(fb, b, ldb, kb + 16 * ks, nb, lane);
    qla_mma(acc, fa, fb);
  }
}

// the w-th 16x8 output tile of a warp at level B: pair p (A at rows/cols a0.., D at d0 = a0 + B), tile row mt, col nt
struct QlaLevelTile {
  int p, mt, nt, a0, d0;
};

template <int B>
__device__ __forceinline__ QlaLevelTile qla_level_tile(int warp, int w) {
  constexpr int NT = B / 8, PER_PAIR = (B / 16) * NT, PER_WARP = (64 / (2 * B)) * PER_PAIR / 4;
  int q = warp * PER_WARP + w, p = q / PER_PAIR;
  return {p, (q % PER_PAIR) / NT, q % NT, 2 * p * B, 2 * p * B + B};
}

// level B (16 or 32) on tensor cores: Y = C A^-1 into the scratch (fp16, row stride B + 8), then -D^-1 Y over C;
// the 16x8 output tiles of all pairs are dealt to the four warps
template <int B>
__device__ __forceinline__ void qla_inv_level_mma(__half* t, __half* yh, int tx) {
  constexpr int YS = B + 8, PER_WARP = (64 / (2 * B)) * (B / 16) * (B / 8) / 4;
  int warp = tx >> 5, lane = tx & 31, row = lane >> 2, col = 2 * (lane & 3);
  float acc[4];
#pragma unroll
  for (int w = 0; w < PER_WARP; ++w) {
    QlaLevelTile u = qla_level_tile<B>(warp, w);
    qla_tile_mma<B / 16>(acc, t, QLA_TS, u.d0 + 16 * u.mt, u.a0, t, QLA_TS, u.a0, u.a0 + 8 * u.nt, lane);
    int y = (u.p * B + 16 * u.mt + row) * YS + 8 * u.nt + col;
    *reinterpret_cast<__half2*>(&yh[y]) = __floats2half2_rn(acc[0], acc[1]);
    *reinterpret_cast<__half2*>(&yh[y + 8 * YS]) = __floats2half2_rn(acc[2], acc[3]);
  }
  __syncthreads();
#pragma unroll
  for (int w = 0; w < PER_WARP; ++w) {
    QlaLevelTile u = qla_level_tile<B>(warp, w);
    qla_tile_mma<B / 16>(acc, t, QLA_TS, u.d0 + 16 * u.mt, u.d0, yh, YS, u.p * B, 8 * u.nt, lane);
    int x = (u.d0 + 16 * u.mt + row) * QLA_TS + u.a0 + 8 * u.nt + col;  // C was read before the sync
    *reinterpret_cast<__half2*>(&t[x]) = __floats2half2_rn(-acc[0], -acc[1]);
    *reinterpret_cast<__half2*>(&t[x + 8 * QLA_TS]) = __floats2half2_rn(-acc[2], -acc[3]);
  }
  __syncthreads();
}

__device__ __forceinline__ void qla_tile_inverse(void* tile, void* scratch) {
  __half* t = reinterpret_cast<__half*>(tile);
  int tx = threadIdx.x & 127;
  qla_inv_diag8(t, tx);
  qla_inv_level8(t, reinterpret_cast<float*>(scratch), tx);
  qla_inv_level_mma<16>(t, reinterpret_cast<__half*>(scratch), tx);
  qla_inv_level_mma<32>(t, reinterpret_cast<__half*>(scratch), tx);
}
""".replace("QLA_TS", str(TILE_STRIDE))
