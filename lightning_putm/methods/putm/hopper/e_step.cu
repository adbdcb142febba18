// PUTM's E-step on Hopper (design B): every Adam step of one E-step of one task in one block of 8 warps, sm_90a,
// bf16 tensor-core products (mma.sync m16n8k16, fp32 accumulation). Built at run time by NVRTC (build.py), with the
// task shape as macros: Q (queries), N (ways), M (basis width), and EXACT_ADAM, FULL_UNROLL (SASS counting build).
//
// It computes what the `fused` engine computes in bf16 (step.py's navigator_step + adam.py's StackedAdam): the same
// values rounded to bf16 at the same places, the CT loss in fp32 (both softmax directions, the balance term when
// theta != 0), Adam on fp32 master weights with the bias corrections of a per-step schedule; only the order of the
// fp32 sums differs. Per Adam step:
//   forward   3 passes of 128 pairs (warp w: 16 rows), last to first; L1 -> L2 chained in registers (an accumulator
//             fragment re-packed as the next product's A fragment); L3 (64 -> 1) on the CUDA cores; logits to shared
//             memory; the first pass's h1, h2 stay in registers for the backward
//   CT head   column statistics (warp k: class k), then rows (thread j: query j): dL/dlogit to shared memory
//   backward  3 passes, the first with the forward's h1, h2, the others' computed again (5 forwards a step, not 6:
//             -8% instructions); g2, h1 and g1 staged in shared memory (g1 = g2 W2^T in two halves of
//             64 columns); each warp accumulates ITS OWN block of dW1^T (16 x XS: the x0 column M is 1, so the last
//             block holds db1) and dW2^T (16 x 64, + the h1 column 128 = 1: db2) over the passes, in registers; w3's
//             gradient summed over the warp's rows every pass (a scratch in the warp's g1 rows), 2 registers a thread
//   Adam      on those registers: fp32 W, m, v of this thread's fragment slots (float4, a per-block workspace in
//             global memory, L2-resident); the new bf16 weights go straight back to shared memory; w3 and b3 by
//             threads 0..64
// Per E-step: x0 = bf16((x_j - mu_k)^2) (+ the ones column) and the bf16 weights into shared memory; the workspace
// gathered from / scattered to the navigator's flat buffers through an index table made by layout.py (the one
// definition of which fragment slot holds which parameter).
#include <cuda_bf16.h>

#ifndef Q
#define Q 75
#endif
#ifndef N
#define N 5
#endif
#ifndef M
#define M 80
#endif
#ifdef FULL_UNROLL
#define PASS_UNROLL _Pragma("unroll")
#else
#define PASS_UNROLL _Pragma("unroll 1")
#endif

typedef unsigned int u32;

enum : int {
  NWARPS = 8, THREADS = NWARPS * 32,
  P = Q * N, PASS = 128, PASSES = (P + PASS - 1) / PASS, P_PAD = PASSES * PASS,
  H1 = 128, H2 = 64, W3S = 8,                      // navigator widths; w3 stored zero-padded to 8 columns
  K16 = M / 16 + (M % 16 > 8 ? 1 : 0),             // 16-wide k-steps of the L1 product ...
  K8 = (M % 16 > 0 && M % 16 <= 8) ? 1 : 0,        // ... and an 8-wide one for the rest
  K_PAD = 16 * K16 + 8 * K8,
  XS0 = ((M + 1 > K_PAD ? M + 1 : K_PAD) + 7) / 8 * 8,
  XS = (XS0 / 8) % 2 ? XS0 : XS0 + 8,              // x0 / sW1 row stride: an odd number of 16-byte units
  NB1 = XS / 8,                                    // n-blocks of dW1^T (bias column M included)
  H1S = 136, H2S = 72, W2S = 72,                   // strides of the staged h1|1, g1, g2 and of sW2 [h][j]
  SLOTS = 4 * NB1 + 36, NQ = SLOTS / 4,            // fp32 state per thread: dW1^T then dW2^T fragments
  SCR = 36,                                        // row of w3's gradient scratch (float2), 32 lanes + 4
};
static_assert(P <= 3 * PASS, "at most 384 pairs (shared memory)");
static_assert(N <= NWARPS && Q <= THREADS, "CT head: a warp per class, a thread per query");
static_assert(8 * SCR * 8 <= 16 * H1S * 2, "w3's gradient scratch fits in a warp's 16 rows of staged g1");
static_assert(M % 2 == 0 && NB1 <= 15, "an even basis width of at most 112 (the bias column pairs with a padding column)");

// shared memory, byte offsets (every array 16-byte aligned)
enum : u32 {
  OFF_X0 = 0, OFF_W1 = OFF_X0 + P_PAD * XS * 2, OFF_W2 = OFF_W1 + H1 * XS * 2, OFF_H1 = OFF_W2 + H1 * W2S * 2,
  OFF_G1 = OFF_H1 + PASS * H1S * 2, OFF_G2 = OFF_G1 + PASS * H1S * 2, OFF_F = OFF_G2 + PASS * H2S * 2,
};
struct Small {  // the fp32 part, after the bf16 arrays
  float b1[H1], b2[H2], w3[H2];                    // bf16-rounded values (the fused engine's casts)
  u32 w3p[H2 / 2];                                 // w3 as packed bf16 pairs
  float logit[P_PAD], gout[P_PAD], cost[P_PAD], fwd[P_PAD];
  float colmax[8], colexp[8], colsum[8], colslope[8];
  float red[NWARPS * H2];
  float b3, b3grad[NWARPS];
};
constexpr u32 SMEM_BYTES = OFF_F + sizeof(Small);
extern "C" __device__ const unsigned int putm_smem_bytes = SMEM_BYTES;  // read by the launcher

