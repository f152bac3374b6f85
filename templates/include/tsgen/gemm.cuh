// tsgen/gemm.cuh -- a persistent, warp-specialized Hopper (sm_90a) GEMM:
// C (M x N) = A (M x K) . B (K x N), all row-major, 16-bit inputs, fp32
// accumulation, 16-bit output.
//
// Hand-written; included by generated gemm sources (it uses
// globaltimer_ns and fence_proxy_async_shared_cta of tsgen/ptx.cuh). The
// op's template supplies a `Config` struct (sizes as constexpr members, the
// element type, and `mma`, the one wgmma instruction of its tile width).
//
// How one CTA works (threads = 128 x (1 + CONSUMERS)):
//   * warpgroup 0, the producer, gives most of its registers back
//     (setmaxnreg.dec) and one of its threads walks this CTA's tiles, loading
//     A (TILE_M x TILE_K) and B (TILE_K x TILE_N) tiles with TMA
//     (cp.async.bulk.tensor) into a ring of STAGES shared-memory stages. Each
//     stage has a `full` mbarrier (the TMA bytes land; expect_tx /
//     complete_tx) and an `empty` one (every consumer warpgroup that reads the
//     stage, in every CTA the stage is multicast to, is done with it).
//   * warpgroups 1..CONSUMERS take more registers (setmaxnreg.inc), wait for
//     a full stage, issue TILE_K / 16 wgmma.mma_async per 64-row block of
//     their TILE_M / CONSUMERS rows into fp32 registers, keep one stage of
//     wgmma in flight (wait_group 1) and release the stage before it.
//   * after the last K block of a tile each consumer warpgroup converts its
//     accumulators to 16 bits, writes them to shared memory in 64 x 64
//     chunks (two buffers, 128B-swizzled) and stores each chunk with a TMA
//     store, which clips rows >= M. The producer meanwhile loads the next
//     tile's first stages.
//   * tiles are handed out persistently: cluster c takes cluster tiles c,
//     c + clusters, ... in a grouped order (RASTER_GROUP row tiles at a
//     time, rows first) so CTAs running together share A and B in L2.
//   * with CLUSTER = 2, the two CTAs of a cluster take adjacent tiles that
//     share B (along M) or A (along N); each loads half of the shared tile
//     and multicasts it to both, halving that operand's L2 -> SM traffic.
//
// Shared-memory layout (all tiles 128B-swizzled, so 1024-byte aligned):
//   A stages | B stages | epilogue chunk buffers | full[STAGES] | empty[STAGES]
// A stage: TILE_M rows x 128 bytes (K-major; TILE_K = 64 16-bit values a row).
// B stage: TILE_N / 64 boxes, each TILE_K rows (k) x 128 bytes (64 columns n).
//
// wgmma descriptors (PTX ISA, "Matrix Descriptor Format"): bits 0-13 start
// address >> 4, 16-29 leading byte offset >> 4, 32-45 stride byte offset >> 4,
// 62-63 swizzle (1 = 128B). With 128B swizzle:
//   A, K-major: 8-row groups 1024 bytes apart (stride offset); the leading
//     offset is unused; the k16 step j starts 32 * j bytes into the row.
//   B, N-major (transpose bit set): 64-column boxes TILE_K * 128 bytes apart
//     (leading offset), 8-row (k) groups 1024 bytes apart (stride offset); the
//     k16 step j starts 16 rows = 2048 * j bytes in.
#ifndef TSGEN_GEMM_CUH
#define TSGEN_GEMM_CUH

#include <cuda.h>  // CUtensorMap and its enums (types only: nothing links against libcuda)
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>
#include <utility>  // std::declval

#include "tsgen/ptx.cuh"
#include "tsgen/sync.cuh"

namespace tsgen {
namespace gemm {

// ---------------------------------------------------------------------------
// PTX wrappers (sm_90a). Shared-memory addresses are 32-bit shared-window
// addresses (cvta.to.shared), as the PTX instructions take them.
// ---------------------------------------------------------------------------

static __device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

static __device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
}

// Makes the barrier inits visible to the other CTAs of the cluster and to the
// TMA unit (async proxy) before anyone uses them.
static __device__ __forceinline__ void fence_mbarrier_init_release_cluster() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Arrive (count 1) and expect `bytes` more transaction bytes in this phase.
static __device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// Expect `bytes` more transaction bytes in this phase without arriving (relaxed, CTA scope: it orders nothing; the
// phase still waits for its arrivals): a thread that issues TMA loads before its own arrival, which comes after
// other work whose stores that arrival must release.
static __device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

static __device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Arrive on the barrier at the same offset in CTA `cta` of this cluster (itself
// included). Default .release.cta semantics, as CUTLASS's ClusterBarrier: what the
// arrival announces is that our wgmma reads of a stage are complete (wgmma.wait_group),
// which needs no memory fence; .release.cluster would add a MEMBAR.GPU per arrival.
static __device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t cta) {
  asm volatile(
      "{\n\t"
      ".reg .b32 remote;\n\t"
      "mapa.shared::cluster.u32 remote, %0, %1;\n\t"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n\t"
      "}" ::"r"(bar),
      "r"(cta)
      : "memory");
}

// True once the phase with parity `parity` has completed (try_wait suspends
// the thread for a while before it gives up, so callers simply loop).
static __device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n\t"
      ".reg .pred p;\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
      "selp.u32 %0, 1, 0, p;\n\t"
      "}"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}

// Wait for phase `parity` of a pipeline barrier. A pipeline that stops moving
// traps after TSGEN_TIMEOUT_NS instead of hanging (the launch then fails with
// "unspecified launch failure"). It traps without printing: any function call
// in the kernel, printf's included, makes ptxas serialize every wgmma (C7510).
static __device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  if (mbar_try_wait(bar, parity)) return;
  const uint64_t start = globaltimer_ns();
  while (!mbar_try_wait(bar, parity)) {
    if (TSGEN_TIMEOUT_NS != 0 && globaltimer_ns() - start > (uint64_t)TSGEN_TIMEOUT_NS) __trap();
  }
}

