// Hopper (sm_90a) warpgroup MMA building blocks for the tensor-core attention kernels:
// swizzled shared-memory tiles (128-byte swizzle; 64-byte for 32-wide low-rank query/key tiles),
// their matrix descriptors, and wgmma.mma_async at N = 32, 64 and 128 (wider accumulators in
// slices of those) in the two operand forms attention needs: both operands in shared memory
// (S = Q K^T; the backward's dQ = dS K with both read transposed) and A in registers
// (O += P V, dV += P^T dO, dK += dS^T Q, with B read transposed). A warpgroup is 4 consecutive warps; warp w of a warpgroup holds accumulator
// rows 16w .. 16w + 15 in exactly the layout of mma.sync m16n8 fragments (mma.h), so the softmax
// and mask code of the SM80 kernels applies.
// Everything here compiles only for sm_90a (ADAATTN_SM90A_DEVICE); other targets get no body.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "mma.h"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ADAATTN_SM90A_DEVICE 1
#endif

namespace adaattn {
namespace tc {
namespace sm90 {

// Swizzled layout of a [ROWS][D] operand tile (2-byte elements) as wgmma reads it: for D % 64
// == 0, D / 64 column blocks of [ROWS][64], each row one 128-byte line whose 16-byte chunks are
// XORed with row % 8 (128-byte swizzle); for D = 32 (low-rank scores), one block of 64-byte rows
// whose chunks are XORed with (row / 2) % 4 (64-byte swizzle). Tiles start 1024-byte aligned.
template <int D>
struct GmmaLayout {
  static_assert(D % 64 == 0 || D == 32, "wgmma tiles: D % 64 == 0 or D = 32");
  static constexpr int kWidth = D % 64 == 0 ? 64 : 32;  // elements per swizzled row
  static constexpr uint32_t kMode = kWidth == 64 ? 1 : 2;  // descriptor swizzle: 128 / 64 bytes
  static constexpr uint32_t kGroupBytes = 8 * kWidth * 2;  // one 8-row group of a block
};

// Element offset of (row, col) in a GmmaLayout<D> tile of ROWS rows: column blocks of the
// SM80 kernels' swizzle (mma.h's swz at widths 64 and 32 is the hardware's 128- and 64-byte one).
template <int ROWS, int D>
__device__ __forceinline__ int gmma_off(int row, int col) {
  constexpr int W = GmmaLayout<D>::kWidth;
  return (col / W) * (ROWS * W) + swz<W>(row, col % W);
}

// Element offset of reduction column `col` (a multiple of 16) of a K-major tile: where the
// descriptor of the k = 16 step starting there points.
template <int ROWS, int D>
__device__ __forceinline__ int gmma_kcol(int col) {
  constexpr int W = GmmaLayout<D>::kWidth;
  return (col / W) * (ROWS * W) + col % W;
}

// Copies a [ROWS][D] tile whose row r lives at src + r * row_stride into a gmma_off tile with
// cp.async; rows >= valid_rows are zero-filled, and at D <= 128 columns >= valid_cols too (a
// multiple of 8: a caller's head dim below the kernel's; wider tiles are read whole, the host
// zero-pads the dims that run on them: TcLayout). Few registers: each thread keeps one 16-byte
// column chunk and walks its rows (kRowStep apart, a multiple of the swizzle's 8-row period, so
// the shared-memory offset moves by a constant) with two running pointers. A tile whose rows
// are all in bounds (all but a sequence's last) takes an unrolled loop without per-row
// predicates: the predicated loop's ~11 instructions per copy were 36% of the Hopper forward's
// issued instructions (ncu), and the forward is 11-15% faster without them. A chunk past
// valid_cols reads nothing (zero-filled, at its row's column 0, in bounds) in the same loop, so
// the warp does not split over the rows; full-width tiles keep the copies without a source-size
// operand. Column tests in the wider tiles' loads slowed the Hopper forward at D = 192 and 256
// by 14-23% (H100; its producer has 24-40 registers).
// Tiles wider than the threads cover in whole 8-row groups (D = 192, 256 at 128 threads) are
// loaded one 64-column block at a time, each block being a [ROWS][64] tile of its own.
template <int ROWS, int D, int THREADS, typename T>
__device__ __forceinline__ void load_tile_gmma(T* dst, const T* src, int64_t row_stride,
                                               int valid_rows, int tid, int valid_cols = D) {
  constexpr int kChunksPerRow = D / 8;
  constexpr bool kColumnTests = D <= 128;
  if constexpr (D > 64 && (THREADS % kChunksPerRow != 0 || (THREADS / kChunksPerRow) % 8 != 0)) {
    static_assert(D % 64 == 0, "wide tiles are whole 64-column blocks");
#pragma unroll 1
    for (int block = 0; block < D / 64; ++block) {
      load_tile_gmma<ROWS, 64, THREADS>(dst + block * ROWS * 64, src + block * 64, row_stride,
                                        valid_rows, tid);
    }
  } else {
    constexpr int kRowStep = THREADS / kChunksPerRow;
    static_assert(THREADS % kChunksPerRow == 0 && kRowStep % 8 == 0 && ROWS % kRowStep == 0,
                  "a thread's rows must share their swizzle phase");
    const int r0 = tid / kChunksPerRow;
    const int col = (tid % kChunksPerRow) * 8;
    T* d = dst + gmma_off<ROWS, D>(r0, col);
    const bool col_ok = !kColumnTests || col < valid_cols;
    const T* s = src + r0 * row_stride + (col_ok ? col : 0);
    if (valid_rows >= ROWS) {
      const uint32_t d0 = smem_addr(d);
      if (!kColumnTests || valid_cols >= D) {
#pragma unroll
        for (int i = 0; i < ROWS / kRowStep; ++i) {
          cp_async16_unmasked(d0 + i * kRowStep * GmmaLayout<D>::kWidth * sizeof(T), s);
          s += kRowStep * row_stride;
        }
      } else {
#pragma unroll
        for (int i = 0; i < ROWS / kRowStep; ++i) {
          cp_async16(d0 + i * kRowStep * GmmaLayout<D>::kWidth * sizeof(T), s, col_ok);
          s += kRowStep * row_stride;
        }
      }
      return;
    }
    const int rows = col_ok ? valid_rows : 0;
#pragma unroll 2
    for (int r = r0; r < ROWS; r += kRowStep) {
      cp_async16(d, r < rows ? s : src, r < rows);
      d += kRowStep * GmmaLayout<D>::kWidth;
      s += kRowStep * row_stride;
    }
  }
}

// Matrix descriptor of a swizzled operand at p (PTX ISA "matrix descriptor"): start address,
// leading and stride byte offsets in 16-byte units, swizzle mode (1: 128 B, 2: 64 B).
__device__ __forceinline__ uint64_t gmma_desc(const void* p, uint32_t leading_bytes,
                                              uint32_t stride_bytes, uint32_t mode) {
  const uint32_t addr = smem_addr(p);
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) |
         static_cast<uint64_t>((leading_bytes >> 4) & 0x3FFF) << 16 |
         static_cast<uint64_t>((stride_bytes >> 4) & 0x3FFF) << 32 |
         static_cast<uint64_t>(mode) << 62;
}

// K-major operand of a GmmaLayout<D> tile (rows of reduction elements, as Q and K for S = Q K^T)
// at p: the leading offset is unused, the stride offset spans one 8-row group.
template <int D>
__device__ __forceinline__ uint64_t gmma_desc_k(const void* p) {
  using L = GmmaLayout<D>;
  return gmma_desc(p, 0, L::kGroupBytes, L::kMode);
}

// MN-major operand (read transposed: one row per reduction step, D output columns) of a
// GmmaLayout<D> tile of ROWS rows at p: the leading offset is the distance between column
// blocks, the stride offset spans 8 reduction rows. Reduction row r starts r * kWidth
// elements further on.
template <int ROWS, int D>
__device__ __forceinline__ uint64_t gmma_desc_mn(const void* p) {
  using L = GmmaLayout<D>;
  return gmma_desc(p, ROWS * L::kWidth * 2, L::kGroupBytes, L::kMode);
}

// Descriptor of the operand `elems` elements of T further on. The start address field holds
// address / 16 of a shared-memory address below 256 KiB, so offsets within the allocation
// never carry into the other fields.
template <typename T>
__device__ __forceinline__ uint64_t desc_at(uint64_t desc, int elems) {
  return desc + static_cast<uint64_t>(elems * static_cast<int>(sizeof(T)) / 16);
}
// The value of x, opaque to the compiler: a loop computes its descriptors from one such base
// per operand instead of keeping every step's descriptor live across iterations.
__device__ __forceinline__ uint64_t opaque(uint64_t x) {
  asm volatile("" : "+l"(x));
  return x;
}
__device__ __forceinline__ int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

// One sm_90a instruction without operands, ordered with memory accesses (no body elsewhere).
#ifdef ADAATTN_SM90A_DEVICE
#define ADAATTN_SM90_ASM(text) asm volatile(text "\n" ::: "memory")
#else
#define ADAATTN_SM90_ASM(text)
#endif

// Orders this thread's generic-proxy shared-memory writes (cp.async, st.shared) before later
// async-proxy reads (wgmma, bulk copies) once a barrier has passed.
__device__ __forceinline__ void fence_proxy_async() {
  ADAATTN_SM90_ASM("fence.proxy.async.shared::cta;");
}
// Makes register writes visible to the next wgmma (accumulators, register A operands).
__device__ __forceinline__ void wgmma_fence() { ADAATTN_SM90_ASM("wgmma.fence.sync.aligned;"); }
__device__ __forceinline__ void wgmma_commit() {
  ADAATTN_SM90_ASM("wgmma.commit_group.sync.aligned;");
}
// Pins registers at this point of the program: accumulators (float), which no access may cross
// around wgmma issue and wait (the compiler does not see those as their writers), and register
// A operands (uint32_t), which stay live (unclobbered) until the wgmma reading them is waited for.
template <typename R, int N>
__device__ __forceinline__ void fence_operand(R (&x)[N][4]) {
  static_assert(std::is_same_v<R, float> || std::is_same_v<R, uint32_t>, "32-bit registers");
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if constexpr (std::is_same_v<R, float>) {
        asm volatile("" : "+f"(x[j][e])::"memory");
      } else {
        asm volatile("" : "+r"(x[j][e])::"memory");
      }
    }
}
// Waits until at most N committed wgmma groups of this warpgroup are in flight; d is the
// accumulator whose product the caller reads next.
template <int N, int NT>
__device__ __forceinline__ void wgmma_wait(float (&d)[NT][4]) {
#ifdef ADAATTN_SM90A_DEVICE
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
  fence_operand(d);
#endif
}

// mbarrier (PTX "mbarrier"): a shared-memory barrier object that completes a phase when `count`
// arrivals have been made; waiters name the phase by its parity.
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
#ifdef ADAATTN_SM90A_DEVICE
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count)
               : "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
