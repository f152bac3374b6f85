// tsgen/attention_bwd_wgmma.cuh -- the flash-attention backward's main kernel for Hopper (sm_90a),
// in the FlashAttention-3 style: TMA loads, an mbarrier ring fed by a producer warp, two consumer
// warpgroups computing every product with wgmma. The second implementation of the main kernel
// (params.impl: wgmma); the preprocess, the dQ conversion, the workspace and the calling
// convention are tsgen/attention_bwd.cuh's (the mma.sync kernel's), shared.
//
// Hand-written; included by generated attention_backward sources with params.impl = wgmma. The
// op's template supplies a `Config` struct: the attention_bwd Config's members (Element, BF16,
// HEAD_DIM, HEADS, KV_HEADS, CAUSAL, BHSD, SCALE, SCALE_LOG2, SMEM_BYTES), TILE_M (= BLOCK_M)
// and TILE_N (= BLOCK_N, for the forward's TMA descriptor encoder), STAGES, and three wgmma
// instructions (templates/ops/attention_backward.cu.j2):
//   mma_s   (m64n64k16,        A and B K-major in shared memory):   S^T = K Q^T, dP^T = V dO^T
//   mma_rs  (m64n{HEAD_DIM}k16, A in registers, B N-major):         dV += P^T dO, dK += dS^T Q
//   mma_dq  (m64n64k16,        A M-major, B N-major, shared memory): dQ = dS K
//
// Work: one CTA per (block of BLOCK_N = 128 keys, KV head, sequence), KV block major as the
// mma.sync kernel's (block 0 of every head first: with CAUSAL it sees the most queries), or with
// params.head_group so inside groups of that many (sequence, KV head) pairs, one group after the
// other (kv_cta in tsgen/attention_bwd.cuh: fewer pairs live at once, their Q, dO and dQ
// accumulator shared through L2 by more CTAs). 384 threads:
//   * warpgroup 0: its warp 0 is the producer (40 registers, setmaxnreg.dec; warps 1-3 leave at
//     once). Lane 0 loads K and V of the block once (TMA, kv_full), then for each step of the walk
//     (query head of the GQA group, query block of BLOCK_M = 64 rows; CAUSAL skips the blocks that
//     see none of the CTA's keys, rows_see_keys) the Q and dO tiles into stage `step % STAGES` of
//     a ring (q_full / q_empty): lane 0 sets the stage's expected bytes (expect_tx, no arrival) and
//     issues them, with the step's LSE2 and D (ROWS fp32 each) by two bulk copies where q_len is a
//     multiple of 4 and both buffers start 16-byte aligned (every step's rows then a 16-byte
//     aligned run; produce() checks both); the 32 lanes store +inf and 0 for the rows
//     past q_len (and otherwise copy LSE2 and D through their registers), and every lane arrives on
//     q_full (32 arrivals and the bytes complete the phase).
//   * warpgroups 1 and 2, the consumers (232 registers): warpgroup w owns keys 64w .. 64w + 63 of
//     the block, as the M of its products (the transposed form, as the mma.sync kernel's). Per
//     step:
//       S^T = K_w Q^T, dP^T = V_w dO^T   (wgmma, 64 keys x 64 queries each, fp32; a group each)
//       P^T = exp2(SCALE_LOG2 S^T - LSE2) (0 where masked: key >= kv_len, or CAUSAL and key
//             after query; masked only on the steps that can need it) once S^T's group is done,
//             while dP^T's may still run; then dS^T = P^T (dP^T - D)
//       P^T, dS^T -> 16-bit A fragments in registers (the accumulator layout is the register-A
//             layout: the forward's to_operand); dS^T also to shared memory [key][query]
//             (128B-swizzled rows of 64 queries), buffer step % 2
//       dV_w += P^T dO, dK_w += dS^T Q   (wgmma, A from registers, dO and Q N-major: one group)
//       barrier DS_READY (both consumer warpgroups: dS^T of all BLOCK_N keys is in shared memory)
//       dQ (64 queries x 64 columns) = dS K (wgmma, dS^T read M-major through the transpose bit,
//             K N-major): HEAD_DIM 128: warpgroup w takes columns 64w .. 64w + 63 over all 128
//             keys; HEAD_DIM 64: warpgroup w takes all 64 columns over its own 64 keys (either
//             way an m64n64 accumulator of 32 registers; a 32-column half of a 128-byte swizzle
//             row is not a canonical wgmma layout)
//       wait for the dV / dK group, release the stage (q_empty), wait for dQ, add it into
//             dq_accum: DQ_TILED (dq_reduce bulk, the default): the 64 x 64 partial into the
//             warpgroup's fp32 staging buffer in shared memory (tsgen::attention_bwd::dq_tiled_offset's
//             panel order), barrier DQ_STAGED + w, and one cp.reduce.async.bulk .add.f32 adds the
//             step's valid rows (n x 256 contiguous bytes) into the tiled dq_accum, issued by the dQ
//             writer warp (DQ_WRITER: not deterministic, not lookahead; write_dq) or else thread 0;
//             dq_reduce atomic: fp32 reductions from registers (red.global.add.f32, dQ's own
//             layout). Either way a race by design, as the mma.sync kernel's: the order of the adds
//             is not fixed, except with DETERMINISTIC (params.deterministic, bulk only): thread 0
//             waits until the query block's semaphore (dq_semaphores, after dq_accum) reaches its
//             CTA's turn, DQ_ADDERS x visitor_rank (the KV blocks' order), before its reduction, and
//             raises it a step later, once the reduction is complete; HEAD_DIM 64 first sums the two
//             warpgroups' partials of the same panel in shared memory (DQ_PAIRED: one reduction)
//     After the walk, dK (times SCALE) and dV leave from registers (rows past kv_len clipped).
//     params.dk_after_dq (consume, DK_AFTER_DQ): FlashAttention-3's order of the step's last products:
//     dV alone before DS_READY, then dQ, then dK once dV is done (wait_group 1; dS^T's registers stay
//     live until dK retires), then wait for dQ (wait_group 1) and stage and reduce it while dK still
//     runs; dK is waited for (wait_group 0) and the stage released (q_empty: dV read dO, dK read Q) at
//     the end of the step. The default drains the tensor pipe (dV, dK, dQ all done) before the staging.
//     params.lookahead (consume_lookahead): the same products and waits, the next step's S^T issued
//     behind this step's dQ and its dP^T right after the dQ staging's stores, so that the tensor pipe
//     runs them under the dQ tail; the loop's back edge after dP^T's wait.
//     params.step_rows 128 (consume_tall; HEAD_DIM 64): steps of 128 query rows (STEP_ROWS), the same
//     products, waits and barriers per step over twice the rows: S^T, dP^T as m64n128, dV and dK over 8 k16
//     steps, dS^T in two panels of 64 queries, warpgroup w's dQ of queries 64w .. 64w + 63 over all 128 keys
//     into its own query block's bulk reduction. With params.dk_after_dq as well: consume()'s DK_AFTER_DQ order
//     (dV alone, DS_READY, dQ, dK once dV is done, the dQ staged and reduced while dK runs, then dK's wait and
//     q_empty at the end of the step).
//     params.step_rows 80 (consume()'s WIDE form; HEAD_DIM 128, not causal, the dQ writer warp): steps of 80 query
//     rows (WIDE_ROWS, FlashAttention-4's hd 128 tile), Q / dO boxes of 80 rows: S^T, dP^T as m64n80 (40 registers
//     each), dV and dK over 5 k16 steps, dS (not transposed: [query][key], two boxes of 64 keys, ds_wide_offset)
//     by stmatrix .trans, dQ computed transposed (dQ^T = K^T dS^T, m64n80: 80 is no multiple of wgmma's M) by
//     warpgroup w for head-dim columns 64w .. 64w + 63, staged in dq_tiled_offset's order (stage_dq_t: one 32-bit
//     store a value) and added by the writer warp in one or two bulk reductions (dq_run: the step's 80 rows cross
//     at most one 64-row block of the tiled layout); 240 registers a consumer, 24 the producer's warpgroup.
//
// Hazards (and what orders each):
//   - Q / dO / LSE2 / D stage reuse: the producer reloads a stage only after both consumer
//     warpgroups arrived on its q_empty (one thread each), which each does after wgmma.wait_group
//     has retired every wgmma reading the stage (S^T, dP^T, dV, dK), and after DS_READY: every
//     thread of both warpgroups read its LSE2 / D before that barrier (the arrive is a release).
//     With DK_AFTER_DQ the arrive is at the end of the step, after the wait_group 0 that retires dK (the
//     last reader of Q); dV (dO's) has retired before dK was issued.
//   - LSE2 / D written by generic stores of the producer lanes, read by the consumers: each
//     lane's mbarrier arrive (release) before the consumers' wait (acquire) on q_full.
//   - dS^T written by generic stores, read by wgmma (the async proxy): fence.proxy.async.shared::cta
//     by every writing thread, then the named barrier DS_READY, then the wgmma.
//   - dS^T buffer reuse: buffer step % 2. A warpgroup writes buffer b % 2 at step b + 2 only after
//     passing DS_READY of step b + 1, which the other warpgroup reaches only after its
//     wgmma.wait_group retired its dQ product of step b (the only reader of that buffer).
//   - Registers under wgmma: wgmma.fence before every group whose A fragments or accumulators
//     were written by ordinary instructions; accumulators read only after wgmma.wait_group
//     (fence_operand keeps the compiler from hoisting the reads).
//   - Rows past q_len: TMA fills Q and dO with zeros, LSE2 = +inf gives P = 0 (no mask needed);
//     keys past kv_len: zeros give S = 0 and P = exp2(-LSE2) != 0, so they are masked explicitly.
//   - DQ_TILED, the staging buffer (one per consumer warpgroup): generic stores read by the bulk
//     reduction (async proxy): fence.proxy.async.shared::cta by every writing thread, then the
//     warpgroup's named barrier DQ_STAGED + w, then one thread issues the reduction. DQ_WRITER: the
//     warpgroup arrives (bar.arrive, 160 = its 128 threads and the writer warp) and goes on; the writer
//     warp syncs there and its lane 0 issues. Reuse: the writer waits until the reduction has read its
//     source (cp.async.bulk.wait_group.read: 1 for warpgroup 0's, the older group, then 0), then arrives
//     on DQ_FREE + w, on which the warpgroup syncs before it stages again (both start free: the writer
//     arrives once on each before the first step; after the last step it arrives on neither, so no
//     barrier is left half-arrived). Without the writer (deterministic, lookahead), thread 0 issues
//     after the warpgroup's sync and the next step writes the buffer only after DS_READY, which thread 0
//     reaches only after cp.async.bulk.wait_group.read 0 (bulk groups are per thread, and thread 0
//     issued them all). At the end the issuing thread waits for the writes (cp.async.bulk.wait_group 0)
//     before the CTA exits.
//   - DQ_TILED, dq_accum: the preprocess zeroes every float (same size as dQ; the tiled layout is a
//     permutation), in stream order before this kernel; the convert pass reads it (ConvertTiled: one
//     CTA per 64-row block) after this kernel (stream order; the bulk writes complete before exit).
//   - TAIL_SPLIT (params.tail_split, not causal): the producer and both consumer warpgroups of a piece walk the
//     same Part (tail_part of blockIdx.x: a function of the Problem alone), so their steps and stages agree as
//     in a whole item. The pieces' dK, dV: red.relaxed.gpu adds into their item's tail slot, which
//     Main::launch zeroes (cudaMemsetAsync) before the main kernel and the tail kernel (tail_convert) reads
//     after it, both in stream order; nothing else reads a slot during the main kernel. The pieces' dQ adds
//     are the whole items' bulk reductions into dq_accum. Rows of a slot past kv_len hold zeros (masked
//     keys: P = dS = 0) and are not converted.
//   - The producer's tail waits (with the timeout of gemm::mbar_wait) for the consumers' release
//     of the last STAGES steps: a consumer stuck on a load that never lands traps, not hangs.
//   - DETERMINISTIC, the turns: the CTAs adding into one query block are KV blocks 0 .. J - 1
//     (visitor_rank) and wait for turns 0, DQ_ADDERS, 2 DQ_ADDERS, ...: each waits only for lower
//     KV blocks, and holds no turn while it waits (the last one is passed on before DS_READY of the
//     next step, ahead of the next wait), so the chain ends, PROVIDED that every CTA a CTA waits for
//     has started or can start: the grid puts KV block j of every head before block j + 1
//     (main_kernel: blockIdx.x = j x batch x KV_HEADS + ...; with params.head_group, of every head of
//     its group, kv_cta: a head's block j still before its block j + 1), and the argument relies on the hardware
//     starting CTAs in increasing blockIdx order, which CUDA does not promise (FA3's deterministic
//     backward and CUTLASS's serial split-K rely on it too). A scheduler that started higher blocks
//     first and filled every SM with waiting CTAs would hang them (the producers' timeout traps).
//     Order of one add after the previous one: the previous adder's cp.async.bulk.wait_group 0 (its
//     writes complete), fence.proxy.async.global, red.release.gpu; this adder's ld.acquire.gpu (after
//     ld.relaxed.gpu polls, wait_dq_turn), then fence.proxy.async.global, then its reduction (the
//     async proxy). The semaphores: zeroed by the preprocess in stream order, as dq_accum. A turn
//     that never comes: the consumers spin without a timeout; the producer's tail waits (with it)
//     for the CTA's last turn to be passed on.
//   - DQ_PAIRED, warpgroup 1's staging read by warpgroup 0 (generic loads): written, then bar.arrive
//     DQ_PAIR against warpgroup 0's bar.sync; rewritten only after the next DS_READY, which warpgroup
//     0 reaches after its reads.
#ifndef TSGEN_ATTENTION_BWD_WGMMA_CUH
#define TSGEN_ATTENTION_BWD_WGMMA_CUH

#include "tsgen/attention.cuh"
#include "tsgen/attention_bwd.cuh"