// cp.async.bulk (not .tensor): `bytes` (a multiple of 16) from global `src` to shared `dst` (both 16-byte aligned),
// completing on the mbarrier `bar` as transaction bytes (the caller's expect_tx counts them). Async proxy: generic
// accesses of `dst` before it need a fence.proxy.async on their way to this thread (its completion brings its own
// fence for the readers that wait on `bar`).
static __device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// TMA load of one box at (x = column, y = row) into this CTA's shared memory;
// its bytes complete_tx on `bar`. Out-of-bounds elements are filled with zeros.
static __device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int x, int y,
                                                   uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          dst),
      "l"(map), "r"(x), "r"(y), "r"(bar)
      : "memory");
}

// The same box into the same shared-memory offset of every CTA in `cta_mask`,
// completing on the barrier at the same offset in each of them.
static __device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const CUtensorMap* map, int x, int y,
                                                             uint32_t bar, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster "
      "[%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
      "l"(map), "r"(x), "r"(y), "r"(bar), "h"(cta_mask)
      : "memory");
}

// TMA store of one box from shared memory; rows and columns outside the tensor are not written.
static __device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, uint32_t src, int x, int y) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%1, %2}], [%3];" ::"l"(map),
               "r"(x), "r"(y), "r"(src)
               : "memory");
}

// The same for a 3-D tensor (x = column, y = row, z = batch): batched operands of the
// fused ops, where a box never crosses from one batch (a source rank's rows) into the next.
static __device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int x, int y, int z,
                                                   uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(
          dst),
      "l"(map), "r"(x), "r"(y), "r"(z), "r"(bar)
      : "memory");
}

static __device__ __forceinline__ void tma_load_3d_multicast(uint32_t dst, const CUtensorMap* map, int x, int y,
                                                             int z, uint32_t bar, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster "
      "[%0], [%1, {%2, %3, %4}], [%5], %6;" ::"r"(dst),
      "l"(map), "r"(x), "r"(y), "r"(z), "r"(bar), "h"(cta_mask)
      : "memory");
}

static __device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, uint32_t src, int x, int y, int z) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3}], [%4];" ::"l"(map),
               "r"(x), "r"(y), "r"(z), "r"(src)
               : "memory");
}

// The same box added into global memory instead of stored: an element-wise reduction
// (the tensor map's type: bf16 / fp16 adds) done where the memory is -- in a peer's L2
// when the map points there. Concurrent adds to one element are atomic; their order is not fixed.
static __device__ __forceinline__ void tma_reduce_add_3d(const CUtensorMap* map, uint32_t src, int x, int y, int z) {
  asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3}], [%4];" ::"l"(
                   map),
               "r"(x), "r"(y), "r"(z), "r"(src)
               : "memory");
}

// Orders this thread's earlier generic-proxy accesses (an acquire load of a signal) before
// its later async-proxy ones (TMA loads of the data the signal announced).
static __device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Spin until *signal >= expected (ld.acquire.sys), then fence toward the async proxy.
// Traps after TSGEN_TIMEOUT_NS without printing, as mbar_wait (a printf would make
// ptxas serialize the kernel's wgmma).
static __device__ __forceinline__ void wait_signal_ge_sys(const uint64_t* signal, uint64_t expected) {
  if (ld_acquire_sys_global_u64(signal) < expected) {
    const uint64_t start = globaltimer_ns();
    while (ld_acquire_sys_global_u64(signal) < expected) {
      if (TSGEN_TIMEOUT_NS != 0 && globaltimer_ns() - start > (uint64_t)TSGEN_TIMEOUT_NS) __trap();
    }
  }
  fence_proxy_async_global();
}

static __device__ __forceinline__ void bulk_commit_group() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Wait until at most N of this thread's bulk groups still read their shared-memory source.
template <int N>
static __device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// Wait until all of this thread's bulk groups are complete (their writes done).
static __device__ __forceinline__ void bulk_wait_group_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// Wait until at most `n` (a run-time value, n <= MAX) of this thread's most recent bulk
// groups are incomplete: every older group's writes are done.
template <int MAX>
static __device__ __forceinline__ void bulk_wait_group_at_most(uint32_t n) {
  if constexpr (MAX == 0) {
    bulk_wait_group_all();
  } else if (n >= (uint32_t)MAX) {
    asm volatile("cp.async.bulk.wait_group %0;" ::"n"(MAX) : "memory");
  } else {
    bulk_wait_group_at_most<MAX - 1>(n);
  }
}

static __device__ __forceinline__ void prefetch_tensormap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}

static __device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t value) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(value) : "memory");
}

// bar.sync on a named barrier (0 is __syncthreads'): `threads` threads of the CTA meet.
static __device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// wgmma.fence: orders earlier register accesses before the wgmma that follow.
static __device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

static __device__ __forceinline__ void wgmma_commit_group() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

// Wait until at most N committed wgmma groups of this warpgroup are pending.
template <int N>
static __device__ __forceinline__ void wgmma_wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Tells the compiler the accumulators changed here (they are written
// asynchronously by wgmma): reads of them are not moved above this point.
static __device__ __forceinline__ void fence_operand(float& x) {
  asm volatile("" : "+f"(x)::"memory");
}

// Per-thread register budget of the whole warpgroup (all warps must execute it).
template <int REGS>
static __device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGS));
}

template <int REGS>
static __device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGS));
}

static __device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

static __device__ __forceinline__ uint32_t cluster_id_x() {
  uint32_t r;
  asm("mov.u32 %0, %%clusterid.x;" : "=r"(r));
  return r;
}