#ifdef ADAATTN_SM90A_DEVICE
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar))
               : "memory");
#endif
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
#ifdef ADAATTN_SM90A_DEVICE
  asm volatile(
      "{\n .reg .pred done;\n"
      "WAIT_%=:\n mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT_%=;\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
#endif
}

// The mbarriers of a warp-specialised kernel's load ring: `full[s]` completes when the 128
// producer threads have arrived (stage s landed; with TMA, the one issuing thread and the copies'
// bytes), `empty[s]` when lane 0 of every consumer warp has (stage s free). Thread 0 initialises
// them; the CTA barrier makes them visible.
template <int kStages>
__device__ __forceinline__ void init_load_ring(uint64_t (&full)[kStages],
                                               uint64_t (&empty)[kStages],
                                               int consumer_threads, int producer_arrivals = 128) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], producer_arrivals);
      mbar_init(&empty[s], consumer_threads / 32);
    }
    // One arrival: a TMA producer's (tma.h), whose copies the copy engine counts into `full`;
    // it must see the barriers initialised.
    if (producer_arrivals == 1) ADAATTN_SM90_ASM("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
}

// The producer's end of load group j of a load ring: waits for its cp.async copies, orders
// them before the consumers' wgmma reads, and arrives on the stage's `full` barrier.
__device__ __forceinline__ void publish_stage(uint64_t* full) {
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async();
  mbar_arrive(full);
}

