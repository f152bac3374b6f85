// tsgen/attention.cuh -- a warp-specialized Hopper (sm_90a) flash-attention forward:
//   O = softmax(scale * Q K^T (+ causal mask)) V, and LSE = log(sum(exp(scale * Q K^T)))
// per (query, head), 16-bit Q, K, V, O, fp32 accumulation and softmax, fp32 LSE.
//
// Hand-written; included by generated attention sources. It includes tsgen/gemm.cuh, whose PTX
// wrappers (mbarriers, TMA, wgmma fences and descriptors, setmaxnreg, pack2) it uses. The
// op's template supplies a `Config` struct: the sizes as constexpr members, the element
// type, and two wgmma instructions: `mma_qk` (S = Q K^T, both operands in shared memory)
// and `mma_pv` (O += P V, P in registers).
//
// Tensors (row = one position of one sequence):
//   Q, O   [batch, q_len, HEADS, HEAD_DIM]     (Config::BHSD: [batch, HEADS, q_len, HEAD_DIM])
//   K, V   [batch, kv_len, KV_HEADS, HEAD_DIM] (BHSD: [batch, KV_HEADS, kv_len, HEAD_DIM])
//   LSE    [batch, HEADS, q_len] fp32, natural log; -inf for a query that sees no key
// Query head h reads KV head h / (HEADS / KV_HEADS) (grouped-query attention).
//
// Positions (the causal mask and sequence parallelism): query row r of a sequence sits
// at global position q_offset + r for r < q_split, at q_offset2 + (r - q_split) after
// (the two-chunk "zig-zag" layout of a rank that holds chunks i and 2P-1-i); key row j at
// kv_offset + j. Causal: a query sees the keys at positions <= its own. A query that sees
// no key gets O = 0 and LSE = -inf, so partial results over KV chunks merge exactly.
//
// Work: one tile = TILE_M (128) query rows of one head of one sequence. Tiles are
// numbered head-major (all query tiles of head 0 of sequence 0, then head 1, ...: the CTAs
// that run together read the same K and V from L2), and with CAUSAL the longest tiles
// (last rows) of each head come first. CTA c takes tiles c, c + gridDim.x, ...: a plain
// grid of one CTA per tile, or a persistent grid (the launcher's `blocks`).
// The dynamic schedule (Problem::work set; cp_attention's causal kernel, issue 33): tiles are
// numbered longest first within groups of `head_group` (batch, head) pairs (the KV heads whose
// K and V fit in half of L2: `head_group`): all the group's pairs' last query tiles, then the
// tiles before, ...; CTA c takes tile c, then the next tile of an atomic counter each time it
// is done (the CTA that frees first takes the next tile: no tail of long tiles on a few SMs).
// The producer thread takes the tile and publishes it to the consumers in shared memory
// (`TILE`, read after q_full); a tile >= tiles ends the CTA. The counter needs no reset by the
// host: the CTA that draws the call's last value (tiles - 1: every CTA draws until it gets a
// tile past the end, once) sets it back to 0, after every other draw of the call (one
// location's order), so it holds 0 at the next kernel's start (stream order; CUDA graph
// replay too). Each caller owns its counter (cp_attention: the rank's own `sig` slot, also
// when ranks share a GPU; single-GPU attention with params.schedule: persistent: a __device__
// counter of its module, `persistent` below). Causal tiles go longest first in head groups; not
// causal (equal tiles) head-major, the counter only hands them out.
// Epilogue overlap (Config::EPILOGUE_OVERLAP, params.epilogue_overlap; default off): O is staged
// in a buffer of its own after the V stages, not in the Q tile, and each consumer warpgroup
// releases Q (q_empty) as soon as its last S = Q K^T has completed, not after its epilogue; its
// epilogue waits, before writing the staging buffer, until the previous tile's O store has read
// it. So in a persistent grid the producer loads the next tile's Q and first K blocks during
// this tile's last softmax, last P V and epilogue, and the O store drains while the next tile's
// first S runs.
// Test-only trace (the code exists only where TSGEN_ATTENTION_TRACE is defined before this
// header: cp_attention's params.trace): with Problem::trace set, the producer thread appends one
// record per tile, trace[0] counting them (atomic; records past trace_records are counted, not
// written), record i at trace + 2 + TRACE_WORDS i: {smid << 48 | blockIdx.x << 32 | tile, start,
// end, waited, first_ready, last_ready, cycles}, globaltimer ns: start when the producer begins the tile
// (the consumers released the previous tile's Q), end when the consumers release this tile's Q (its
// epilogue is done), waited the time summed over the tile's wait_chunks calls (one per KV block,
// most of which return at once), first_ready / last_ready when the wait for the tile's first / last
// KV chunk returned (0: no chunk wait ran; a chunk not waited for, kv_unwaited, counts as waited),
// cycles the SM clock's count over the tile (%clock, so cycles / (end - start) is the SM's clock in GHz)
// (tsgen/ops/cp_attention.py trace_table reads them).
//
// One CTA (384 threads; 512 with three consumer warpgroups, TILE_M 192: each part below the same
// per consumer warpgroup, the ping-pong turns going round robin, the producer keeping 32 registers
// and the consumers 160):
//   * warpgroup 0, the producer, keeps 40 registers (setmaxnreg.dec); one thread loads
//     each tile's Q once (TMA, q_full / q_empty barriers) and its K and V blocks of TILE_N
//     keys into rings of STAGES stages (k_full / k_empty, v_full / v_empty), in the order
//     the consumers use them: K_0, then K_i and V_(i-1), then the last V. Blocks are
//     walked from the last needed one down, so that masked (diagonal and tail) blocks come
//     first. With KV_WAITS, before the first block of KV chunk c (kv_chunk rows each) it
//     waits until kv_signal[c] >= kv_expected (acquire; a sequence-parallel producer of K
//     and V raises it once the chunk is in place), or >= *kv_epoch where that is given (a
//     device call counter: cp_attention's epoch, which the host does not know).
//   * warpgroups 1 and 2, the consumers, take 232 registers and 64 query rows each. Per
//     block i: S_i = Q K_i^T (wgmma, both operands from shared memory, fp32), then the
//     online softmax in registers (exp2 with scale * log2(e) folded in, running max m and
//     sum l per row, O rescaled when the max grows), P_i rounded to 16 bits in registers
//     as the A operand of O += P_i V_i (wgmma, V read "N-major" through the transpose bit).
//     Intra-warpgroup overlap (as FlashAttention-3): S_(i+1) and P_i V_i are issued
//     together, and the softmax of S_(i+1) runs while P_i V_i is still in the tensor core.
//     With PINGPONG the two consumer warpgroups take turns issuing their GEMMs (two named
//     barriers), so one's softmax overlaps the other's GEMMs.
//   * epilogue: O / l rounded to 16 bits into the warpgroup's own rows of the Q tile's
//     shared memory (128B-swizzled), stored with TMA (rows >= q_len clipped); LSE from
//     registers. Then q_empty: the producer may load the next tile's Q. (EPILOGUE_OVERLAP:
//     the rows of the O staging buffer instead, and q_empty came after the last S.)
//
// Shared memory (1024-byte aligned, every tile 128B-swizzled in 64-column boxes):
//   Q (HEAD_DIM / 64 boxes of TILE_M rows) | K stages | V stages | [O staging] | barriers
#ifndef TSGEN_ATTENTION_CUH
#define TSGEN_ATTENTION_CUH

#include <math.h>
#include <string.h>

#include <mutex>
#include <type_traits>
#include <unordered_map>

#include "tsgen/ptx.cuh"
#include "tsgen/sync.cuh"
#include "tsgen/gemm.cuh"

namespace tsgen {
namespace attention {

using gemm::bulk_commit_group;
using gemm::bulk_wait_group_all;
using gemm::bulk_wait_group_read;
using gemm::fence_mbarrier_init_release_cluster;
using gemm::fence_operand;
using gemm::fence_proxy_async_global;
using gemm::mbar_arrive;
using gemm::mbar_arrive_expect_tx;
using gemm::mbar_init;
using gemm::mbar_wait;
using gemm::named_barrier_sync;
using gemm::pack2;
using gemm::prefetch_tensormap;
using gemm::setmaxnreg_dec;
using gemm::setmaxnreg_inc;
using gemm::smem_u32;
using gemm::st_shared_u32;
using gemm::sw128_descriptor;
using gemm::sw128_descriptor_hi;
using gemm::sw128_descriptor_lo;
using gemm::wgmma_commit_group;
using gemm::wgmma_fence;
using gemm::wgmma_wait_group;

// ---------------------------------------------------------------------------
// PTX wrappers beyond the GEMM's
// ---------------------------------------------------------------------------

// TMA load of one 4-D box (c0 = column, then the tensor's other dimensions in order).
static __device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                                   int c3, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
      "%5}], [%6];" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

// TMA store of one 4-D box from shared memory; elements outside the tensor are not written.
static __device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2,
                                                    int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];" ::"l"(map),
               "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
               : "memory");
}