namespace tsgen {
namespace attention_bwd {
namespace wgmma {

// Config::LOOKAHEAD where the Config has it (only specs with params.lookahead emit it), else false:
// consume_lookahead(), the next step's S^T and dP^T issued under this step's dQ tail.
template <class C, class = void>
struct lookahead_of : std::false_type {};
template <class C>
struct lookahead_of<C, std::void_t<decltype(C::LOOKAHEAD)>> : std::integral_constant<bool, C::LOOKAHEAD> {};

// Config::DK_AFTER_DQ where the Config has it (only specs with params.dk_after_dq emit it), else false:
// consume() issues dV alone before DS_READY, then dQ, then dK, and stages the dQ while dK runs.
template <class C, class = void>
struct dk_after_dq_of : std::false_type {};
template <class C>
struct dk_after_dq_of<C, std::void_t<decltype(C::DK_AFTER_DQ)>> : std::integral_constant<bool, C::DK_AFTER_DQ> {};

// Config::TAIL_SPLIT where the Config has it (only specs with params.tail_split resolved on emit it), else false:
// the grid's last items, those of a last wave that would leave most SMs idle, each cut into pieces along its walk
// (tail_plan; main_kernel), their dK, dV added in fp32 into the tail slots after dq_accum (tail_accum), converted
// by the tail kernel (tail_convert). Not causal only (a causal walk skips steps: its ranges are not a division).
template <class C, class = void>
struct tail_split_of : std::false_type {};
template <class C>
struct tail_split_of<C, std::void_t<decltype(C::TAIL_SPLIT)>> : std::integral_constant<bool, C::TAIL_SPLIT != 0> {};

// Config::KV_PUSH where the Config has it (only specs with params.kv_push emit it), else false: the main kernel's
// dK, dV partial sums go to the rank that holds their keys (KvPush, tsgen/attention_bwd.cuh; store_dk_dv), and the
// owner's push_reduce adds them up.
template <class C, class = void>
struct kv_push_of : std::false_type {};
template <class C>
struct kv_push_of<C, std::void_t<decltype(C::KV_PUSH)>> : std::integral_constant<bool, C::KV_PUSH != 0> {};

using attention::mbar_wait_no_timeout;
using attention::tma_load_4d;
using gemm::bulk_commit_group;
using gemm::bulk_wait_group_all;
using gemm::bulk_wait_group_read;
using gemm::fence_mbarrier_init_release_cluster;
using gemm::fence_proxy_async_global;
using gemm::mbar_arrive;
using gemm::mbar_arrive_expect_tx;
using gemm::mbar_expect_tx;
using gemm::bulk_load;
using gemm::mbar_init;
using gemm::mbar_wait;
using gemm::named_barrier_sync;
using gemm::prefetch_tensormap;
using gemm::setmaxnreg_dec;
using gemm::setmaxnreg_inc;
using gemm::smem_u32;
using gemm::st_shared_u32;
using gemm::sw128_descriptor;
using gemm::wgmma_commit_group;
using gemm::wgmma_fence;
using gemm::wgmma_wait_group;

constexpr int BLOCK_M = 64;   // query rows per step (params.step_rows 128: two such blocks per step)
constexpr int WIDE_ROWS = 80;  // params.step_rows 80: query rows per step of consume()'s WIDE form
// the preprocess zeroes the semaphores per attention_bwd::BLOCK_M rows (dq_semaphores), the walk uses these
static_assert(BLOCK_M == ::tsgen::attention_bwd::BLOCK_M, "one query block for the semaphores and the walk");

// Config::STEP_ROWS where the Config has it (only specs with params.step_rows 80 or 128 emit it), else BLOCK_M:
// the query rows of one step of the walk. 128 (head dim 64 only): consume_tall(), FlashAttention-3's hd 64
// tile (128 queries x 128 keys), each fixed cost of a step (its waits, barriers, bulk issue, the walk's
// advance) paid once per 128 query rows instead of once per 64. 80 (head dim 128, not causal: WIDE):
// consume() with S^T, dP^T as m64n80 and dQ computed transposed (dQ^T = K^T dS^T, m64 head-dim columns x n80
// queries: 80 is no multiple of 64, the M of a wgmma), FlashAttention-3's and -4's hd 128 tile when not causal;
// the step's fixed costs paid once per 80 rows, within the registers (S^T, dP^T 40 each) and shared memory.
template <class C, class = void>
struct step_rows_of : std::integral_constant<int, BLOCK_M> {};
template <class C>
struct step_rows_of<C, std::void_t<decltype(C::STEP_ROWS)>> : std::integral_constant<int, C::STEP_ROWS> {};
constexpr int BLOCK_N = 128;  // keys per CTA: 64 per consumer warpgroup
// TAIL_SPLIT: the most items split (tsgen/ops/attention_backward.py TAIL_ITEMS: the workspace's tail slots, each
// BLOCK_N key rows x (dK, dV) x HEAD_DIM floats, after dq_accum's floats)
constexpr uint32_t TAIL_ITEMS = 64;
constexpr int THREADS = 384;
constexpr uint32_t DS_READY = 1;  // named barrier of the two consumer warpgroups (0 is __syncthreads')
constexpr uint32_t DQ_STAGED = 2;  // + w: named barrier of consumer warpgroup w (DQ_TILED: its staging written)
constexpr uint32_t DQ_PAIR = 4;    // DQ_PAIRED: warpgroup 1's partial staged, for warpgroup 0 (arrive / sync)
constexpr uint32_t DQ_FREE = 5;    // + w: DQ_WRITER: warpgroup w's staging read by its last reduction (writer arrives)
constexpr uint32_t WRITER_BAR = 160;  // DQ_WRITER: DQ_STAGED + w and DQ_FREE + w: a consumer warpgroup and the writer

// cp.reduce.async.bulk (not .tensor): `bytes` (a multiple of 16) of fp32 at shared `src` added into
// global `dst` (both 16-byte aligned), element-wise, at L2, by the TMA unit; each element's add is
// atomic, the order of concurrent adds is not fixed. Completes through this thread's bulk groups
// (gemm.cuh's bulk_commit_group, bulk_wait_group_read, bulk_wait_group_all).
static __device__ __forceinline__ void bulk_reduce_add_f32(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst), "r"(src),
               "r"(bytes)
               : "memory");
}

// bar.sync with an immediate id (ptxas counts the ids a kernel uses; an id in a register counts as all 16)
template <uint32_t ID>
static __device__ __forceinline__ void named_barrier_sync_imm(uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"n"(ID), "r"(threads) : "memory");
}

// bar.arrive with an immediate id (the same count as named_barrier_sync_imm's)
template <uint32_t ID>
static __device__ __forceinline__ void named_barrier_arrive_imm(uint32_t threads) {
  asm volatile("bar.arrive %0, %1;" ::"n"(ID), "r"(threads) : "memory");
}

static __device__ __forceinline__ void st_shared_v2_f32(uint32_t addr, float x, float y) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(x), "f"(y) : "memory");
}

static __device__ __forceinline__ void ld_shared_v2_f32(uint32_t addr, float& x, float& y) {
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(x), "=f"(y) : "r"(addr) : "memory");
}

template <class C>
struct Layout {
  static_assert(sizeof(typename C::Element) == 2, "16-bit inputs");
  static_assert(C::HEAD_DIM == 64 || C::HEAD_DIM == 128, "head dim 64 or 128");
  static_assert(C::TILE_N == BLOCK_N, "the Config's key tile is this header's");
  static constexpr int BOXES = C::HEAD_DIM / 64;  // 64-column (128-byte) boxes per row
  // query rows per step: BLOCK_M, or params.step_rows' 128 (TALL: consume_tall, head dim 64 only) or 80 (WIDE:
  // consume() with S^T, dP^T as m64n80 and dQ transposed, head dim 128 not causal)
  static constexpr int ROWS = step_rows_of<C>::value;
  static constexpr bool TALL = ROWS == 2 * BLOCK_M;  // consume_tall
  static constexpr bool WIDE = ROWS == WIDE_ROWS;    // consume() with dQ transposed (step_rows_of)
  static constexpr int BOX_ROWS = WIDE ? ROWS : BLOCK_M;  // rows of the Q and dO maps' box (C::TILE_M)
  static constexpr int HALVES = ROWS / BOX_ROWS;  // TMA boxes of BOX_ROWS rows per Q or dO tile and box column
  static constexpr int Q_BOX = BOX_ROWS * 128;    // one TMA box of a Q or dO tile
  static constexpr int KV_BOX = BLOCK_N * 128;    // one box of K or V
  static constexpr int Q_TILE = BOXES * HALVES * Q_BOX;  // [box column][ROWS rows] (TALL: one column)
  static constexpr int KV_TILE = BOXES * KV_BOX;
  static_assert(C::TILE_M == BOX_ROWS && attention::o_box_rows_of<C>::value == BOX_ROWS, "the Q and dO maps' box is a step's");
  static constexpr int DS_PANEL = BLOCK_N * 128;  // dS^T: BLOCK_N key rows x 64 queries (16-bit), 128B-swizzled
  // WIDE: dS (not transposed) [80 queries][64 keys] a box, 128B-swizzled, box w the keys of consumer warpgroup w
  static constexpr int DS_BOX = ROWS * 128;
  static_assert(!WIDE || DS_BOX == WIDE_ROWS * 128, "ds_wide_offset's box");
  // dS^T's buffer: TALL two panels, queries 0 .. 63 and 64 .. 127; WIDE dS in two boxes
  static constexpr int DS_BUF = WIDE ? 2 * DS_BOX : HALVES * DS_PANEL;
  static constexpr int SN = ROWS / 2;           // fp32 per thread of a 64 x ROWS accumulator (S^T, dP^T)
  static constexpr int S_ACC = 32;              // fp32 per thread of a 64 x 64 accumulator
  static constexpr int D_ACC = C::HEAD_DIM / 2;  // of a 64 x HEAD_DIM one (dK, dV)
  static constexpr int K16 = ROWS / 16;          // k16 steps of dV, dK (over the step's queries)
  static constexpr bool DQ_SPLIT_N = C::HEAD_DIM == 128;  // dQ: columns split (else keys split)
  static constexpr int DQ_KEYS = DQ_SPLIT_N ? BLOCK_N : 64;
  static constexpr bool DQ_TILED = C::DQ_TILED;   // dQ by bulk reductions through a staging buffer
  static constexpr int DQ_BUF = (WIDE ? ROWS : BLOCK_M) * 64 * 4;  // one warpgroup's fp32 dQ partial (rows x 64)
  // params.deterministic: the bulk reductions into a query block wait their turn (dq_semaphores)
  static constexpr bool DETERMINISTIC = deterministic_of<C>::value;
  static_assert(!DETERMINISTIC || DQ_TILED, "deterministic: the ordered adds are the bulk reductions");
  // DETERMINISTIC with HEAD_DIM 64: both warpgroups' partials are of the same 64 x 64 panel; warpgroup 0
  // adds warpgroup 1's to its own (through its staging) and alone issues the step's reduction. Ordering
  // the two warpgroups' adds on the semaphore instead would make warpgroup 1 wait for warpgroup 0's
  // turn to be passed on, a step later (after its completion wait): the two would alternate, not overlap.
  static constexpr bool DQ_PAIRED = DETERMINISTIC && !DQ_SPLIT_N;
  static constexpr uint32_t DQ_ADDERS = DQ_PAIRED ? 1 : 2;  // reductions per CTA and step into the query block
  // params.lookahead: consume_lookahead (bulk dQ, not deterministic: tsgen/ops/attention_backward.py refuses both)
  static constexpr bool LOOKAHEAD = lookahead_of<C>::value;
  static_assert(!LOOKAHEAD || (DQ_TILED && !DETERMINISTIC), "lookahead: the bulk dQ path, not deterministic");
  // The dQ writer warp (warp 1 of the producer warpgroup; FlashAttention-4's sm_90 backward has one): where
  // dQ is reduced in bulk and in no fixed order, a consumer warpgroup stages its dQ partial, arrives on
  // DQ_STAGED + w and goes on; the writer waits there, issues the bulk reduction, and arrives on DQ_FREE + w
  // once the reduction has read the staging; the warpgroup syncs on that before it stages again. Without it
  // (deterministic, lookahead), the warpgroup syncs on DQ_STAGED + w and its thread 0 issues and waits.
  static constexpr bool DQ_WRITER = DQ_TILED && !DETERMINISTIC && !LOOKAHEAD;
  // params.dk_after_dq: consume()'s product order dV | DS_READY | dQ, dK (tsgen/ops/attention_backward.py refuses the rest)
  static constexpr bool DK_AFTER_DQ = dk_after_dq_of<C>::value;
  static_assert(!DK_AFTER_DQ || (DQ_TILED && !DETERMINISTIC && !LOOKAHEAD),
                "dk_after_dq: the bulk dQ path, not deterministic, not lookahead");
  // params.tail_split: consume()'s pieces (tsgen/ops/attention_backward.py refuses the rest)
  static_assert(!tail_split_of<C>::value || (DQ_TILED && !DETERMINISTIC && !LOOKAHEAD && !TALL && !C::CAUSAL),
                "tail_split: the bulk dQ path, 64- or 80-row steps, not deterministic, not lookahead, not causal");
  // params.step_rows 128: consume_tall (tsgen/ops/attention_backward.py refuses the rest)
  static_assert(ROWS == BLOCK_M || (ROWS == 2 * BLOCK_M && C::HEAD_DIM == 64 && DQ_TILED && !DETERMINISTIC &&
                                    !LOOKAHEAD) || WIDE,
                "step_rows 128: head dim 64, the bulk dQ path, not deterministic, not lookahead");
  // params.step_rows 80 (tsgen/ops/attention_backward.py refuses the rest): dQ^T's M is the head dim split between
  // the warpgroups (64 columns each), its staging read by the writer warp
  static_assert(!WIDE || (C::HEAD_DIM == 128 && DQ_WRITER && !C::CAUSAL && !kv_push_of<C>::value),
                "step_rows 80: head dim 128, the bulk dQ path with the writer warp, not causal, not kv_push");

  static constexpr int K_OFF = 0;
  static constexpr int V_OFF = K_OFF + KV_TILE;
  static constexpr int Q_OFF = V_OFF + KV_TILE;
  static constexpr int DO_OFF = Q_OFF + C::STAGES * Q_TILE;
  static constexpr int DS_OFF = DO_OFF + C::STAGES * Q_TILE;
  static constexpr int DQ_OFF = DS_OFF + 2 * DS_BUF;  // DQ_TILED: fp32 [2 warpgroups][DQ_BUF / 256 rows][64]
  static constexpr int LSE2_OFF = DQ_OFF + (DQ_TILED ? 2 * DQ_BUF : 0);  // fp32 [STAGES][ROWS]
  static constexpr int DSUM_OFF = LSE2_OFF + 4 * C::STAGES * ROWS;
  static constexpr int BAR_OFF = DSUM_OFF + 4 * C::STAGES * ROWS;
  static constexpr int KV_FULL = BAR_OFF, Q_FULL = BAR_OFF + 8, Q_EMPTY = Q_FULL + 8 * C::STAGES;
  static constexpr int SMEM_BYTES = Q_EMPTY + 8 * C::STAGES + 1024;  // + slack for aligning the base
  static_assert(LSE2_OFF % 16 == 0 && DSUM_OFF % 16 == 0 && 4 * ROWS % 16 == 0, "produce()'s bulk copies of LSE2 / D");
  static_assert(SMEM_BYTES == C::SMEM_BYTES, "tsgen/ops/attention_backward.py smem_bytes() disagrees");
};