__device__ __forceinline__ void ldsm_x4(u32& r0, u32& r1, u32& r2, u32& r3, u32 a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a));
}
__device__ __forceinline__ void ldsm_x2(u32& r0, u32& r1, u32 a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_t(u32& r0, u32& r1, u32& r2, u32& r3, u32 a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a));
}
__device__ __forceinline__ void ldsm_x2_t(u32& r0, u32& r1, u32 a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(a));
}
__device__ __forceinline__ void stsm_x4(u32 a, u32 r0, u32 r1, u32 r2, u32 r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n"
               :: "r"(a), "r"(r0), "r"(r1), "r"(r2), "r"(r3));
}
__device__ __forceinline__ void mma16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma8(float* c, u32 a0, u32 a1, u32 b0) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a0), "r"(a1), "r"(b0));
}
__device__ __forceinline__ u32 pack(float lo, float hi) {  // round both to bf16 (one F2FP)
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<u32*>(&v);
}
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
  __nv_bfloat162 r = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
  return *reinterpret_cast<u32*>(&r);
}
__device__ __forceinline__ float lo_of(u32 u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float hi_of(u32 u) { return __uint_as_float(u & 0xFFFF0000u); }
__device__ __forceinline__ float bf16r(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
__device__ __forceinline__ u32 le0(u32 x) {  // 0xFFFF in each half that is <= 0 (bf16x2 compare, one HSET2)
  u32 m;
  asm("set.le.u32.bf16x2 %0, %1, %2;" : "=r"(m) : "r"(x), "r"(0u));
  return m;
}
// x * slope for packed bf16 x, rounded once to bf16: slope = hi + lo (both bf16; the fp32 slope to 16 bits), so
// bf16(x * hi + bf16(x * lo)) is the fp32 product rounded once but for an error of ~2^-17 of it (packed HFMA2)
struct Slope { __nv_bfloat162 hi, lo; };
__device__ __forceinline__ u32 times_slope(u32 x, Slope sl) {
  const __nv_bfloat162 v = *reinterpret_cast<__nv_bfloat162*>(&x);
  __nv_bfloat162 y = __hfma2(v, sl.hi, __hmul2(v, sl.lo));
  return *reinterpret_cast<u32*>(&y);
}
// LeakyReLU of packed bf16 x, like the fused engine's in-place leaky_relu_ on bf16: x where x > 0, else bf16(x * slope)
// = max(x, x * slope) for a slope in (0, 1)
__device__ __forceinline__ u32 leaky2(u32 x, Slope sl) {
  const u32 y = times_slope(x, sl);
  __nv_bfloat162 r = __hmax2(*reinterpret_cast<const __nv_bfloat162*>(&x), *reinterpret_cast<const __nv_bfloat162*>(&y));
  return *reinterpret_cast<u32*>(&r);
}
// LeakyReLU's backward of packed bf16 g against the output h (the sign of the input): g where h > 0, else
// bf16(g * slope) (aten's leaky_relu_backward on bf16)
__device__ __forceinline__ u32 leaky2_back(u32 g, u32 h, Slope sl) {
  const u32 y = times_slope(g, sl), m = le0(h);
  return (g & ~m) | (y & m);
}

// h1 (bf16 A fragments: 8 k-blocks x 4) and h2 (bf16: 8 n-blocks x 2) of the warp's 16 rows at row0
__device__ __forceinline__ void forward_rows(u32 sb, const Small& s, int row0, int lane, Slope sl,
                                             u32 (&aH1)[8][4], u32 (&h2)[8][2]) {
  const int t = lane & 3;
  {
    float acc[16][4];  // starts at b1 (the fp32 sum then rounds once, as acc + b1 would)
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      const float2 bias = *reinterpret_cast<const float2*>(&s.b1[n * 8 + 2 * t]);
      acc[n][0] = acc[n][2] = bias.x;
      acc[n][1] = acc[n][3] = bias.y;
    }
#pragma unroll
    for (int ks = 0; ks < K16; ++ks) {
      u32 a0, a1, a2, a3;
      ldsm_x4(a0, a1, a2, a3, sb + OFF_X0 + ((row0 + (lane & 15)) * XS + ks * 16 + (lane >> 4) * 8) * 2);
#pragma unroll
      for (int nb = 0; nb < 8; ++nb) {  // B = W1 stored [h][i]: non-transposed ldmatrix, 2 n-blocks per x4
        u32 b0, b1, b2, b3;
        ldsm_x4(b0, b1, b2, b3,
                sb + OFF_W1 + ((nb * 16 + (lane & 7) + (lane >> 4) * 8) * XS + ks * 16 + ((lane >> 3) & 1) * 8) * 2);
        mma16(acc[2 * nb], a0, a1, a2, a3, b0, b1);
        mma16(acc[2 * nb + 1], a0, a1, a2, a3, b2, b3);
      }
    }
    if (K8) {  // the last 8 input columns (the ones column and the zero columns of sW1 beyond M add nothing)
      u32 a0, a1;
      ldsm_x2(a0, a1, sb + OFF_X0 + ((row0 + (lane & 15)) * XS + K16 * 16) * 2);
#pragma unroll
      for (int nq = 0; nq < 4; ++nq) {  // 4 n-blocks per x4
        u32 b0, b1, b2, b3;
        ldsm_x4(b0, b1, b2, b3, sb + OFF_W1 + ((nq * 32 + lane) * XS + K16 * 16) * 2);
        mma8(acc[4 * nq], a0, a1, b0);
        mma8(acc[4 * nq + 1], a0, a1, b1);
        mma8(acc[4 * nq + 2], a0, a1, b2);
        mma8(acc[4 * nq + 3], a0, a1, b3);
      }
    }
    // rounded to bf16 (the product's output dtype), LeakyReLU; C fragments -> A fragments of the next product
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      aH1[n >> 1][(n & 1) * 2 + 0] = leaky2(pack(acc[n][0], acc[n][1]), sl);  // row g
      aH1[n >> 1][(n & 1) * 2 + 1] = leaky2(pack(acc[n][2], acc[n][3]), sl);  // row g + 8
    }
  }
  float acc2[8][4];  // starts at b2
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    const float2 bias = *reinterpret_cast<const float2*>(&s.b2[n * 8 + 2 * t]);
    acc2[n][0] = acc2[n][2] = bias.x;
    acc2[n][1] = acc2[n][3] = bias.y;
  }