// `threads` threads meet at named barrier `id`: this one arrives without waiting.
static __device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Approximate exp2, log2 and 1 / x (MUFU): no call to a slow path (a call in the kernel
// makes ptxas give up the consumers' 232-register budget and serialize the wgmma).
static __device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 2^x on the FMA and integer pipes instead of MUFU, for kernels whose exp2 come in runs that wait on the MUFU pipe's
// issue interval (a quarter-rate pipe: one warp's MUFU holds it 8 cycles) while the FMA pipe idles; mixing a share of
// these among the MUFU ones shortens the run. x = j + f, j = round(x) (by the 1.5 * 2^23 addition, exact for |x| <
// 2^22), f in [-0.5, 0.5]; 2^f = 1 + f (c1 + f (c2 + f c3)), fitted to the relative error over that range (at most
// 1.02e-4 in float32, 38x under a bf16 rounding of P); 2^j as the float whose exponent field is j + 127, built from
// the addition's low bits. x <= -127 (-inf too) gives exactly 0, as ex2.approx.ftz does (its results under 2^-126
// flush to 0; here 2^-126.5 .. 2^-126 may come out as a subnormal instead). For x <= 127; NaN gives 0. Nine
// instructions (FMNMX, three FADD, two FFMA, FMUL, a shift-add, FFMA). Host-compiled by the tests.
__host__ __device__ __forceinline__ float exp2_fma(float x) {
  constexpr float ROUND = 12582912.f;  // 1.5 * 2^23: x + ROUND holds round(x) in its low mantissa bits
  x = fmaxf(x, -127.f);
  const float t = x + ROUND;
  const float f = x - (t - ROUND);
  const float q = fmaf(fmaf(0.05500862f, f, 0.24221021f), f, 0.6932829f);
  uint32_t bits;
  memcpy(&bits, &t, 4);
  bits = (bits << 23) + (127u << 23);  // (0x4B400000 + j) << 23 = j << 23 (mod 2^32): 2^j, 0 at j = -127
  float scale;
  memcpy(&scale, &bits, 4);
  return fmaf(f * q, scale, scale);
}

static __device__ __forceinline__ float log2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Wait for phase `parity` of a pipeline barrier, with no timeout: the consumers' waits. A
// trap anywhere in the consumers' code makes ptxas give up their 232-register budget (and
// spill); the producer's waits keep the timeout (mbar_wait), and the producer waits at the
// end until the consumers have released everything, so a stuck pipeline still traps.
static __device__ __forceinline__ void mbar_wait_no_timeout(uint32_t bar, uint32_t parity) {
  while (!gemm::mbar_try_wait(bar, parity)) {
  }
}

static __device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

static __device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---------------------------------------------------------------------------
// Sizes and shared-memory offsets derived from the Config
// ---------------------------------------------------------------------------

// Config::EPILOGUE_OVERLAP where the Config has it (only specs with params.epilogue_overlap
// emit it), else false.
template <class C, class = void>
struct epilogue_overlap_of : std::false_type {};
template <class C>
struct epilogue_overlap_of<C, std::void_t<decltype(C::EPILOGUE_OVERLAP)>>
    : std::integral_constant<bool, C::EPILOGUE_OVERLAP> {};

// Config::ROW_MAX_CHAINS where the Config has it (only specs with params.row_max_chains emit it), else 1:
// the independent running maxima each thread keeps per row while it reduces a block's scores.
template <class C, class = void>
struct row_max_chains_of : std::integral_constant<int, 1> {};
template <class C>
struct row_max_chains_of<C, std::void_t<decltype(C::ROW_MAX_CHAINS)>>
    : std::integral_constant<int, C::ROW_MAX_CHAINS> {};

// Config::RESCALE_AT where the Config has it (only specs with params.rescale_at emit it), else the block's
// K16 column groups (the rescale after every exp2): how many of a block's 16-key column groups of exp2 a
// consumer computes before it waits for the previous P V and rescales O, so that the rescale's multiplies
// interleave with the remaining exp2s instead of following them.
template <class C, class = void>
struct rescale_at_of : std::integral_constant<int, C::TILE_N / 16> {};
template <class C>
struct rescale_at_of<C, std::void_t<decltype(C::RESCALE_AT)>> : std::integral_constant<int, C::RESCALE_AT> {};

// Config::EXP2_FMA_EVERY where the Config has it (only specs with params.exp2_fma_every emit it), else 0: every
// EXP2_FMA_EVERY-th group of 4 exponentials of a thread (8 keys of the forward's S, of the backward's P^T 8 queries)
// on the FMA pipe (exp2_fma), the rest on MUFU (exp2_approx): the forward's exps, the backward's probability_column.
template <class C, class = void>
struct exp2_fma_every_of : std::integral_constant<int, 0> {};
template <class C>
struct exp2_fma_every_of<C, std::void_t<decltype(C::EXP2_FMA_EVERY)>>
    : std::integral_constant<int, C::EXP2_FMA_EVERY> {};

// exp2 of x for a thread's group `group` of 4 exponentials: on the FMA pipe for every EXP2_FMA_EVERY-th group (the
// group a compile-time constant in an unrolled loop, so the choice costs nothing), else on MUFU.
template <class C>
static __device__ __forceinline__ float exp2_of_group(float x, int group) {
  constexpr int EVERY = exp2_fma_every_of<C>::value, EVERY_OR_1 = EVERY > 0 ? EVERY : 1;
  return EVERY > 0 && group % EVERY_OR_1 == EVERY - 1 ? exp2_fma(x) : exp2_approx(x);
}

// Config::RESCALE_SKIP where the Config has it (only specs with params.rescale_skip emit it), else false: O's rescale
// of a block skipped by the whole warp where no row maximum of its 16 rows grew (every scale exactly 1, so the
// multiplies would change no bit), decided by one vote.
template <class C, class = void>
struct rescale_skip_of : std::false_type {};
template <class C>
struct rescale_skip_of<C, std::void_t<decltype(C::RESCALE_SKIP)>> : std::integral_constant<bool, C::RESCALE_SKIP> {};

// Config::LOCAL_KV where the Config has it (only cp_attention specs with params.local_kv emit it), else
// false: the kernel takes two more tensor maps (k_local, v_local: the rank's own K and V), and up to two
// KV chunks (Problem::kv_local_chunk, each kv_chunk rows, starting at a block boundary and ending at one or
// at kv_len) come through them (row + kv_local_shift), instead of from the gathered k / v; nothing signals
// those chunks and the producer does not wait for them. A call with no chunk in place (kv_local_chunk -1)
// gathers every chunk, and the local maps are never read (tsgen/cp.cuh own_in_place decides per call).
template <class C, class = void>
struct local_kv_of : std::false_type {};
template <class C>
struct local_kv_of<C, std::void_t<decltype(C::LOCAL_KV)>> : std::integral_constant<bool, C::LOCAL_KV> {};

template <class C>
struct Layout {
  static_assert(sizeof(typename C::Element) == 2, "16-bit inputs");
  static_assert(C::HEAD_DIM % 64 == 0 && C::HEAD_DIM <= 256, "head dim: 64-column boxes, wgmma N <= 256");
  static_assert(C::TILE_M == 128 || C::TILE_M == 192, "2 or 3 consumer warpgroups x 64 query rows");
  static_assert(C::TILE_N % 16 == 0 && C::TILE_N <= 256, "keys per block: k16 steps of P V, wgmma N <= 256");
  static_assert(C::HEADS % C::KV_HEADS == 0, "KV heads divide the query heads");
  static constexpr int CONSUMERS = C::TILE_M / 64;  // consumer warpgroups, 64 query rows each
  static constexpr int THREADS = 128 * (1 + CONSUMERS);
  // setmaxnreg: 128 x PRODUCER_REGS + 128 CONSUMERS x CONSUMER_REGS = 65536 (384 x 168 or 512 x 128)
  static constexpr int PRODUCER_REGS = CONSUMERS == 2 ? 40 : 32;
  static constexpr int CONSUMER_REGS = CONSUMERS == 2 ? 232 : 160;
  static constexpr int BOXES = C::HEAD_DIM / 64;  // 64-column (128-byte) boxes per row
  static constexpr int Q_BOX = C::TILE_M * 128;
  static constexpr int KV_BOX = C::TILE_N * 128;
  static constexpr int Q_BYTES = BOXES * Q_BOX;
  static constexpr int KV_STAGE = BOXES * KV_BOX;
  static constexpr int S_ACC = C::TILE_N / 2;    // fp32 scores per thread (64 rows x TILE_N / 128)
  static constexpr int O_ACC = C::HEAD_DIM / 2;  // fp32 outputs per thread
  static constexpr int K16 = C::TILE_N / 16;     // k16 steps of P V
  static constexpr int GROUP = C::HEADS / C::KV_HEADS;

  static constexpr bool OVERLAP = epilogue_overlap_of<C>::value;  // O staged apart from Q

  static constexpr int Q_OFF = 0;
  static constexpr int K_OFF = Q_OFF + Q_BYTES;
  static constexpr int V_OFF = K_OFF + C::STAGES * KV_STAGE;
  static constexpr int STAGES_END = V_OFF + C::STAGES * KV_STAGE;
  static constexpr int O_OFF = OVERLAP ? STAGES_END : Q_OFF;  // O staging: boxes as Q's (else Q's own memory)
  static constexpr int BAR_OFF = STAGES_END + (OVERLAP ? Q_BYTES : 0);
  static constexpr int Q_FULL = BAR_OFF, Q_EMPTY = BAR_OFF + 8;
  static constexpr int K_FULL = BAR_OFF + 16, K_EMPTY = K_FULL + 8 * C::STAGES;
  static constexpr int V_FULL = K_EMPTY + 8 * C::STAGES, V_EMPTY = V_FULL + 8 * C::STAGES;
  static constexpr int TILE = V_EMPTY + 8 * C::STAGES;  // u32: the dynamic schedule's current tile (then the trace's clock)
  static constexpr int SMEM_BYTES = TILE + 8 + 1024;    // + slack for aligning the base
  static_assert(SMEM_BYTES == C::SMEM_BYTES, "tsgen/ops/attention.py smem_bytes() disagrees with this layout");

  // named barriers: 0 is __syncthreads'; PINGPONG turns (one per consumer warpgroup); per-warpgroup epilogue
  static constexpr uint32_t TURN = 1, EPILOGUE = TURN + CONSUMERS;
};

// ---------------------------------------------------------------------------
// The problem of one call (kernel parameter, by value)
// ---------------------------------------------------------------------------

struct Problem {
  float* lse;                 // [batch, HEADS, q_len]
  const uint64_t* kv_signal;  // KV_WAITS: one signal per KV chunk (nullptr: no waits)
  uint64_t kv_expected;       // the value each signal must reach, unless kv_epoch is set:
  const uint64_t* kv_epoch;   //   then the value there (a call counter on the device, read once)
  int32_t kv_unwaited;        // the chunk not waited for (-1: none): the negative control's
  uint32_t kv_chunk;          // KV rows per signal
  int32_t kv_local_chunk[2];  // LOCAL_KV: the chunks read from the local maps (-1: none), their gathered
  int32_t kv_local_from[2], kv_local_end[2];  // rows [from, end) (none: empty), and what a gathered row
  int32_t kv_local_shift[2];                  // adds to become the local maps' row
  uint32_t batch, q_len, kv_len;
  int32_t q_offset, q_split, q_offset2, kv_offset;  // positions: see the top of this file
  uint32_t m_tiles, tiles;                          // query tiles per head; tiles in all
  int32_t q_shift;  // query tile m holds rows [m TILE_M - q_shift, (m + 1) TILE_M - q_shift): end_shift
  uint32_t head_group;  // (batch, head) pairs per group of the longest-first order (0: head-major)
  uint64_t* work;       // the dynamic schedule's tile counter, 0 at the start (nullptr: static stride)
  uint64_t* trace;      // TSGEN_ATTENTION_TRACE: the records (see the top of this file); else unused
  uint32_t trace_records;
};

// Query heads per group of the dynamic schedule's order: as many KV heads as have their K and
// V (kv_len rows each) in half of L2 (`l2_bytes`), at least one, times the query heads per KV
// head (tsgen/ops/cp_schedule.py head_group). `balanced` (the single-GPU persistent schedule):
// the same number of groups, of equal size (within one KV head), so that the last group is not a
// small one whose long tiles start late and end the call alone (32 heads in groups of 30: the
// last 2 heads' tiles run after the others').
template <class C>
static __host__ __device__ inline uint32_t head_group(uint64_t kv_len, uint64_t l2_bytes, bool balanced = false) {
  const uint64_t per_kv_head = 2 * kv_len * C::HEAD_DIM * 2;
  uint64_t kv = l2_bytes / 2 / (per_kv_head > 0 ? per_kv_head : 1);
  kv = kv < 1 ? 1 : kv > (uint64_t)C::KV_HEADS ? (uint64_t)C::KV_HEADS : kv;
  if (balanced) {
    const uint64_t groups = ((uint64_t)C::KV_HEADS + kv - 1) / kv;
    kv = ((uint64_t)C::KV_HEADS + groups - 1) / groups;
  }
  return (uint32_t)kv * (uint32_t)(C::HEADS / C::KV_HEADS);
}

// Causal, one query segment (the single-GPU launcher's `end_aligned`): the tiles end at the
// sequence's last row, so the partial tile is the first (the shortest: fewest keys) rather than
// the last (the longest, which would then walk every KV block for its few rows). Rows below 0 are
// not read (the TMA fills them with zeros) and not stored; what they compute is never used (the
// tile's blocks and mask follow its rows at 0 and past). A multiple of 64, so each consumer
// warpgroup's 64 rows lie all below 0 or all at 0 and past: m_tiles TILE_M - q_len rounded down
// to one (at most TILE_M - 64; 0 where q_len is a multiple of 64).
template <class C>
static __host__ __device__ __forceinline__ int32_t end_shift(uint32_t q_len) {
  const uint32_t m_tiles = (q_len + C::TILE_M - 1) / C::TILE_M;
  return (int32_t)((m_tiles * C::TILE_M - q_len) / 64 * 64);
}

// Global position of query row r.
static __host__ __device__ __forceinline__ int64_t q_position(const Problem& p, int64_t r) {
  return r < p.q_split ? p.q_offset + r : p.q_offset2 + (r - p.q_split);
}

struct Tile {
  int32_t m0;  // the first row (m TILE_M - q_shift: below 0 in the first tile when q_shift > 0)
  uint32_t head, batch;
  int32_t blocks;       // KV blocks this tile needs (0: no key is visible to any of its rows)
  int32_t masked_from;  // the first KV block that needs the element-wise mask (block_masked: j >= it)
  int64_t min_q;        // smallest position of the tile's rows (< q_len): causal masking
};

// The last key row (of the gathered K) that a query at position q_pos sees: kv_len - 1, or (causal) its
// position less kv_offset where that is smaller (below 0: none).
template <class C>
static __host__ __device__ __forceinline__ int64_t last_key(const Problem& p, int64_t q_pos) {
  int64_t last = (int64_t)p.kv_len - 1;
  if constexpr (C::CAUSAL) last = q_pos - p.kv_offset < last ? q_pos - p.kv_offset : last;
  return last;
}

// Tile t: the same on the producer and the consumers (and on the host, for tests).
template <class C>
static __host__ __device__ __forceinline__ Tile tile_of(const Problem& p, uint32_t t) {
  Tile tile;
  uint32_t m, bh;
  if (p.head_group > 0) {  // groups of head_group pairs; within one, the last query tiles of each pair first
    const uint32_t pairs = p.batch * C::HEADS, per_group = p.head_group * p.m_tiles;
    const uint32_t g = t / per_group, in = t % per_group;
    const uint32_t size = pairs - g * p.head_group < p.head_group ? pairs - g * p.head_group : p.head_group;
    m = p.m_tiles - 1 - in / size;
    bh = g * p.head_group + in % size;
  } else {
    const uint32_t within = t % p.m_tiles;
    bh = t / p.m_tiles;
    m = C::CAUSAL ? p.m_tiles - 1 - within : within;  // causal: longest tiles first
  }
  tile.m0 = (int32_t)(m * C::TILE_M) - p.q_shift;
  tile.head = bh % C::HEADS;
  tile.batch = bh / C::HEADS;
  const int32_t all = (int32_t)((p.kv_len + C::TILE_N - 1) / C::TILE_N);
  const int64_t first = tile.m0 > 0 ? tile.m0 : 0;  // the tile's rows in [0, q_len)
  const int64_t end = (int64_t)tile.m0 + C::TILE_M, last = (end < (int64_t)p.q_len ? end : (int64_t)p.q_len) - 1;
  // positions increase within each of the two segments
  int64_t max_q = q_position(p, last), min_q = q_position(p, first);
  if (first < p.q_split && last >= p.q_split) {
    const int64_t end0 = q_position(p, p.q_split - 1), start1 = q_position(p, p.q_split);
    max_q = max_q > end0 ? max_q : end0;
    min_q = min_q < start1 ? min_q : start1;
  }
  tile.min_q = min_q;
  // The blocks the tile needs: through the last key its latest row sees (not causal: all). The mask from
  // the first block past the keys its earliest row sees: block_masked's test solved for j once a tile
  // (block j needs it when (j + 1) TILE_N > seen, i.e. j >= seen / TILE_N), so the consumer's step
  // compares two 32-bit ints.
  const int64_t last_seen = last_key<C>(p, max_q), seen = last_key<C>(p, min_q) + 1;
  tile.blocks = last_seen < 0 ? 0 : (int32_t)(last_seen / C::TILE_N + 1);
  const int64_t from = seen <= 0 ? 0 : seen / C::TILE_N;
  tile.masked_from = from < all ? (int32_t)from : all;
  return tile;
}

// KV block j of a tile needs the element-wise mask: it holds rows >= kv_len, or (causal)
// keys past the tile's first query position. The definition; the kernel compares j with
// tile.masked_from (tile_of), which the host test checks against this for every block.
template <class C>
static __host__ __device__ __forceinline__ bool block_masked(const Problem& p, const Tile& tile, int32_t j) {
  const int64_t end = (int64_t)(j + 1) * C::TILE_N;
  if (end > p.kv_len) return true;
  return C::CAUSAL && p.kv_offset + end - 1 > tile.min_q;
}

// The masked step's per-row limit for lane `lane` in KV block j: the row's last visible key less the
// thread's first key of the block (j TILE_N + 2 (lane % 4)), clamped to [-1, TILE_N]. The thread's score
// at offset 8 (i / 4) + i % 2 from its first key is hidden when the offset is past the limit (Softmax::step).
template <class C>
static __host__ __device__ __forceinline__ int32_t score_limit(int64_t last, int32_t j, uint32_t lane) {
  const int64_t rel = last - ((int64_t)j * C::TILE_N + 2 * (int64_t)(lane % 4));
  return rel < -1 ? -1 : rel > C::TILE_N ? C::TILE_N : (int32_t)rel;
}
// Score i of a thread (its accumulator index) in the masked step: hidden past its row's limit.
static __host__ __device__ __forceinline__ bool score_hidden(int i, int32_t limit) {
  return 8 * (i / 4) + (i % 2) > limit;
}

// A running counter of KV blocks (over this CTA's tiles): its ring stage and phase.
template <class C>
struct Ring {
  uint32_t stage, phase;
  __device__ __forceinline__ explicit Ring(uint32_t count)
      : stage(count % C::STAGES), phase((count / C::STAGES) & 1) {}
};

// ---------------------------------------------------------------------------
// Producer: one thread issues every TMA load of this CTA.
// ---------------------------------------------------------------------------

// TMA coordinates of (column d, row s, head h, sequence b) in a [b, s, h, d] or [b, h, s, d] map.
template <class C>
static __device__ __forceinline__ void load_rows(uint32_t dst, const CUtensorMap* map, int d, int s, int h, int b,
                                                 uint32_t bar) {
  if constexpr (C::BHSD) {
    tma_load_4d(dst, map, d, s, h, b, bar);
  } else {
    tma_load_4d(dst, map, d, h, s, b, bar);
  }
}

// KV_WAITS: wait for every KV chunk that block j touches and that this tile has not waited
// for yet (blocks are walked downwards: `waited` is the lowest chunk already waited for).
// True when block j began a chunk (its waits, if any, have returned): the trace's use.
template <class C>
static __device__ __forceinline__ bool wait_chunks(const Problem& p, uint64_t expected, int32_t j, uint32_t& waited) {
  if constexpr (C::KV_WAITS) {
    if (p.kv_signal == nullptr) return false;
    const uint32_t first = (uint32_t)j * C::TILE_N / p.kv_chunk;
    const uint32_t end = ((uint32_t)j + 1) * C::TILE_N < p.kv_len ? ((uint32_t)j + 1) * C::TILE_N : p.kv_len;
    const uint32_t last = (end - 1) / p.kv_chunk;
    if (first >= waited) return false;
    for (uint32_t c = (last < waited ? last : waited - 1) + 1; c-- > first;) {
      bool local = false;  // LOCAL_KV: a chunk read in place is never signalled
      if constexpr (local_kv_of<C>::value) local = (int32_t)c == p.kv_local_chunk[0] || (int32_t)c == p.kv_local_chunk[1];
      if ((int32_t)c != p.kv_unwaited && !local) C::wait_signal(p.kv_signal + c, expected, (int)c);
    }
    fence_proxy_async_global();  // the acquired data, visible to the TMA loads that follow
    waited = first;
    return true;
  }
  return false;
}

// The producer's next tile after t: static, t + gridDim.x; dynamic, gridDim.x + the counter's
// next value (the first gridDim.x tiles are the CTAs' first). Every CTA draws until it gets a
// tile >= tiles, once, so a call draws the values 0 .. tiles - 1: the CTA that draws the last
// one resets the counter for the next call (every other draw of the call came before it in the
// counter's order).
static __device__ __forceinline__ uint32_t next_tile(const Problem& p, uint32_t t) {
  if (p.work == nullptr) return t + gridDim.x;
  const uint64_t i = atom_add_relaxed_gpu_global_u64(p.work, 1ull);
  // i + 1 == tiles, not i == tiles - 1: the same test, against a zero-extended 32-bit value (tiles - 1
  // in 64 bits kept a high word live, which the trace build spilled: tests/test_cp_attention_cpu.py)
  if (i + 1 == (uint64_t)p.tiles) st_relaxed_gpu_global_u64(p.work, 0ull);
  return i < (uint64_t)p.tiles ? (uint32_t)(gridDim.x + i) : p.tiles;  // i < tiles: no overflow
}

#ifdef TSGEN_ATTENTION_TRACE
constexpr int TRACE_WORDS = 7;  // u64 words per trace record (tsgen/ops/cp_attention.py TRACE_WORDS)

// What the producer notes of one tile for its trace record, in few registers (the producer keeps 40, or
// 32): the summed waits in ns, and when its first and last chunk waits returned as two 16-bit counts of
// READY_UNIT ns after the start (0: none; at most 65535 units, 8.4 ms).
constexpr uint32_t READY_UNIT = 128;
struct TraceTile {
  uint64_t start = 0;
  uint32_t waited = 0, ready = 0, tile = 0;  // ready: first << 16 | last
};
// The tile's start on the SM clock (%clock) is kept in shared memory, in the spare word after the
// dynamic schedule's tile number (Layout::TILE + 4), not in a register: the producer has none to spare.
constexpr uint32_t TRACE_CLOCK = 4;

static __device__ __forceinline__ uint32_t sm_clock() {
  uint32_t c;
  asm volatile("mov.u32 %0, %%clock;" : "=r"(c)::"memory");
  return c;
}

// The trace record of one tile (the producer thread).
static __device__ __forceinline__ void trace_tile(const Problem& p, const TraceTile& x, uint64_t end,
                                                  uint32_t cycles) {
  if (p.trace == nullptr) return;
  const uint64_t i = atom_add_relaxed_gpu_global_u64(p.trace, 1ull);
  if (i >= p.trace_records) return;
  uint32_t smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  uint64_t* r = p.trace + 2 + TRACE_WORDS * i;
  r[0] = (uint64_t)smid << 48 | (uint64_t)blockIdx.x << 32 | x.tile;
  const uint64_t first = x.ready >> 16, last = x.ready & 0xFFFFu;
  r[1] = x.start, r[2] = end, r[3] = x.waited;
  r[4] = first ? x.start + first * READY_UNIT : 0, r[5] = last ? x.start + last * READY_UNIT : 0;
  r[6] = cycles;  // SM cycles over the tile (over end - start in ns: the SM's clock)
}
#endif

// The map and row of KV block row `row` (j x TILE_N): with LOCAL_KV, a row of local chunk i (gathered rows
// kv_local_from[i] .. kv_local_end[i] - 1) comes from the local map (`local`) at row + kv_local_shift[i]; else
// `full` unchanged. A block never straddles a local chunk's ends (the launcher's check), so its first row
// decides for all of it.
template <class C>
static __device__ __forceinline__ const CUtensorMap* kv_map(const CUtensorMap* full, const CUtensorMap* local,
                                                            const Problem& p, int32_t& row) {
  if constexpr (local_kv_of<C>::value) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (row >= p.kv_local_from[i] && row < p.kv_local_end[i]) {
        row += p.kv_local_shift[i];
        return local;
      }
    }
  }
  (void)local, (void)p;
  return full;
}