static __device__ __forceinline__ uint32_t cluster_count_x() {
  uint32_t r;
  asm("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
  return r;
}

// Every thread of every CTA in the cluster meets here (release / acquire at cluster scope).
static __device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// wgmma descriptor of a 128B-swizzled tile starting at `addr` (see the top of this file): start address
// in 16-byte units (bits 0-13), leading byte offset (bits 16-29), stride byte offset (bits 32-45), the
// 128B swizzle (bit 62).
static __host__ __device__ __forceinline__ constexpr uint64_t sw128_descriptor(uint32_t addr, uint32_t leading,
                                                                               uint32_t stride) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(leading >> 4) << 16) | ((uint64_t)(stride >> 4) << 32) |
         (1ull << 62);
}
// Its two halves, for callers that keep the low half (address and leading offset) and add offsets to it.
static __host__ __device__ __forceinline__ constexpr uint32_t sw128_descriptor_lo(uint32_t addr, uint32_t leading) {
  return (uint32_t)sw128_descriptor(addr, leading, 0);
}
static __host__ __device__ __forceinline__ constexpr uint32_t sw128_descriptor_hi(uint32_t stride) {
  return (uint32_t)(sw128_descriptor(0, 0, stride) >> 32);
}

// Two fp32 values rounded to the output type, packed: `lo` in the low 16 bits.
template <class T>
static __device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// ---------------------------------------------------------------------------
// Sizes and shared-memory offsets derived from the Config
// ---------------------------------------------------------------------------

// Config::BATCHES (optional, default 1): A and C are BATCHES row blocks of `rows` rows
// each (3-D tensor maps: column, row, batch); a tile never spans two batches, and a
// row tile past `rows` is clipped per batch. The fused ops use one batch per source rank.
template <class C, class = void>
struct BatchesOf {
  static constexpr int value = 1;
};
template <class C>
struct BatchesOf<C, std::void_t<decltype(C::BATCHES)>> {
  static constexpr int value = C::BATCHES;
};

// What a fused op hooks into the kernel (the plain gemm passes NoHook; every call
// inlines to nothing):
//   first_batch()            the batch the schedule starts with (then first + 1, ... mod BATCHES)
//   wait(batch)              the producer thread, before it loads A rows of `batch`
//   a_map(a_map, batch, z)   the tensor map to load A of `batch` from, and its z coordinate
struct NoHook {
  __device__ __forceinline__ uint32_t first_batch() const { return 0; }
  __device__ __forceinline__ void wait(uint32_t) {}
  __device__ __forceinline__ const CUtensorMap* a_map(const CUtensorMap* a, uint32_t batch, int& z) const {
    z = (int)batch;
    return a;
  }
};

// Optional hook method (detected; hooks without it compile to the unchanged producer):
//   k_block(kb)              the producer thread, before the kb-th K block of a tile: the K
//                            block to load instead (a rotation of the K loop) after waiting
//                            for its operands to be in place (cannon / summa: per K panel)
template <class H, class = void>
struct HasKBlock : std::false_type {};
template <class H>
struct HasKBlock<H, std::void_t<decltype(std::declval<H&>().k_block(0))>> : std::true_type {};
//   c_map(c_map, batch, z)   a consumer thread, before it stores a tile of `batch`: the tensor
//                            map to store it through and its z coordinate (gemm_reduce_scatter
//                            push: the owner's memory); without it: c_map, z = batch
template <class H, class = void>
struct HasCMap : std::false_type {};
template <class H>
struct HasCMap<H, std::void_t<decltype(std::declval<H&>().c_map(nullptr, 0u, std::declval<int&>()))>>
    : std::true_type {};
//   stored(batch, leader)    every thread of a consumer warpgroup, once the TMA stores of
//                            its part of a tile of `batch` are complete (written: in a peer's
//                            memory too when c_map points there; leader: the thread that
//                            issued them; a tile wholly past M stores nothing but still
//                            counts): per-tile completion signals (gemm_reduce_scatter).
//                            The consumer checks a tile's stores only after it issued the
//                            next tile's, so it never stalls on the round trip of its own
//                            writes (remote ones take microseconds); the last tile's are
//                            checked at the end.
template <class H, class = void>
struct HasStored : std::false_type {};
template <class H>
struct HasStored<H, std::void_t<decltype(std::declval<H&>().stored(0u, true))>> : std::true_type {};
//   REDUCE_ADD               (a static constexpr bool; batched C only) true: the epilogue
//                            adds each tile into C (TMA reduce-add, tma_reduce_add_3d) instead
//                            of storing it: several GEMMs sum into one C (gemm_reduce_scatter
//                            push with reduce: add)
//   side_work(t, n)          threads 32 + t (t < n = 96) of the producer warpgroup, once, beside
//                            the pipeline (they have nothing else to do; 40 registers each):
//                            gemm_reduce_scatter add zeroes its C there while the first tiles'
//                            MMAs run. Named barrier SIDE_BARRIER is theirs.
template <class H, class = void>
struct HasSideWork : std::false_type {};
template <class H>
struct HasSideWork<H, std::void_t<decltype(std::declval<H&>().side_work(0u, 0u))>> : std::true_type {};
constexpr uint32_t SIDE_THREADS = 96, SIDE_BARRIER = 3;  // consumers use barriers 1 + warpgroup

template <class H, class = void>
struct ReducesIntoC : std::false_type {};
template <class H>
struct ReducesIntoC<H, std::void_t<decltype(H::REDUCE_ADD)>> : std::integral_constant<bool, H::REDUCE_ADD> {};

template <class C>
struct Layout {
  static_assert(sizeof(typename C::Element) == 2, "16-bit inputs");
  static_assert(C::TILE_K == 64, "one 128-byte swizzle row of 16-bit values per stage");
  static_assert(C::TILE_N % 64 == 0 && C::TILE_N <= 256, "wgmma N: 64-column boxes, at most 256");
  static_assert(C::TILE_M % (64 * C::CONSUMERS) == 0, "64-row wgmma blocks per consumer warpgroup");
  static_assert(C::N % C::TILE_N == 0 && C::K % C::TILE_K == 0, "N and K are whole tiles");
  static_assert(C::CLUSTER == 1 || C::CLUSTER == 2, "clusters of 1 or 2 CTAs");