#pragma unroll
  for (int ks = 0; ks < H1 / 16; ++ks) {
#pragma unroll
    for (int nb = 0; nb < 4; ++nb) {  // B = W2 stored [h][j] = [k][n]: transposed ldmatrix
      u32 b0, b1, b2, b3;
      ldsm_x4_t(b0, b1, b2, b3,
                sb + OFF_W2 + ((ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * W2S + nb * 16 + (lane >> 4) * 8) * 2);
      mma16(acc2[2 * nb], aH1[ks][0], aH1[ks][1], aH1[ks][2], aH1[ks][3], b0, b1);
      mma16(acc2[2 * nb + 1], aH1[ks][0], aH1[ks][1], aH1[ks][2], aH1[ks][3], b2, b3);
    }
  }
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    h2[n][0] = leaky2(pack(acc2[n][0], acc2[n][1]), sl);
    h2[n][1] = leaky2(pack(acc2[n][2], acc2[n][3]), sl);
  }
}

// The block's task, read again where the step loop needs it (a volatile read: not hoisted, so the 64-bit addresses
// made from it are not held in registers across the step loop; they spilled once the forward's h1, h2 were kept)
__device__ __forceinline__ long long block_task() {
  u32 b;
  asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(b));
  return b;
}

// Adam on one element (adam.py's StackedAdam): m <- lerp(m, g, w1); v <- b2 v + (1 - b2) g g;
// p <- p - step_size * m / (sqrt(v) / bc2 + eps)
__device__ __forceinline__ float adam1(float p, float& m, float& v, float g, float w1, int from_end, float beta2,
                                       float omb2, float eps, float step_size, float bc2, float inv_bc2) {
  m = from_end ? g - (g - m) * (1.f - w1) : m + w1 * (g - m);  // torch.lerp's two forms (weight >= 0.5: from the end)
  v = v * beta2 + (omb2 * g) * g;
#ifdef EXACT_ADAM
  return p + (-step_size) * __fdiv_rn(m, __fadd_rn(__fdiv_rn(__fsqrt_rn(v), bc2), eps));
#else
  float root, inv;  // the GPU's approximate square root and reciprocal (MUFU, within 2 ulp)
  asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(root) : "f"(v));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(inv) : "f"(fmaf(root, inv_bc2, eps)));
  return fmaf(-step_size * m, inv, p);