template <class C>
static __device__ __forceinline__ void produce(const CUtensorMap* q_map, const CUtensorMap* k_map,
                                               const CUtensorMap* v_map, uint32_t smem, const Problem& p,
                                               const CUtensorMap* k_local = nullptr,
                                               const CUtensorMap* v_local = nullptr) {
  using L = Layout<C>;
  uint32_t count = 0, tiles = 0;  // KV blocks and tiles loaded so far
  const uint64_t expected = C::KV_WAITS && p.kv_epoch != nullptr ? ld_relaxed_gpu_global_u64(p.kv_epoch) : p.kv_expected;
  const bool dynamic = p.work != nullptr;
#ifdef TSGEN_ATTENTION_TRACE
  TraceTile trace;
#endif
  for (uint32_t t = blockIdx.x;; ++tiles) {
    if (!dynamic && t >= p.tiles) break;  // static: the consumers count the same tiles
    // Q: the consumers are done with the previous tile's Q (and the O stores staged in it),
    // and have read its number
    mbar_wait(smem + L::Q_EMPTY, (tiles & 1) ^ 1);
#ifdef TSGEN_ATTENTION_TRACE
    {
      const uint64_t now = globaltimer_ns();
      const uint32_t cycles = sm_clock();
      if (tiles > 0) trace_tile(p, trace, now, cycles - ld_shared_u32(smem + L::TILE + TRACE_CLOCK));
      st_shared_u32(smem + L::TILE + TRACE_CLOCK, cycles);
      trace = TraceTile();
      trace.start = now, trace.tile = t;
    }
#endif
    if (dynamic) {
      st_shared_u32(smem + L::TILE, t);  // released to the consumers by the arrive on q_full
      if (t >= p.tiles) {                // the end: q_full completes with no bytes
        mbar_arrive(smem + L::Q_FULL);
        break;
      }
    }
    const Tile tile = tile_of<C>(p, t);
    const int kvh = (int)(tile.head / L::GROUP), h = (int)tile.head, b = (int)tile.batch;
    mbar_arrive_expect_tx(smem + L::Q_FULL, L::Q_BYTES);
#pragma unroll
    for (int x = 0; x < L::BOXES; ++x)
      load_rows<C>(smem + L::Q_OFF + x * L::Q_BOX, q_map, 64 * x, tile.m0, h, b, smem + L::Q_FULL);
    uint32_t waited = 0xFFFFFFFFu;
    // K_0, then (K_i, V_(i-1)) for i = 1 .. blocks - 1, then V_(blocks-1); block i is KV block
    // blocks - 1 - i (downwards).
    for (int32_t i = 0; i <= tile.blocks; ++i) {
      if (i < tile.blocks) {
        const int32_t j = tile.blocks - 1 - i;
#ifdef TSGEN_ATTENTION_TRACE
        const uint64_t before = globaltimer_ns();
        const bool began = wait_chunks<C>(p, expected, j, waited);
        const uint64_t after = globaltimer_ns();
        trace.waited += (uint32_t)(after - before);
        if (began) {  // this block began a chunk: its wait (if any) has returned
          const uint32_t units = ((uint32_t)after - (uint32_t)trace.start) / READY_UNIT + 1;  // 0 means none
          const uint32_t since = units < 0xFFFFu ? units : 0xFFFFu;
          trace.ready = (i == 0 ? since << 16 : trace.ready & 0xFFFF0000u) | since;
        }
#else
        wait_chunks<C>(p, expected, j, waited);
#endif
        const Ring<C> r(count + i);
        const uint32_t full = smem + L::K_FULL + 8 * r.stage;
        mbar_wait(smem + L::K_EMPTY + 8 * r.stage, r.phase ^ 1);  // a fresh barrier passes parity 1
        mbar_arrive_expect_tx(full, L::KV_STAGE);
        int32_t row = j * C::TILE_N;
        const CUtensorMap* map = kv_map<C>(k_map, k_local, p, row);
#pragma unroll
        for (int x = 0; x < L::BOXES; ++x)
          load_rows<C>(smem + L::K_OFF + r.stage * L::KV_STAGE + x * L::KV_BOX, map, 64 * x, row, kvh, b, full);
      }
      if (i > 0) {
        const int32_t j = tile.blocks - i;
        const Ring<C> r(count + i - 1);
        const uint32_t full = smem + L::V_FULL + 8 * r.stage;
        mbar_wait(smem + L::V_EMPTY + 8 * r.stage, r.phase ^ 1);
        mbar_arrive_expect_tx(full, L::KV_STAGE);
        int32_t row = j * C::TILE_N;
        const CUtensorMap* map = kv_map<C>(v_map, v_local, p, row);
#pragma unroll
        for (int x = 0; x < L::BOXES; ++x)
          load_rows<C>(smem + L::V_OFF + r.stage * L::KV_STAGE + x * L::KV_BOX, map, 64 * x, row, kvh, b, full);
      }
    }
    count += (uint32_t)tile.blocks;
    t = next_tile(p, t);
  }
  // Tail: wait (with the timeout) until the consumers have released every stage and the last
  // Q, so that a consumer stuck on a load that never lands makes the kernel trap, not hang
  // (dynamic: the wait before publishing the end did it for Q).
  if (!dynamic && tiles > 0) {
    mbar_wait(smem + L::Q_EMPTY, (tiles - 1) & 1);
#ifdef TSGEN_ATTENTION_TRACE
    trace_tile(p, trace, globaltimer_ns(), sm_clock() - ld_shared_u32(smem + L::TILE + TRACE_CLOCK));
#endif
  }
  for (uint32_t c = count > C::STAGES ? count - C::STAGES : 0; c < count; ++c) {
    const Ring<C> r(c);
    mbar_wait(smem + L::K_EMPTY + 8 * r.stage, r.phase);
    mbar_wait(smem + L::V_EMPTY + 8 * r.stage, r.phase);
  }
}