// The walk of one CTA: (query head of the group, query block), CAUSAL skipping the blocks that see
// none of its keys. The producer and the consumers step through the same sequence. Query heads outer,
// query blocks ascending; DESCENDING (DETERMINISTIC): query blocks descending, the group's query heads
// inner. The turns (visitor_rank) do not depend on the order, the wait chain does: with CAUSAL, KV block
// j skips a query block's rows that see none of its keys, the lowest ones (positions from 0), 2j blocks
// of every head. Ascending, j then reaches a (head, block) up to 2 GROUP + 1 steps earlier in its walk
// than j - 1, which adds first: each visitor lags the previous by that many steps. Descending, the
// skipped blocks come last, and every visitor reaches a (head, block) at the same step of its walk
// ((q_blocks - 1 - qb) GROUP + the head's index; the zig-zag's second segment, whose positions are the
// later ones, first): each lags the previous by the one step of its turn's hand-over.
// What one CTA of the main kernel walks: its item's whole walk, or (TAIL_SPLIT, a piece of a split item) steps
// [begin, begin + count) of it, its dK, dV then added into tail slot `slot` (main_kernel, tail_plan).
struct Part {
  static constexpr uint32_t WHOLE = 0xFFFFFFFFu;
  uint32_t begin = 0, count = WHOLE, slot = WHOLE;
  __host__ __device__ __forceinline__ bool whole() const { return slot == WHOLE; }
};

template <class C>
struct Walk {
  static constexpr uint32_t GROUP = C::HEADS / C::KV_HEADS;
  static constexpr bool DESCENDING = deterministic_of<C>::value;
  static constexpr uint32_t ROWS = step_rows_of<C>::value;  // query rows per step (block qb: rows qb ROWS ..)
  static constexpr bool RANGED = tail_split_of<C>::value;  // a Part's step range (not causal, ascending)
  static_assert(!RANGED || (!C::CAUSAL && !DESCENDING), "a step range divides an unskipped, ascending walk");
  uint32_t hq, qb, q_blocks, hq_end;
  int32_t first_key;
  uint32_t left;  // RANGED: the steps still to walk
  __host__ __device__ __forceinline__ Walk(const Problem& p, uint32_t hk, int32_t first_key_, Part part = Part{})
      : hq(hk * GROUP), qb(DESCENDING && p.q_len > 0 ? (p.q_len - 1) / ROWS : 0),
        q_blocks((p.q_len + ROWS - 1) / ROWS), hq_end((hk + 1) * GROUP), first_key(first_key_), left(part.count) {
    if constexpr (RANGED)  // step s of the walk is (query head hk GROUP + s / q_blocks, query block s % q_blocks)
      if (q_blocks > 0) hq += part.begin / q_blocks, qb = part.begin % q_blocks;
    skip(p);
  }
  __host__ __device__ __forceinline__ bool done() const {
    if constexpr (RANGED)
      if (left == 0) return true;
    return hq >= hq_end || q_blocks == 0;
  }
  __host__ __device__ __forceinline__ void next(const Problem& p) {
    advance();
    if constexpr (RANGED) --left;
    skip(p);
  }
  // the whole walk's steps (not causal: every (query head of the group, query block))
  __host__ __device__ __forceinline__ static uint32_t steps(const Problem& p) {
    return GROUP * ((p.q_len + ROWS - 1) / ROWS);
  }
  __host__ __device__ __forceinline__ uint32_t rows_end(const Problem& p) const {  // r1 of the step
    return (qb + 1) * ROWS < p.q_len ? (qb + 1) * ROWS : p.q_len;
  }

 private:
  __host__ __device__ __forceinline__ void advance() {
    if constexpr (DESCENDING) {
      if (++hq == hq_end && qb != 0) hq -= GROUP, --qb;  // past the last head of block 0: done
    } else {
      if (++qb == q_blocks) qb = 0, ++hq;
    }
  }
  __host__ __device__ __forceinline__ void skip(const Problem& p) {
    if constexpr (C::CAUSAL) {
      while (!done()) {
        const uint32_t r0 = qb * ROWS, r1 = rows_end(p);
        if (rows_see_keys(p, (int32_t)r0, (int32_t)r1, first_key)) break;
        advance();
      }
    }
  }
};

// Whether step (query rows [r0, r1), the CTA's keys from first_key) needs the element-wise mask:
// keys past kv_len, or (CAUSAL) a key after the earliest query position of the rows. Host-compiled
// by the tests (with Walk).
__host__ __device__ __forceinline__ bool step_masked(const Problem& p, bool causal, uint32_t k0, int32_t first_key,
                                                     int32_t r0, int32_t r1) {
  if (k0 + BLOCK_N > p.kv_len) return true;
  if (!causal) return false;
  int32_t first = query_position(p, r0);
  if (r0 < p.q_split && p.q_split < r1) {
    const int32_t second = query_position(p, p.q_split);
    first = second < first ? second : first;
  }
  return first_key + BLOCK_N - 1 > first;
}

// params.deterministic (DETERMINISTIC): the rank of KV block j among the CTAs whose walks visit a query
// block that j's visits, the order of their adds into it. Walk visits query rows [r0, r1) from the KV
// block whose first key sits at position first_key iff rows_see_keys(p, r0, r1, first_key) (Walk::skip;
// every block without CAUSAL). That predicate compares the rows' latest position (over both zig-zag
// segments) with first_key, so if it holds for one first key it holds for every smaller one, and first
// keys grow with j: a query block's visitors are KV blocks 0 .. J - 1, and j's rank among them is j (no
// loop over the earlier blocks per step). Host-compiled by the tests against a count over Walk itself
// (offsets, the two segments, tails): a change of the walk that breaks the prefix fails there.
__host__ __device__ __forceinline__ uint32_t visitor_rank(uint32_t j) { return j; }

// DETERMINISTIC: the semaphore of walk step w (query head w.hq, query block w.qb) of sequence b.
template <class C>
__host__ __device__ __forceinline__ uint32_t* dq_semaphore(const Problem& p, uint32_t b, const Walk<C>& w) {
  return dq_semaphores<C>(p) + ((size_t)b * C::HEADS + w.hq) * w.q_blocks + w.qb;
}

// DETERMINISTIC: spin until the query block's semaphore reaches `turn`, the adds of every earlier visitor
// complete: one ld.acquire.gpu first (the turn usually came already), else ld.relaxed.gpu polls (an acquire
// load is a load plus an L1 invalidate each time) and one ld.acquire.gpu once one reads the turn (it reads
// that value or a later one: the semaphore only grows; a later one was raised by a later red.release, whose
// release sequence the earlier raises head). >=, not ==: with HEAD_DIM 128 the CTA's two warpgroups take the same turn (each
// adds into its own column panel) and the other one may already have passed it on. TIMEOUT: trap after
// TSGEN_TIMEOUT_NS without printing, as gemm::mbar_wait (a printf would serialize the kernel's wgmma): the
// producer's check. The consumers spin without one (a trap in their code costs their 232-register budget,
// see attention::mbar_wait_no_timeout); a consumer stuck on its turn makes the producer trap instead.
template <bool TIMEOUT>
static __device__ __forceinline__ void wait_dq_turn(const uint32_t* sem, uint32_t turn) {
  if (ld_acquire_gpu_global_u32(sem) >= turn) return;
  if constexpr (TIMEOUT) {
    const uint64_t start = globaltimer_ns();
    while (ld_relaxed_gpu_global_u32(sem) < turn)
      if (TSGEN_TIMEOUT_NS != 0 && globaltimer_ns() - start > (uint64_t)TSGEN_TIMEOUT_NS) __trap();
  } else {
    while (ld_relaxed_gpu_global_u32(sem) < turn) {
    }
  }
  (void)ld_acquire_gpu_global_u32(sem);
}

// DETERMINISTIC: pass the turn of this thread's last reduction (semaphore `sem`, none if nullptr) on, once
// the reduction is complete: its writes done (cp.async.bulk.wait_group 0, not only .read), then a proxy
// fence (the async proxy's writes before the generic release), then +1 with release at gpu scope. Called
// a step after the reduction was issued (before the next DS_READY), so that the wait is off the critical
// path. Returns nullptr: no turn held.
static __device__ __forceinline__ uint32_t* pass_dq_turn(uint32_t* sem) {
  if (sem != nullptr) {
    bulk_wait_group_all();
    fence_proxy_async_global();
    red_add_release_gpu_global_u32(sem, 1u);
  }
  return nullptr;
}

// The producer warp (all 32 lanes; lane 0 issues the TMA loads).
template <class C>
static __device__ __forceinline__ void produce(const CUtensorMap* q_map, const CUtensorMap* k_map,
                                               const CUtensorMap* v_map, const CUtensorMap* do_map, uint32_t smem,
                                               const Problem& p, uint32_t b, uint32_t hk, uint32_t k0,
                                               Part part = Part{}) {
  using L = Layout<C>;
  const uint32_t lane = threadIdx.x % 32;
  if (lane == 0) {
    mbar_arrive_expect_tx(smem + L::KV_FULL, 2 * L::KV_TILE);
#pragma unroll
    for (int x = 0; x < L::BOXES; ++x) {
      attention::load_rows<C>(smem + L::K_OFF + x * L::KV_BOX, k_map, 64 * x, (int)k0, (int)hk, (int)b,
                              smem + L::KV_FULL);
      attention::load_rows<C>(smem + L::V_OFF + x * L::KV_BOX, v_map, 64 * x, (int)k0, (int)hk, (int)b,
                              smem + L::KV_FULL);
    }
  }
  uint32_t step = 0;
  uint32_t* last_semaphore = nullptr;  // DETERMINISTIC: that of the walk's last step
  // LSE2 and D by bulk copy where every step's rows are a 16-byte aligned run of whole 16-byte units: q_len a
  // multiple of 4 (a step starts at a multiple of 16 rows) and both buffers 16-byte aligned; else the lanes copy
  // them through registers. Either way the lanes store +inf and 0 for the step's rows past q_len.
  const bool bulk = p.q_len % 4 == 0 &&
                    ((reinterpret_cast<uintptr_t>(p.lse2) | reinterpret_cast<uintptr_t>(p.dsum)) % 16) == 0;
  for (Walk<C> w(p, hk, p.kv_offset + (int32_t)k0, part); !w.done(); w.next(p), ++step) {
    const uint32_t stage = step % C::STAGES, phase = (step / C::STAGES) & 1;
    mbar_wait(smem + L::Q_EMPTY + 8 * stage, phase ^ 1);  // a fresh barrier passes parity 1
    if constexpr (L::DETERMINISTIC) last_semaphore = dq_semaphore<C>(p, b, w);
    const uint32_t r0 = w.qb * L::ROWS;
    const uint32_t n = p.q_len - r0 < (uint32_t)L::ROWS ? p.q_len - r0 : (uint32_t)L::ROWS;  // the step's rows
    const size_t row0 = ((size_t)b * C::HEADS + w.hq) * p.q_len + r0;  // LSE2 / D of the step's first row
    const uint32_t full = smem + L::Q_FULL + 8 * stage;
    // Lane 0 expects the stage's bytes (no arrival) and issues its bulk copies and TMA loads before the lanes'
    // stores: the loads' latency runs under the stores instead of after them (docs/design/attention.md, "A second
    // cost in the same profiles", and the bulk copies after it). The phase completes with the bytes and all 32
    // arrivals below.
    if (lane == 0) {
      mbar_expect_tx(full, 2 * L::Q_TILE + (bulk ? 8 * n : 0));
      if (bulk) {
        bulk_load(smem + L::LSE2_OFF + 4 * stage * L::ROWS, p.lse2 + row0, 4 * n, full);
        bulk_load(smem + L::DSUM_OFF + 4 * stage * L::ROWS, p.dsum + row0, 4 * n, full);
      }
#pragma unroll
      for (int x = 0; x < L::BOXES; ++x)
#pragma unroll
        for (int h = 0; h < L::HALVES; ++h) {  // TALL: the box of rows r0 + 64 h .. (BOX_ROWS rows a box)
          const uint32_t box = stage * L::Q_TILE + (x * L::HALVES + h) * L::Q_BOX;
          // Rows past q_len in a box that starts in bounds: zeros (TMA). A box that would start past q_len (TALL's
          // second half where q_len - r0 <= 64) loads rows r0 .. again instead: the step's rows there are past
          // q_len, whose LSE2 = +inf and D = 0 make P = dS = 0 from any finite values, so every box starts in
          // bounds and nothing rests on a wholly out-of-bounds box
          const int rows = (int)(r0 + L::BOX_ROWS * h < p.q_len ? r0 + L::BOX_ROWS * h : r0);
          attention::load_rows<C>(smem + L::Q_OFF + box, q_map, 64 * x, rows, (int)w.hq, (int)b, full);
          attention::load_rows<C>(smem + L::DO_OFF + box, do_map, 64 * x, rows, (int)w.hq, (int)b, full);
        }
    }
    for (uint32_t i = (bulk ? n : 0) + lane; i < L::ROWS; i += 32) {
      const bool in = i < n;
      const float l2 = in ? p.lse2[row0 + i] : INFINITY;  // padding rows: P = 0
      const float d = in ? p.dsum[row0 + i] : 0.f;
      st_shared_u32(smem + L::LSE2_OFF + 4 * (stage * L::ROWS + i), __float_as_uint(l2));
      st_shared_u32(smem + L::DSUM_OFF + 4 * (stage * L::ROWS + i), __float_as_uint(d));
    }
    // The bulk path: the padding rows' generic stores here and a later phase's bulk copy over the same bytes
    // (a stage's short last block, then a full one) are ordered by this fence, not only by the consumers' (below)
    if (bulk) fence_proxy_async_shared_cta();
    mbar_arrive(full);  // each lane's stores above, released to the consumers' q_full wait
  }
  // Tail: the consumers release the last stages (with the timeout: a stuck pipeline traps).
  for (uint32_t s = step > (uint32_t)C::STAGES ? step - C::STAGES : 0; s < step; ++s)
    mbar_wait(smem + L::Q_EMPTY + 8 * (s % C::STAGES), (s / C::STAGES) & 1);
  // DETERMINISTIC: the consumers wait for their turns without a timeout and release the last stages before
  // the last turn; until this CTA's last adds are passed on, a stuck turn traps here (with the timeout)
  if constexpr (L::DETERMINISTIC)
    if (lane == 0 && last_semaphore != nullptr)
      wait_dq_turn<true>(last_semaphore, L::DQ_ADDERS * (visitor_rank(k0 / BLOCK_N) + 1));
}

// A 64 x 64 fp32 accumulator (the wgmma layout: register 4q + {0, 1} is (row g, column 8q + 2c + {0, 1}),
// 4q + {2, 3} row g + 8, with g = 16 warp + lane / 4, c = lane % 4) -> the 16-bit A fragments of a
// product over its columns: k16 step k holds registers (g, 2c), (g + 8, 2c), (g, 2c + 8), (g + 8, 2c + 8)
// of columns 16k .. 16k + 15 (as the forward's to_operand). N = 64 (TALL): a 64 x 128 accumulator, 8 steps.
template <class C, int N>
static __device__ __forceinline__ void to_operand(const float (&s)[N], uint32_t (&a)[N / 8][4]) {
#pragma unroll
  for (int k = 0; k < N / 8; ++k)
#pragma unroll
    for (int x = 0; x < 4; ++x) a[k][x] = gemm::pack2<typename C::Element>(s[8 * k + 2 * x], s[8 * k + 2 * x + 1]);
}