  static constexpr int BATCHES = BatchesOf<C>::value;
  static_assert(BATCHES >= 1, "at least one batch");
  static constexpr int THREADS = 128 * (1 + C::CONSUMERS);
  static constexpr int K_BLOCKS = C::K / C::TILE_K;  // pipeline stages per tile
  static constexpr int N_TILES = C::N / C::TILE_N;
  static constexpr int WG_M = C::TILE_M / C::CONSUMERS;  // rows of C per consumer warpgroup
  static constexpr int M_BLOCKS = WG_M / 64;             // 64-row wgmma blocks per consumer warpgroup
  static constexpr int ACC = C::TILE_N / 2;              // fp32 accumulators per thread per 64-row block

  // Cluster: CM x CN tiles per cluster; the shared operand is split into one box per CTA.
  static constexpr bool SHARE_B = C::CLUSTER > 1 && C::CLUSTER_ALONG_M;   // along M: same columns, same B
  static constexpr bool SHARE_A = C::CLUSTER > 1 && !C::CLUSTER_ALONG_M;  // along N: same rows, same A
  static constexpr int CM = SHARE_B ? C::CLUSTER : 1;
  static constexpr int CN = SHARE_A ? C::CLUSTER : 1;
  static_assert(N_TILES % CN == 0, "a cluster along N takes whole pairs of column tiles");
  static constexpr uint16_t CLUSTER_MASK = (1u << C::CLUSTER) - 1;

  // Bytes. A TMA box is at most 128 bytes wide (the swizzle span): 64 columns.
  static constexpr int A_BOX_ROWS = C::TILE_M / (SHARE_A ? C::CLUSTER : 1);
  static constexpr int A_BOX = A_BOX_ROWS * 128;
  static constexpr int B_BOXES = C::TILE_N / 64;
  static constexpr int B_BOX = C::TILE_K * 128;
  static_assert(!SHARE_B || B_BOXES % C::CLUSTER == 0, "the B tile splits into one set of boxes per CTA");
  static constexpr int A_STAGE = C::TILE_M * 128;
  static constexpr int B_STAGE = B_BOXES * B_BOX;
  static constexpr int STAGE_TX = A_STAGE + B_STAGE;  // bytes that land in each CTA per stage
  static constexpr int CHUNK = 64 * 128;              // epilogue: 64 rows x 64 columns of C

  // Offsets from the 1024-byte aligned base.
  static constexpr int A_OFF = 0;
  static constexpr int B_OFF = A_OFF + C::STAGES * A_STAGE;
  static constexpr int EPI_OFF = B_OFF + C::STAGES * B_STAGE;
  static constexpr int FULL_OFF = EPI_OFF + C::CONSUMERS * 2 * CHUNK;
  static constexpr int EMPTY_OFF = FULL_OFF + 8 * C::STAGES;
  static constexpr int SMEM_BYTES = EMPTY_OFF + 8 * C::STAGES + 1024;  // + slack for aligning the base
  static_assert(SMEM_BYTES == C::SMEM_BYTES, "tsgen/ops/gemm.py smem_bytes() disagrees with this layout");
};

// ---------------------------------------------------------------------------
// Persistent tile schedule: the same on the producer and the consumers, and on
// both CTAs of a cluster (they walk cluster tiles in lockstep).
// ---------------------------------------------------------------------------

// A Config with INTERLEAVE_BATCHES = true deals its tiles round-robin over the batches
// (tile i of the walk belongs to batch first + i mod BATCHES), so the grid works on every
// batch at once; without it the batches are walked one after the other.
template <class C, class = void>
struct InterleavesBatches : std::false_type {};
template <class C>
struct InterleavesBatches<C, std::void_t<decltype(C::INTERLEAVE_BATCHES)>>
    : std::integral_constant<bool, C::INTERLEAVE_BATCHES> {};

template <class C>
struct Scheduler {
  using L = Layout<C>;
  uint32_t cluster_rows;  // cluster tiles down M (per batch)
  uint32_t per_batch;     // cluster tiles per batch
  uint32_t total;         // cluster tiles
  uint32_t index;         // this cluster's next cluster tile
  uint32_t stride;        // clusters in the grid
  uint32_t rank;          // this CTA in its cluster
  uint32_t first;         // the batch visited first

  // Cluster tiles of one batch of `rows` rows.
  __host__ __device__ static uint32_t batch_tiles(uint32_t rows) {
    const uint32_t m_tiles = (rows + C::TILE_M - 1) / C::TILE_M;
    return (m_tiles + L::CM - 1) / L::CM * (L::N_TILES / L::CN);
  }

  __host__ __device__ static uint32_t cluster_tiles(uint32_t rows) { return batch_tiles(rows) * L::BATCHES; }

  // Host and device (tests walk the schedule on the CPU): cluster `cluster` of `clusters`.
  // Batches are visited one after the other (or interleaved), starting with `first_batch`.
  __host__ __device__ Scheduler(uint32_t rows, uint32_t cluster, uint32_t clusters, uint32_t cta_rank,
                                uint32_t first_batch = 0)
      : cluster_rows(((rows + C::TILE_M - 1) / C::TILE_M + L::CM - 1) / L::CM),
        per_batch(batch_tiles(rows)),
        total(cluster_tiles(rows)),
        index(cluster),
        stride(clusters),
        rank(cta_rank),
        first(first_batch) {}

  __host__ __device__ bool next(uint32_t& m0, uint32_t& n0) {
    uint32_t batch;
    return next(m0, n0, batch);
  }