// ---------------------------------------------------------------------------
// Consumers
// ---------------------------------------------------------------------------

// Per thread of a consumer warpgroup: rows g = 16 * warp + lane / 4 and g + 8 of its 64;
// score / output register 4q + {0, 1} is (row g, column 8q + 2 (lane % 4) + {0, 1}),
// 4q + {2, 3} the same columns of row g + 8 (the wgmma accumulator layout).
template <class C>
struct Softmax {
  float m[2];  // running max of the row's scores, in log2 units (scale * log2(e) * s)
  float l[2];  // this thread's part of the running sum of exp2(scaled s - m)

  __device__ __forceinline__ void reset() {
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
  }

  // A block's softmax in three parts (step: all three; the loop may wait for the previous P V between
  // two exps, params.rescale_at). prepare: scores of KV block j masked and their row maxima taken, `use`
  // gets the rows' new maxima (0 for a row with no visible key yet) and `scale` the factor the rows'
  // earlier outputs must be multiplied by. MASK: scores of keys past the row's last visible one (`last`:
  // last_key, at least -1) count as -inf. FIRST: nothing to rescale.
  template <bool MASK, bool FIRST>
  __device__ __forceinline__ void prepare(float (&s)[Layout<C>::S_ACC], float (&scale)[2], float (&use)[2],
                                          int32_t j, const int32_t (&last)[2]) {
    using L = Layout<C>;
    const uint32_t lane = threadIdx.x % 32;
    if constexpr (MASK) {
      // Score i of this thread is key j TILE_N + 2 (lane % 4) + 8 (i / 4) + i % 2 of its row (i / 2) % 2,
      // hidden when that key is past the row's last visible one. So per row one limit (score_limit) and
      // per score a compare of a constant offset with it: one ISETP with an immediate, where the keys
      // compared in 64 bits took several.
      int32_t limit[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) limit[r] = score_limit<C>(last[r], j, lane);
#pragma unroll
      for (int i = 0; i < L::S_ACC; ++i) {
        if (score_hidden(i, limit[(i / 2) % 2])) s[i] = -INFINITY;
      }
    }
    float mx[2] = {-INFINITY, -INFINITY};
    constexpr int CHAINS = row_max_chains_of<C>::value;
    if constexpr (CHAINS == 1) {
#pragma unroll
      for (int i = 0; i < L::S_ACC; ++i) mx[(i / 2) % 2] = fmaxf(mx[(i / 2) % 2], s[i]);
    } else {
      // CHAINS independent maxima per row (score e of the row's S_ACC / 2 into chain e % CHAINS, the
      // first CHAINS taken as they are), then a pairwise tree: the one serial chain of S_ACC / 2
      // dependent FMNMX per row becomes S_ACC / (2 CHAINS) + log2(CHAINS) steps. Max is exact: the
      // same row maxima, bit for bit, in any order.
      static_assert((CHAINS & (CHAINS - 1)) == 0 && (L::S_ACC / 2) % CHAINS == 0, "ROW_MAX_CHAINS");
      float part[2][CHAINS];
#pragma unroll
      for (int e = 0; e < L::S_ACC / 2; ++e) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float x = s[4 * (e / 2) + 2 * r + e % 2];  // the row's e-th score (the accumulator layout)
          part[r][e % CHAINS] = e < CHAINS ? x : fmaxf(part[r][e % CHAINS], x);
        }
      }
#pragma unroll
      for (int w = CHAINS / 2; w > 0; w /= 2)
#pragma unroll
        for (int c = 0; c < w; ++c)
#pragma unroll
          for (int r = 0; r < 2; ++r) part[r][c] = fmaxf(part[r][c], part[r][c + w]);
      mx[0] = part[0][0], mx[1] = part[1][0];
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xFFFFFFFFu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xFFFFFFFFu, mx[r], 2));
      const float m_new = FIRST ? mx[r] * C::SCALE_LOG2 : fmaxf(m[r], mx[r] * C::SCALE_LOG2);
      use[r] = m_new == -INFINITY ? 0.f : m_new;  // a row with no visible key yet: exp2(-inf) = 0
      scale[r] = FIRST ? 0.f : exp2_approx(m[r] - use[r]);
      m[r] = m_new;
    }
  }

  // Scores FROM .. TO - 1 -> unnormalized probabilities (in place), added into the rows' sums.
  template <int FROM, int TO>
  __device__ __forceinline__ void exps(float (&s)[Layout<C>::S_ACC], const float (&use)[2], float (&sum)[2]) {
#pragma unroll
    for (int i = FROM; i < TO; ++i) {
      const int r = (i / 2) % 2;
      s[i] = exp2_of_group<C>(fmaf(s[i], C::SCALE_LOG2, -use[r]), i / 4);  // i / 4: the score's 8-key group
      sum[r] += s[i];
    }
  }

  template <bool FIRST>
  __device__ __forceinline__ void finish(const float (&sum)[2], const float (&scale)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = FIRST ? sum[r] : fmaf(l[r], scale[r], sum[r]);
  }

  // The whole of a block: prepare, every exp2, finish.
  template <bool MASK, bool FIRST>
  __device__ __forceinline__ void step(float (&s)[Layout<C>::S_ACC], float (&scale)[2], int32_t j,
                                       const int32_t (&last)[2]) {
    float use[2], sum[2] = {0.f, 0.f};
    prepare<MASK, FIRST>(s, scale, use, j, last);
    exps<0, Layout<C>::S_ACC>(s, use, sum);
    finish<FIRST>(sum, scale);
  }
};