#endif
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
putm_e_step(const float* __restrict__ query, const float* __restrict__ protos, const float* __restrict__ cost,
            float* __restrict__ params, float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,
            const signed char* __restrict__ active, const float2* __restrict__ schedule,
            float* __restrict__ forward_out, float* __restrict__ backward_out,
            float4* __restrict__ work, const int* __restrict__ slot_index, int inner_steps,
            long long off_w2, long long off_w3, long long off_b1, long long off_b2, long long off_b3,
            float slope, float rho, float theta, float weight1, int lerp_from_end, float beta2, float omb2, float eps) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const u32 sb = (u32)__cvta_generic_to_shared(smem_raw);
  __nv_bfloat16* sx0 = reinterpret_cast<__nv_bfloat16*>(smem_raw + OFF_X0);
  __nv_bfloat16* sw1 = reinterpret_cast<__nv_bfloat16*>(smem_raw + OFF_W1);
  __nv_bfloat16* sw2 = reinterpret_cast<__nv_bfloat16*>(smem_raw + OFF_W2);
  __nv_bfloat16* sh1 = reinterpret_cast<__nv_bfloat16*>(smem_raw + OFF_H1);
  Small& s = *reinterpret_cast<Small*>(smem_raw + OFF_F);
  const long long task = blockIdx.x;
  if (!active[task]) return;
  Slope sl;  // the fp32 slope as a sum of two bf16 values, in both halves
  sl.hi = __float2bfloat162_rn(slope);
  sl.lo = __float2bfloat162_rn(slope - __bfloat162float(sl.hi.x));
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const float* x = query + task * (Q * M);
  const float* mu = protos + task * (N * M);
  const long long w1_at = task * (M * H1), w2_at = off_w2 + task * (H1 * H2), w3_at = off_w3 + task * (H2 * W3S);
  const long long b1_at = off_b1 + task * H1, b2_at = off_b2 + task * H2, b3_at = off_b3 + task;
  float4* state = work + task * (3 * NQ * THREADS) + tid;  // W, m, v of this thread's slots, q-th at q * THREADS

  // ---------------------------------------------------------------- per E-step setup
  for (int e = tid; e < P_PAD * XS; e += THREADS) {  // x0 = bf16((x_j - mu_k)^2), column M = 1, zeros elsewhere
    const int p = e / XS, i = e % XS;
    float v = 0.f;
    if (p < P && i < M) {
      const float d = x[(p / N) * M + i] - mu[(p % N) * M + i];
      v = d * d;
    } else if (p < P && i == M) {
      v = 1.f;
    }
    sx0[e] = __float2bfloat16_rn(v);
  }
  for (int e = tid; e < H1 * XS; e += THREADS) {  // sW1 [h][i] = bf16(W1[i][h]); zero beyond M
    const int h = e / XS, i = e % XS;
    sw1[e] = __float2bfloat16_rn(i < M ? params[w1_at + i * H1 + h] : 0.f);
  }
  for (int e = tid; e < H1 * W2S; e += THREADS) {  // sW2 [h][j] = bf16(W2[h][j])
    const int h = e / W2S, j = e % W2S;
    sw2[e] = __float2bfloat16_rn(j < H2 ? params[w2_at + h * H2 + j] : 0.f);
  }
  for (int e = tid; e < PASS * (H1S - H1); e += THREADS) {  // staged h1: column 128 = 1 (db2), the rest 0
    const int r = e / (H1S - H1), c = e % (H1S - H1);
    sh1[r * H1S + H1 + c] = __float2bfloat16_rn(c == 0 ? 1.f : 0.f);
  }
  if (tid < H1) s.b1[tid] = bf16r(params[b1_at + tid]);
  if (tid < H2) {
    s.b2[tid] = bf16r(params[b2_at + tid]);
    s.w3[tid] = bf16r(params[w3_at + tid * W3S]);
  }
  if (tid == 0) s.b3 = params[b3_at];
  __syncthreads();
  if (tid < H2 / 2) s.w3p[tid] = pack(s.w3[2 * tid], s.w3[2 * tid + 1]);
  for (int p = tid; p < P_PAD; p += THREADS) {
    s.cost[p] = p < P ? cost[task * P + p] : 0.f;
    s.gout[p] = 0.f;  // padded pairs keep a zero gradient
  }
  // the fp32 W, m, v of this thread's fragment slots, gathered from the flat buffers (slot_index: layout.py)