// The accumulator's query columns of this thread: f(col, i) for each column col it holds of the step's
// 8 x GROUPS queries (GROUPS: the accumulator's 8-column groups; 8 for a 64-query step, 16 for TALL's 128)
// and i, its register for key row g (i + 2: row g + 8); the layout of to_operand's.
template <int GROUPS, class F>
static __device__ __forceinline__ void each_query_column(F&& f) {
  const uint32_t c = threadIdx.x % 4;
#pragma unroll
  for (int q = 0; q < GROUPS; ++q)
#pragma unroll
    for (int e = 0; e < 2; ++e) f(8 * q + 2 * c + e, 4 * q + e);
}

// P^T in place of S^T at one query column `col` of the thread (registers i0 and i0 + 2: key rows g and g + 8;
// each_query_column's). MASK: keys past kv_len, or (CAUSAL) after the query, give 0. exp2 on MUFU, or on the FMA pipe
// for every EXP2_FMA_EVERY-th column group (params.exp2_fma_every).
template <class C, bool MASK, int N>
static __device__ __forceinline__ void probability_column(float (&s)[N], int col, int i0, uint32_t smem, uint32_t stage,
                                                          const Problem& p, uint32_t key_lo, int32_t r0) {
  using L = Layout<C>;
  const float l2 = __uint_as_float(attention::ld_shared_u32(smem + L::LSE2_OFF + 4 * (stage * L::ROWS + col)));
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = i0 + 2 * h;
    float pr = attention::exp2_of_group<C>(fmaf(s[i], C::SCALE_LOG2, -l2), i0 / 4);  // i0 / 4: the column group
    if constexpr (MASK) {
      const uint32_t key = key_lo + 8 * h;  // within the sequence
      bool seen = key < p.kv_len;
      if constexpr (C::CAUSAL) seen = seen && p.kv_offset + (int32_t)key <= query_position(p, r0 + col);
      if (!seen) pr = 0.f;
    }
    s[i] = pr;
  }
}

// dS^T = P^T (dP^T - D) in place of dP^T at one query column (a masked P is 0, so is its dS).
template <class C, int N>
static __device__ __forceinline__ void ds_column(const float (&pr)[N], float (&dp)[N], int col, int i0, uint32_t smem,
                                                 uint32_t stage) {
  using L = Layout<C>;
  const float d = __uint_as_float(attention::ld_shared_u32(smem + L::DSUM_OFF + 4 * (stage * L::ROWS + col)));
#pragma unroll
  for (int h = 0; h < 2; ++h) dp[i0 + 2 * h] = pr[i0 + 2 * h] * (dp[i0 + 2 * h] - d);
}

// The step's P^T and dS^T around dP^T's wait (N: the accumulators' registers, 32 or, TALL, 64): the column groups
// before EARLY get their P^T before the wait (early), the rest after it (late), each beside the dS^T of the groups,
// so that half of the exp2 (the MUFU pipe) run while the dS^T of the others is computed instead of all of them back
// to back before the wait, where dP^T is usually done already (FA4 issues half of its 32 MUFU.EX2 after dP's wait
// so: ncu, results/attention_backward/2026-11-28-e84d42e-stalls-fa4-hd128_causal_kv32.txt).
// The column groups of P^T computed before dP^T's wait: half of the N / 4 (one definition for both functions).
template <int N>
constexpr int EARLY_GROUPS = N / 8;

template <class C, bool MASK, int N>
static __device__ __forceinline__ void probabilities_early(float (&s)[N], uint32_t smem, uint32_t stage,
                                                           const Problem& p, uint32_t key_lo, int32_t r0) {
  each_query_column<EARLY_GROUPS<N>>(
      [&](int col, int i0) { probability_column<C, MASK>(s, col, i0, smem, stage, p, key_lo, r0); });
}
template <class C, bool MASK, int N>
static __device__ __forceinline__ void probabilities_late_and_ds(float (&s)[N], float (&dp)[N], uint32_t smem,
                                                                 uint32_t stage, const Problem& p, uint32_t key_lo,
                                                                 int32_t r0) {
  each_query_column<N / 4>([&](int col, int i0) {
    if (i0 / 4 >= EARLY_GROUPS<N>) probability_column<C, MASK>(s, col, i0, smem, stage, p, key_lo, r0);
    ds_column<C>(s, dp, col, i0, smem, stage);
  });
}

// All of a step's P^T, and all of its dS^T (params.lookahead computes them a wait apart, in two iterations).
template <class C, bool MASK, int N>
static __device__ __forceinline__ void probabilities_all(float (&s)[N], uint32_t smem, uint32_t stage,
                                                         const Problem& p, uint32_t key_lo, int32_t r0) {
  each_query_column<N / 4>(
      [&](int col, int i0) { probability_column<C, MASK>(s, col, i0, smem, stage, p, key_lo, r0); });
}
template <class C, int N>
static __device__ __forceinline__ void ds_all(const float (&pr)[N], float (&dp)[N], uint32_t smem, uint32_t stage) {
  each_query_column<N / 4>([&](int col, int i0) { ds_column<C>(pr, dp, col, i0, smem, stage); });
}

// DQ_TILED: this thread's float pairs of a warpgroup's 64 x 64 dQ partial in its staging buffer:
// f(address, i) for registers i, i + 1 of the accumulator (row `row` (+ 8) of the step's 64 queries, its
// 32-byte chunk q, columns 8q .. 8q + 7, at chunk q ^ (row % 8), row % 8 = lane / 4:
// tsgen::attention_bwd::dq_tiled_offset's panel order).
template <class F>
static __device__ __forceinline__ void each_staged_pair(uint32_t staging, uint32_t row, uint32_t lane, F&& f) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t at = staging + (row + 8 * h) * 256 + 8 * (lane % 4);
#pragma unroll
    for (int q = 0; q < 8; ++q) f(at + ((q ^ (lane / 4)) << 5), 4 * q + 2 * h);
  }
}

// stmatrix: four 8 x 8 matrices of 16-bit elements to shared memory, lane l giving the address of row l % 8 of
// matrix l / 8 (16 contiguous bytes) and holding in r[m] its part of matrix m: row l / 4, columns 2 (l % 4) and
// 2 (l % 4) + 1 (the wgmma accumulator's and to_operand's fragment layout).
static __device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3])
               : "memory");
}

// stmatrix .trans: as stmatrix_x4, each 8 x 8 matrix stored transposed: lane l's address is that of row l % 8 of
// matrix l / 8 in memory, which holds column l % 8 of the registers' matrix.
static __device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// WIDE: the byte offset in dS's buffer of query `query`'s 16 bytes holding keys 8 unit .. 8 unit + 7 of consumer
// warpgroup cw's 64 (box cw: 80 query rows of 128 bytes, 128B-swizzled: unit ^ query % 8). dQ^T reads it as its
// K-major B (FlashAttention-4's dS layout for 80-row steps). Host-compiled by the tests.
__host__ __device__ __forceinline__ constexpr uint32_t ds_wide_offset(uint32_t cw, uint32_t query, uint32_t unit) {
  return cw * WIDE_ROWS * 128 + query * 128 + ((unit ^ (query % 8)) << 4);  // box cw: Layout's DS_BOX bytes
}

// A step's dS^T (16-bit, the A fragments `ad` of K k16 steps: 4, TALL 8, WIDE 5) to shared memory at ds_base: key row
// 64 cw + 16 warp + (0 .. 15), query unit u (8 queries, 16 bytes) in panel u / 8 (DS_PANEL apart) at 16-byte unit
// (u % 8) ^ (row % 8) of its 128-byte row (the 128B swizzle), then fenced so that the wgmma (async proxy) sees it
// after the next barrier. One stmatrix a k16 step: ad[k] holds rows g and g + 8 of units 2k and 2k + 1 (to_operand:
// registers (g, 2c), (g + 8, 2c), (g, 2c + 8), (g + 8, 2c + 8)), the four 8 x 8 matrices of that step, in that
// order; lane l addresses row l % 8 of matrix m = l / 8: row 8 (m % 2) + l % 8 of the warp's 16, unit 2k + m / 2.
// (FlashAttention-4 stores dS so; 32-bit stores took four times the instructions, each with its own address.)
template <class C, int K>
static __device__ __forceinline__ void store_ds_t(uint32_t ds_base, uint32_t cw, uint32_t warp, uint32_t lane,
                                                  const uint32_t (&ad)[K][4]) {
  using L = Layout<C>;
  const uint32_t m = lane / 8, r = lane % 8;
  if constexpr (!L::WIDE) {
    const uint32_t base = ds_base + (64 * cw + 16 * warp + 8 * (m % 2) + r) * 128;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const uint32_t u = 2 * k + m / 2;
      stmatrix_x4(base + (u / 8) * L::DS_PANEL + (((u % 8) ^ r) << 4), ad[k]);
    }
  } else {  // transposed: matrix m is keys 16 warp + 8 (m % 2) .. + 7 x queries 16 k + 8 (m / 2) .. + 7; row r a query
#pragma unroll
    for (int k = 0; k < K; ++k)
      stmatrix_x4_trans(ds_base + ds_wide_offset(cw, 16 * k + 8 * (m / 2) + r, 2 * warp + m % 2), ad[k]);
  }
  // Also the fence between this thread's generic reads of the stage's LSE2 / D (before this call in every consume
  // form) and the producer's bulk copies into the same bytes two steps later (async proxy; ordered through
  // DS_READY and q_empty): keep every LSE2 / D read of a step before it
  fence_proxy_async_shared_cta();
}

// acc += A B over the step's queries (64, TALL 128: K16 k16 steps), A (P^T or dS^T) from registers, B (dO or Q
// of the stage at b_base) N-major, 16 rows = 2048 bytes a k16 step; no fence, no commit (the caller's group)
template <class C>
static __device__ __forceinline__ void rs_product(float (&acc)[Layout<C>::D_ACC],
                                                  const uint32_t (&a)[Layout<C>::K16][4], uint32_t b_base) {
  using L = Layout<C>;
  const uint64_t b_n = sw128_descriptor(b_base, L::Q_BOX, 1024);
#pragma unroll
  for (int k = 0; k < L::K16; ++k) C::mma_rs(acc, a[k], b_n + ((k * 2048) >> 4), 1);
}

// dV_w += P^T dO, dK_w += dS^T Q: one group.
template <class C>
static __device__ __forceinline__ void issue_dv_dk(float (&dv)[Layout<C>::D_ACC], float (&dk)[Layout<C>::D_ACC],
                                                   const uint32_t (&ap)[Layout<C>::K16][4], const uint32_t (&ad)[Layout<C>::K16][4],
                                                   uint32_t q_base, uint32_t do_base) {
  wgmma_fence();
  rs_product<C>(dv, ap, do_base);
  rs_product<C>(dk, ad, q_base);
  wgmma_commit_group();
}

// acc += A B (rs_product) as a group of its own: params.dk_after_dq's dV, and its dK after the dQ.
template <class C>
static __device__ __forceinline__ void issue_rs(float (&acc)[Layout<C>::D_ACC], const uint32_t (&a)[Layout<C>::K16][4],
                                                uint32_t b_base) {
  wgmma_fence();
  rs_product<C>(acc, a, b_base);
  wgmma_commit_group();
}

// A step's waits once its dQ is issued (the last group), up to the dQ's completion. DK_AFTER_DQ: wait for dV
// (P^T's registers free), issue dK (`issue_dk`: a group of its own) to run on the tensor pipe while the dQ is
// staged, wait for the dQ (dK may still run; its wait and the stage's q_empty come at the step's end). Else: wait
// for dV and dK (the stage's Q and dO no longer read), release the stage, wait for the dQ.
template <class C, class IssueDk>
static __device__ __forceinline__ void after_dq_issue(float (&dk)[Layout<C>::D_ACC], float (&dv)[Layout<C>::D_ACC],
                                                      uint32_t t, uint32_t smem, uint32_t stage, IssueDk issue_dk) {
  using L = Layout<C>;
  if constexpr (L::DK_AFTER_DQ) {
    wgmma_wait_group<1>();
    attention::fence_all<C>(dv, L::D_ACC);
    issue_dk();
    wgmma_wait_group<1>();
  } else {
    wgmma_wait_group<1>();
    attention::fence_all<C>(dk, L::D_ACC);
    attention::fence_all<C>(dv, L::D_ACC);
    if (t == 0) mbar_arrive(smem + L::Q_EMPTY + 8 * stage);
    wgmma_wait_group<0>();
  }
}

// DK_AFTER_DQ, the step's end (after_dq_issue left dK running): wait for dK, then release the stage (dV read dO,
// dK read Q; neither is read any more).
template <class C>
static __device__ __forceinline__ void dk_done_release_stage(float (&dk)[Layout<C>::D_ACC], uint32_t t, uint32_t smem,
                                                             uint32_t stage) {
  wgmma_wait_group<0>();
  attention::fence_all<C>(dk, Layout<C>::D_ACC);
  if (t == 0) mbar_arrive(smem + Layout<C>::Q_EMPTY + 8 * stage);
}

// dK (times the scale) and dV of rows row_lo (+ 8) of tensors dk_out, dv_out of `len` rows a sequence, columns
// 8q + 2c (+ 1); rows from `end` on clipped.
template <class C>
static __device__ __forceinline__ void store_dk_dv_rows(void* dk_out, void* dv_out, uint32_t len, uint32_t end,
                                                        uint32_t b, uint32_t hk, uint32_t row_lo, uint32_t lane,
                                                        const float (&dk)[Layout<C>::D_ACC],
                                                        const float (&dv)[Layout<C>::D_ACC]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t r = row_lo + 8 * h;
    if (r >= end) continue;
    const size_t at = row_offset<C>(b, r, hk, C::KV_HEADS, len);
    uint32_t* dkg = reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(dk_out) + at);
    uint32_t* dvg = reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(dv_out) + at);
#pragma unroll
    for (int q = 0; q < C::HEAD_DIM / 8; ++q) {
      dkg[4 * q + lane % 4] = pack2<C>(dk[4 * q + 2 * h] * C::SCALE, dk[4 * q + 2 * h + 1] * C::SCALE);
      dvg[4 * q + lane % 4] = pack2<C>(dv[4 * q + 2 * h], dv[4 * q + 2 * h + 1]);
    }
  }
}