// Probabilities (scores registers) -> the A fragments of P V: k16 step k holds columns
// 16k .. 16k + 15, registers (row g, 2c), (row g + 8, 2c), (row g, 2c + 8), (row g + 8, 2c + 8).
template <class C>
static __device__ __forceinline__ void to_operand(const float (&s)[Layout<C>::S_ACC],
                                                  uint32_t (&a)[Layout<C>::K16][4]) {
#pragma unroll
  for (int k = 0; k < Layout<C>::K16; ++k)
#pragma unroll
    for (int x = 0; x < 4; ++x) a[k][x] = pack2<typename C::Element>(s[8 * k + 2 * x], s[8 * k + 2 * x + 1]);
}

template <class C>
static __device__ __forceinline__ void rescale(float (&o)[Layout<C>::O_ACC], const float (&scale)[2]) {
#pragma unroll
  for (int i = 0; i < Layout<C>::O_ACC; ++i) o[i] *= scale[(i / 2) % 2];
}

// The wgmma descriptors of a consumer warpgroup's operands. Without ping-pong (OPAQUE): the low
// halves (address field and leading offset) made once, of its Q rows and of K and V at ring stage 0;
// stage s's K is stage 0's plus s * STAGE in the address field, and a k16 step's is that plus its
// own offset (the field counts 16 bytes; every address stays below 2^18, the field's reach, so a sum
// never carries out of it); the high half (stride 1024, the swizzle) is a constant. The low halves
// are opaque to the compiler, which otherwise folds the sums back and remakes each descriptor from
// the shared-memory base at every step (seen in the SASS). With ping-pong each is remade from the base
// as before: measured 2026-11-28 (docs/design/attention.md "The forward's step beside FA4's"), the
// held form was 3 % faster without ping-pong and 1 % slower with it (hd 128 causal GQA).
template <class C>
struct Descriptors {
  using L = Layout<C>;
  static constexpr bool OPAQUE = !C::PINGPONG;
  static constexpr uint32_t STAGE = L::KV_STAGE >> 4;
  static constexpr uint64_t HI = (uint64_t)sw128_descriptor_hi(1024) << 32;
  // (the real bound is the hardware's: a CTA's shared window is at most 227 KiB past a 1 KiB reserve, below 2^18)
  static_assert(L::KV_STAGE % 16 == 0 && L::SMEM_BYTES <= (1 << 18), "descriptor arithmetic stays in the field");
  uint32_t smem, cw;  // ping-pong's form (remade from these)
  uint32_t q, k, v;   // OPAQUE's form (the low halves); each form leaves the other's members unused
  __device__ __forceinline__ Descriptors(uint32_t smem_, uint32_t cw_)
      : smem(smem_), cw(cw_), q(sw128_descriptor_lo(smem_ + L::Q_OFF + cw_ * 64 * 128, 16)),
        k(sw128_descriptor_lo(smem_ + L::K_OFF, 16)), v(sw128_descriptor_lo(smem_ + L::V_OFF, L::KV_BOX)) {
    if constexpr (OPAQUE) asm("" : "+r"(q), "+r"(k), "+r"(v));
  }
  // `bytes` past the start of Q / of K or V at `stage`
  __device__ __forceinline__ uint64_t q_at(uint32_t bytes) const {
    if constexpr (OPAQUE) return HI | (q + (bytes >> 4));
    return sw128_descriptor(smem + L::Q_OFF + cw * 64 * 128, 16, 1024) + (bytes >> 4);
  }
  __device__ __forceinline__ uint64_t k_at(uint32_t stage, uint32_t bytes) const {
    if constexpr (OPAQUE) return HI | (k + stage * STAGE + (bytes >> 4));
    return sw128_descriptor(smem + L::K_OFF + stage * L::KV_STAGE, 16, 1024) + (bytes >> 4);
  }
  __device__ __forceinline__ uint64_t v_at(uint32_t stage, uint32_t bytes) const {
    if constexpr (OPAQUE) return HI | (v + stage * STAGE + (bytes >> 4));
    return sw128_descriptor(smem + L::V_OFF + stage * L::KV_STAGE, L::KV_BOX, 1024) + (bytes >> 4);
  }
};

// S = Q K^T for KV stage `stage`: HEAD_DIM / 16 wgmma, both operands K-major in shared memory.
template <class C>
static __device__ __forceinline__ void issue_qk(float (&s)[Layout<C>::S_ACC], const Descriptors<C>& d,
                                                uint32_t stage) {
  using L = Layout<C>;
#pragma unroll
  for (int k = 0; k < C::HEAD_DIM / 16; ++k) {
    const uint32_t q_step = (k / 4) * L::Q_BOX + (k % 4) * 32, k_step = (k / 4) * L::KV_BOX + (k % 4) * 32;
    C::mma_qk(s, d.q_at(q_step), d.k_at(stage, k_step), k > 0);
  }
}

// O (+)= P V for KV stage `stage`: TILE_N / 16 wgmma, V N-major (64-column boxes KV_BOX apart).
template <class C>
static __device__ __forceinline__ void issue_pv(float (&o)[Layout<C>::O_ACC], const uint32_t (&a)[Layout<C>::K16][4],
                                                const Descriptors<C>& d, uint32_t stage, bool accumulate) {
  using L = Layout<C>;
#pragma unroll
  for (int k = 0; k < L::K16; ++k) C::mma_pv(o, a[k], d.v_at(stage, k * 16 * 128), accumulate || k > 0);
}