#pragma unroll 1
  for (int q = 0; q < NQ; ++q) {
    float w4[4], m4[4], v4[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int code = slot_index[(q * 4 + e) * THREADS + tid];
      w4[e] = m4[e] = v4[e] = 0.f;
      if (code >= 0) {
        const int seg = code >> 24, off = code & 0xFFFFFF;
        const long long at = (seg == 0 ? w1_at : seg == 1 ? w2_at : seg == 2 ? b1_at : b2_at) + off;
        w4[e] = params[at]; m4[e] = exp_avg[at]; v4[e] = exp_avg_sq[at];
      }
    }
    state[(0 * NQ + q) * THREADS] = make_float4(w4[0], w4[1], w4[2], w4[3]);
    state[(1 * NQ + q) * THREADS] = make_float4(m4[0], m4[1], m4[2], m4[3]);
    state[(2 * NQ + q) * THREADS] = make_float4(v4[0], v4[1], v4[2], v4[3]);
  }
  __syncthreads();

  const float tf = (1.f - theta) * rho / Q, tb = (1.f - theta) * (1.f - rho) / N;
  for (int step = 0; step < inner_steps; ++step) {
    // ---------------------------------------------------------------- forward: logits to shared memory
    // the passes last to first: pass 0's h1 and h2 stay in registers for the backward, which starts with it
    u32 aH1[8][4], h2[8][2];
    PASS_UNROLL
    for (int pass = PASSES - 1; pass >= 0; --pass) {
      const int row0 = pass * PASS + warp * 16;
      forward_rows(sb, s, row0, lane, sl, aH1, h2);
      float lg = 0.f, lg8 = 0.f;  // L3: h2 . w3 on the CUDA cores, a quad reduction
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const float2 w = *reinterpret_cast<const float2*>(&s.w3[n * 8 + 2 * t]);
        lg = fmaf(lo_of(h2[n][0]), w.x, fmaf(hi_of(h2[n][0]), w.y, lg));
        lg8 = fmaf(lo_of(h2[n][1]), w.x, fmaf(hi_of(h2[n][1]), w.y, lg8));
      }
      lg += __shfl_xor_sync(0xffffffff, lg, 1);
      lg += __shfl_xor_sync(0xffffffff, lg, 2);
      lg8 += __shfl_xor_sync(0xffffffff, lg8, 1);
      lg8 += __shfl_xor_sync(0xffffffff, lg8, 2);
      if (t == 0) {  // the product's bf16 output, then + b3 in fp32 (logits = -(out + b3))
        s.logit[row0 + g] = -(bf16r(lg) + s.b3);
        s.logit[row0 + g + 8] = -(bf16r(lg8) + s.b3);
      }
    }
    __syncthreads();
    const bool last = step == inner_steps - 1;
    // ---------------------------------------------------------------- CT head (loss.py's ct_loss_gradient)
    if (theta != 0.f) {  // the balance term needs sum_j pi_f(k|j) per class: rows first
      if (tid < Q) {
        float d[N], mx = -__int_as_float(0x7f800000), sum = 0.f;
#pragma unroll
        for (int k = 0; k < N; ++k) { d[k] = s.logit[tid * N + k]; mx = fmaxf(mx, d[k]); }
#pragma unroll
        for (int k = 0; k < N; ++k) { d[k] = __expf(d[k] - mx); sum += d[k]; }
#pragma unroll
        for (int k = 0; k < N; ++k) s.fwd[tid * N + k] = __fdividef(d[k], sum);
      }
      __syncthreads();
    }
    if (warp < N) {  // class k = warp: pi_b's max and sum over the queries, and sum_j gb_jk pi_b(j|k)
      const int k = warp;
      float mx = -__int_as_float(0x7f800000);
      for (int j = lane; j < Q; j += 32) mx = fmaxf(mx, s.logit[j * N + k]);
#pragma unroll
      for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, o));
      float sum = 0.f, fsum = 0.f;
      for (int j = lane; j < Q; j += 32) {
        sum += __expf(s.logit[j * N + k] - mx);
        if (theta != 0.f) fsum += s.fwd[j * N + k];
      }
#pragma unroll
      for (int o = 16; o; o >>= 1) {
        sum += __shfl_xor_sync(0xffffffff, sum, o);
        fsum += __shfl_xor_sync(0xffffffff, fsum, o);
      }
      float slope_k = 0.f;
      if (theta != 0.f) {  // balance_k = sum_j rho pi_f + (1 - rho) pi_b, and sum_j pi_b(j|k) = 1
        float bsum = 0.f;
        for (int j = lane; j < Q; j += 32) bsum += __fdividef(__expf(s.logit[j * N + k] - mx), sum);
#pragma unroll
        for (int o = 16; o; o >>= 1) bsum += __shfl_xor_sync(0xffffffff, bsum, o);
        slope_k = theta / N * (2.f * (rho * fsum + (1.f - rho) * bsum - 1.f / N));
      }
      float sb_k = 0.f;
      for (int j = lane; j < Q; j += 32) {
        const float b = __fdividef(__expf(s.logit[j * N + k] - mx), sum);
        sb_k += (tb * s.cost[j * N + k] + slope_k * (1.f - rho)) * b;
      }
#pragma unroll
      for (int o = 16; o; o >>= 1) sb_k += __shfl_xor_sync(0xffffffff, sb_k, o);
      if (lane == 0) { s.colmax[k] = mx; s.colexp[k] = sum; s.colsum[k] = sb_k; s.colslope[k] = slope_k; }
    }
    __syncthreads();
    float b3g = 0.f;
    if (tid < Q) {  // query j = tid: pi_f over the classes, then dL/dlogit of its row
      const int j = tid;
      float d[N], f[N], gf[N], mx = -__int_as_float(0x7f800000), sum = 0.f, sf = 0.f;
#pragma unroll
      for (int k = 0; k < N; ++k) { d[k] = s.logit[j * N + k]; mx = fmaxf(mx, d[k]); }
#pragma unroll
      for (int k = 0; k < N; ++k) { f[k] = __expf(d[k] - mx); sum += f[k]; }
#pragma unroll
      for (int k = 0; k < N; ++k) {
        f[k] = __fdividef(f[k], sum);
        gf[k] = tf * s.cost[j * N + k] + s.colslope[k] * rho;
        sf += gf[k] * f[k];
      }
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float b = __fdividef(__expf(d[k] - s.colmax[k]), s.colexp[k]);
        const float gb = tb * s.cost[j * N + k] + s.colslope[k] * (1.f - rho);
        const float grad = f[k] * (gf[k] - sf) + b * (gb - s.colsum[k]);
        s.gout[j * N + k] = -grad;
        b3g += -grad;
        if (last) { forward_out[task * P + j * N + k] = f[k]; backward_out[task * P + j * N + k] = b; }
      }
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) b3g += __shfl_xor_sync(0xffffffff, b3g, o);
    if (lane == 0) s.b3grad[warp] = b3g;
    __syncthreads();

    // ---------------------------------------------------------------- backward
    float dw1[NB1][4], dw2[9][4];
    float2 gw3 = make_float2(0.f, 0.f);  // w3's gradient, columns 8g + 2t and + 1, summed over the warp's rows