// The walk's end: consumer warpgroup cw's dK (times the scale) and dV of key rows key_lo (+ 8) to global; rows past
// kv_len clipped. KV_PUSH with a table (p.push, <kernel>_backward_push): to the keys' owner (KvPush): this rank's
// own keys into p.dk, p.dv at its rows; another rank's into that rank's receive area (this rank's slot of the
// call's parity), over NVLink, not waited for: push_signal, after this kernel, tells the owners. The warpgroup's
// 64 keys share one owner (the caller's rows are a multiple of 128: tsgen.torch's pushes()).
template <class C>
static __device__ __forceinline__ void store_dk_dv(const Problem& p, uint32_t b, uint32_t hk, uint32_t key_lo,
                                                   uint32_t lane, const float (&dk)[Layout<C>::D_ACC],
                                                   const float (&dv)[Layout<C>::D_ACC]) {
  if (!kv_push_of<C>::value || p.push == nullptr) {  // KV_PUSH without a table: the plain backward (<kernel>_backward)
    store_dk_dv_rows<C>(p.dk, p.dv, p.kv_len, p.kv_len, b, hk, key_lo, lane, dk, dv);
  } else {
    const KvPush& t = *p.push;
    const uint32_t in_group = key_lo % PUSH_KEYS, first = key_lo - in_group;  // the warpgroup's first key
    uint32_t row0 = 0;
    const uint32_t owner = push_owner(t, first, row0);
    if (owner == t.rank) {
      store_dk_dv_rows<C>(p.dk, p.dv, t.rows, t.rows, b, hk, row0 + in_group, lane, dk, dv);
      return;
    }
    const uint64_t epoch = ld_relaxed_gpu_global_u64(t.calls) + 1;  // push_reduce advances it after this kernel
    const size_t elems = (size_t)p.batch * t.rows * C::KV_HEADS * C::HEAD_DIM;
    const uint32_t slot = push_sender(t.rank, owner);
    uint16_t* area = static_cast<uint16_t*>(t.area[owner]);
    store_dk_dv_rows<C>(area + push_slot(t.world, epoch, slot, 0, elems), area + push_slot(t.world, epoch, slot, 1, elems),
                        t.rows, t.rows, b, hk, row0 + in_group, lane, dk, dv);
  }
}

// TAIL_SPLIT: the tail slots, after dq_accum's floats (the workspace grows by TAIL_ITEMS slots, zeroed by
// Main::launch when a call splits): slot t holds key row r (0 .. BLOCK_N - 1 of its item) as dK (times the
// scale) then dV, HEAD_DIM floats each, at (t BLOCK_N + r) 2 HEAD_DIM.
template <class C>
__host__ __device__ __forceinline__ float* tail_accum(const Problem& p) {
  return p.dq_accum + (size_t)p.batch * p.q_len * C::HEADS * C::HEAD_DIM;
}
template <class C>
constexpr size_t TAIL_ROW_FLOATS = 2 * C::HEAD_DIM;  // a key row of a slot: dK then dV
template <class C>
constexpr size_t TAIL_SLOT_FLOATS = (size_t)BLOCK_N * TAIL_ROW_FLOATS<C>;
// Key row r of tail slot `slot`.
template <class C>
__host__ __device__ __forceinline__ float* tail_row(const Problem& p, uint32_t slot, uint32_t r) {
  return tail_accum<C>(p) + slot * TAIL_SLOT_FLOATS<C> + r * TAIL_ROW_FLOATS<C>;
}

static __device__ __forceinline__ void red_add_v2_f32(float* at, float x, float y) {
  asm volatile("red.relaxed.gpu.global.add.v2.f32 [%0], {%1, %2};" ::"l"(at), "f"(x), "f"(y) : "memory");
}

// A piece's end (TAIL_SPLIT): its partial dK (times the scale), dV of the warpgroup's key rows row_lo (+ 8) of the
// item, columns 8q + 2c (+ 1), added into tail slot `slot` (the other pieces of the item add theirs; tail_convert
// reads the sums after the main kernel). Rows past kv_len hold zeros (their P and dS are 0) and are not converted.
template <class C>
static __device__ __forceinline__ void add_dk_dv_tail(const Problem& p, uint32_t slot, uint32_t row_lo,
                                                      uint32_t lane, const float (&dk)[Layout<C>::D_ACC],
                                                      const float (&dv)[Layout<C>::D_ACC]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float* at = tail_row<C>(p, slot, row_lo + 8 * h) + 2 * (lane % 4);
#pragma unroll
    for (int q = 0; q < C::HEAD_DIM / 8; ++q) {
      red_add_v2_f32(at + 8 * q, dk[4 * q + 2 * h] * C::SCALE, dk[4 * q + 2 * h + 1] * C::SCALE);
      red_add_v2_f32(at + C::HEAD_DIM + 8 * q, dv[4 * q + 2 * h], dv[4 * q + 2 * h + 1]);
    }
  }
}

// The bulk reduction of consumer warpgroup cw's dQ partial for the walk's step at rows r0 .. r1: its destination
// in dq_accum, and its rows (0: none; TALL: the warpgroup's 64 query rows of the step's 128, none past q_len).
// 64-row steps: the step's n rows of panel dq_col_box (columns split at head dim 128; at 64 both warpgroups add
// partials of the one panel, each its own); n x 256 contiguous bytes either way.
template <class C>
static __device__ __forceinline__ uint32_t dq_reduction(const Problem& p, uint32_t b, uint32_t hq, uint32_t r0,
                                                        uint32_t r1, uint32_t cw, float*& dst) {
  using L = Layout<C>;
  const uint32_t q0 = L::TALL ? r0 + BLOCK_M * cw : r0;
  if (q0 >= r1) return 0;
  const uint32_t n = r1 - q0 < (uint32_t)BLOCK_M ? r1 - q0 : (uint32_t)BLOCK_M;
  const uint32_t dq_col_box = L::DQ_SPLIT_N && !L::TALL ? cw : 0;
  dst = p.dq_accum + dq_tiled_panel(b, hq, q0, n, dq_col_box, C::HEADS, p.q_len, C::HEAD_DIM);
  return n;
}

// WIDE: run `run` (0, 1) of consumer warpgroup cw's dQ partial (head-dim columns 64 cw .. 64 cw + 63 of the step's rows
// r0 .. r1, staged as dq_tiled_offset orders a block's rows) in dq_accum: the 80 rows cross at most one boundary of
// the layout's 64-row blocks (r0 is a multiple of 80, so of 16: the first block takes 64 - r0 % 64 >= 16 of them and
// the second the rest, <= 64), and a run's rows are contiguous both in the staging (from byte `from`) and in the
// block's panel cw (their chunk swizzle, row % 8, is the same in both: r0 is a multiple of 8). Its rows, 0 for none;
// dst, from: where they go and come from. Host-compiled by the tests (against dq_tiled_offset, every row once).
template <class C>
__host__ __device__ __forceinline__ uint32_t dq_run(const Problem& p, uint32_t b, uint32_t hq, uint32_t r0, uint32_t r1,
                                                    uint32_t cw, uint32_t run, float*& dst, uint32_t& from) {
  const uint32_t split = (r0 / 64 + 1) * 64;  // the end of r0's block
  const uint32_t lo = run == 0 ? r0 : split, hi = run == 0 ? (split < r1 ? split : r1) : r1;
  if (lo >= hi) return 0;
  const uint32_t block = lo / 64 * 64, n = p.q_len - block < 64 ? p.q_len - block : 64;
  dst = p.dq_accum + dq_tiled_panel(b, hq, block, n, cw, C::HEADS, p.q_len, C::HEAD_DIM) + (size_t)(lo - block) * 64;
  from = (lo - r0) * 256;
  return hi - lo;
}

// DQ_WRITER, the consumer's side: wait until warpgroup cw's staging is free (before staging), and say it is
// written (after staging and its fence).
static __device__ __forceinline__ void staging_free_wait(uint32_t cw) {
  if (cw == 0)
    named_barrier_sync_imm<DQ_FREE>(WRITER_BAR);
  else
    named_barrier_sync_imm<DQ_FREE + 1>(WRITER_BAR);
}
static __device__ __forceinline__ void staged_arrive(uint32_t cw) {
  if (cw == 0)
    named_barrier_arrive_imm<DQ_STAGED>(WRITER_BAR);
  else
    named_barrier_arrive_imm<DQ_STAGED + 1>(WRITER_BAR);
}

// DQ_WRITER: the writer warp's walk, the consumers' (the same Walk, the same part): at each step, for each
// consumer warpgroup in turn, wait for its staging, and lane 0 issues its bulk reduction (a bulk group each,
// empty where no rows); then, if a step follows, each staging is free once its reduction has read it (the older
// group first). Both stagings start free. Every reduction complete (its writes too) before the CTA ends: the
// convert pass reads dq_accum next.
template <class C>
static __device__ __forceinline__ void write_dq(const Problem& p, uint32_t smem, uint32_t b, uint32_t hk,
                                                uint32_t k0, Part part) {
  using L = Layout<C>;
  // consume_tall walks without a part (whole items) and the writer with one: the same steps, since only
  // TAIL_SPLIT makes ranged parts and Layout refuses it with 128-row steps (ROWS == BLOCK_M there)
  const bool lead = threadIdx.x % 32 == 0;
  Walk<C> w(p, hk, p.kv_offset + (int32_t)k0, part);
  if (w.done()) return;  // no step: the consumers stage nothing (and no arrival is left on a barrier)
  named_barrier_arrive_imm<DQ_FREE>(WRITER_BAR);
  named_barrier_arrive_imm<DQ_FREE + 1>(WRITER_BAR);
  while (true) {
    const uint32_t r0 = w.qb * L::ROWS, r1 = w.rows_end(p);
#pragma unroll
    for (uint32_t cw = 0; cw < 2; ++cw) {
      if (cw == 0)
        named_barrier_sync_imm<DQ_STAGED>(WRITER_BAR);
      else
        named_barrier_sync_imm<DQ_STAGED + 1>(WRITER_BAR);
      if (lead) {
        float* dst = nullptr;
        if constexpr (L::WIDE) {  // two runs (dq_run), one bulk group
#pragma unroll
          for (uint32_t run = 0; run < 2; ++run) {
            uint32_t from = 0;
            if (const uint32_t n = dq_run<C>(p, b, w.hq, r0, r1, cw, run, dst, from))
              bulk_reduce_add_f32(dst, smem + L::DQ_OFF + cw * L::DQ_BUF + from, n * 256);
          }
        } else if (const uint32_t n = dq_reduction<C>(p, b, w.hq, r0, r1, cw, dst)) {
          bulk_reduce_add_f32(dst, smem + L::DQ_OFF + cw * L::DQ_BUF, n * 256);
        }
        bulk_commit_group();
      }
    }
    w.next(p);
    if (w.done()) break;
    if (lead) bulk_wait_group_read<1>();  // warpgroup 0's reduction has read its staging
    __syncwarp();
    named_barrier_arrive_imm<DQ_FREE>(WRITER_BAR);
    if (lead) bulk_wait_group_read<0>();
    __syncwarp();
    named_barrier_arrive_imm<DQ_FREE + 1>(WRITER_BAR);
  }
  if (lead) bulk_wait_group_all();
}

// WIDE: this thread's part of warpgroup cw's dQ^T (head-dim columns row, row + 8 of the warpgroup's 64, queries
// 8q + 2c + e: register 4q + 2h + e of dq, h: column row + 8h) to its staging as
// dq_tiled_offset orders a block's rows: query i's 256 bytes at i x 256, its 32-byte chunk u (columns 8u .. 8u + 7)
// at chunk u ^ (i % 8). One 32-bit store a value (a warp's store: 4 queries x 8 columns, two to a bank).
static __device__ __forceinline__ void stage_dq_t(uint32_t staging, uint32_t row, uint32_t lane, const float (&dq)[40]) {
  const uint32_t c = lane % 4;
#pragma unroll
  for (int q = 0; q < 10; ++q)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const uint32_t i = 8 * q + 2 * c + e, col = row + 8 * h;
        st_shared_u32(staging + i * 256 + ((((col >> 3) ^ (i & 7)) << 5) | ((col & 7) << 2)),
                      __float_as_uint(dq[4 * q + 2 * h + e]));
      }
}