// PINGPONG: warpgroup cw waits for its turn to issue GEMMs, and hands the turn over.
template <class C>
static __device__ __forceinline__ void turn_wait(uint32_t cw) {
  if constexpr (C::PINGPONG) named_barrier_sync(Layout<C>::TURN + cw, 256);
}
// Three consumer warpgroups (tile.m 192) take turns round robin: 0, 1, 2, 0, ...
template <class C>
static __device__ __forceinline__ void turn_pass(uint32_t cw) {
  if constexpr (C::PINGPONG) {
    if constexpr (Layout<C>::CONSUMERS == 2) {
      named_barrier_arrive(Layout<C>::TURN + (cw ^ 1), 256);
    } else {
      named_barrier_arrive(Layout<C>::TURN + (cw + 1 == Layout<C>::CONSUMERS ? 0 : cw + 1), 256);
    }
  }
}

template <class C>
static __device__ __forceinline__ void fence_all(float* x, int n) {
#pragma unroll
  for (int i = 0; i < n; ++i) fence_operand(x[i]);
}

// O / l -> 16 bits -> this warpgroup's 64 rows of the Q tile (128B-swizzled boxes) -> TMA
// store; LSE from registers.
template <class C>
static __device__ __forceinline__ void epilogue(float (&o)[Layout<C>::O_ACC], Softmax<C>& sm,
                                                const CUtensorMap* o_map, uint32_t smem, uint32_t cw,
                                                const Tile& tile, const Problem& p) {
  using L = Layout<C>;
  const uint32_t t = threadIdx.x % 128, lane = t % 32;
  const uint32_t row = 16 * (t / 32) + lane / 4;  // and row + 8, of this warpgroup's 64
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = sm.l[r];
    l += __shfl_xor_sync(0xFFFFFFFFu, l, 1);
    l += __shfl_xor_sync(0xFFFFFFFFu, l, 2);
    inv[r] = l > 0.f ? rcp_approx(l) : 0.f;
    const int64_t q = (int64_t)tile.m0 + cw * 64 + row + 8 * r;
    if (lane % 4 == 0 && q >= 0 && q < (int64_t)p.q_len) {
      const float lse = l > 0.f ? (sm.m[r] + log2_approx(l)) * 0.69314718055994530942f : -INFINITY;
      p.lse[((uint64_t)tile.batch * C::HEADS + tile.head) * p.q_len + q] = lse;
    }
  }
  // Every warp of the warpgroup is past its last wgmma reading this Q rows' shared memory
  // (OVERLAP: the previous tile's O store has read the staging rows, thread 0's bulk group).
  if (L::OVERLAP && t == 0) bulk_wait_group_read<0>();
  named_barrier_sync(L::EPILOGUE + cw, 128);
  const uint32_t base = smem + L::O_OFF + cw * 64 * 128;
  const uint32_t swizzle = lane / 4;  // = row % 8: 128B swizzle XORs the 16-byte unit with it
#pragma unroll
  for (int x = 0; x < L::BOXES; ++x) {
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const float* d = &o[4 * (8 * x + q)];
      const uint32_t col = ((q ^ swizzle) << 4) + 4 * (lane % 4);
      const uint32_t box = base + x * L::Q_BOX;
      st_shared_u32(box + row * 128 + col, pack2<typename C::Element>(d[0] * inv[0], d[1] * inv[0]));
      st_shared_u32(box + (row + 8) * 128 + col, pack2<typename C::Element>(d[2] * inv[1], d[3] * inv[1]));
    }
  }
  fence_proxy_async_shared_cta();  // our shared-memory writes, visible to the TMA engine
  named_barrier_sync(L::EPILOGUE + cw, 128);
  if (t == 0) {
    const int s0 = tile.m0 + (int)cw * 64;  // the warpgroup's rows: all below 0 or none (end_shift)
    if (s0 >= 0 && (uint32_t)s0 < p.q_len) {
#pragma unroll
      for (int x = 0; x < L::BOXES; ++x) {
        const uint32_t src = base + x * L::Q_BOX;
        if constexpr (C::BHSD) {
          tma_store_4d(o_map, src, 64 * x, s0, (int)tile.head, (int)tile.batch);
        } else {
          tma_store_4d(o_map, src, 64 * x, (int)tile.head, s0, (int)tile.batch);
        }
      }
      bulk_commit_group();
      // the stores have read the shared memory: Q may be reloaded (OVERLAP: the next
      // epilogue waits for that, and Q was released after the last S)
      if (!L::OVERLAP) bulk_wait_group_read<0>();
    }
    if (!L::OVERLAP) mbar_arrive(smem + L::Q_EMPTY);
  }
}

template <class C>
static __device__ __forceinline__ void consume(const CUtensorMap* o_map, uint32_t smem, const Problem& p,
                                               uint32_t cw) {
  using L = Layout<C>;
  const bool leader = threadIdx.x % 128 == 0;  // arrives on the ring's empty barriers
  const uint32_t t = threadIdx.x % 128;
  float s[L::S_ACC];
  float o[L::O_ACC];
  uint32_t a[L::K16][4];
  Softmax<C> sm;
  const Descriptors<C> desc(smem, cw);
  uint32_t count = 0, tiles = 0;
  const bool dynamic = p.work != nullptr;
  if (cw == L::CONSUMERS - 1) turn_pass<C>(cw);  // warpgroup 0 issues first
  for (uint32_t tn = blockIdx.x;; tn += gridDim.x, ++tiles) {
    if (!dynamic && tn >= p.tiles) break;
    mbar_wait_no_timeout(smem + L::Q_FULL, tiles & 1);
    if (dynamic) {  // the producer's tile (written before its arrive on q_full)
      tn = ld_shared_u32(smem + L::TILE);
      if (tn >= p.tiles) break;
    }
    const Tile tile = tile_of<C>(p, tn);
    int64_t q_pos[2];
#pragma unroll
    for (int r = 0; r < 2; ++r)
      q_pos[r] = q_position(p, (int64_t)tile.m0 + cw * 64 + 16 * (t / 32) + (t % 32) / 4 + 8 * r);
    // The last key row each row sees (last_key, at least -1: below kv_len, so 32 bits hold it), for
    // the masked steps.
    int32_t last[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t k = last_key<C>(p, q_pos[r]);
      last[r] = (int32_t)(k < -1 ? -1 : k);
    }
    sm.reset();
    const int32_t n = tile.blocks;
    if (n == 0) {
#pragma unroll
      for (int i = 0; i < L::O_ACC; ++i) o[i] = 0.f;
    } else {
      float scale[2];
      // Block 0 (KV block n - 1): S only.
      {
        const Ring<C> r(count);
        mbar_wait_no_timeout(smem + L::K_FULL + 8 * r.stage, r.phase);
        turn_wait<C>(cw);
        wgmma_fence();
        issue_qk<C>(s, desc, r.stage);
        wgmma_commit_group();
        turn_pass<C>(cw);
        wgmma_wait_group<0>();
        fence_all<C>(s, L::S_ACC);
        if (leader) mbar_arrive(smem + L::K_EMPTY + 8 * r.stage);
        if (L::OVERLAP && n == 1 && leader) mbar_arrive(smem + L::Q_EMPTY);  // the tile's last S read Q
        if (n - 1 >= tile.masked_from) {
          sm.template step<true, true>(s, scale, n - 1, last);
        } else {
          sm.template step<false, true>(s, scale, n - 1, last);
        }
        to_operand<C>(s, a);
      }
      // Block i: S_i and P_(i-1) V_(i-1) together, softmax of S_i while P V runs.
      for (int32_t i = 1; i < n; ++i) {
        const int32_t j = n - 1 - i;
        const Ring<C> rk(count + i), rv(count + i - 1);
        mbar_wait_no_timeout(smem + L::K_FULL + 8 * rk.stage, rk.phase);
        turn_wait<C>(cw);
        wgmma_fence();
        issue_qk<C>(s, desc, rk.stage);
        wgmma_commit_group();
        mbar_wait_no_timeout(smem + L::V_FULL + 8 * rv.stage, rv.phase);
        issue_pv<C>(o, a, desc, rv.stage, i > 1);
        wgmma_commit_group();
        turn_pass<C>(cw);
        wgmma_wait_group<1>();  // S_i is done; P V may still run
        fence_all<C>(s, L::S_ACC);
        if (leader) mbar_arrive(smem + L::K_EMPTY + 8 * rk.stage);
        if (L::OVERLAP && i == n - 1 && leader) mbar_arrive(smem + L::Q_EMPTY);  // the tile's last S read Q
        // The previous P V waited for and O rescaled after RESCALE_AT of the block's column groups of
        // exp2 (params.rescale_at; by default after all of them).
        const auto pv_done = [&] {
          wgmma_wait_group<0>();
          fence_all<C>(o, L::O_ACC);
          if (leader) mbar_arrive(smem + L::V_EMPTY + 8 * rv.stage);
          if constexpr (rescale_skip_of<C>::value) {
            if (__any_sync(0xFFFFFFFFu, scale[0] != 1.f || scale[1] != 1.f)) rescale<C>(o, scale);
          } else {
            rescale<C>(o, scale);
          }
        };
        constexpr int AT = 8 * rescale_at_of<C>::value;  // scores before the wait (8 a column group)
        static_assert(AT >= 0 && AT <= L::S_ACC, "RESCALE_AT: 0 .. TILE_N / 16");
        if constexpr (AT == L::S_ACC) {
          if (j >= tile.masked_from) {
            sm.template step<true, false>(s, scale, j, last);
          } else {
            sm.template step<false, false>(s, scale, j, last);
          }
          pv_done();
        } else {
          float use[2], sum[2] = {0.f, 0.f};
          if (j >= tile.masked_from) {
            sm.template prepare<true, false>(s, scale, use, j, last);
          } else {
            sm.template prepare<false, false>(s, scale, use, j, last);
          }
          sm.template exps<0, AT>(s, use, sum);
          pv_done();
          sm.template exps<AT, L::S_ACC>(s, use, sum);
          sm.template finish<false>(sum, scale);
        }
        to_operand<C>(s, a);
      }
      // The last P V.
      {
        const Ring<C> rv(count + n - 1);
        mbar_wait_no_timeout(smem + L::V_FULL + 8 * rv.stage, rv.phase);
        turn_wait<C>(cw);
        wgmma_fence();
        issue_pv<C>(o, a, desc, rv.stage, n > 1);
        wgmma_commit_group();
        turn_pass<C>(cw);
        wgmma_wait_group<0>();
        fence_all<C>(o, L::O_ACC);
        if (leader) mbar_arrive(smem + L::V_EMPTY + 8 * rv.stage);
      }
    }
    epilogue<C>(o, sm, o_map, smem, cw, tile, p);
    // OVERLAP, a tile with no visible key (no S read Q): Q released here, after the epilogue's
    // barriers, by which every thread of the warpgroup has read the tile's number (dynamic).
    if (L::OVERLAP && n == 0 && leader) mbar_arrive(smem + L::Q_EMPTY);
    count += (uint32_t)n;
  }
  if (cw == 0) turn_wait<C>(cw);  // takes the last warpgroup's last hand-over: the barriers end balanced
  if (t == 0) bulk_wait_group_all();  // O is written before the CTA (and its shared memory) goes
}