  // The next tile of this CTA (its first row within the batch, its first column of C,
  // and its batch); false when none is left. Grouped order within a batch:
  // RASTER_GROUP cluster rows at a time, down the rows first.
  __host__ __device__ bool next(uint32_t& m0, uint32_t& n0, uint32_t& batch) {
    if (index >= total) return false;
    uint32_t local = index;
    if constexpr (L::BATCHES > 1) {
      uint32_t b;
      if constexpr (InterleavesBatches<C>::value) {
        b = index % (uint32_t)L::BATCHES;
        local = index / (uint32_t)L::BATCHES;
      } else {
        b = index / per_batch;
        local = index - b * per_batch;
      }
      batch = (first + b) % (uint32_t)L::BATCHES;
    } else {
      batch = 0;
    }
    const uint32_t per_group = C::RASTER_GROUP * (L::N_TILES / L::CN);
    const uint32_t first_row = local / per_group * C::RASTER_GROUP;
    const uint32_t left = cluster_rows - first_row;
    const uint32_t group_rows = left < (uint32_t)C::RASTER_GROUP ? left : (uint32_t)C::RASTER_GROUP;
    const uint32_t within = local % per_group;
    const uint32_t cm = first_row + within % group_rows, cn = within / group_rows;
    m0 = (cm * L::CM + (L::SHARE_B ? rank : 0)) * C::TILE_M;
    n0 = (cn * L::CN + (L::SHARE_A ? rank : 0)) * C::TILE_N;
    index += stride;
    return true;
  }
};

// The schedule of this CTA.
template <class C>
static __device__ __forceinline__ Scheduler<C> my_tiles(uint32_t rows, uint32_t first_batch) {
  if constexpr (C::CLUSTER == 1) {
    return Scheduler<C>(rows, blockIdx.x, gridDim.x, 0, first_batch);
  } else {
    return Scheduler<C>(rows, cluster_id_x(), cluster_count_x(), cluster_ctarank(), first_batch);
  }
}

// ---------------------------------------------------------------------------
// Producer: one thread issues every TMA load of this CTA.
// ---------------------------------------------------------------------------

template <class C, class Hook>
static __device__ __forceinline__ void produce(const CUtensorMap* a_full, const CUtensorMap* b_map, uint32_t smem,
                                               uint32_t rows, Hook& hook) {
  using L = Layout<C>;
  Scheduler<C> tiles = my_tiles<C>(rows, hook.first_batch());
  uint32_t stage = 0, phase = 0, m0, n0, batch;
  while (tiles.next(m0, n0, batch)) {
    hook.wait(batch);  // the rows of this batch are in place (fused ops)
    int z;
    const CUtensorMap* a_map = hook.a_map(a_full, batch, z);
    // A cluster's second row tile can lie wholly below M (an odd number of row tiles):
    // it still takes part in the pipeline (its B boxes feed its peer) but is never
    // stored, so its A rows may be any rows; load rows that exist.
    const uint32_t a_row = m0 < rows ? m0 : 0;
    for (int kb = 0; kb < L::K_BLOCKS; ++kb) {
      int kblock = kb;  // the K block loaded: kb, or the hook's choice (it waits for its operands)
      if constexpr (HasKBlock<Hook>::value) kblock = hook.k_block(kb);
      const uint32_t full = smem + L::FULL_OFF + 8 * stage;
      // A fresh barrier counts as having completed the phase before its first, so
      // the first pass over the ring (parity 1) does not wait.
      mbar_wait(smem + L::EMPTY_OFF + 8 * stage, phase ^ 1);
      mbar_arrive_expect_tx(full, L::STAGE_TX);
      const int k0 = kblock * C::TILE_K;
      const uint32_t a = smem + L::A_OFF + stage * L::A_STAGE;
      const uint32_t b = smem + L::B_OFF + stage * L::B_STAGE;
      if constexpr (L::SHARE_A && L::BATCHES > 1) {
        tma_load_3d_multicast(a + tiles.rank * L::A_BOX, a_map, k0, a_row + tiles.rank * L::A_BOX_ROWS, z, full,
                              L::CLUSTER_MASK);
      } else if constexpr (L::SHARE_A) {  // this CTA's half of the rows, to both CTAs
        tma_load_2d_multicast(a + tiles.rank * L::A_BOX, a_map, k0, a_row + tiles.rank * L::A_BOX_ROWS, full,
                              L::CLUSTER_MASK);
      } else if constexpr (L::BATCHES > 1) {
        tma_load_3d(a, a_map, k0, a_row, z, full);
      } else {
        tma_load_2d(a, a_map, k0, a_row, full);
      }
#pragma unroll
      for (int j = 0; j < L::B_BOXES; ++j) {
        if constexpr (L::SHARE_B) {  // boxes j = rank, rank + CLUSTER, ..., to both CTAs
          if (j % C::CLUSTER == (int)tiles.rank)
            tma_load_2d_multicast(b + j * L::B_BOX, b_map, n0 + 64 * j, k0, full, L::CLUSTER_MASK);
        } else {
          tma_load_2d(b + j * L::B_BOX, b_map, n0 + 64 * j, k0, full);
        }
      }
      if (++stage == C::STAGES) stage = 0, phase ^= 1;
    }
  }
  if constexpr (C::CLUSTER > 1) {
    // Tail: wait until every stage has been released by every consumer warpgroup of
    // the cluster. After that no peer arrives on this CTA's barriers any more, so it
    // may leave (as CUTLASS's producer tail; no cluster barrier at the end).
    for (int s = 0; s < C::STAGES; ++s) {
      mbar_wait(smem + L::EMPTY_OFF + 8 * stage, phase ^ 1);
      if (++stage == C::STAGES) stage = 0, phase ^= 1;
    }
  }
}

// ---------------------------------------------------------------------------
// Consumers: wgmma mainloop and epilogue of consumer warpgroup `cw`.
// ---------------------------------------------------------------------------

// A stage is free again for the producer(s) of every CTA that writes into it.
template <class C>
static __device__ __forceinline__ void release_stage(uint32_t empty) {
  if constexpr (C::CLUSTER == 1) {
    mbar_arrive(empty);
  } else {
#pragma unroll
    for (uint32_t cta = 0; cta < (uint32_t)C::CLUSTER; ++cta) mbar_arrive_cluster(empty, cta);
  }
}