template <class C>
static __device__ __forceinline__ void consume(const Problem& p, uint32_t smem, uint32_t cw, uint32_t b,
                                               uint32_t hk, uint32_t k0, Part part = Part{}) {
  using L = Layout<C>;
  static_assert(!L::TALL, "params.step_rows 128: consume_tall");
  const uint32_t t = threadIdx.x % 128, lane = t % 32, warp = t / 32;
  const uint32_t row = 16 * warp + lane / 4;  // and row + 8: this thread's keys (of the warpgroup's 64)
  const uint32_t key_lo = k0 + 64 * cw + row;  // within the sequence
  const int32_t first_key = p.kv_offset + (int32_t)k0;
  float dk[L::D_ACC], dv[L::D_ACC];
#pragma unroll
  for (int i = 0; i < L::D_ACC; ++i) dk[i] = 0.f, dv[i] = 0.f;

  // Descriptors (see tsgen/gemm.cuh): K-major operands step 32 bytes per k16 within a 64-column box,
  // N/M-major ones 16 rows = 2048 bytes.
  const uint64_t k_desc = sw128_descriptor(smem + L::K_OFF + 64 * cw * 128, 16, 1024);  // A of S^T: K_w
  const uint64_t v_desc = sw128_descriptor(smem + L::V_OFF + 64 * cw * 128, 16, 1024);
  const uint32_t dq_col_box = L::DQ_SPLIT_N ? cw : 0, dq_key0 = L::DQ_SPLIT_N ? 0 : 64 * cw;
  const uint64_t kn_desc = sw128_descriptor(smem + L::K_OFF + dq_col_box * L::KV_BOX + dq_key0 * 128, L::KV_BOX, 1024);
  uint32_t* dq_turn = nullptr;  // DETERMINISTIC (thread 0): the semaphore of its last reduction, not yet passed on

  mbar_wait_no_timeout(smem + L::KV_FULL, 0);
  uint32_t step = 0;
  for (Walk<C> w(p, hk, first_key, part); !w.done(); w.next(p), ++step) {
    const uint32_t stage = step % C::STAGES, phase = (step / C::STAGES) & 1;
    const uint32_t r0 = w.qb * L::ROWS, r1 = w.rows_end(p);
    const uint32_t q_base = smem + L::Q_OFF + stage * L::Q_TILE, do_base = smem + L::DO_OFF + stage * L::Q_TILE;
    const uint32_t ds_base = smem + L::DS_OFF + (step % 2) * L::DS_BUF;
    mbar_wait_no_timeout(smem + L::Q_FULL + 8 * stage, phase);

    // S^T = K_w Q^T, then dP^T = V_w dO^T: two groups, so that P is computed (exp2) while the
    // tensor pipe still runs dP^T
    float s[L::SN], dp[L::SN];
    {
      const uint64_t q_desc = sw128_descriptor(q_base, 16, 1024), do_desc = sw128_descriptor(do_base, 16, 1024);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < C::HEAD_DIM / 16; ++k) {
        const uint32_t kv_step = (k / 4) * L::KV_BOX + (k % 4) * 32, q_step = (k / 4) * L::Q_BOX + (k % 4) * 32;
        C::mma_s(s, k_desc + (kv_step >> 4), q_desc + (q_step >> 4), k > 0);
      }
      wgmma_commit_group();
#pragma unroll
      for (int k = 0; k < C::HEAD_DIM / 16; ++k) {
        const uint32_t kv_step = (k / 4) * L::KV_BOX + (k % 4) * 32, q_step = (k / 4) * L::Q_BOX + (k % 4) * 32;
        C::mma_s(dp, v_desc + (kv_step >> 4), do_desc + (q_step >> 4), k > 0);
      }
      wgmma_commit_group();
    }
    // P^T = exp2(SCALE_LOG2 S^T - LSE2) once S^T is in (the S group; dP^T may still run), half of it; the other
    // half with dS^T = P^T (dP^T - D) once dP^T is in
    const bool masked = step_masked(p, C::CAUSAL, k0, first_key, (int32_t)r0, (int32_t)r1);
    wgmma_wait_group<1>();
    attention::fence_all<C>(s, L::SN);
    if (masked)
      probabilities_early<C, true>(s, smem, stage, p, key_lo, (int32_t)r0);
    else
      probabilities_early<C, false>(s, smem, stage, p, key_lo, (int32_t)r0);
    wgmma_wait_group<0>();
    attention::fence_all<C>(dp, L::SN);
    if (masked)
      probabilities_late_and_ds<C, true>(s, dp, smem, stage, p, key_lo, (int32_t)r0);
    else
      probabilities_late_and_ds<C, false>(s, dp, smem, stage, p, key_lo, (int32_t)r0);
    uint32_t ap[L::K16][4], ad[L::K16][4];
    to_operand<C>(s, ap);
    to_operand<C>(dp, ad);

    store_ds_t<C>(ds_base, cw, warp, lane, ad);         // dS^T to shared memory
    if constexpr (L::DK_AFTER_DQ)
      issue_rs<C>(dv, ap, do_base);                     // dV_w += P^T dO alone; dK after the dQ (below)
    else
      issue_dv_dk<C>(dv, dk, ap, ad, q_base, do_base);  // dV_w += P^T dO, dK_w += dS^T Q

    // DQ_TILED without the writer warp: this warpgroup's staging buffer is rewritten after DS_READY
    // (below); the bulk reduction of the last step (thread 0's bulk group) must have finished reading it
    // first. Issued a whole step ago: the wait does not stall in the steady state. DETERMINISTIC: it must
    // be complete (its writes too) before its turn is passed on, here, which also frees the staging.
    // With the writer warp (DQ_WRITER) the staging is freed by its DQ_FREE arrival instead, synced on
    // just before the staging stores.
    if constexpr (L::DQ_TILED && !L::DQ_WRITER)
      if (t == 0) {
        if constexpr (L::DETERMINISTIC)
          dq_turn = pass_dq_turn(dq_turn);
        else
          bulk_wait_group_read<0>();
      }
    named_barrier_sync(DS_READY, 256);  // dS^T of both warpgroups written and fenced (without DQ_WRITER: the staging free)

    if constexpr (L::WIDE) {
      // dQ^T (head-dim columns 64 cw .. 64 cw + 63 x the step's 80 queries) = K^T dS^T over the 128 keys (m64n80:
      // mma_dq): A = K's box cw, M-major (kn_desc); B = dS^T read K-major from dS [query][key] (ds_wide_offset: two
      // boxes of 64 keys, 32 bytes a k16 step inside a box). Earlier forms read dS^T N-major: queries 0 .. 63 in a
      // 128B panel and 64 .. 79 in a 32B one, two products (ptxas serialized every wgmma of the kernel beside their
      // 16 instructions, C7512); then all 80 32B-swizzled (correct, and 3-8 % slower than the 64-row kernel)
      float dq[L::SN];
      {
        const uint64_t ds_desc = sw128_descriptor(ds_base, 16, 1024);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < BLOCK_N / 16; ++k) {
          const uint32_t ds_step = (k / 4) * L::DS_BOX + (k % 4) * 32;
          C::mma_dq(dq, kn_desc + ((k * 2048) >> 4), ds_desc + (ds_step >> 4), k > 0);
        }
        wgmma_commit_group();
      }
      after_dq_issue<C>(dk, dv, t, smem, stage, [&] { issue_rs<C>(dk, ad, q_base); });
      attention::fence_all<C>(dq, L::SN);
      const uint32_t staging = smem + L::DQ_OFF + cw * L::DQ_BUF;
      staging_free_wait(cw);  // the writer's last reductions from it have read it
      stage_dq_t(staging, row, lane, dq);
      fence_proxy_async_shared_cta();  // generic stores, read by the bulk reductions (async proxy)
      staged_arrive(cw);               // the writer warp reduces it (write_dq: two runs, dq_run)
    } else {
      // dQ (64 queries x 64 columns) = dS K over DQ_KEYS keys
      float dq[32];
      {
        const uint64_t ds_desc = sw128_descriptor(ds_base + dq_key0 * 128, L::DS_BUF, 1024);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < L::DQ_KEYS / 16; ++k)
          C::mma_dq(dq, ds_desc + ((k * 2048) >> 4), kn_desc + ((k * 2048) >> 4), k > 0);
        wgmma_commit_group();
      }
      after_dq_issue<C>(dk, dv, t, smem, stage, [&] { issue_rs<C>(dk, ad, q_base); });
      attention::fence_all<C>(dq, 32);

      if constexpr (L::DQ_TILED) {
        // dq += dQ through the staging buffer (each_staged_pair: dq_tiled_offset's panel order); then one
        // bulk reduction of the step's n valid rows (n x 256 contiguous bytes) into panel dq_col_box of
        // the query block.
        const uint32_t staging = smem + L::DQ_OFF + cw * L::DQ_BUF;
        // DQ_PAIRED: warpgroup 0 adds warpgroup 1's partial (staged below, at the same offsets of the next
        // buffer) to its own first. Warpgroup 1 rewrites its staging only after the next DS_READY, which
        // warpgroup 0 reaches after these reads.
        if constexpr (L::DQ_PAIRED)
          if (cw == 0) {
            named_barrier_sync_imm<DQ_PAIR>(256);
            each_staged_pair(staging + L::DQ_BUF, row, lane, [&](uint32_t at, int i) {
              float x, y;
              ld_shared_v2_f32(at, x, y);
              dq[i] += x, dq[i + 1] += y;
            });
          }
        if constexpr (L::DQ_WRITER) staging_free_wait(cw);  // the writer's last reduction from it has read it
        each_staged_pair(staging, row, lane, [&](uint32_t at, int i) { st_shared_v2_f32(at, dq[i], dq[i + 1]); });
        fence_proxy_async_shared_cta();           // generic stores, read by the bulk reduction (async proxy)
        // the warpgroup's 64 rows staged; immediate barrier ids (a register id makes ptxas reserve all 16)
        if constexpr (L::DQ_WRITER) {
          staged_arrive(cw);  // the writer warp reduces it (write_dq)
        } else if (cw == 0) {
          named_barrier_sync_imm<DQ_STAGED>(128);
        } else {
          named_barrier_sync_imm<DQ_STAGED + 1>(128);
        }
        if constexpr (L::DQ_PAIRED)
          if (cw == 1) named_barrier_arrive_imm<DQ_PAIR>(256);  // its partial, for warpgroup 0 (which adds it)
        if (!L::DQ_WRITER && t == 0 && (!L::DQ_PAIRED || cw == 0)) {
          float* dst = nullptr;
          const uint32_t n = dq_reduction<C>(p, b, w.hq, r0, r1, cw, dst);
          if constexpr (L::DETERMINISTIC) {
            // the adds into the query block in the visitors' order: wait for this CTA's turn (both warpgroups
            // take the same one: DQ_ADDERS), then order the acquire before the reduction (async proxy)
            dq_turn = dq_semaphore<C>(p, b, w);
            wait_dq_turn<false>(dq_turn, L::DQ_ADDERS * visitor_rank(k0 / BLOCK_N));
            fence_proxy_async_global();
          }
          bulk_reduce_add_f32(dst, staging, n * 256);
          bulk_commit_group();
        }
      } else {  // dq_reduce atomic
        // dq += dQ: query row r0 + row (+ 8), columns 64 dq_col_box + 8q + 2c (+ 1)
  #pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t q_row = r0 + row + 8 * h;
          if (q_row >= p.q_len) continue;
          float* dst = p.dq_accum + row_offset<C>(b, q_row, w.hq, C::HEADS, p.q_len) + 64 * dq_col_box + 2 * (lane % 4);
  #pragma unroll
          for (int q = 0; q < 8; ++q) {
            atomicAdd(dst + 8 * q, dq[4 * q + 2 * h]);
            atomicAdd(dst + 8 * q + 1, dq[4 * q + 2 * h + 1]);
          }
        }
      }
    }
    if constexpr (L::DK_AFTER_DQ) dk_done_release_stage<C>(dk, t, smem, stage);
  }

  // DQ_TILED: every bulk reduction complete (its writes done) before the CTA ends and its shared
  // memory goes (the reads alone would free the memory; the convert pass reads dq_accum next);
  // DETERMINISTIC: and the last turn passed on. DQ_WRITER: the writer warp waits for its own.
  if constexpr (L::DQ_TILED && !L::DQ_WRITER)
    if (t == 0) {
      if constexpr (L::DETERMINISTIC)
        dq_turn = pass_dq_turn(dq_turn);
      else
        bulk_wait_group_all();
    }

  if constexpr (tail_split_of<C>::value)
    if (!part.whole()) {
      add_dk_dv_tail<C>(p, part.slot, 64 * cw + row, lane, dk, dv);
      return;
    }
  store_dk_dv<C>(p, b, hk, key_lo, lane, dk, dv);
}

// params.lookahead (LOOKAHEAD; bulk dQ, not DETERMINISTIC): consume() with the next step's S^T issued as
// soon as this step's dV / dK products are done (their A fragments and the stage's readers retired), queued
// behind this step's dQ on the tensor pipe, and the next step's dP^T right after the dQ staging's stores
// (dQ's registers free), so that the pipe runs them under the dQ tail (its staging, proxy fence, barrier and
// bulk issue, the walk's advance, the next stage's q_full wait) instead of idling from the dQ's completion
// to the next step's first product (consume(): wait dQ, stage, reduce, loop, issue S^T, wait for it).
// Registers: at most dK, dV 128 + two 32-register accumulators (dQ and S^T in flight at the staging,
// S^T and dP^T at P), consume()'s peak; S^T and dP^T issued together before the dQ wait (dQ 32 + 64 +
// 128 = 224) spilled 548 bytes. Per step, in order: dS^T (P^T and dP^T came in at the end of the last
// step), its store; dV / dK; DS_READY; dQ; wait dV / dK (wait_group 1), q_empty; the walk's advance, the
// next step's q_full and S^T; wait dQ (1); the staging's stores; the next dP^T; fence, DQ_STAGED, the
// bulk reduction; wait S^T (1), the next P^T; wait dP^T (0). The loop's back edge sits there, with no
// wgmma in flight (a first form, S^T and dP^T in flight across it and waited for at the loop's top, compiled
// with every wgmma serialized, C7514, and spills). Nor is a wgmma issued on a path that depends on the walk
// (ptxas's C7518, "serialized due to ... WG.DP in divergent path", serialized the refuted s_prefetch's
// kernel, which issued its early S^T under `if (!next.done())`): the products of the step after the walk's
// last are issued too, on the stale
// stage (its q_full wait passes at once: its parity flipped, as mbar_wait's "a fresh barrier passes
// parity 1" for a stage never loaded), with their P^T computed and never read; the same before the loop
// for a walk with no step. The descriptors come from 32-bit addresses made opaque where used: hoisted out
// of the loop, their 64-bit sums per k16 step stayed live and spilled 28 bytes.
// Hazards beyond consume()'s: the next step's products read stage (step + 1) % STAGES, which the
// producer reloads only after both warpgroups released it at step + 1, after those products retired;
// the step past the walk's end reads a stage that the producer no longer writes (or never wrote: its
// products' values are garbage, unread). q_empty of a step is arrived at before the next step's products
// are issued: they read the other stage. dS^T buffer reuse holds as in consume(): a warpgroup retires its
// dQ of step b (the wait after the next S^T's issue) before it reaches DS_READY of step b + 1.
template <class C>
static __device__ __forceinline__ void consume_lookahead(const Problem& p, uint32_t smem, uint32_t cw, uint32_t b,
                                                         uint32_t hk, uint32_t k0) {
  using L = Layout<C>;
  static_assert(L::LOOKAHEAD, "params.lookahead's consumer");
  const uint32_t t = threadIdx.x % 128, lane = t % 32, warp = t / 32;
  const uint32_t row = 16 * warp + lane / 4;  // and row + 8: this thread's keys (of the warpgroup's 64)
  const uint32_t key_lo = k0 + 64 * cw + row;  // within the sequence
  const int32_t first_key = p.kv_offset + (int32_t)k0;
  float dk[L::D_ACC], dv[L::D_ACC];
#pragma unroll
  for (int i = 0; i < L::D_ACC; ++i) dk[i] = 0.f, dv[i] = 0.f;

  const uint32_t dq_col_box = L::DQ_SPLIT_N ? cw : 0, dq_key0 = L::DQ_SPLIT_N ? 0 : 64 * cw;
  // The descriptors of K_w, V_w (K-major, A of S^T, dP^T) and of K (N-major, B of dQ) from one 32-bit
  // address each, made opaque where used (`fresh`): hoisted out of the loop, their 8 + 8 + 8 64-bit sums
  // per k16 step (one add with carry each) stayed live and spilled beside the lookahead's accumulators
  const uint32_t k_addr = smem + L::K_OFF + 64 * cw * 128, v_addr = smem + L::V_OFF + 64 * cw * 128;
  const uint32_t kn_addr = smem + L::K_OFF + dq_col_box * L::KV_BOX + dq_key0 * 128;
  auto fresh = [](uint32_t x) {
    asm volatile("" : "+r"(x));
    return x;
  };

  // S^T = K_w Q^T of step `at` (a group) once its stage has landed; `past_end`: the walk has no such step,
  // the product runs on the stale stage and is never read (q_full's parity flipped: that wait passes at once)
  float s[32], dp[32];
  auto issue_s = [&](uint32_t at, bool past_end) {
    const uint32_t stage = at % C::STAGES, phase = ((at / C::STAGES) & 1) ^ (past_end ? 1u : 0u);
    mbar_wait_no_timeout(smem + L::Q_FULL + 8 * stage, phase);
    const uint64_t q_desc = sw128_descriptor(smem + L::Q_OFF + stage * L::Q_TILE, 16, 1024);
    const uint64_t k_desc = sw128_descriptor(fresh(k_addr), 16, 1024);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < C::HEAD_DIM / 16; ++k) {
      const uint32_t kv_step = (k / 4) * L::KV_BOX + (k % 4) * 32, q_step = (k / 4) * L::Q_BOX + (k % 4) * 32;
      C::mma_s(s, k_desc + (kv_step >> 4), q_desc + (q_step >> 4), k > 0);
    }
    wgmma_commit_group();
  };
  // dP^T = V_w dO^T of step `at` (a group; after issue_s of the same step, which waited for the stage)
  auto issue_dp = [&](uint32_t at) {
    const uint64_t do_desc = sw128_descriptor(smem + L::DO_OFF + (at % C::STAGES) * L::Q_TILE, 16, 1024);
    const uint64_t v_desc = sw128_descriptor(fresh(v_addr), 16, 1024);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < C::HEAD_DIM / 16; ++k) {
      const uint32_t kv_step = (k / 4) * L::KV_BOX + (k % 4) * 32, q_step = (k / 4) * L::Q_BOX + (k % 4) * 32;
      C::mma_s(dp, v_desc + (kv_step >> 4), do_desc + (q_step >> 4), k > 0);
    }
    wgmma_commit_group();
  };

  // P^T of the walk's step `at` (query rows of w, stage at % STAGES) once S^T is in (its dP^T may still run),
  // then dP^T waited for: every group retired
  auto probabilities_of = [&](const Walk<C>& w, uint32_t at) {
    const uint32_t r0 = w.qb * BLOCK_M, r1 = w.rows_end(p);
    wgmma_wait_group<1>();
    attention::fence_all<C>(s, 32);
    if (step_masked(p, C::CAUSAL, k0, first_key, (int32_t)r0, (int32_t)r1)) {  // all of P^T here
      probabilities_all<C, true>(s, smem, at % C::STAGES, p, key_lo, (int32_t)r0);
    } else {
      probabilities_all<C, false>(s, smem, at % C::STAGES, p, key_lo, (int32_t)r0);
    }
    wgmma_wait_group<0>();
    attention::fence_all<C>(dp, 32);
  };

  mbar_wait_no_timeout(smem + L::KV_FULL, 0);
  Walk<C> w(p, hk, first_key);
  issue_s(0, w.done());
  issue_dp(0);
  probabilities_of(w, 0);
  // The loop's back edge sits where no wgmma is in flight (after dP^T's wait; see above)
  for (uint32_t step = 0; !w.done(); ++step) {
    const uint32_t stage = step % C::STAGES;
    const uint32_t r0 = w.qb * BLOCK_M, r1 = w.rows_end(p);
    const uint32_t q_base = smem + L::Q_OFF + stage * L::Q_TILE, do_base = smem + L::DO_OFF + stage * L::Q_TILE;
    const uint32_t ds_base = smem + L::DS_OFF + (step % 2) * L::DS_BUF;

    // dS^T = P^T (dP^T - D) (P^T and dP^T of this step came in at the end of the last)
    ds_all<C>(s, dp, smem, stage);
    uint32_t ap[4][4], ad[4][4];
    to_operand<C>(s, ap);
    to_operand<C>(dp, ad);

    store_ds_t<C>(ds_base, cw, warp, lane, ad);         // dS^T to shared memory
    issue_dv_dk<C>(dv, dk, ap, ad, q_base, do_base);   // dV_w += P^T dO, dK_w += dS^T Q

    // the staging is rewritten after DS_READY: the last reduction has read it (issued a step ago)
    if (t == 0) bulk_wait_group_read<0>();
    named_barrier_sync(DS_READY, 256);

    // dQ (64 queries x 64 columns) = dS K over DQ_KEYS keys
    float dq[32];
    {
      const uint64_t ds_desc = sw128_descriptor(ds_base + dq_key0 * 128, L::DS_BUF, 1024);
      const uint64_t kn_desc = sw128_descriptor(fresh(kn_addr), L::KV_BOX, 1024);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < L::DQ_KEYS / 16; ++k)
        C::mma_dq(dq, ds_desc + ((k * 2048) >> 4), kn_desc + ((k * 2048) >> 4), k > 0);
      wgmma_commit_group();
    }
    wgmma_wait_group<1>();  // dV, dK done: the stage's Q and dO are no longer read, ap / ad are free
    attention::fence_all<C>(dk, L::D_ACC);
    attention::fence_all<C>(dv, L::D_ACC);
    if (t == 0) mbar_arrive(smem + L::Q_EMPTY + 8 * stage);

    // this step's bulk destination; the walk's next step (or the end) and its S^T, queued behind dQ
    const uint32_t n = r1 - r0;
    float* const dst = p.dq_accum + (((size_t)b * C::HEADS + w.hq) * p.q_len + r0) * C::HEAD_DIM +
                       (size_t)dq_col_box * n * 64;
    w.next(p);
    issue_s(step + 1, w.done());

    wgmma_wait_group<1>();  // dQ done (the next step's S^T may run)
    attention::fence_all<C>(dq, 32);
    const uint32_t staging = smem + L::DQ_OFF + cw * L::DQ_BUF;
    each_staged_pair(staging, row, lane, [&](uint32_t at, int i) { st_shared_v2_f32(at, dq[i], dq[i + 1]); });
    issue_dp(step + 1);  // into registers of its own, dQ's free: S^T, dP^T, dK, dV 192 at most
    fence_proxy_async_shared_cta();
    if (cw == 0)
      named_barrier_sync_imm<DQ_STAGED>(128);
    else
      named_barrier_sync_imm<DQ_STAGED + 1>(128);
    if (t == 0) {
      bulk_reduce_add_f32(dst, staging, n * 256);
      bulk_commit_group();
    }
    // the next step's P^T (past the walk's end: of the stale stage, unread)
    probabilities_of(w, step + 1);
  }
  if (t == 0) bulk_wait_group_all();

  store_dk_dv<C>(p, b, hk, key_lo, lane, dk, dv);
}