// Registers a CTA of `threads` holds under __launch_bounds__(threads, 1): setmaxnreg only moves
// these between warpgroups (a split asking for more waits forever), and ptxas gives each thread
// the largest multiple of 8 that fits the 64K register file.
constexpr int launch_register_budget(int threads) {
  const int per_thread = 65536 / threads / 8 * 8;
  return threads * (per_thread < 255 ? per_thread : 255);
}

// The thread and register split of a warp-specialised CTA: kWarpgroups consumer warpgroups and
// one producer warpgroup, to which setmaxnreg gives kConsumerRegs and kProducerRegs a thread.
template <int kConsumerWarpgroups, int kProducerRegisters, int kConsumerRegisters>
struct WarpSpecialisedSplit {
  static constexpr int kWarpgroups = kConsumerWarpgroups;
  static constexpr int kProducerRegs = kProducerRegisters;
  static constexpr int kConsumerRegs = kConsumerRegisters;
  static constexpr int kConsumerThreads = kWarpgroups * 128;
  static constexpr int kThreads = kConsumerThreads + 128;
  static_assert(kConsumerThreads * kConsumerRegs + 128 * kProducerRegs <=
                    launch_register_budget(kThreads),
                "the register split fits what the CTA was launched with");
};

// Moves this warpgroup's register budget (setmaxnreg, sm_90a): a warp-specialised kernel's
// producer gives registers up for its consumers.
template <int N>
__device__ __forceinline__ void regs_dealloc() {
#ifdef ADAATTN_SM90A_DEVICE
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void regs_alloc() {
#ifdef ADAATTN_SM90A_DEVICE
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}

using tc::named_arrive;
using tc::named_sync;

// Turns passed round kWarpgroups consumer warpgroups in order (FA3's ping-pong): warpgroup wg
// waits on named barrier kFirstBarrier + wg for its turn and passes it to the next on that
// one's barrier; each barrier counts the warpgroup waiting and the one passing.
template <int kWarpgroups, int kFirstBarrier>
struct WarpgroupTurns {
  int wg;
  __device__ __forceinline__ void take() const { named_sync(kFirstBarrier + wg, 2 * 128); }
  __device__ __forceinline__ void pass() const {
    named_arrive(kFirstBarrier + (wg + 1) % kWarpgroups, 2 * 128);
  }
};

// Whether pred holds for any thread of warpgroup wg (all 128 threads must call it): a reduction
// on named barrier 1 + wg, which __syncthreads (barrier 0) never uses.
__device__ __forceinline__ bool warpgroup_any(bool pred, int wg) {
  int any;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, 128, p;\n"
      " selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(any)
      : "r"(static_cast<int>(pred)), "r"(wg + 1)
      : "memory");
  return any != 0;
}