// ---------------------------------------------------------------------------
// The kernel body
// ---------------------------------------------------------------------------

// k_local, v_local: LOCAL_KV's maps of the rank's own K and V (see local_kv_of); unused otherwise.
template <class C>
static __device__ __forceinline__ void run(const CUtensorMap* q_map, const CUtensorMap* k_map,
                                           const CUtensorMap* v_map, const CUtensorMap* o_map, const Problem& p,
                                           const CUtensorMap* k_local = nullptr,
                                           const CUtensorMap* v_local = nullptr) {
  using L = Layout<C>;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t smem = (smem_u32(smem_raw) + 1023u) & ~1023u;
  if (threadIdx.x == 0) {
    mbar_init(smem + L::Q_FULL, 1);   // the producer's arrive.expect_tx (+ the TMA bytes)
    mbar_init(smem + L::Q_EMPTY, L::CONSUMERS);  // one arrival per consumer warpgroup
    for (int s = 0; s < C::STAGES; ++s) {
      mbar_init(smem + L::K_FULL + 8 * s, 1);
      mbar_init(smem + L::K_EMPTY + 8 * s, L::CONSUMERS);
      mbar_init(smem + L::V_FULL + 8 * s, 1);
      mbar_init(smem + L::V_EMPTY + 8 * s, L::CONSUMERS);
    }
    fence_mbarrier_init_release_cluster();  // visible to the TMA unit
    prefetch_tensormap(q_map);
    prefetch_tensormap(k_map);
    prefetch_tensormap(v_map);
    prefetch_tensormap(o_map);
    if constexpr (local_kv_of<C>::value) {
      prefetch_tensormap(k_local);
      prefetch_tensormap(v_local);
    }
  }
  __syncthreads();
  const uint32_t warpgroup = ptx::warpgroup_id();
  if (warpgroup == 0) {
    // 384 threads x 168 registers (the kernel's allocation) = 128 x 40 + 256 x 232; tile.m 192:
    // 512 x 128 = 128 x 32 + 384 x 160 (FlashAttention-3's and -4's split for three consumers).
    setmaxnreg_dec<L::PRODUCER_REGS>();
    if (threadIdx.x == 0) produce<C>(q_map, k_map, v_map, smem, p, k_local, v_local);
    return;  // the producer's code never joins the consumers' (ptxas allocates each its own registers)
  } else {
    setmaxnreg_inc<L::CONSUMER_REGS>();
    consume<C>(o_map, smem, p, warpgroup - 1);
  }
}

// ---------------------------------------------------------------------------
// Host side: TMA descriptors and the launch.
// ---------------------------------------------------------------------------

// Positions and lengths are 32-bit signed on the device (TMA coordinates too).
constexpr uint64_t MAX_LEN = 1ull << 30;

// A [batch, rows, heads, HEAD_DIM] tensor (bhsd: [batch, heads, rows, HEAD_DIM]) of 16-bit
// values, read or written in boxes of `box_rows` rows x 64 columns of one head (128 bytes a
// row: the swizzle span), 128B-swizzled in shared memory; rows past `rows` load as zeros
// and are not stored.
template <class C>
static cudaError_t encode_heads(CUtensorMap* map, const void* base, uint64_t batch, uint64_t rows, uint64_t heads,
                                uint32_t box_rows) {
  PFN_cuTensorMapEncodeTiled_v12000 encode;
  const cudaError_t err = gemm::tensor_map_encoder(&encode);
  if (err != cudaSuccess) return err;
  constexpr CUtensorMapDataType dtype = gemm::tensor_map_dtype<typename C::Element>();
  const uint64_t row_bytes = (uint64_t)C::HEAD_DIM * 2;
  cuuint64_t dims[4], strides[3];
  cuuint32_t box[4];
  if (C::BHSD) {
    const cuuint64_t d[4] = {(cuuint64_t)C::HEAD_DIM, rows, heads, batch};
    const cuuint64_t s[3] = {row_bytes, rows * row_bytes, heads * rows * row_bytes};
    const cuuint32_t b[4] = {64, box_rows, 1, 1};
    for (int i = 0; i < 4; ++i) dims[i] = d[i], box[i] = b[i];
    for (int i = 0; i < 3; ++i) strides[i] = s[i];
  } else {
    const cuuint64_t d[4] = {(cuuint64_t)C::HEAD_DIM, heads, rows, batch};
    const cuuint64_t s[3] = {row_bytes, heads * row_bytes, rows * heads * row_bytes};
    const cuuint32_t b[4] = {64, 1, box_rows, 1};
    for (int i = 0; i < 4; ++i) dims[i] = d[i], box[i] = b[i];
    for (int i = 0; i < 3; ++i) strides[i] = s[i];
  }
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, dtype, 4, const_cast<void*>(base), dims, strides, box, element_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

struct TensorMaps {
  CUtensorMap q, k, v, o;
};

// Config::O_BOX_ROWS where the Config has it (the backward's params.step_rows 80: its dO tiles of 80 rows), else
// 64: the rows of the `o` map's box (the forward's O staging, the backward's dO).
template <class C, class = void>
struct o_box_rows_of : std::integral_constant<uint32_t, 64> {};
template <class C>
struct o_box_rows_of<C, std::void_t<decltype(C::O_BOX_ROWS)>> : std::integral_constant<uint32_t, C::O_BOX_ROWS> {};

// The four descriptors; each host thread keeps the last set and reuses it while the
// pointers and sizes stay the same (encoding takes microseconds).
template <class C>
static cudaError_t tensor_maps(const void* q, const void* k, const void* v, const void* o, uint32_t batch,
                               uint32_t q_len, uint32_t kv_len, const TensorMaps** out) {
  struct Last {
    bool valid = false;
    const void *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr;
    uint32_t batch = 0, q_len = 0, kv_len = 0;
    TensorMaps maps;
  };
  thread_local Last last;
  if (!last.valid || last.q != q || last.k != k || last.v != v || last.o != o || last.batch != batch ||
      last.q_len != q_len || last.kv_len != kv_len) {
    last.valid = false;
    const uint64_t kv_rows = kv_len > 0 ? kv_len : 1;  // no key: the maps are never used
    cudaError_t err = encode_heads<C>(&last.maps.q, q, batch, q_len, C::HEADS, C::TILE_M);
    if (err == cudaSuccess) err = encode_heads<C>(&last.maps.k, k, batch, kv_rows, C::KV_HEADS, C::TILE_N);
    if (err == cudaSuccess) err = encode_heads<C>(&last.maps.v, v, batch, kv_rows, C::KV_HEADS, C::TILE_N);
    if (err == cudaSuccess) err = encode_heads<C>(&last.maps.o, o, batch, q_len, C::HEADS, o_box_rows_of<C>::value);
    if (err != cudaSuccess) return err;
    last.valid = true, last.q = q, last.k = k, last.v = v, last.o = o;
    last.batch = batch, last.q_len = q_len, last.kv_len = kv_len;
  }
  *out = &last.maps;
  return cudaSuccess;
}

// LOCAL_KV: the maps of the rank's own K and V read in place (k_local, v_local: `rows` rows each), cached per
// host thread as tensor_maps' are.
template <class C>
static cudaError_t local_maps(const void* k, const void* v, uint32_t batch, uint32_t rows, const CUtensorMap** out) {
  struct Last {
    bool valid = false;
    const void *k = nullptr, *v = nullptr;
    uint32_t batch = 0, rows = 0;
    CUtensorMap maps[2];
  };
  thread_local Last last;
  if (!last.valid || last.k != k || last.v != v || last.batch != batch || last.rows != rows) {
    last.valid = false;
    cudaError_t err = encode_heads<C>(&last.maps[0], k, batch, rows, C::KV_HEADS, C::TILE_N);
    if (err == cudaSuccess) err = encode_heads<C>(&last.maps[1], v, batch, rows, C::KV_HEADS, C::TILE_N);
    if (err != cudaSuccess) return err;
    last.valid = true, last.k = k, last.v = v, last.batch = batch, last.rows = rows;
  }
  *out = last.maps;
  return cudaSuccess;
}

// LOCAL_KV: what a call reads in place (tsgen/cp.cuh fills it from the rank's own segments). k and v are
// [batch, rows, KV_HEADS, HEAD_DIM] (bhsd: [batch, KV_HEADS, rows, HEAD_DIM]) as the gathered ones; chunk
// chunk[i] (kv_chunk rows of the gathered order; -1: none) is read from their row src[i] on.
struct LocalKv {
  const void* k = nullptr;
  const void* v = nullptr;
  uint32_t rows = 0;
  int32_t chunk[2] = {-1, -1};
  uint32_t src[2] = {0, 0};
  // Every chunk read in place starts on a block boundary and ends on one or at kv_len (no block of
  // tile_n rows straddles it and a gathered chunk), lies inside kv_len, and its rows inside k / v; one that
  // ends inside its last block (at kv_len) ends the local maps too, so the rows that block reads past it
  // load as zeros, as the gathered maps' do; the two chunks are distinct and their rows in k / v disjoint.
  bool fits(uint64_t kv_len, uint64_t kv_chunk, uint32_t tile_n) const {
    if (kv_chunk == 0 || rows == 0 || tile_n == 0) return false;
    if (chunk[0] >= 0 && chunk[1] >= 0 &&
        (chunk[0] == chunk[1] || (src[0] < src[1] ? (uint64_t)src[0] + kv_chunk > src[1]
                                                  : (uint64_t)src[1] + kv_chunk > src[0])))
      return false;
    for (int i = 0; i < 2; ++i) {
      if (chunk[i] < 0) continue;
      const uint64_t from = (uint64_t)chunk[i] * kv_chunk, end = from + kv_chunk, last = (uint64_t)src[i] + kv_chunk;
      if (end > kv_len || from % tile_n || (end % tile_n && (end != kv_len || last != rows)) || last > rows)
        return false;
    }
    return true;
  }
};

// The shared-memory opt-in, once per device.
template <class C>
static cudaError_t prepare(const void* kernel) {
  static PerDevice<int> done;
  int device, one;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  return done.get(device, &one, [&](int* set) {
    *set = 1;
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Layout<C>::SMEM_BYTES);
  });
}