// params.step_rows 128 (TALL; head dim 64, bulk dQ, not deterministic, not lookahead): consume() with steps of 128
// query rows, FlashAttention-3's hd 64 tile (its Hopper backward at hdim 64: kBlockM 128 x kBlockN 128, two MMA
// warpgroups, S and dP with the keys as M (SdP_swapAB), dK / dV with A from registers (Mma_dKV_is_RS), dQ split
// by query rows (AtomLayoutMdQ 2)). Why: at head dim 64 a 64-row step's five products are 1 280 tensor clocks for
// the CTA, half of hd 128's, while its fixed part is the same (four warpgroup waits, each exposing the pipe's
// fill or drain, DS_READY and DQ_STAGED, the q_full wait, the bulk issue, the walk's advance and the loop:
// docs/design/attention.md, "Tall steps at head dim 64"). Per 128-row step, warpgroup w (keys 64w .. 64w + 63 as
// M, as consume()):
//   S^T = K_w Q^T, dP^T = V_w dO^T   m64n128k16, 4 each (mma_s_n128), 64 fp32 registers each, a group each
//   P^T, dS^T as consume()'s over 128 query columns (each_query_column<16>), then 8 k16 fragments each
//   dS^T to shared memory: [panel: queries 64x .. 64x + 63][key][64 queries], each panel consume()'s 128B-swizzled
//             rows, DS_PANEL apart
//   dV += P^T dO, dK += dS^T Q        m64n64k16, 8 each (K = the step's 128 queries), one group
//   DS_READY; dQ of the step's queries 64w .. 64w + 63 (query block 2 qb + w of attention_bwd::BLOCK_M rows) over
//             all 128 keys: m64n64k16 x 8 (mma_dq: A = dS^T panel w, M-major; B = K, N-major): the hd 128
//             column split's shape, split by rows instead (hd 64 has one 64-column box)
//   wait dV / dK, q_empty, wait dQ; DQ_FREE + w, the staging (16 STS.64), DQ_STAGED + w: the writer warp's bulk
//             reduction of the block's valid rows (none where the block starts past q_len) into its panel 0
// Against consume() at hd 64, per query row: the same exp2, dS^T and its stores; per step twice the products (2 560
// tensor clocks), one set of waits, barriers and walk overhead for 128 rows; the dQ partials per 64 query rows
// halve (one per block over 128 keys, against consume()'s key split: two over 64 keys each into the same panel),
// and so do the staging stores and the bulk reductions' L2 traffic. Registers: S^T 64 + dP^T 64 + dK 32 + dV 32 =
// 192 accumulators at the peak (FA3's hd 64 tile holds the same); shared memory (Layout, smem_bytes): K, V 32 KiB,
// Q, dO 2 stages x 2 x 16 KiB, dS^T 2 x 32 KiB, the staging 32 KiB, LSE2 and D 2 KiB.
// Hazards: consume()'s, and
//   - dS^T buffer reuse (step % 2): warpgroup w's dQ reads panel w over all 128 keys, the other warpgroup's rows
//     too (as the hd 128 column split reads both halves). A warpgroup writes buffer b % 2 again at step b + 2 only
//     after DS_READY of step b + 1, which the other warpgroup reaches only after its wgmma.wait_group retired its
//     dQ of step b (and the writing warpgroup retired its own dQ of step b before that barrier).
//   - The staging: one buffer per warpgroup, as consume()'s; its 64 rows are the warpgroup's query block, so the
//     reduction is that block's (n = its valid rows). A block past q_len (n = 0) issues none; its stores and the
//     DQ_FREE / DQ_STAGED barriers still run (every thread reaches every barrier), into a buffer whose last
//     reduction the writer warp waited for (bulk_wait_group_read) before its DQ_FREE arrival, as in every step.
//   - Rows past q_len: as consume()'s (TMA zero fill, LSE2 = +inf); a second box wholly past q_len reloads the
//     first (produce): finite values, P = dS = 0 there. The dQ rows past q_len are not reduced (n).
template <class C>
static __device__ __forceinline__ void consume_tall(const Problem& p, uint32_t smem, uint32_t cw, uint32_t b,
                                                    uint32_t hk, uint32_t k0) {
  using L = Layout<C>;
  static_assert(L::TALL && L::ROWS == 128 && C::HEAD_DIM == 64 && L::DQ_TILED, "params.step_rows 128's consumer");
  constexpr int SN = L::ROWS / 2;  // fp32 registers of a 64 x 128 accumulator (S^T, dP^T)
  const uint32_t t = threadIdx.x % 128, lane = t % 32, warp = t / 32;
  const uint32_t row = 16 * warp + lane / 4;  // and row + 8: this thread's keys (S^T ..), its queries (dQ)
  const uint32_t key_lo = k0 + 64 * cw + row;  // within the sequence
  const int32_t first_key = p.kv_offset + (int32_t)k0;
  float dk[L::D_ACC], dv[L::D_ACC];
#pragma unroll
  for (int i = 0; i < L::D_ACC; ++i) dk[i] = 0.f, dv[i] = 0.f;

  // Descriptors: K_w, V_w K-major (A of S^T, dP^T: k16 steps 32 bytes along the 128-byte rows); K N-major over
  // all 128 keys (B of dQ: k16 steps of 16 key rows, 2048 bytes)
  const uint64_t k_desc = sw128_descriptor(smem + L::K_OFF + 64 * cw * 128, 16, 1024);
  const uint64_t v_desc = sw128_descriptor(smem + L::V_OFF + 64 * cw * 128, 16, 1024);
  const uint64_t kn_desc = sw128_descriptor(smem + L::K_OFF, L::KV_BOX, 1024);

  mbar_wait_no_timeout(smem + L::KV_FULL, 0);
  uint32_t step = 0;
  for (Walk<C> w(p, hk, first_key); !w.done(); w.next(p), ++step) {
    const uint32_t stage = step % C::STAGES, phase = (step / C::STAGES) & 1;
    const uint32_t r0 = w.qb * L::ROWS, r1 = w.rows_end(p);
    const uint32_t q_base = smem + L::Q_OFF + stage * L::Q_TILE, do_base = smem + L::DO_OFF + stage * L::Q_TILE;
    const uint32_t ds_base = smem + L::DS_OFF + (step % 2) * L::DS_BUF;
    mbar_wait_no_timeout(smem + L::Q_FULL + 8 * stage, phase);

    // S^T = K_w Q^T, then dP^T = V_w dO^T (64 keys x 128 queries each): two groups, P's exp2 under dP^T
    float s[SN], dp[SN];
    {
      const uint64_t q_desc = sw128_descriptor(q_base, 16, 1024), do_desc = sw128_descriptor(do_base, 16, 1024);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < C::HEAD_DIM / 16; ++k)
        C::mma_s_n128(s, k_desc + ((k * 32) >> 4), q_desc + ((k * 32) >> 4), k > 0);
      wgmma_commit_group();
#pragma unroll
      for (int k = 0; k < C::HEAD_DIM / 16; ++k)
        C::mma_s_n128(dp, v_desc + ((k * 32) >> 4), do_desc + ((k * 32) >> 4), k > 0);
      wgmma_commit_group();
    }
    const bool masked = step_masked(p, C::CAUSAL, k0, first_key, (int32_t)r0, (int32_t)r1);
    wgmma_wait_group<1>();  // S^T in (dP^T may still run): half of P^T
    attention::fence_all<C>(s, SN);
    if (masked)
      probabilities_early<C, true>(s, smem, stage, p, key_lo, (int32_t)r0);
    else
      probabilities_early<C, false>(s, smem, stage, p, key_lo, (int32_t)r0);
    wgmma_wait_group<0>();  // dP^T in: the other half of P^T beside dS^T
    attention::fence_all<C>(dp, SN);
    if (masked)
      probabilities_late_and_ds<C, true>(s, dp, smem, stage, p, key_lo, (int32_t)r0);
    else
      probabilities_late_and_ds<C, false>(s, dp, smem, stage, p, key_lo, (int32_t)r0);
    uint32_t ap[L::K16][4], ad[L::K16][4];
    to_operand<C>(s, ap);
    to_operand<C>(dp, ad);

    store_ds_t<C>(ds_base, cw, warp, lane, ad);  // dS^T (16-bit) to shared memory, two panels of 64 queries

    // dV_w += P^T dO, dK_w += dS^T Q (over the step's 128 queries: 8 k16 steps of 16 rows, 2048 bytes); DK_AFTER_DQ:
    // dV alone here, dK after the dQ (below)
    if constexpr (L::DK_AFTER_DQ)
      issue_rs<C>(dv, ap, do_base);
    else
      issue_dv_dk<C>(dv, dk, ap, ad, q_base, do_base);

    named_barrier_sync(DS_READY, 256);  // dS^T of both warpgroups written and fenced

    // dQ (queries 64 cw .. 64 cw + 63 of the step x 64 columns) = dS K over the 128 keys
    float dq[32];
    {
      const uint64_t ds_desc = sw128_descriptor(ds_base + cw * L::DS_PANEL, L::DS_PANEL, 1024);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < BLOCK_N / 16; ++k)
        C::mma_dq(dq, ds_desc + ((k * 2048) >> 4), kn_desc + ((k * 2048) >> 4), k > 0);
      wgmma_commit_group();
    }
    after_dq_issue<C>(dk, dv, t, smem, stage, [&] { issue_rs<C>(dk, ad, q_base); });
    attention::fence_all<C>(dq, 32);

    // dq += dQ through the staging buffer (dq_tiled_offset's panel order, as consume()), then one bulk reduction
    // of the block's valid rows (n x 256 contiguous bytes: head dim 64 is one panel)
    // (the writer warp reduces it: write_dq, the warpgroup's 64 query rows of the step's 128)
    static_assert(L::DQ_WRITER, "step_rows 128: the bulk dQ path, not deterministic, not lookahead");
    const uint32_t staging = smem + L::DQ_OFF + cw * L::DQ_BUF;
    staging_free_wait(cw);  // the writer's last reduction from it has read it
    each_staged_pair(staging, row, lane, [&](uint32_t at, int i) { st_shared_v2_f32(at, dq[i], dq[i + 1]); });
    fence_proxy_async_shared_cta();  // generic stores, read by the bulk reduction (async proxy)
    staged_arrive(cw);
    if constexpr (L::DK_AFTER_DQ) dk_done_release_stage<C>(dk, t, smem, stage);
  }

  store_dk_dv<C>(p, b, hk, key_lo, lane, dk, dv);
}