// dst[0, bytes) += src[0, bytes) in float32 by the bulk copy engine, asynchronously (no register
// or load/store-unit traffic, unlike per-thread reductions); both 16-byte aligned, bytes a
// multiple of 16. Tracked in this thread's bulk groups.
__device__ __forceinline__ void bulk_reduce_add(float* dst, const float* src, int bytes) {
#ifdef ADAATTN_SM90A_DEVICE
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::
                   "l"(dst), "r"(smem_addr(src)), "r"(bytes)
               : "memory");
#endif
}
__device__ __forceinline__ void bulk_commit() { ADAATTN_SM90_ASM("cp.async.bulk.commit_group;"); }
// Waits until this thread's bulk groups have read their shared-memory sources (the buffer may be
// rewritten); bulk_wait waits until they have completed.
__device__ __forceinline__ void bulk_wait_read() {
  ADAATTN_SM90_ASM("cp.async.bulk.wait_group.read 0;");
}
__device__ __forceinline__ void bulk_wait() { ADAATTN_SM90_ASM("cp.async.bulk.wait_group 0;"); }

// Operand lists of the m64nNk16 accumulators (N / 2 fp32 registers per thread), written out
// because inline asm takes no arrays; the asm below differs per shape only in these and in the
// operand numbers after them.
#define ADAATTN_WGMMA_D16 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define ADAATTN_WGMMA_D32 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define ADAATTN_WGMMA_D40 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39}"
#define ADAATTN_WGMMA_D64 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
// Accumulator operand lists, C the constraint: "+f" for float accumulators, "+r" for s32.
#define ADAATTN_WGMMA_ACC4(C) \
  C(d[0][0]), C(d[0][1]), C(d[0][2]), C(d[0][3]), \
  C(d[1][0]), C(d[1][1]), C(d[1][2]), C(d[1][3]), \
  C(d[2][0]), C(d[2][1]), C(d[2][2]), C(d[2][3]), \
  C(d[3][0]), C(d[3][1]), C(d[3][2]), C(d[3][3])
