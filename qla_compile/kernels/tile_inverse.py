"""CUDA device code, for ``T.import_source``: (I + L)^-1 of one 64x64 fp16 tile in shared memory, in place, by a
warpgroup (128 threads), for ``kkt_inverse.kkt_inverse_tc`` and the aux warpgroup of
``split_state_recurrence.chunk_fwd_split`` with its inverse on chip.

The tile is row-major and unswizzled, rows :data:`TILE_STRIDE` halves apart (144 B: the eight rows a lane group
reads down a column fall in eight different banks); on entry the strictly lower triangle holds L (what the diagonal
and the upper triangle hold is not read: the inverse writes ones and zeros there). Block doubling: each warp inverts
one 16x16 diagonal block on its own (its two 8x8 diagonal blocks by substitution in fp32, the block under them by
two ``mma.sync`` m16n8k8), then for b = 16, 32 every pair [[A, 0], [C, D]] of b x b diagonal blocks (A^-1, D^-1
already in place) gets -D^-1 (C A^-1) over C, by ``mma.sync`` m16n8k16. Every product has fp16 operands and fp32
sums, C A^-1 rounded to fp16 between its two products (in the scratch at levels 16 and 32), as FlashInfer 0.7's T
precompute does; the products read the upper triangles' zeros, but for level 32's k-steps where a factor is all zero
(skipped).
Entry point: ``qla_tile_inverse<BAR>(void* tile, void* scratch)``, ``scratch`` 4 KB of shared memory; ``BAR`` is the
barrier its 128 threads meet at between steps: 0 (the default) ``__syncthreads`` for a CTA of one warpgroup, else the
named barrier ``BAR`` for one warpgroup of a larger CTA (``qla_wg_sync<BAR>``).
"""

TILE_STRIDE = 72