// Item `item` of the main kernel (its grid order): KV block j of KV head hk of sequence b.
template <class C>
__host__ __device__ __forceinline__ void item_of(const Problem& p, uint32_t item, uint32_t& j, uint32_t& hk,
                                                 uint32_t& b) {
  const uint32_t heads_x_batch = p.batch * C::KV_HEADS;
  if constexpr (head_group_of<C>::value == 0) {
    j = item / heads_x_batch;  // the KV block: block 0 of every head first
    hk = item % heads_x_batch % C::KV_HEADS, b = item % heads_x_batch / C::KV_HEADS;
  } else {  // params.head_group: groups of that many (sequence, KV head) pairs, one after the other (kv_cta)
    const KvCta c = kv_cta(item, heads_x_batch, p.kv_blocks, head_group_of<C>::value);
    j = c.block, hk = c.pair % C::KV_HEADS, b = c.pair / C::KV_HEADS;
  }
}

// TAIL_SPLIT: how a call's grid splits its last items (items: the main kernel's, sms: the GPU's, steps: one item's
// walk). The last wave's items (items mod sms) are split when they would leave at least half the SMs idle, the grid
// fills more than one wave and they fit the workspace's TAIL_ITEMS slots: each into parts = sms / tail pieces (at
// most its steps), so that the last wave is tail x parts <= sms pieces of about 1 / parts of an item's time each.
// first: the first split item (= items: none split). Host-compiled by the tests.
struct TailPlan {
  uint32_t first, parts;
};
__host__ __device__ __forceinline__ TailPlan tail_plan(uint64_t items, uint32_t sms, uint32_t steps) {
  const uint64_t tail = sms > 0 ? items % sms : 0;
  uint64_t parts = tail > 0 ? sms / tail : 0;
  if (parts > steps) parts = steps;
  if (items <= sms || tail == 0 || tail > TAIL_ITEMS || parts < 2) return TailPlan{(uint32_t)items, 1};
  return TailPlan{(uint32_t)(items - tail), (uint32_t)parts};
}

// TAIL_SPLIT: what CTA x >= p.tail_first walks: piece (x - tail_first) mod tail_parts of the item in slot
// (x - tail_first) / tail_parts, its steps in tail_parts runs of the walk in order, the first (steps mod
// tail_parts) one step longer (32-bit arithmetic: no division call beside the wgmma). Host-compiled by the tests.
template <class C>
__host__ __device__ __forceinline__ Part tail_part(const Problem& p, uint32_t x) {
  const uint32_t at = x - p.tail_first, piece = at % p.tail_parts, steps = Walk<C>::steps(p);
  const uint32_t base = steps / p.tail_parts, longer = steps % p.tail_parts;
  Part part;
  part.slot = at / p.tail_parts;
  part.begin = piece * base + (piece < longer ? piece : longer);
  part.count = base + (piece < longer ? 1 : 0);
  return part;
}

// The main kernel's body. CTA x < p.tail_first: item x whole; from p.tail_first on (TAIL_SPLIT): piece
// (x - tail_first) mod tail_parts of item tail_first + (x - tail_first) / tail_parts, the item's steps split evenly.
template <class C>
static __device__ __forceinline__ void main_kernel(const CUtensorMap* q_map, const CUtensorMap* k_map,
                                                   const CUtensorMap* v_map, const CUtensorMap* do_map,
                                                   const Problem& p) {
  using L = Layout<C>;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t smem = (smem_u32(smem_raw) + 1023u) & ~1023u;
  Part part{};
  if constexpr (tail_split_of<C>::value)
    if (blockIdx.x >= p.tail_first) part = tail_part<C>(p, blockIdx.x);
  const uint32_t item = part.whole() ? blockIdx.x : p.tail_first + part.slot;
  uint32_t j, hk, b;
  item_of<C>(p, item, j, hk, b);
  // params.head_group: the three as plain values from here: without this the compiler carries the mapping's
  // operands into the producer's 40 registers and spills
  if constexpr (head_group_of<C>::value != 0) asm volatile("" : "+r"(j), "+r"(hk), "+r"(b));
  const uint32_t k0 = j * BLOCK_N;
  if (threadIdx.x == 0) {
    mbar_init(smem + L::KV_FULL, 1);
    for (int s = 0; s < C::STAGES; ++s) {
      mbar_init(smem + L::Q_FULL + 8 * s, 32);  // the producer warp's lanes (and lane 0's expected TMA bytes)
      mbar_init(smem + L::Q_EMPTY + 8 * s, 2);  // one arrival per consumer warpgroup
    }
    fence_mbarrier_init_release_cluster();  // visible to the TMA unit
    prefetch_tensormap(q_map);
    prefetch_tensormap(k_map);
    prefetch_tensormap(v_map);
    prefetch_tensormap(do_map);
  }
  __syncthreads();
  const uint32_t warpgroup = ptx::warpgroup_id();
  if (warpgroup == 0) {
    // 384 threads x 168 registers (the kernel's allocation) = 128 x 40 + 256 x 232; WIDE: 128 x 24 + 256 x 240
    // (FlashAttention-4's split: its S^T, dP^T of 40 registers each beside dK, dV's 128)
    setmaxnreg_dec<L::WIDE ? 24 : 40>();
    if (threadIdx.x < 32)
      produce<C>(q_map, k_map, v_map, do_map, smem, p, b, hk, k0, part);
    else if constexpr (L::DQ_WRITER)
      if (threadIdx.x < 64) write_dq<C>(p, smem, b, hk, k0, part);
  } else {
    setmaxnreg_inc<L::WIDE ? 240 : 232>();
    if constexpr (L::LOOKAHEAD)
      consume_lookahead<C>(p, smem, warpgroup - 1, b, hk, k0);
    else if constexpr (L::TALL)
      consume_tall<C>(p, smem, warpgroup - 1, b, hk, k0);
    else
      consume<C>(p, smem, warpgroup - 1, b, hk, k0, part);
  }
}

// TAIL_SPLIT: the tail kernel's body, one CTA (TAIL_THREADS) per split item (blockIdx.x: its slot), after the main
// kernel in stream order: the slot's fp32 sums to dK, dV (16-bit, the item's key rows below kv_len).
constexpr int TAIL_THREADS = 256;
template <class C>
static __device__ __forceinline__ void tail_convert(const Problem& p) {
  uint32_t j, hk, b;
  item_of<C>(p, p.tail_first + blockIdx.x, j, hk, b);
  constexpr uint32_t PAIRS = C::HEAD_DIM / 2;  // column pairs a row
  for (uint32_t i = threadIdx.x; i < BLOCK_N * PAIRS; i += TAIL_THREADS) {
    const uint32_t r = i / PAIRS, c = 2 * (i % PAIRS), key = j * BLOCK_N + r;
    if (key >= p.kv_len) break;  // i ascends with r
    const float* row = tail_row<C>(p, blockIdx.x, r);
    const float2 k2 = *reinterpret_cast<const float2*>(row + c);
    const float2 v2 = *reinterpret_cast<const float2*>(row + C::HEAD_DIM + c);
    const size_t at = row_offset<C>(b, key, hk, C::KV_HEADS, p.kv_len) + c;
    *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(p.dk) + at) = pack2<C>(k2.x, k2.y);
    *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(p.dv) + at) = pack2<C>(v2.x, v2.y);
  }
}

// KV_PUSH: after the main kernel in stream order, one warp raises every other rank's arrived[this rank] (push_signal:
// lane o < world but this rank; a system-scope fence first: the main kernel's stores to rank o, visible to this
// kernel at the boundary, are visible at o before the add), then one warp waits (push_wait: lane s < world but this
// rank waits for sender s's count of this epoch, acquire at system scope, with the timeout), then push_reduce (PUSH_CTAS CTAs, a
// fixed grid: call_end counts them): every element of this rank's dK, dV (batch x rows x KV heads x head dim, the
// main kernel's own partials) gets the senders' partials of this parity added, 8 at a time, in fp32, rounded
// once; call_end advances calls[0], the next call's epoch. The wait is a kernel of its own, one CTA: ranks
// sharing a GPU would otherwise fill every SM with waiting CTAs while a peer's main kernel, whose pushes they wait
// for, has none left to run on. Without the wait (the GPU checks' negative control) the sums are wrong.
constexpr int PUSH_THREADS = 256;
constexpr unsigned PUSH_CTAS = 264;
static __device__ __forceinline__ void push_signal(const KvPush* table) {
  const KvPush& t = *table;
  if (threadIdx.x < t.world && threadIdx.x != t.rank) {
    fence_acq_rel_sys();
    atom_add_release_sys_global_u64(t.arrived_at[threadIdx.x], 1ull);
  }
}

static __device__ __forceinline__ void push_wait(const KvPush* table) {
  const KvPush& t = *table;
  const uint64_t epoch = call_begin(t.calls);
  if (threadIdx.x < t.world && threadIdx.x != t.rank)
    wait_ge_acquire_sys(t.arrived + threadIdx.x, epoch,
                        make_site("kv_push arrived", (int)t.rank, (int)t.rank, (int)threadIdx.x));
}

template <class C>
static __device__ __forceinline__ void push_reduce(void* dk, void* dv, const KvPush* table, uint32_t batch) {
  const KvPush& t = *table;
  const uint64_t epoch = call_begin(t.calls);
  const size_t elems = (size_t)batch * t.rows * C::KV_HEADS * C::HEAD_DIM, groups = elems / 8;
  const uint16_t* area = static_cast<const uint16_t*>(t.area[t.rank]);
  for (size_t i = blockIdx.x * (size_t)PUSH_THREADS + threadIdx.x; i < 2 * groups;
       i += (size_t)PUSH_CTAS * PUSH_THREADS) {
    const uint32_t which = i < groups ? 0 : 1;
    const size_t at = 8 * (i - which * groups);
    uint4* out = reinterpret_cast<uint4*>(static_cast<uint16_t*>(which ? dv : dk) + at);
    float sum[8];
    unpack8<C>(*out, sum);
    for (uint32_t s = 0; s < t.world; ++s) {
      if (s == t.rank) continue;
      float part[8];
      const uint16_t* from = area + push_slot(t.world, epoch, push_sender(s, t.rank), which, elems) + at;
      unpack8<C>(ld_weak_global_v4(reinterpret_cast<const uint4*>(from)), part);
#pragma unroll
      for (int e = 0; e < 8; ++e) sum[e] += part[e];
    }
    *out = pack8<C>(sum);
  }
  call_end(t.calls, epoch);
}

// This main kernel's launch (for attention_bwd::call): the TMA descriptors of Q, K, V and dO from
// the forward's encoder (tsgen/attention.cuh: boxes of TILE_M = 64 rows for Q and dO (its `o`),
// TILE_N = 128 for K and V), reused while the pointers and sizes stay the same.
template <class C, class Kernel, class Tail>
struct Main {
  Kernel kernel;
  Tail tail;  // TAIL_SPLIT: the tail kernel (tail_convert), else nullptr
  const attention::TensorMaps* maps = nullptr;
  cudaError_t prepare(Problem& p, Sizes& z) {
    // DQ_TILED: the bulk reductions need 16-byte aligned destinations (their offsets are multiples of 256
    // bytes) and the convert pass stores dQ 16 bytes at a time (8 columns of one row)
    if (Layout<C>::DQ_TILED &&
        (reinterpret_cast<uintptr_t>(p.dq_accum) % 16 != 0 || reinterpret_cast<uintptr_t>(p.dq) % 16 != 0))
      return cudaErrorInvalidValue;
    if (z.ctas == 0) return cudaSuccess;
    // q_len 0 (dK = dV = 0): maps of one row, never read (an encoded tensor has no empty dimension)
    cudaError_t err =
        attention::tensor_maps<C>(p.q, p.k, p.v, p.dout, p.batch, p.q_len > 0 ? p.q_len : 1, p.kv_len, &maps);
    if (err != cudaSuccess) return err;
    if constexpr (tail_split_of<C>::value) {  // the split of the last wave's items for this GPU's SM count
      int device = 0, sms = 0;
      if ((err = cudaGetDevice(&device)) != cudaSuccess) return err;
      if ((err = sm_count(device, &sms)) != cudaSuccess) return err;
      const TailPlan t = tail_plan(z.ctas, (uint32_t)sms, Walk<C>::steps(p));
      p.tail_first = t.first, p.tail_parts = t.parts;
      z.grid = t.first + (z.ctas - t.first) * t.parts;
    }
    return cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                Layout<C>::SMEM_BYTES);
  }
  cudaError_t launch(const Problem& p, const Sizes& z, cudaStream_t stream) {
    const uint32_t split = (uint32_t)(z.ctas - p.tail_first);  // items split (TAIL_SPLIT), 0: none
    if constexpr (tail_split_of<C>::value) {
      static_assert(!std::is_same_v<Tail, std::nullptr_t>, "TAIL_SPLIT: launch() needs the tail kernel");
      if (split > 0) {
        const cudaError_t err = cudaMemsetAsync(tail_accum<C>(p), 0,
                                                split * TAIL_SLOT_FLOATS<C> * sizeof(float), stream);
        if (err != cudaSuccess) return err;
      }
    }
    kernel<<<(unsigned)z.grid, THREADS, Layout<C>::SMEM_BYTES, stream>>>(maps->q, maps->k, maps->v, maps->o, p);
    if constexpr (tail_split_of<C>::value)
      if (split > 0) tail<<<split, TAIL_THREADS, 0, stream>>>(p);
    return cudaGetLastError();
  }
};

// One backward call with this main kernel: the shared preprocess and convert around it (TAIL_SPLIT: and the tail
// kernel after it).
template <class C, class Pre, class Kernel, class Convert, class Tail = std::nullptr_t>
static cudaError_t launch(Pre pre, Kernel main, Convert conv, const Problem& given, uint64_t batch, uint64_t q_len,
                          uint64_t kv_len, int64_t q_offset, int64_t q_split, int64_t q_offset2, int64_t kv_offset,
                          cudaStream_t stream, Tail tail = nullptr) {
  Main<C, Kernel, Tail> m{main, tail};
  return call<C>(pre, conv, m, BLOCK_N, given, batch, q_len, kv_len, q_offset, q_split, q_offset2, kv_offset, stream);
}

}  // namespace wgmma
}  // namespace attention_bwd
}  // namespace tsgen

#endif  // TSGEN_ATTENTION_BWD_WGMMA_CUH