// Accumulators of rows [m0, m0 + WG_M) x columns [n0, n0 + TILE_N) -> C, through
// the warpgroup's two 64 x 64 chunk buffers and TMA stores (one in flight while
// the next chunk is written). `chunks` counts this warpgroup's chunks (buffer parity).
// ADD: the chunks are added into C (TMA reduce-add) instead of stored.
template <class C, bool ADD = false>
static __device__ __forceinline__ void store_tile(float (&acc)[Layout<C>::M_BLOCKS][Layout<C>::ACC],
                                                  const CUtensorMap* c_map, uint32_t buffers, uint32_t cw,
                                                  uint32_t m0, uint32_t n0, int z, uint32_t rows,
                                                  uint32_t& chunks) {
  using L = Layout<C>;
  const uint32_t t = threadIdx.x % 128, lane = t % 32;
  // wgmma accumulator layout: warp w of the warpgroup holds rows 16w .. 16w + 15 of a
  // 64-row block; per 8-column group q, lane l holds (row 16w + l/4, columns 8q + 2(l%4)
  // + {0, 1}) in acc[4q], acc[4q + 1] and the same 8 rows further down in acc[4q + 2, 3].
  const uint32_t row = 16 * (t / 32) + lane / 4;
  const uint32_t swizzle = lane / 4;  // = row % 8: 128B swizzle XORs the 16-byte unit with it
#pragma unroll
  for (int mb = 0; mb < L::M_BLOCKS; ++mb) {
    const uint32_t r0 = m0 + cw * L::WG_M + 64 * mb;
    if (r0 >= rows) break;  // the same for the whole warpgroup; TMA clips inside the last block
#pragma unroll
    for (int j = 0; j < C::TILE_N / 64; ++j) {
      const uint32_t buf = buffers + (chunks & 1) * L::CHUNK;
      if (t == 0) bulk_wait_group_read<1>();  // the store issued from `buf` two chunks ago has read it
      named_barrier_sync(1 + cw, 128);
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        const float* d = &acc[mb][4 * (8 * j + q)];
        const uint32_t col = ((q ^ swizzle) << 4) + 4 * (lane % 4);
        st_shared_u32(buf + row * 128 + col, pack2<typename C::Element>(d[0], d[1]));
        st_shared_u32(buf + (row + 8) * 128 + col, pack2<typename C::Element>(d[2], d[3]));
      }
      fence_proxy_async_shared_cta();  // our shared-memory writes, visible to the TMA engine
      named_barrier_sync(1 + cw, 128);
      if (t == 0) {
        if constexpr (ADD) {
          static_assert(L::BATCHES > 1, "reduce-add epilogues use batched (3-D) C maps");
          tma_reduce_add_3d(c_map, buf, (int)(n0 + 64 * j), (int)r0, z);
        } else if constexpr (L::BATCHES > 1) {
          tma_store_3d(c_map, buf, (int)(n0 + 64 * j), (int)r0, z);
        } else {
          tma_store_2d(c_map, buf, (int)(n0 + 64 * j), (int)r0);
        }
        bulk_commit_group();
      }
      ++chunks;
    }
  }
}

template <class C, class Hook>
static __device__ __forceinline__ void consume(const CUtensorMap* c_map, uint32_t smem, uint32_t rows, uint32_t cw,
                                               Hook& hook) {
  using L = Layout<C>;
  Scheduler<C> tiles = my_tiles<C>(rows, hook.first_batch());
  const bool leader = threadIdx.x % 128 == 0;  // arrives on barriers and issues the stores
  float acc[L::M_BLOCKS][L::ACC];
#pragma unroll
  for (int mb = 0; mb < L::M_BLOCKS; ++mb)
#pragma unroll
    for (int i = 0; i < L::ACC; ++i) acc[mb][i] = 0.f;
  // Descriptors of stage 0 (this warpgroup's rows of A; all of B); stage s adds s * bytes >> 4.
  const uint64_t a_desc = sw128_descriptor(smem + L::A_OFF + cw * L::WG_M * 128, 16, 1024);
  const uint64_t b_desc = sw128_descriptor(smem + L::B_OFF, L::B_BOX, 1024);
  const uint32_t buffers = smem + L::EPI_OFF + cw * 2 * L::CHUNK;
  uint32_t stage = 0, phase = 0, chunks = 0, m0, n0, batch;
  bool pending = false;        // a tile whose stores are issued but not yet counted (HasStored)
  uint32_t pending_batch = 0;
  while (tiles.next(m0, n0, batch)) {
    uint32_t previous = 0;
    for (int kb = 0; kb < L::K_BLOCKS; ++kb) {
      mbar_wait(smem + L::FULL_OFF + 8 * stage, phase);
      wgmma_fence();
#pragma unroll
      for (int k16 = 0; k16 < C::TILE_K / 16; ++k16) {
#pragma unroll
        for (int mb = 0; mb < L::M_BLOCKS; ++mb) {
          C::mma(acc[mb], a_desc + ((stage * L::A_STAGE + mb * 64 * 128 + k16 * 32) >> 4),
                 b_desc + ((stage * L::B_STAGE + k16 * 16 * 128) >> 4), kb > 0 || k16 > 0);
        }
      }
      wgmma_commit_group();
      if (kb > 0) {  // keep this stage's wgmma in flight; the previous stage's are done
        wgmma_wait_group<1>();
        if (leader) release_stage<C>(smem + L::EMPTY_OFF + 8 * previous);
      }
      previous = stage;
      if (++stage == C::STAGES) stage = 0, phase ^= 1;
    }
    wgmma_wait_group<0>();
    if (leader) release_stage<C>(smem + L::EMPTY_OFF + 8 * previous);
#pragma unroll
    for (int mb = 0; mb < L::M_BLOCKS; ++mb)
#pragma unroll
      for (int i = 0; i < L::ACC; ++i) fence_operand(acc[mb][i]);
    int z = (int)batch;  // the batch's place in C (3-D maps), or the hook's choice of map and place
    const CUtensorMap* to = c_map;
    if constexpr (HasCMap<Hook>::value) to = hook.c_map(c_map, batch, z);
    const uint32_t before = chunks;
    store_tile<C, ReducesIntoC<Hook>::value>(acc, to, buffers, cw, m0, n0, z, rows, chunks);
    if constexpr (HasStored<Hook>::value) {
      if (pending) {  // the previous tile's stores are done once at most this tile's are in flight
        if (leader) bulk_wait_group_at_most<L::M_BLOCKS * (C::TILE_N / 64)>(chunks - before);
        hook.stored(pending_batch, leader);
      }
      pending = true;
      pending_batch = batch;
    }
  }
  if (leader) bulk_wait_group_all();  // C is written before the CTA (and its shared memory) goes
  if constexpr (HasStored<Hook>::value) {
    if (pending) hook.stored(pending_batch, leader);
  }
}