// The persistent schedule's tile counters: a module holds WORK_SLOTS of them (a __device__ u64
// array: 0 at module load, and each back to 0 at the end of every call that used it, next_tile).
// A call takes the slot of its stream: the first WORK_SLOTS streams a module is called on (per
// device) each get one of their own, so calls on different streams may run at the same time;
// a stream seen after those shares a slot with an earlier one (round robin), and so do two host
// threads that both pass cudaStreamPerThread (one handle, two streams): such calls must not run
// at the same time. Calls in one stream's order (back to back, CUDA graph replays) always may. A
// CUDA graph keeps the slot of the stream it was captured on: replaying it on another stream
// while that stream runs a call of this module, or two graphs captured on one stream at the same
// time, shares a counter too.
constexpr uint32_t WORK_SLOTS = 64;

static inline uint32_t work_slot(int device, cudaStream_t stream) {
#ifdef TSGEN_ATTENTION_ONE_WORK_SLOT  // test-only: every stream on slot 0, the negative control of
  (void)device, (void)stream;         // tools/gpu_attention.py's two-stream check
  return 0;
#endif
  static std::mutex lock;
  static std::unordered_map<uint64_t, uint32_t> slots;  // (device, stream) -> slot
  static uint32_t next[64];
  const uint64_t key = (uint64_t)(uintptr_t)stream * 64 + (uint64_t)(device & 63);
  std::lock_guard<std::mutex> held(lock);
  const auto found = slots.find(key);
  if (found != slots.end()) return found->second;
  const uint32_t slot = next[device & 63]++ % WORK_SLOTS;
  if (slots.size() < 4096) slots.emplace(key, slot);  // bounded: streams made and destroyed by the thousand
  return slot;
}

// The persistent schedule of a single-GPU launcher (params.schedule: persistent): `counters`, the
// device address of the module's WORK_SLOTS tile counters; *work gets the slot of `stream`
// (work_slot); where *blocks is 0, as many CTAs as can be resident at once (SMs x CTAs per SM by
// occupancy: 1 for these kernels). The address and the grid are looked up once per device.
template <class C>
static cudaError_t persistent(const void* kernel, const void* counters, cudaStream_t stream, uint64_t** work,
                              int* blocks) {
  static PerDevice<uint64_t*> bases;
  static PerDevice<int> grids;
  int device, grid;
  uint64_t* address;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess)
    err = bases.get(device, &address, [&](uint64_t** at) {
      void* symbol = nullptr;
      const cudaError_t got = cudaGetSymbolAddress(&symbol, counters);
      *at = static_cast<uint64_t*>(symbol);
      return got;
    });
  if (err == cudaSuccess)
    err = grids.get(device, &grid, [&](int* ctas) {
      int sms = 0, per_sm = 0;
      cudaError_t got = prepare<C>(kernel);  // the shared-memory opt-in first: occupancy counts with it
      if (got == cudaSuccess) got = sm_count(device, &sms);
      if (got == cudaSuccess)
        got = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, Layout<C>::THREADS, Layout<C>::SMEM_BYTES);
      if (got == cudaSuccess && per_sm < 1) got = cudaErrorInvalidConfiguration;
      *ctas = sms * per_sm;
      return got;
    });
  if (err != cudaSuccess) return err;
  *work = address + work_slot(device, stream);
  if (*blocks <= 0) *blocks = grid;
  return cudaSuccess;
}

// One call. `blocks` = 0: one CTA per tile; else at most `blocks` CTAs walk the tiles.
// Positions: see the top of this file (q_split >= q_len: one query segment). KV_WAITS
// kernels wait on kv_signal[c] >= kv_expected (kv_epoch given: >= *kv_epoch, read on the
// device) before KV chunk c (kv_chunk rows) unless kv_signal is null; chunk kv_unwaited
// (test-only; -1: none) is not waited for. `work` (a u64 holding 0, owned by this caller):
// the dynamic schedule, longest first in head groups sized by this device's L2 (see the top
// of this file; balanced_groups: of equal sizes, head_group); nullptr: tiles c, c + grid, ...
// per CTA. `trace` (trace_records records):
// the test-only trace where TSGEN_ATTENTION_TRACE is defined. `local` (LOCAL_KV Configs only, whose kernels
// take two more maps): the chunks read in place and where (LocalKv); none: every row from k / v.
// `end_aligned` (the single-GPU launchers; cp_attention's tiles stay at row 0): causal with one query
// segment, the tiles end at the last row (end_shift).
template <class C, class Kernel>
static cudaError_t launch(Kernel kernel, const void* q, const void* k, const void* v, void* o, float* lse,
                          uint64_t batch, uint64_t q_len, uint64_t kv_len, int64_t q_offset, int64_t q_split,
                          int64_t q_offset2, int64_t kv_offset, const uint64_t* kv_signal, uint64_t kv_chunk,
                          uint64_t kv_expected, int blocks, cudaStream_t stream,
                          const uint64_t* kv_epoch = nullptr, int32_t kv_unwaited = -1,
                          uint64_t* work = nullptr, uint64_t* trace = nullptr, uint32_t trace_records = 0,
                          bool balanced_groups = false, const LocalKv& local = LocalKv(), bool end_aligned = false) {
  using L = Layout<C>;
  if (batch == 0 || q_len == 0) return cudaSuccess;
  if (q_len > MAX_LEN || kv_len > MAX_LEN || batch > MAX_LEN || q == nullptr || k == nullptr || v == nullptr ||
      o == nullptr || lse == nullptr)
    return cudaErrorInvalidValue;
  const int64_t limit = (int64_t)1 << 30;
  if (q_offset < -limit || q_offset > limit || q_offset2 < -limit || q_offset2 > limit || kv_offset < -limit ||
      kv_offset > limit)
    return cudaErrorInvalidValue;
  if (kv_signal != nullptr && (!C::KV_WAITS || kv_chunk == 0 || kv_chunk > MAX_LEN)) return cudaErrorInvalidValue;
  Problem p;
  p.lse = lse;
  p.kv_signal = kv_signal;
  p.kv_expected = kv_expected;
  p.kv_epoch = kv_epoch;
  p.kv_unwaited = kv_unwaited;
  p.kv_chunk = (uint32_t)(kv_chunk > 0 ? kv_chunk : 1);
  for (int i = 0; i < 2; ++i)  // LOCAL_KV in place: set below
    p.kv_local_chunk[i] = -1, p.kv_local_from[i] = p.kv_local_end[i] = p.kv_local_shift[i] = 0;
  p.batch = (uint32_t)batch, p.q_len = (uint32_t)q_len, p.kv_len = (uint32_t)kv_len;
  p.q_offset = (int32_t)q_offset, p.q_offset2 = (int32_t)q_offset2, p.kv_offset = (int32_t)kv_offset;
  p.q_split = (int32_t)(q_split < 0 ? 0 : q_split > (int64_t)q_len ? (int64_t)q_len : q_split);
  p.m_tiles = (uint32_t)((q_len + C::TILE_M - 1) / C::TILE_M);
  p.q_shift = end_aligned && C::CAUSAL && p.q_split >= (int32_t)q_len ? end_shift<C>((uint32_t)q_len) : 0;
  const uint64_t tiles = (uint64_t)p.m_tiles * C::HEADS * batch;
  if (tiles > 0x7FFFFFFFull) return cudaErrorInvalidValue;
  p.tiles = (uint32_t)tiles;
  p.work = work;
  p.trace = trace;
  p.trace_records = trace_records;
  p.head_group = 0;
  if (work != nullptr && C::CAUSAL) {  // not causal: equal tiles, head-major (the best L2 reuse)
    int device, l2;
    cudaError_t e = cudaGetDevice(&device);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device);
    if (e != cudaSuccess) return e;
    p.head_group = head_group<C>(kv_len, (uint64_t)l2, balanced_groups);
  }
  const TensorMaps* maps;
  cudaError_t err = tensor_maps<C>(q, k, v, o, (uint32_t)batch, (uint32_t)q_len, (uint32_t)kv_len, &maps);
  if (err != cudaSuccess) return err;
  err = prepare<C>(reinterpret_cast<const void*>(kernel));
  if (err != cudaSuccess) return err;
  const uint64_t grid = blocks > 0 && (uint64_t)blocks < tiles ? (uint64_t)blocks : tiles;
  if constexpr (local_kv_of<C>::value) {
    if ((local.k == nullptr) != (local.v == nullptr)) return cudaErrorInvalidValue;
    if (local.k == nullptr) {  // every chunk gathered: the local maps are never read
      kernel<<<(unsigned)grid, L::THREADS, L::SMEM_BYTES, stream>>>(maps->q, maps->k, maps->v, maps->o, maps->k,
                                                                    maps->v, p);
      return cudaGetLastError();
    }
    if (!local.fits(kv_len, kv_chunk, C::TILE_N)) return cudaErrorInvalidValue;
    const CUtensorMap* lm;
    err = local_maps<C>(local.k, local.v, (uint32_t)batch, local.rows, &lm);
    if (err != cudaSuccess) return err;
    for (int i = 0; i < 2; ++i) {
      if (local.chunk[i] < 0) continue;
      const int32_t from = local.chunk[i] * (int32_t)kv_chunk;
      p.kv_local_chunk[i] = local.chunk[i], p.kv_local_from[i] = from, p.kv_local_end[i] = from + (int32_t)kv_chunk;
      p.kv_local_shift[i] = (int32_t)local.src[i] - from;
    }
    kernel<<<(unsigned)grid, L::THREADS, L::SMEM_BYTES, stream>>>(maps->q, maps->k, maps->v, maps->o, lm[0], lm[1],
                                                                  p);
  } else {
    (void)local;
    kernel<<<(unsigned)grid, L::THREADS, L::SMEM_BYTES, stream>>>(maps->q, maps->k, maps->v, maps->o, p);
  }
  return cudaGetLastError();
}

}  // namespace attention
}  // namespace tsgen

#endif  // TSGEN_ATTENTION_CUH