CUDA = r"""
#include <cuda_fp16.h>

template <int BAR>
__device__ __forceinline__ void qla_wg_sync() {
  if (BAR == 0) {
    __syncthreads();
  } else {
    asm volatile("bar.sync %0, 128;" ::"n"(BAR) : "memory");
  }
}

__device__ __forceinline__ void qla_mma(float* d, const unsigned* a, const unsigned* b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d += a b, m16n8k8 (fp16 operands: a two registers, b one; fp32 sums)
__device__ __forceinline__ void qla_mma8(float* d, const unsigned* a, unsigned b) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(b));
}

// A operand: rows r0..r0+15, cols c0..c0+15 of a row-major fp16 matrix (row stride ld halves, rows 16-byte aligned),
// by one ldmatrix.x4: lane l names row r0 + l % 16 at column c0 + 8 (l / 16)
__device__ __forceinline__ void qla_frag_a(unsigned* a, const __half* m, int ld, int r0, int c0, int lane) {
  unsigned p = static_cast<unsigned>(__cvta_generic_to_shared(&m[(r0 + (lane & 15)) * ld + c0 + (lane >> 4) * 8]));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(p));
}

// B operand (k x n = 16 x 8): rows k0.. (k), cols n0.. (n) of a row-major fp16 matrix, by one ldmatrix.x2.trans:
// lane l < 16 names row k0 + l (lanes 16..31 repeat them)
__device__ __forceinline__ void qla_frag_b(unsigned* b, const __half* m, int ld, int k0, int n0, int lane) {
  unsigned p = static_cast<unsigned>(__cvta_generic_to_shared(&m[(k0 + (lane & 15)) * ld + n0]));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(b[0]), "=r"(b[1]) : "r"(p));
}

// the four 16x16 diagonal blocks, warp w the w-th (no block-wide barrier): its two 8x8 diagonal blocks by
// substitution (lane l < 16 solves column l % 8 of block 2w + l / 8 in fp32, L read from the tile as it goes), then
// the 8x8 block under them, -D^-1 (C A^-1), by two m16n8k8 products (rows 8-15 of A zero; C A^-1 rounded to fp16
// and transposed into the second product's B fragment by movmatrix); each lane writes back where it read C
__device__ __forceinline__ void qla_inv_diag16(__half* t, int tx) {
  int lane = tx & 31, a0 = (tx >> 5) * 16, d0 = a0 + 8;
  float x[8];
  int c = lane & 7, o = a0 + ((lane >> 3) & 1) * 8;
  if (lane < 16) {
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      float s = (r == c) ? 1.f : 0.f;
#pragma unroll
      for (int j = 0; j < r; ++j) s -= __half2float(t[(o + r) * QLA_TS + o + j]) * x[j];
      x[r] = s;
    }
  }
  __syncwarp();
  if (lane < 16) {  // the whole column: the diagonal one and the zeros above it too
#pragma unroll
    for (int r = 0; r < 8; ++r) t[(o + r) * QLA_TS + o + c] = __float2half(x[r]);
  }
  __syncwarp();
  int gid = lane >> 2, col = 2 * (lane & 3);
  unsigned a[2] = {*reinterpret_cast<const unsigned*>(&t[(d0 + gid) * QLA_TS + a0 + col]), 0u}, b;
  unsigned p = static_cast<unsigned>(__cvta_generic_to_shared(&t[(a0 + (lane & 7)) * QLA_TS + a0]));
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(b) : "r"(p));
  float y[4] = {0.f, 0.f, 0.f, 0.f};
  qla_mma8(y, a, b);  // Y = C A^-1
  __half2 yh = __floats2half2_rn(y[0], y[1]);
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(b) : "r"(*reinterpret_cast<unsigned*>(&yh)));
  a[0] = *reinterpret_cast<const unsigned*>(&t[(d0 + gid) * QLA_TS + d0 + col]);
  float z[4] = {0.f, 0.f, 0.f, 0.f};
  qla_mma8(z, a, b);  // D^-1 Y
  *reinterpret_cast<__half2*>(&t[(d0 + gid) * QLA_TS + a0 + col]) = __floats2half2_rn(-z[0], -z[1]);
  *reinterpret_cast<__half2*>(&t[(a0 + gid) * QLA_TS + d0 + col]) = __float2half2_rn(0.f);  // above: zeros
}

// acc = A[ra.., ca..] (16 x 16 KS) B[kb.., nb..] (16 KS x 8), both fp16 row-major (row strides lda, ldb), the
// k-steps outside [ks_lo, ks_hi) skipped (where one factor is zero there)
template <int KS>
__device__ __forceinline__ void qla_tile_mma(float* acc, const __half* a, int lda, int ra, int ca, const __half* b,
                                             int ldb, int kb, int nb, int lane, int ks_lo = 0, int ks_hi = KS) {
  unsigned fa[4], fb[2];
#pragma unroll
  for (int e = 0; e < 4; ++e) acc[e] = 0.f;
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    if (ks < ks_lo || ks >= ks_hi) continue;
    qla_frag_a(fa, a, lda, ra, ca + 16 * ks, lane);
    qla_frag_b(fb, b, ldb, kb + 16 * ks, nb, lane);
    qla_mma(acc, fa, fb);
  }
}

// a warp's w-th 16x8 output tile at level B: pair p (A at rows/cols a0.., D at d0 = a0 + B), tile row mt, col nt,
// the k-steps [ks_lo, ks_hi) where neither factor is zero
struct QlaLevelTile {
  int p, mt, nt, a0, d0, ks_lo, ks_hi;
};

// level 16: one tile per warp, one k-step. Level 32, one pair, two k-steps, balanced over the warps: in C A^-1 the
// columns nt >= 2 need only the second (A^-1 is lower triangular), so each warp takes one of each (nt = warp % 2 +
// 2 w, mt = warp / 2); in D^-1 Y the rows mt = 0 need only the first, so each warp takes both rows (nt = warp, mt = w)
template <int B>
__device__ __forceinline__ QlaLevelTile qla_level_tile(int warp, int w, bool second) {
  if (B == 16) return {warp / 2, 0, warp % 2, 32 * (warp / 2), 32 * (warp / 2) + 16, 0, 1};
  if (!second) return {0, warp / 2, warp % 2 + 2 * w, 0, 32, w, 2};
  return {0, w, warp, 0, 32, 0, w + 1};
}

// level B (16 or 32) on tensor cores: Y = C A^-1 into the scratch (fp16, row stride B + 8), then -D^-1 Y over C;
// the 16x8 output tiles of all pairs are dealt to the four warps (``qla_level_tile``)
template <int B, int BAR>
__device__ __forceinline__ void qla_inv_level_mma(__half* t, __half* yh, int tx) {
  constexpr int YS = B + 8, PER_WARP = (64 / (2 * B)) * (B / 16) * (B / 8) / 4;
  int warp = tx >> 5, lane = tx & 31, row = lane >> 2, col = 2 * (lane & 3);
  float acc[4];
#pragma unroll
  for (int w = 0; w < PER_WARP; ++w) {
    QlaLevelTile u = qla_level_tile<B>(warp, w, false);
    qla_tile_mma<B / 16>(acc, t, QLA_TS, u.d0 + 16 * u.mt, u.a0, t, QLA_TS, u.a0, u.a0 + 8 * u.nt, lane, u.ks_lo,
                         u.ks_hi);
    int y = (u.p * B + 16 * u.mt + row) * YS + 8 * u.nt + col;
    *reinterpret_cast<__half2*>(&yh[y]) = __floats2half2_rn(acc[0], acc[1]);
    *reinterpret_cast<__half2*>(&yh[y + 8 * YS]) = __floats2half2_rn(acc[2], acc[3]);
  }
  qla_wg_sync<BAR>();
#pragma unroll
  for (int w = 0; w < PER_WARP; ++w) {
    QlaLevelTile u = qla_level_tile<B>(warp, w, true);
    qla_tile_mma<B / 16>(acc, t, QLA_TS, u.d0 + 16 * u.mt, u.d0, yh, YS, u.p * B, 8 * u.nt, lane, u.ks_lo,
                         u.ks_hi);
    int x = (u.d0 + 16 * u.mt + row) * QLA_TS + u.a0 + 8 * u.nt + col;  // C was read before the sync
    *reinterpret_cast<__half2*>(&t[x]) = __floats2half2_rn(-acc[0], -acc[1]);
    *reinterpret_cast<__half2*>(&t[x + 8 * QLA_TS]) = __floats2half2_rn(-acc[2], -acc[3]);
    int z = x - B * QLA_TS + B;  // the mirror place above the diagonal: zeros
    *reinterpret_cast<__half2*>(&t[z]) = __float2half2_rn(0.f);
    *reinterpret_cast<__half2*>(&t[z + 8 * QLA_TS]) = __float2half2_rn(0.f);
  }
  qla_wg_sync<BAR>();
}

__device__ __forceinline__ void qla_mark(void* tr, int idx, int k) {
  if (idx >= 0 && (threadIdx.x & 127) == 0) reinterpret_cast<long long*>(tr)[idx + k] = clock64();
}

template <int BAR = 0>
__device__ __forceinline__ void qla_tile_inverse(void* tile, void* scratch, void* tr = nullptr, int idx = -1) {
  __half* t = reinterpret_cast<__half*>(tile);
  int tx;  // read afresh (volatile): addresses derived from it are not hoisted out of a caller's loop and spilled
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tx));
  tx &= 127;
  qla_mark(tr, idx, 1);
  qla_inv_diag16(t, tx);
  qla_mark(tr, idx, 2);
  qla_wg_sync<BAR>();
  qla_mark(tr, idx, 3);
  qla_inv_level_mma<16, BAR>(t, reinterpret_cast<__half*>(scratch), tx);
  qla_mark(tr, idx, 4);
  qla_inv_level_mma<32, BAR>(t, reinterpret_cast<__half*>(scratch), tx);
  qla_mark(tr, idx, 5);
}
""".replace("QLA_TS", str(TILE_STRIDE))