// ---------------------------------------------------------------------------
// The kernel body: `rows` = M.
// ---------------------------------------------------------------------------

// `rows` = M (per batch); `hook`: see NoHook.
template <class C, class Hook = NoHook>
static __device__ __forceinline__ void run(const CUtensorMap* a_map, const CUtensorMap* b_map,
                                           const CUtensorMap* c_map, uint32_t rows, Hook hook = Hook()) {
  using L = Layout<C>;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t smem = (smem_u32(smem_raw) + 1023u) & ~1023u;
  if (threadIdx.x == 0) {
    for (int s = 0; s < C::STAGES; ++s) {
      mbar_init(smem + L::FULL_OFF + 8 * s, 1);  // the producer's arrive.expect_tx (+ the TMA bytes)
      // one arrival per consumer warpgroup of every CTA whose stage s this CTA's loads fill
      mbar_init(smem + L::EMPTY_OFF + 8 * s, C::CONSUMERS * C::CLUSTER);
    }
    fence_mbarrier_init_release_cluster();
    prefetch_tensormap(a_map);
    prefetch_tensormap(b_map);
    prefetch_tensormap(c_map);
  }
  // Barriers initialized in every CTA of the cluster before any TMA or remote arrive.
  if constexpr (C::CLUSTER > 1) {
    cluster_sync();
  } else {
    __syncthreads();
  }
  const uint32_t warpgroup = ptx::warpgroup_id();
  if (warpgroup == 0) {
    // 384 threads x 168 registers (the kernel's allocation) = 128 x 40 + 256 x 232.
    if constexpr (C::CONSUMERS == 2) setmaxnreg_dec<40>();
    if (threadIdx.x == 0) {
      produce<C>(a_map, b_map, smem, rows, hook);
    } else if constexpr (HasSideWork<Hook>::value) {
      static_assert(C::CONSUMERS + 1 <= (int)SIDE_BARRIER, "the side threads' named barrier is free");
      if (threadIdx.x >= 128 - SIDE_THREADS) hook.side_work(threadIdx.x - (128 - SIDE_THREADS), SIDE_THREADS);
    }
  } else {
    if constexpr (C::CONSUMERS == 2) setmaxnreg_inc<232>();
    consume<C>(c_map, smem, rows, warpgroup - 1, hook);
  }
}

// ---------------------------------------------------------------------------
// Host side: TMA descriptors and the launch.
// ---------------------------------------------------------------------------

// At most this many rows (M): TMA coordinates are 32-bit signed.
constexpr uint64_t MAX_ROWS = 1ull << 30;

template <class T>
constexpr CUtensorMapDataType tensor_map_dtype();
template <>
constexpr CUtensorMapDataType tensor_map_dtype<__nv_bfloat16>() {
  return CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
}
template <>
constexpr CUtensorMapDataType tensor_map_dtype<__half>() {
  return CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
}

// A driver function fetched through the runtime (so nothing links against libcuda), at the CUDA 12.0
// ABI; err is the runtime lookup's own error where that call fails, cudaErrorSymbolNotFound where
// the driver lacks the function, and fn nullptr with either. The encoder and bind_thread_context
// each look theirs up once per process and return that error as theirs.
struct DriverFunction {
  void* fn = nullptr;
  cudaError_t err = cudaSuccess;
};
static inline DriverFunction driver_function(const char* name) {
  DriverFunction f;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  f.err = cudaGetDriverEntryPointByVersion(name, &f.fn, 12000, cudaEnableDefault, &status);
#else
  f.err = cudaGetDriverEntryPoint(name, &f.fn, cudaEnableDefault, &status);
#endif
  if (f.err == cudaSuccess && (status != cudaDriverEntryPointSuccess || f.fn == nullptr))
    f.err = cudaErrorSymbolNotFound;
  if (f.err != cudaSuccess) f.fn = nullptr;
  return f;
}

// A driver call such as cuTensorMapEncodeTiled needs a context current in the calling host thread,
// which a thread gets from its first runtime call that uses the device: one that has made none yet
// (PyTorch's autograd worker threads, where a backward's first CUDA call is its launcher) has none,
// and the encode fails there (cudaError 1). Where no context is current, the thread's current
// device's primary context is made current (cudaSetDevice does so since CUDA 12.0); a thread that
// has one, the primary or its own, keeps it. Checked at every call (a query, no stream work: safe
// inside a stream capture, where cudaFree, say, would end the capture).
static inline cudaError_t bind_thread_context() {
  using GetCurrent = CUresult (*)(CUcontext*);
  static const DriverFunction found = driver_function("cuCtxGetCurrent");
  if (found.err != cudaSuccess) return found.err;
  CUcontext ctx = nullptr;
  if (reinterpret_cast<GetCurrent>(found.fn)(&ctx) != CUDA_SUCCESS) return cudaErrorInvalidValue;
  if (ctx != nullptr) return cudaSuccess;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaSetDevice(device);
  return err;
}

// cuTensorMapEncodeTiled (driver_function), the calling thread's context bound first
// (bind_thread_context).
static inline cudaError_t tensor_map_encoder(PFN_cuTensorMapEncodeTiled_v12000* encode) {
  const cudaError_t bound = bind_thread_context();
  if (bound != cudaSuccess) return bound;
  static const DriverFunction found = driver_function("cuTensorMapEncodeTiled");
  *encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(found.fn);
  return found.err;
}