#define ADAATTN_WGMMA_ACC8(C) \
  ADAATTN_WGMMA_ACC4(C), \
  C(d[4][0]), C(d[4][1]), C(d[4][2]), C(d[4][3]), \
  C(d[5][0]), C(d[5][1]), C(d[5][2]), C(d[5][3]), \
  C(d[6][0]), C(d[6][1]), C(d[6][2]), C(d[6][3]), \
  C(d[7][0]), C(d[7][1]), C(d[7][2]), C(d[7][3])
#define ADAATTN_WGMMA_ACC10(C) \
  ADAATTN_WGMMA_ACC8(C), \
  C(d[8][0]), C(d[8][1]), C(d[8][2]), C(d[8][3]), \
  C(d[9][0]), C(d[9][1]), C(d[9][2]), C(d[9][3])
#define ADAATTN_WGMMA_ACC16(C) \
  ADAATTN_WGMMA_ACC8(C), \
  C(d[8][0]), C(d[8][1]), C(d[8][2]), C(d[8][3]), \
  C(d[9][0]), C(d[9][1]), C(d[9][2]), C(d[9][3]), \
  C(d[10][0]), C(d[10][1]), C(d[10][2]), C(d[10][3]), \
  C(d[11][0]), C(d[11][1]), C(d[11][2]), C(d[11][3]), \
  C(d[12][0]), C(d[12][1]), C(d[12][2]), C(d[12][3]), \
  C(d[13][0]), C(d[13][1]), C(d[13][2]), C(d[13][3]), \
  C(d[14][0]), C(d[14][1]), C(d[14][2]), C(d[14][3]), \
  C(d[15][0]), C(d[15][1]), C(d[15][2]), C(d[15][3])

// wgmma with both operands in shared memory; A, B, S, TA, TB: the operand numbers of the two
// descriptors, scale_d and the two transpose immediates.
#define ADAATTN_WGMMA_SS(SHAPE, TYPE, DLIST, ACC, A, B, S, TA, TB)                              \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" S ", 0;\n"                                 \
               "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " " DLIST ", %" A    \
               ", %" B ", p, 1, 1, %" TA ", %" TB ";\n}\n"                                     \
               : ACC                                                                           \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB))
// wgmma with A in registers (4 x 32 bits); A0: the number of the first of them, B: the
// descriptor, P: the accumulate predicate (always 1).
#define ADAATTN_WGMMA_RS(SHAPE, TYPE, DLIST, ACC, A0, A1, A2, A3, B, P)                         \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" P ", 0;\n"                                 \
               "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " " DLIST ", {%" A0 \
               ", %" A1 ", %" A2 ", %" A3 "}, %" B ", p, 1, 1, 1;\n}\n"                        \
               : ACC                                                                           \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1))

// d[N/8][4] (+)= A B over k = 16, both operands in shared memory: A = 64 rows (M) x 16
// reduction elements, B = N x 16, N in {32, 64, 128}. kTransA / kTransB = 0: the operand is
// K-major (rows of reduction elements, as Q and K for S = Q K^T); 1: MN-major (rows of M / N
// elements, one row per reduction step). scale_d = 0 overwrites d.
template <typename T, int NT, int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void wgmma_ss(float (&d)[NT][4], uint64_t desc_a, uint64_t desc_b,
                                         int scale_d) {
  static_assert(NT == 4 || NT == 8 || NT == 10 || NT == 16,
                "wgmma_ss covers N = 32, 64, 80 and 128");
#ifdef ADAATTN_SM90A_DEVICE
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (NT == 10 && kBf16) {
    ADAATTN_WGMMA_SS("m64n80k16", "bf16", ADAATTN_WGMMA_D40, ADAATTN_WGMMA_ACC10("+f"),
                     "40", "41", "42", "43", "44");
  } else if constexpr (NT == 10) {
    ADAATTN_WGMMA_SS("m64n80k16", "f16", ADAATTN_WGMMA_D40, ADAATTN_WGMMA_ACC10("+f"),
                     "40", "41", "42", "43", "44");
  } else if constexpr (NT == 16 && kBf16) {
    ADAATTN_WGMMA_SS("m64n128k16", "bf16", ADAATTN_WGMMA_D64, ADAATTN_WGMMA_ACC16("+f"),
                     "64", "65", "66", "67", "68");
  } else if constexpr (NT == 16) {
    ADAATTN_WGMMA_SS("m64n128k16", "f16", ADAATTN_WGMMA_D64, ADAATTN_WGMMA_ACC16("+f"),
                     "64", "65", "66", "67", "68");
  } else if constexpr (NT == 8 && kBf16) {
    ADAATTN_WGMMA_SS("m64n64k16", "bf16", ADAATTN_WGMMA_D32, ADAATTN_WGMMA_ACC8("+f"),
                     "32", "33", "34", "35", "36");
  } else if constexpr (NT == 8) {
    ADAATTN_WGMMA_SS("m64n64k16", "f16", ADAATTN_WGMMA_D32, ADAATTN_WGMMA_ACC8("+f"),
                     "32", "33", "34", "35", "36");
  } else if constexpr (kBf16) {
    ADAATTN_WGMMA_SS("m64n32k16", "bf16", ADAATTN_WGMMA_D16, ADAATTN_WGMMA_ACC4("+f"),
                     "16", "17", "18", "19", "20");
  } else {
    ADAATTN_WGMMA_SS("m64n32k16", "f16", ADAATTN_WGMMA_D16, ADAATTN_WGMMA_ACC4("+f"),
                     "16", "17", "18", "19", "20");
  }
#endif
}