#pragma unroll
    for (int n = 0; n < NB1; ++n) dw1[n][0] = dw1[n][1] = dw1[n][2] = dw1[n][3] = 0.f;
#pragma unroll
    for (int n = 0; n < 9; ++n) dw2[n][0] = dw2[n][1] = dw2[n][2] = dw2[n][3] = 0.f;
    const int lrow = warp * 16, jb = warp & 3, hb = warp >> 2;
    // one pass of the backward over 128 pairs, given the pass's h1 and h2 (aH1, h2)
    auto backward_pass = [&](const int pass) {
      const int row0 = pass * PASS + lrow;
      {
        const float gr = bf16r(s.gout[row0 + g]), gr8 = bf16r(s.gout[row0 + g + 8]);  // the bf16 gradient
        const u32 grp = pack(gr, gr), grp8 = pack(gr8, gr8);
        u32 aG2[4][4];
        // w3's gradient over the warp's 16 rows: each thread's 2 rows x 16 columns into a scratch in the warp's own
        // g1 rows (free until g1 is staged below), then thread (g, t) sums its columns 8g + 2t, + 1 over the 8 row
        // groups. 2 registers carried over the passes instead of 16 (what keeps the 5-shot build within 64 B of
        // spills). Scratch [n][lane] float2 with a row of 36: conflict-free 64-bit stores and loads.
        float2* scratch = reinterpret_cast<float2*>(smem_raw + OFF_G1 + lrow * H1S * 2);
#pragma unroll
        for (int n = 0; n < 8; ++n)
          scratch[n * SCR + lane] = make_float2(fmaf(gr, lo_of(h2[n][0]), gr8 * lo_of(h2[n][1])),
                                                fmaf(gr, hi_of(h2[n][0]), gr8 * hi_of(h2[n][1])));
        __syncwarp();
#pragma unroll
        for (int r = 0; r < 8; ++r) {
          const float2 v = scratch[g * SCR + 4 * r + t];
          gw3.x += v.x;
          gw3.y += v.y;
        }
        __syncwarp();  // read before g1 overwrites the scratch
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          // g3 w3^T: a bf16 product of bf16 values, rounded once (one HMUL2 per pair)
          aG2[n >> 1][(n & 1) * 2 + 0] = leaky2_back(hmul2(grp, s.w3p[n * 4 + t]), h2[n][0], sl);
          aG2[n >> 1][(n & 1) * 2 + 1] = leaky2_back(hmul2(grp8, s.w3p[n * 4 + t]), h2[n][1], sl);
        }
#pragma unroll
        for (int kb = 0; kb < 4; ++kb)  // stage g2 [row][j]
          stsm_x4(sb + OFF_G2 + ((lrow + (lane & 15)) * H2S + kb * 16 + (lane >> 4) * 8) * 2,
                  aG2[kb][0], aG2[kb][1], aG2[kb][2], aG2[kb][3]);
#pragma unroll
        for (int kb = 0; kb < 8; ++kb)  // stage h1 [row][h] (column 128 stays 1)
          stsm_x4(sb + OFF_H1 + ((lrow + (lane & 15)) * H1S + kb * 16 + (lane >> 4) * 8) * 2,
                  aH1[kb][0], aH1[kb][1], aH1[kb][2], aH1[kb][3]);
        // g1 = g2 W2^T in two halves of 64 h-columns (half the accumulators live at a time, and aH1's first half
        // dies before the second starts: what keeps the 5-shot build's dW1^T accumulators out of local memory; the
        // same instructions, every element's k-order unchanged). B = W2 stored [h][j] = [n][k], non-transposed
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float acc[8][4];
#pragma unroll
          for (int n = 0; n < 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
#pragma unroll
          for (int ks = 0; ks < H2 / 16; ++ks) {
#pragma unroll
            for (int nq = 0; nq < 4; ++nq) {
              const int nb = half * 4 + nq;
              u32 b0, b1, b2, b3;
              ldsm_x4(b0, b1, b2, b3,
                      sb + OFF_W2 + ((nb * 16 + (lane & 7) + (lane >> 4) * 8) * W2S + ks * 16 + ((lane >> 3) & 1) * 8) * 2);
              mma16(acc[2 * nq], aG2[ks][0], aG2[ks][1], aG2[ks][2], aG2[ks][3], b0, b1);
              mma16(acc[2 * nq + 1], aG2[ks][0], aG2[ks][1], aG2[ks][2], aG2[ks][3], b2, b3);
            }
          }
#pragma unroll
          for (int kq = 0; kq < 4; ++kq) {  // bf16, LeakyReLU's backward against h1, stage g1 [row][h]
            const int kb = half * 4 + kq;
            u32 r[4];
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const int n = 2 * kq + hh;
              r[hh * 2 + 0] = leaky2_back(pack(acc[n][0], acc[n][1]), aH1[kb][hh * 2 + 0], sl);
              r[hh * 2 + 1] = leaky2_back(pack(acc[n][2], acc[n][3]), aH1[kb][hh * 2 + 1], sl);
            }
            stsm_x4(sb + OFF_G1 + ((lrow + (lane & 15)) * H1S + kb * 16 + (lane >> 4) * 8) * 2, r[0], r[1], r[2], r[3]);
          }
        }
      }
      __syncthreads();
      // dW1^T [h][i] (+ column M: db1) over the pass's 128 pairs: warp w owns h = 16w.., all XS columns