// A row-major `rows` x `cols` matrix of 16-bit values, read or written in boxes
// of box_rows x 64 columns (128 bytes: the swizzle span), 128B-swizzled in
// shared memory; out-of-bounds loads read zeros, out-of-bounds stores are dropped.
// With batches > 1 (or three_d): `batches` such matrices one after the other (a 3-D
// tensor: column, row, batch; boxes of one batch), so that loads past a batch's last row
// read zeros and stores there are dropped.
static inline cudaError_t encode_matrix(CUtensorMap* map, CUtensorMapDataType dtype, const void* base,
                                        uint64_t rows, uint64_t cols, uint32_t box_rows, uint64_t batches = 1,
                                        bool three_d = false) {
  PFN_cuTensorMapEncodeTiled_v12000 encode;
  const cudaError_t err = tensor_map_encoder(&encode);
  if (err != cudaSuccess) return err;
  const cuuint32_t dims_n = batches > 1 || three_d ? 3 : 2;
  const cuuint64_t dims[3] = {cols, rows, batches};
  const cuuint64_t strides[2] = {cols * 2, rows * cols * 2};  // bytes, of dimensions 1 and 2
  const cuuint32_t box[3] = {64, box_rows, 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult r = encode(map, dtype, dims_n, const_cast<void*>(base), dims, strides, box, element_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

struct TensorMaps {
  CUtensorMap a, b, c;
};

// The descriptors of A (M x K), B (K x N) and C (M x N). Encoding takes a few
// microseconds, so each host thread keeps the last set and reuses it when the
// pointers and M are the same (a descriptor holds nothing else).
template <class C>
static cudaError_t tensor_maps(const void* a, const void* b, const void* c, uint32_t rows,
                               const TensorMaps** out) {
  using L = Layout<C>;
  struct Last {
    bool valid = false;
    const void *a = nullptr, *b = nullptr, *c = nullptr;
    uint32_t rows = 0;
    TensorMaps maps;
  };
  thread_local Last last;
  if (!last.valid || last.a != a || last.b != b || last.c != c || last.rows != rows) {
    last.valid = false;  // until all three are encoded
    constexpr CUtensorMapDataType dtype = tensor_map_dtype<typename C::Element>();
    cudaError_t err = encode_matrix(&last.maps.a, dtype, a, rows, C::K, L::A_BOX_ROWS);
    if (err == cudaSuccess) err = encode_matrix(&last.maps.b, dtype, b, C::K, C::N, C::TILE_K);
    if (err == cudaSuccess) err = encode_matrix(&last.maps.c, dtype, c, rows, C::N, 64);
    if (err != cudaSuccess) return err;
    last.valid = true, last.a = a, last.b = b, last.c = c, last.rows = rows;
  }
  *out = &last.maps;
  return cudaSuccess;
}

// CTAs of `kernel` that are resident at once on the current device (whole
// clusters); computed once per device, together with the shared-memory opt-in.
template <class C>
static cudaError_t resident_ctas(const void* kernel, int* ctas) {
  using L = Layout<C>;
  static PerDevice<int> known;
  int device;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  return known.get(device, ctas, [&](int* n) {
    cudaError_t got = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::SMEM_BYTES);
    if (got != cudaSuccess) return got;
    if constexpr (C::CLUSTER == 1) {
      int sms = 0, per_sm = 0;
      got = sm_count(device, &sms);
      if (got == cudaSuccess)
        got = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, L::THREADS, L::SMEM_BYTES);
      *n = sms * per_sm;
    } else {
      cudaLaunchConfig_t config = {};
      config.gridDim = dim3(C::CLUSTER, 1, 1);
      config.blockDim = dim3(L::THREADS, 1, 1);
      config.dynamicSmemBytes = L::SMEM_BYTES;
      int clusters = 0;
      got = cudaOccupancyMaxActiveClusters(&clusters, kernel, &config);
      *n = clusters * C::CLUSTER;
    }
    if (got != cudaSuccess) return got;
    return *n < C::CLUSTER ? cudaErrorLaunchOutOfResources : cudaSuccess;  // not even one cluster fits
  });
}

// Launch C = A . B for `count` rows on `stream`: a persistent grid of at most
// C::BLOCKS CTAs, no more than are resident at once, no more than there are tiles.
// The persistent grid for `rows` rows (per batch): at most C::BLOCKS CTAs, no more than are
// resident at once less `reserve` CTAs' worth of SMs (left free for kernels that must
// run beside this one: the fused ops' signal kernels), no more than there are tiles.
template <class C>
static cudaError_t grid_size(const void* kernel, uint32_t rows, int reserve, unsigned* out) {
  int resident;
  const cudaError_t err = resident_ctas<C>(kernel, &resident);
  if (err != cudaSuccess) return err;
  resident -= reserve;
  if (resident < C::CLUSTER) return cudaErrorLaunchOutOfResources;
  const uint64_t tiles = (uint64_t)Scheduler<C>::cluster_tiles(rows) * C::CLUSTER;
  uint64_t grid = (uint64_t)C::BLOCKS / C::CLUSTER * C::CLUSTER;
  grid = grid < (uint64_t)resident ? grid : (uint64_t)resident / C::CLUSTER * C::CLUSTER;
  grid = grid < tiles ? grid : tiles;
  *out = (unsigned)grid;
  return cudaSuccess;
}

template <class C, class Kernel>
static cudaError_t launch(Kernel kernel, const void* a, const void* b, void* c, uint64_t count,
                          cudaStream_t stream) {
  using L = Layout<C>;
  if (count == 0) return cudaSuccess;
  if (count > MAX_ROWS) return cudaErrorInvalidValue;
  const uint32_t rows = (uint32_t)count;
  const TensorMaps* maps;
  cudaError_t err = tensor_maps<C>(a, b, c, rows, &maps);
  if (err != cudaSuccess) return err;
  unsigned grid;
  err = grid_size<C>(reinterpret_cast<const void*>(kernel), rows, 0, &grid);
  if (err != cudaSuccess) return err;
  kernel<<<grid, L::THREADS, L::SMEM_BYTES, stream>>>(maps->a, maps->b, maps->c, count);
  return cudaGetLastError();
}

}  // namespace gemm
}  // namespace tsgen

#endif  // TSGEN_GEMM_CUH