// d[N/8][4] += A B over k = 16: A in registers (an mma.sync A fragment per warp, e.g. P from
// to_a_frags) and B = 16 reduction rows of N columns, MN-major in shared memory (transposed).
template <typename T, int NT>
__device__ __forceinline__ void wgmma_rs(float (&d)[NT][4], const uint32_t (&a)[4],
                                         uint64_t desc_b) {
  static_assert(NT == 4 || NT == 8 || NT == 16, "wgmma_rs covers N = 32, 64 and 128");
#ifdef ADAATTN_SM90A_DEVICE
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (NT == 16 && kBf16) {
    ADAATTN_WGMMA_RS("m64n128k16", "bf16", ADAATTN_WGMMA_D64, ADAATTN_WGMMA_ACC16("+f"),
                     "64", "65", "66", "67", "68", "69");
  } else if constexpr (NT == 16) {
    ADAATTN_WGMMA_RS("m64n128k16", "f16", ADAATTN_WGMMA_D64, ADAATTN_WGMMA_ACC16("+f"),
                     "64", "65", "66", "67", "68", "69");
  } else if constexpr (NT == 8 && kBf16) {
    ADAATTN_WGMMA_RS("m64n64k16", "bf16", ADAATTN_WGMMA_D32, ADAATTN_WGMMA_ACC8("+f"),
                     "32", "33", "34", "35", "36", "37");
  } else if constexpr (NT == 8) {
    ADAATTN_WGMMA_RS("m64n64k16", "f16", ADAATTN_WGMMA_D32, ADAATTN_WGMMA_ACC8("+f"),
                     "32", "33", "34", "35", "36", "37");
  } else if constexpr (kBf16) {
    ADAATTN_WGMMA_RS("m64n32k16", "bf16", ADAATTN_WGMMA_D16, ADAATTN_WGMMA_ACC4("+f"),
                     "16", "17", "18", "19", "20", "21");
  } else {
    ADAATTN_WGMMA_RS("m64n32k16", "f16", ADAATTN_WGMMA_D16, ADAATTN_WGMMA_ACC4("+f"),
                     "16", "17", "18", "19", "20", "21");
  }
#endif
}

// wgmma_rs for an accumulator of any width N = 8 * NT (NT a multiple of 4; Dv = 192 and 256 take
// more than one instruction's 128 columns): instructions of N = 128, then one of 64 and one of
// 32 for what is left, each on its slice of d. desc_cols(c) is the descriptor of B's columns from
// c on (a multiple of 32; of 64 where a slice starts past a 64-column block of the tile).
template <typename T, int NT, int kFirst = 0, typename DescCols>
__device__ __forceinline__ void wgmma_rs_cols(float (&d)[NT][4], const uint32_t (&a)[4],
                                              DescCols desc_cols) {
  constexpr int kRest = NT - kFirst;
  constexpr int kSlice = kRest >= 16 ? 16 : kRest >= 8 ? 8 : 4;
  static_assert(kRest % 4 == 0 && kRest > 0, "N a multiple of 32");
  wgmma_rs<T, kSlice>(*reinterpret_cast<float(*)[kSlice][4]>(&d[kFirst]), a,
                      desc_cols(kFirst * 8));
  if constexpr (kFirst + kSlice < NT) wgmma_rs_cols<T, NT, kFirst + kSlice>(d, a, desc_cols);
}