#pragma unroll
      for (int ks = 0; ks < PASS / 16; ++ks) {
        u32 a0, a1, a2, a3;  // A = g1^T: g1 stored [p][h] = [k][m], transposed ldmatrix
        ldsm_x4_t(a0, a1, a2, a3,
                  sb + OFF_G1 + ((ks * 16 + (lane & 7) + (lane >> 4) * 8) * H1S + lrow + ((lane >> 3) & 1) * 8) * 2);
        const u32 xrow = sb + OFF_X0 + ((pass * PASS + ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * XS) * 2;
#pragma unroll
        for (int nb = 0; nb < NB1 / 2; ++nb) {  // B = x0 stored [p][i] = [k][n], transposed ldmatrix
          u32 b0, b1, b2, b3;
          ldsm_x4_t(b0, b1, b2, b3, xrow + (nb * 16 + (lane >> 4) * 8) * 2);
          mma16(dw1[2 * nb], a0, a1, a2, a3, b0, b1);
          mma16(dw1[2 * nb + 1], a0, a1, a2, a3, b2, b3);
        }
        u32 b0, b1;  // NB1 is odd: the last n-block
        ldsm_x2_t(b0, b1, xrow + (NB1 - 1) * 8 * 2);
        mma16(dw1[NB1 - 1], a0, a1, a2, a3, b0, b1);
      }
      // dW2^T [j][h] (+ column 128: db2): warp (jb, hb) owns j = 16 jb.., h = 64 hb.. (hb = 1: also the bias block)
#pragma unroll
      for (int ks = 0; ks < PASS / 16; ++ks) {
        u32 a0, a1, a2, a3;
        ldsm_x4_t(a0, a1, a2, a3,
                  sb + OFF_G2 + ((ks * 16 + (lane & 7) + (lane >> 4) * 8) * H2S + jb * 16 + ((lane >> 3) & 1) * 8) * 2);
        const u32 hrow = sb + OFF_H1 + ((ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * H1S) * 2;
#pragma unroll
        for (int nb = 0; nb < 4; ++nb) {
          u32 b0, b1, b2, b3;
          ldsm_x4_t(b0, b1, b2, b3, hrow + (hb * 64 + nb * 16 + (lane >> 4) * 8) * 2);
          mma16(dw2[2 * nb], a0, a1, a2, a3, b0, b1);
          mma16(dw2[2 * nb + 1], a0, a1, a2, a3, b2, b3);
        }
        if (hb == 1) {
          u32 b0, b1;
          ldsm_x2_t(b0, b1, hrow + H1 * 2);
          mma16(dw2[8], a0, a1, a2, a3, b0, b1);
        }
      }
      __syncthreads();
    };
    backward_pass(0);  // pass 0's h1, h2: still in registers from the forward
    PASS_UNROLL
    for (int pass = 1; pass < PASSES; ++pass) {  // the others' computed again (registers do not hold them all)
      forward_rows(sb, s, pass * PASS + lrow, lane, sl, aH1, h2);
      backward_pass(pass);
    }

    // ---------------------------------------------------------------- Adam on the fragment registers
    state = work + block_task() * (3 * NQ * THREADS) + tid;
    const float2 sch = schedule[step];
    const float step_size = sch.x, bc2 = sch.y, inv_bc2 = 1.f / sch.y;
    float grad[SLOTS];
#pragma unroll
    for (int n = 0; n < NB1; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {  // weights: the product's bf16 output; column M (db1): fp32
        const int i = n * 8 + 2 * t + (e & 1);
        grad[n * 4 + e] = (n * 8 + 7 < M || i != M) ? bf16r(dw1[n][e]) : dw1[n][e];
      }
#pragma unroll
    for (int n = 0; n < 9; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) grad[4 * NB1 + n * 4 + e] = n < 8 ? bf16r(dw2[n][e]) : dw2[n][e];
    float neww[SLOTS];
#pragma unroll
    for (int q = 0; q < NQ; ++q) {
      float4 p = state[(0 * NQ + q) * THREADS], m = state[(1 * NQ + q) * THREADS], v = state[(2 * NQ + q) * THREADS];
      p.x = adam1(p.x, m.x, v.x, grad[4 * q + 0], weight1, lerp_from_end, beta2, omb2, eps, step_size, bc2, inv_bc2);
      p.y = adam1(p.y, m.y, v.y, grad[4 * q + 1], weight1, lerp_from_end, beta2, omb2, eps, step_size, bc2, inv_bc2);
      p.z = adam1(p.z, m.z, v.z, grad[4 * q + 2], weight1, lerp_from_end, beta2, omb2, eps, step_size, bc2, inv_bc2);
      p.w = adam1(p.w, m.w, v.w, grad[4 * q + 3], weight1, lerp_from_end, beta2, omb2, eps, step_size, bc2, inv_bc2);
      state[(0 * NQ + q) * THREADS] = p;
      state[(1 * NQ + q) * THREADS] = m;
      state[(2 * NQ + q) * THREADS] = v;
      neww[4 * q + 0] = p.x; neww[4 * q + 1] = p.y; neww[4 * q + 2] = p.z; neww[4 * q + 3] = p.w;
    }
    // the new bf16 weights into the operand buffers: dW1^T slot (h, i) -> sW1[h][i] (i < M), b1[h] (i = M)
#pragma unroll
    for (int n = 0; n < NB1; ++n) {
      const int i = n * 8 + 2 * t, h = warp * 16 + g;
      if (n * 8 + 7 < M || i + 1 < M) {
        *reinterpret_cast<u32*>(&sw1[h * XS + i]) = pack(neww[n * 4 + 0], neww[n * 4 + 1]);
        *reinterpret_cast<u32*>(&sw1[(h + 8) * XS + i]) = pack(neww[n * 4 + 2], neww[n * 4 + 3]);
      } else if (i == M) {  // M is even: a slot pair (M, M + 1), M + 1 a padding column
        s.b1[h] = bf16r(neww[n * 4 + 0]);
        s.b1[h + 8] = bf16r(neww[n * 4 + 2]);
      }
    }
    {  // dW2^T slot (j, h) -> sW2[h][j]; the bias block (hb = 1, column 128) -> b2[j]
      __nv_bfloat16* w2 = sw2;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const int h = hb * 64 + n * 8 + 2 * t, j = jb * 16 + g;
        w2[h * W2S + j] = __float2bfloat16_rn(neww[4 * NB1 + n * 4 + 0]);
        w2[(h + 1) * W2S + j] = __float2bfloat16_rn(neww[4 * NB1 + n * 4 + 1]);
        w2[h * W2S + j + 8] = __float2bfloat16_rn(neww[4 * NB1 + n * 4 + 2]);
        w2[(h + 1) * W2S + j + 8] = __float2bfloat16_rn(neww[4 * NB1 + n * 4 + 3]);
      }
      if (hb == 1 && t == 0) {
        s.b2[jb * 16 + g] = bf16r(neww[4 * NB1 + 32]);
        s.b2[jb * 16 + g + 8] = bf16r(neww[4 * NB1 + 34]);
      }
    }
    // w3's gradient: each warp's sums, then over the warps (a fixed order)
    *reinterpret_cast<float2*>(&s.red[warp * H2 + 8 * g + 2 * t]) = gw3;
    __syncthreads();
    if (tid <= H2) {  // threads 0..63: w3[tid] (a bf16 product output); thread 64: b3 (fp32 sum of dL/dlogit)
      float gsum = 0.f;
      const long long task = block_task();
      long long at = off_b3 + task;
      if (tid < H2) {
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) gsum += s.red[w * H2 + tid];
        gsum = bf16r(gsum);
        at = off_w3 + task * (H2 * W3S) + tid * W3S;
      } else {
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) gsum += s.b3grad[w];
      }
      float p = params[at], m = exp_avg[at], v = exp_avg_sq[at];
      p = adam1(p, m, v, gsum, weight1, lerp_from_end, beta2, omb2, eps, step_size, bc2, inv_bc2);
      params[at] = p; exp_avg[at] = m; exp_avg_sq[at] = v;
      if (tid < H2) s.w3[tid] = bf16r(p); else s.b3 = p;
    }
    __syncthreads();
    if (tid < H2 / 2) s.w3p[tid] = pack(s.w3[2 * tid], s.w3[2 * tid + 1]);  // read after the next step's barrier
  }

  // ---------------------------------------------------------------- the workspace back to the flat buffers
  const long long task_end = block_task();
  state = work + task_end * (3 * NQ * THREADS) + tid;
#pragma unroll 1
  for (int q = 0; q < NQ; ++q) {
    const float4 w4 = state[(0 * NQ + q) * THREADS], m4 = state[(1 * NQ + q) * THREADS],
                 v4 = state[(2 * NQ + q) * THREADS];
    const float ws[4] = {w4.x, w4.y, w4.z, w4.w}, ms[4] = {m4.x, m4.y, m4.z, m4.w}, vs[4] = {v4.x, v4.y, v4.z, v4.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int code = slot_index[(q * 4 + e) * THREADS + tid];
      if (code >= 0) {
        const int seg = code >> 24, off = code & 0xFFFFFF;
        const long long at = (seg == 0 ? task_end * (M * H1) : seg == 1 ? off_w2 + task_end * (H1 * H2)
                              : seg == 2 ? off_b1 + task_end * H1 : off_b2 + task_end * H2) + off;
        params[at] = ws[e]; exp_avg[at] = ms[e]; exp_avg_sq[at] = vs[e];
      }
    }
  }
}