// wgmma_ss over N = 8 * NT output columns in instructions of N = 8 * kSliceNT (NT a multiple of
// kSliceNT, kSliceNT in {4, 8, 16}), each on its slice of d; A is the same for every slice, and
// desc_b_cols(c) is the descriptor of B's columns from c on (a slice must not cross a 64-column
// block of a swizzled MN-major B unless it starts at one).
template <typename T, int NT, int kSliceNT, int kTransA, int kTransB, typename DescCols>
__device__ __forceinline__ void wgmma_ss_cols(float (&d)[NT][4], uint64_t desc_a,
                                              DescCols desc_b_cols, int scale_d) {
  static_assert(NT % kSliceNT == 0, "whole slices");
#pragma unroll
  for (int first = 0; first < NT; first += kSliceNT) {
    wgmma_ss<T, kSliceNT, kTransA, kTransB>(*reinterpret_cast<float(*)[kSliceNT][4]>(&d[first]),
                                            desc_a, desc_b_cols(first * 8), scale_d);
  }
}

// 8-bit operands (k = 32 per instruction; both operands K-major, the only layout 8-bit wgmma
// reads from shared memory). A k = 32 step of an 8-bit tile covers the bytes of a k = 16 step
// of a 16-bit tile, so the tiles are GmmaLayout<D / 2> tiles of 16-bit units and their
// descriptors those of 16-bit tiles half as wide.

// d[N/8][4] (+)= A B^T over k = 32, s8 x s8 -> s32 (exact), both operands in shared memory,
// N = 128. scale_d = 0 overwrites d.
template <int NT>
__device__ __forceinline__ void wgmma_ss_s8(int32_t (&d)[NT][4], uint64_t desc_a,
                                            uint64_t desc_b, int scale_d) {
  static_assert(NT == 16, "wgmma_ss_s8 covers N = 128");
#ifdef ADAATTN_SM90A_DEVICE
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 " ADAATTN_WGMMA_D64
               ", %64, %65, p;\n}\n"
               : ADAATTN_WGMMA_ACC16("+r")
               : "l"(desc_a), "l"(desc_b), "r"(scale_d));
#endif
}

// d[N/8][4] += A B^T over k = 32, e4m3 x e4m3 -> f32: A in registers (four 32-bit registers of
// four e4m3 each: rows g and g + 8 of the warp's 16, reduction columns 4t .. 4t + 3 and
// 16 + 4t .. 16 + 4t + 3, t = lane % 4), B = N rows of 32 reduction bytes, K-major in shared
// memory; N in {64, 128}.
template <int NT>
__device__ __forceinline__ void wgmma_rs_e4m3(float (&d)[NT][4], const uint32_t (&a)[4],
                                              uint64_t desc_b) {
  static_assert(NT == 8 || NT == 16, "wgmma_rs_e4m3 covers N = 64 and 128");
#ifdef ADAATTN_SM90A_DEVICE
  if constexpr (NT == 16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " ADAATTN_WGMMA_D64
                 ", {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
                 : ADAATTN_WGMMA_ACC16("+f")
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " ADAATTN_WGMMA_D32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
                 : ADAATTN_WGMMA_ACC8("+f")
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  }
#endif
}

// Waits as wgmma_wait for an s32 accumulator.
template <int N, int NT>
__device__ __forceinline__ void wgmma_wait(int32_t (&d)[NT][4]) {
#ifdef ADAATTN_SM90A_DEVICE
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(d[j][e])::"memory");
#endif
}

// Two floats to e4m3 (round to nearest even, saturating at +-448; NaN stays NaN), lo in the low
// byte.
__device__ __forceinline__ uint16_t pack_e4m3x2(float lo, float hi) {
#ifdef ADAATTN_SM90A_DEVICE
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return 0;
#endif
}

// An s32 product of two 8-bit tiles as the float 1.5 * 2^23 + x, exact and ordered as x for
// |x| < 2^22 (D <= 128: |x| <= 127^2 * 128 < 2^21): one integer add instead of I2F, which
// issues at a quarter of the float rate (softmax_frag.h's online_softmax takes the bias out).
__device__ __forceinline__ float s32_as_biased_float(int32_t x) {
  return __int_as_float(x + 0x4B400000);
}

}  // namespace sm90
}  // namespace tc
}  // namespace adaattn
