// tsgen/cp.cuh -- the communication side of context-parallel attention (cp_attention): where
// each rank's K and V rows go in every rank's gathered buffers, the SM push kernel body, the
// one-block signal kernel body. The attention kernel is tsgen/attention.cuh's, with its
// per-KV-chunk waits; the side streams and the entry / FREE exchange are tsgen/fused.cuh's.
//
// Hand-written; included by cp_attention sources after tsgen/attention.cuh (it includes tsgen/fused.cuh).
//
// Signals (u64 counters that only grow, in the `sig` buffer of every rank):
//   sig[FREE + s]  = e: rank s has entered call e, so its previous call's attention no longer
//                  reads its k_full / v_full: this rank may write its rows there (tsgen_fused's
//                  ENTRY and WAIT_FREE, the same offsets).
//   sig[READY + c] = e: KV chunk c of call e is in this rank's k_full and v_full (raised by the
//                  rank that holds it, after its copy: the attention producer waits for it).
//   sig[ARRIVED + d] (push kernel, this rank's own): CTAs done with their part of receiver d in
//                  this call; the last resets it and raises READY at d.
//   sig[WORK]      (causal, or not causal with TILE_COUNTER; this rank's own): the attention kernel's tile counter (its dynamic
//                  schedule, tsgen/attention.cuh: 0 between calls, reset by its last draw).
// Trace variants only (params.trace, test-only): after the signals, the call timeline's stamps (STAMP_WORDS,
// below), then tsgen/attention.cuh's per-tile trace (a count, a spare word, the records).
//
// Tensors: a rank's K (and V) is `lines` runs of count rows of `row_bytes` each: bshd
// [batch, count, KV_HEADS, HEAD_DIM] = batch lines of KV_HEADS x HEAD_DIM x 2 bytes a row,
// bhsd [batch, KV_HEADS, count, HEAD_DIM] = batch x KV_HEADS lines of HEAD_DIM x 2 bytes; the
// gathered k_full the same with world x count rows a line. Copying a piece of rows is a 2-D
// copy: `lines` runs of rows x row_bytes, source pitch count x row_bytes, destination pitch
// world x count x row_bytes.
#ifndef TSGEN_CP_CUH
#define TSGEN_CP_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include <stdio.h>

#include <type_traits>
#ifdef TSGEN_ATTENTION_TRACE
#include <chrono>
#endif

#include "tsgen/ptx.cuh"
#include "tsgen/sync.cuh"
#include "tsgen/attention.cuh"
#include "tsgen/fused.cuh"

namespace tsgen {
namespace cp {

constexpr int MAX_WORLD = 8;
constexpr int FREE = 0;                          // = fused::FREE
constexpr int READY = MAX_WORLD;                 // sig[READY + c], c < 2 MAX_WORLD (zig-zag: 2 chunks a rank)
constexpr int ARRIVED = READY + 2 * MAX_WORLD;   // sig[ARRIVED + d]
constexpr int WORK = ARRIVED + MAX_WORLD;        // sig[WORK]
constexpr int SIGNALS = WORK + 1;                // tsgen/ops/cp_attention.py SIGNALS
static_assert(FREE == fused::FREE && MAX_WORLD == fused::MAX_WORLD, "tsgen_fused's FREE exchange");

// The call timeline of a trace variant (test-only; tools/cp_call_timeline.py, tsgen/ops/cp_timeline.py read
// it): at sig + SIGNALS, STAMP_CALLS slots of STAMP_SLOT u64 words, call (epoch) e in slot e % STAMP_CALLS:
// [0] e, [1, 2] the entry kernel's start and end, [3, 4] WAIT_FREE's (its end: every peer's FREE seen), [5 + 2 i,
// 6 + 2 i] those of the signal kernel after the copies to the i-th receiver in copy order (ourselves first,
// then rank + 1, ...): globaltimer ns, written by thread 0 of each one-block sync kernel at its end.
constexpr int STAMP_CALLS = 8, STAMP_SLOT = 24;
constexpr int STAMP_WORDS = STAMP_CALLS * STAMP_SLOT;  // tsgen/ops/cp_timeline.py STAMP_WORDS
constexpr int STAMP_ENTRY = 1, STAMP_WAIT_FREE = 3, STAMP_SIGNAL = 5;
static_assert(STAMP_SIGNAL + 2 * MAX_WORLD <= STAMP_SLOT, "a stamp slot holds every receiver's signal kernel");
// Its host side (trace variants' launchers; host_call below): HOST_CALLS rows of HOST_STEPS u64 per rank.
constexpr int HOST_CALLS = 8, HOST_STEPS = 24, HOST_ATTENTION = 4 + 2 * MAX_WORLD, HOST_RETURN = HOST_ATTENTION + 1;
static_assert(HOST_RETURN < HOST_STEPS, "a host timeline row holds every step");

#ifdef TSGEN_ATTENTION_TRACE
// The end of a sync kernel of a trace variant: its start (`start`, read first thing) and end stamped into
// the slot of this call. `signal_mode`: the op's SIGNAL_CHUNKS (a mode beside fused::SyncMode's).
template <int WORLD>
static __device__ __forceinline__ void stamp_sync(uint64_t* stamps, int rank, const uint64_t* calls, int mode,
                                                  int target, int signal_mode, uint64_t start) {
  __syncthreads();  // every thread's part of the kernel (its waits) is done
  if (threadIdx.x != 0) return;
  const uint64_t epoch = ld_relaxed_gpu_global_u64(calls), end = globaltimer_ns();
  uint64_t* slot = stamps + (epoch % STAMP_CALLS) * STAMP_SLOT;
  int at = -1;
  if (mode == fused::ENTRY) {
    slot[0] = epoch;
    at = STAMP_ENTRY;
  } else if (mode == fused::WAIT_FREE) {
    at = STAMP_WAIT_FREE;
  } else if (mode == signal_mode) {
    at = STAMP_SIGNAL + 2 * ((target - rank + WORLD) % WORLD);
  }
  if (at >= 0) slot[at] = start, slot[at + 1] = end;
}

// The host side of the call timeline: per rank, the last HOST_CALLS calls of its launcher, HOST_STEPS u64 a
// call: [0] the launcher's call number on this rank (1, 2, ...: the device epoch where every call reached the
// entry kernel), then CLOCK_REALTIME ns (system_clock) at [1] the launcher's checks and device queries done (just
// before the entry kernel is enqueued), [2] the entry kernel
// enqueued, [3] WAIT_FREE (or the push kernel) enqueued, [4 + 2 i] the copies to the i-th receiver in copy
// order enqueued, [5 + 2 i] its signal kernel enqueued, [HOST_ATTENTION] the attention kernel enqueued,
// [HOST_RETURN] the joins enqueued (the launcher returns). 0: not reached (a copy skipped).
struct HostTimeline {
  uint64_t calls;
  uint64_t at[HOST_CALLS][HOST_STEPS];
};
static inline HostTimeline* host_timeline(int rank) {
  static HostTimeline all[MAX_WORLD];
  return rank >= 0 && rank < MAX_WORLD ? &all[rank] : nullptr;
}
static inline uint64_t host_now_ns() {
  return (uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch()).count();
}
// A new call of `rank`'s launcher: its row, zeroed, with the call number and the entry time.
static inline uint64_t* host_call(int rank) {
  HostTimeline* h = host_timeline(rank);
  if (h == nullptr) return nullptr;
  const uint64_t call = ++h->calls;
  uint64_t* row = h->at[call % HOST_CALLS];
  for (int i = 0; i < HOST_STEPS; ++i) row[i] = 0;
  row[0] = call, row[1] = host_now_ns();
  return row;
}
// The module's NAME_host_timeline(rank, out, words): [calls, then HOST_CALLS rows of HOST_STEPS] into out;
// the words written, or -1 (rank out of range, too little room).
static inline int copy_host_timeline(int rank, uint64_t* out, int words) {
  const HostTimeline* h = host_timeline(rank);
  constexpr int N = 1 + HOST_CALLS * HOST_STEPS;
  if (h == nullptr || out == nullptr || words < N) return -1;
  out[0] = h->calls;
  for (int c = 0; c < HOST_CALLS; ++c)
    for (int i = 0; i < HOST_STEPS; ++i) out[1 + c * HOST_STEPS + i] = h->at[c][i];
  return N;
}
#define TSGEN_CP_HOST_STEP(row, i) \
  do {                             \
    if (row) (row)[i] = host_now_ns(); \
  } while (0)
#else
#define TSGEN_CP_HOST_STEP(row, i) \
  do {                             \
  } while (0)
#endif

// Where rows live (the same on every rank; tsgen/ops/cp_attention.py `segments`).
struct Geometry {
  uint64_t lines;      // runs of rows: batch (bshd) or batch x KV_HEADS (bhsd)
  uint64_t row_bytes;  // one row of a run
  uint32_t count;      // rows per rank (S / P)
  int world;
  bool causal;         // gathered rows in position order (else whole shards, rotated)
  bool zigzag;         // causal zig-zag: a rank's rows are chunks r and 2P - 1 - r of count / 2
};

// One piece of source s's rows in receiver d's gathered buffers.
struct Segment {
  uint32_t src_row, rows, dst_row, chunk;
};

static __host__ __device__ __forceinline__ int segments(const Geometry& g) { return g.causal && g.zigzag ? 2 : 1; }

// KV rows per signal.
static __host__ __device__ __forceinline__ uint32_t kv_chunk(const Geometry& g) {
  return g.causal && g.zigzag ? g.count / 2 : g.count;
}

static __host__ __device__ __forceinline__ Segment segment(const Geometry& g, int s, int d, int i) {
  Segment x;
  if (!g.causal) {  // rotated: slot j holds rank d + 1 + j, so d's own shard is the last slot (walked first)
    const uint32_t slot = (uint32_t)((s - d - 1 + 2 * g.world) % g.world);
    x.src_row = 0, x.rows = g.count, x.dst_row = slot * g.count, x.chunk = slot;
  } else if (!g.zigzag) {
    x.src_row = 0, x.rows = g.count, x.dst_row = (uint32_t)s * g.count, x.chunk = (uint32_t)s;
  } else {
    const uint32_t half = g.count / 2, c = i == 0 ? (uint32_t)s : (uint32_t)(2 * g.world - 1 - s);
    x.src_row = i == 0 ? 0 : half, x.rows = half, x.dst_row = c * half, x.chunk = c;
  }
  return x;
}

// The first KV chunk of another rank that rank's attention producer reads (its first tile has
// the last positions and walks its blocks downwards): `skip_wait`'s chunk; -1 if none.
static __host__ __forceinline__ int first_remote_chunk(const Geometry& g, int rank) {
  if (!g.causal) return g.world - 2;
  int owner[2 * MAX_WORLD];
  for (int s = 0; s < g.world; ++s)
    for (int i = 0; i < segments(g); ++i) owner[segment(g, s, rank, i).chunk] = s;
  const int top = g.zigzag ? 2 * g.world - 1 - rank : rank;
  for (int c = top; c >= 0; --c)
    if (owner[c] != rank) return c;
  return -1;
}

// ---------------------------------------------------------------------------
// Device: the SM push. Every CTA copies a share of this rank's K and V rows to each receiver
// in turn (ourselves first, then rank + 1, rank + 2, ...: rank + 1 reads our rows right after
// its own), after the receiver's FREE; the last CTA done with a receiver raises its READY
// signals. 16-byte vectors, grid-stride over (line, vector).
// ---------------------------------------------------------------------------
static __device__ __forceinline__ void copy_piece(char* dst, const char* src, const Geometry& g, const Segment& x) {
  const uint64_t width = (uint64_t)x.rows * g.row_bytes / 16;  // vectors per line
  const uint64_t total = width * g.lines;
  const uint64_t src_pitch = (uint64_t)g.count * g.row_bytes, dst_pitch = (uint64_t)g.world * src_pitch;
  const char* from = src + (uint64_t)x.src_row * g.row_bytes;
  char* to = dst + (uint64_t)x.dst_row * g.row_bytes;
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (uint64_t)gridDim.x * blockDim.x) {
    const uint64_t line = i / width, col = i % width;
    const uint4 v = *reinterpret_cast<const uint4*>(from + line * src_pitch + col * 16);
    *reinterpret_cast<uint4*>(to + line * dst_pitch + col * 16) = v;
  }
}

// OWN_FIRST (params.own_copy_first): the rank's own rows copied into its k_full / v_full on the call's own
// stream by the SMs, before the attention kernel (stream order), instead of on the copy engine under it: a
// grid-stride copy of every own segment (16-byte vectors); the launcher signals them after it, also in stream
// order, so the kernel reads every row through k_full's map and never waits for its own.
static __device__ __forceinline__ void own_copy_body(int rank, const char* k, const char* v, char* k_full, char* v_full,
                                                     Geometry g) {
  for (int s = 0; s < segments(g); ++s) {
    const Segment x = segment(g, rank, rank, s);
    copy_piece(k_full, k, g, x);
    copy_piece(v_full, v, g, x);
  }
}

// LOCAL_KV (params.local_kv): whether this call's attention kernel reads the rank's own rows in place, from
// k and v, instead of from its copy in k_full. The own rows are the segments segment(g, rank, rank, s) of
// k_full (not causal: the last slot; causal: chunk rank, or zig-zag chunks rank and 2P - 1 - rank); the
// kernel's KV blocks of tile_n rows must not straddle one of them and a gathered chunk, so only a call
// whose own segments start on a block boundary and end on one (or at the end of k_full) reads them in
// place; any other copies, signals and waits for them like a peer's (the launcher and the push kernel
// decide alike, per call and rank).
static __host__ __device__ __forceinline__ bool own_in_place(const Geometry& g, int rank, uint32_t tile_n) {
  const uint64_t kv_len = (uint64_t)g.world * g.count;
  for (int s = 0; s < segments(g); ++s) {
    const Segment x = segment(g, rank, rank, s);
    const uint64_t end = (uint64_t)x.dst_row + x.rows;
    if (x.dst_row % tile_n || (end % tile_n && end != kv_len)) return false;
  }
  return true;
}

// What the attention launch reads in place where own_in_place: this rank's own segments, each a KV chunk of
// the gathered order and its first row in this rank's k and v (count rows).
static __host__ inline tsgen::attention::LocalKv own_local(const Geometry& g, int rank, const void* k, const void* v) {
  tsgen::attention::LocalKv local;
  local.k = k, local.v = v, local.rows = g.count;
  for (int s = 0; s < segments(g); ++s) {
    const Segment x = segment(g, rank, rank, s);
    local.chunk[s] = (int32_t)x.chunk, local.src[s] = x.src_row;
  }
  return local;
}

// LOCAL_TILE (LOCAL_KV: the kernel's tile.n; 0: none): where own_in_place, no copy to ourselves.
template <int WORLD, uint32_t LOCAL_TILE = 0>
static __device__ __forceinline__ void push_body(char* const* peers, int rank, const uint64_t* calls, uint64_t* sig,
                                                 const char* k, const char* v, char* k_full, char* v_full,
                                                 Geometry g) {
  const uint64_t epoch = ld_relaxed_gpu_global_u64(calls);
  const bool skip_own = LOCAL_TILE != 0 && own_in_place(g, rank, LOCAL_TILE);
  for (int i = skip_own ? 1 : 0; i < WORLD; ++i) {
    const int d = (rank + i) % WORLD;
    if (d != rank) {  // d's previous call no longer reads its gathered buffers
      if (threadIdx.x == 0) wait_ge_acquire_sys(sig + FREE + d, epoch, make_site("sig.free", rank, rank, FREE + d));
      __syncthreads();
    }
    char* kd = peer_ptr(k_full, peers, rank, d);
    char* vd = peer_ptr(v_full, peers, rank, d);
    for (int s = 0; s < segments(g); ++s) {
      const Segment x = segment(g, rank, d, s);
      copy_piece(kd, k, g, x);
      copy_piece(vd, v, g, x);
    }
    __threadfence_system();  // this thread's stores, before the CTA is counted
    __syncthreads();
    if (threadIdx.x == 0) {
      const uint64_t before = atom_add_acq_rel_gpu_global_u64(sig + ARRIVED + d, 1ull);
      if (before + 1 == (uint64_t)gridDim.x) {  // every CTA's share landed (acquired through the counter)
        st_relaxed_gpu_global_u64(sig + ARRIVED + d, 0ull);  // for the next call (stream order)
        fence_acq_rel_sys();
        uint64_t* at = peer_ptr(sig, peers, rank, d);
        for (int s = 0; s < segments(g); ++s) st_release_sys_global_u64(at + READY + segment(g, rank, d, s).chunk, epoch);
      }
    }
  }
}

// The copy engine's copies to `target` completed before this one-block kernel started (stream
// order): raise their READY signals at target.
static __device__ __forceinline__ void signal_body(char* const* peers, int rank, const uint64_t* calls, uint64_t* sig,
                                                   int target, Geometry g) {
  const uint64_t epoch = ld_relaxed_gpu_global_u64(calls);
  __threadfence_system();
  if (threadIdx.x != 0) return;
  uint64_t* at = peer_ptr(sig, peers, rank, target);
  for (int s = 0; s < segments(g); ++s) st_release_sys_global_u64(at + READY + segment(g, rank, target, s).chunk, epoch);
}

// ---------------------------------------------------------------------------
// Host side: one call of a cp_attention op (its NAME_wW_launch) and its prepare.
// ---------------------------------------------------------------------------
// `Op` is what the generated source says of the op (templates/ops/cp_attention.cu.j2, struct Host):
//   NAME (for messages), BATCH, CAUSAL, ZIGZAG, SKIP_WAIT, BLOCKS (launch.blocks, 0: every SM but
//   RESERVE_SMS), RESERVE_SMS, SM_GATHER (push kernel, else the copy engine), GATHER_BLOCKS,
//   GATHER_THREADS, SIGNAL_CHUNKS (the sync kernel's mode beside fused::SyncMode's), optionally
//   TILE_COUNTER (not causal: tiles from the counter, `tile_counter_of`), COPY_1D (`copy_1d_of`), TRACE (room
//   for trace records after sig's signals and the call timeline's stamps: tsgen/attention.cuh's
//   test-only trace; 0: none), the attention `Config` (LOCAL_KV there, tsgen::attention::local_kv_of:
//   where own_in_place the kernel reads this rank's own rows in place, from k and v, so nothing copies
//   them into k_full, nothing signals them and nothing waits for them), and geometry(world, count).
// SYNC, PUSH (nullptr without SM_GATHER) and ATTENTION are the kernels of world size WORLD.

// Op::TILE_COUNTER where the Op has it (only not-causal specs with params.tile_counter emit it),
// else false: whether a not-causal kernel takes its tiles from the counter (sig[WORK]).
template <class Op, class = void>
struct tile_counter_of : std::false_type {};
template <class Op>
struct tile_counter_of<Op, std::void_t<decltype(Op::TILE_COUNTER)>> : std::integral_constant<bool, Op::TILE_COUNTER> {};

// Op::COPY_1D where the Op has it (only specs with params.copy_1d emit it), else false: a piece that is one
// contiguous run (lines == 1) goes by cudaMemcpyAsync instead of cudaMemcpy2DAsync.
template <class Op, class = void>
struct copy_1d_of : std::false_type {};
template <class Op>
struct copy_1d_of<Op, std::void_t<decltype(Op::COPY_1D)>> : std::integral_constant<bool, Op::COPY_1D> {};

// Op::OWN_COPY where the Op has it (only specs with params.own_copy_first emit it: the module's own-copy
// kernel), else none: whether the own rows are copied on the call's stream before the kernel (OWN_FIRST).
template <class Op, class = void>
struct own_first_of : std::false_type {};
template <class Op>
struct own_first_of<Op, std::void_t<decltype(Op::OWN_COPY)>> : std::true_type {};

// A call the launcher refuses before it starts anything, with what and where on stderr.
template <class Op>
static cudaError_t refused(int world, int rank, uint64_t count, const char* why, cudaError_t err) {
  fprintf(stderr, "tsgen: %s_w%d_launch: rank %d, count %llu: %s\n", Op::NAME, world, rank, (unsigned long long)count,
          why);
  return err;
}

// ATTENTION_ONLY (test-only, params.attention_only_entry): the attention kernel alone at the rank's current
// epoch, no entry exchange, copies or signals; after a full call every chunk it waits for is signalled.
template <class Op, int WORLD, auto SYNC, auto PUSH, auto ATTENTION, bool ATTENTION_ONLY = false, class T>
static cudaError_t launch(char* const* peers, char* const* peers_host, int rank, uint64_t* calls, uint64_t count,
                          T* q, T* k, T* v, T* o, float* lse, T* k_full, T* v_full, uint64_t* sig,
                          cudaStream_t stream) {
  using namespace tsgen::fused;
  // LOCAL_KV: our own rows are read in place where the call's row count lets them (own_in_place; else
  // they are gathered like a peer's)
  constexpr bool LOCAL_KV = tsgen::attention::local_kv_of<typename Op::Config>::value;
  if constexpr (Op::SM_GATHER) (void)peers_host;  // the push kernel addresses peers through the device table
  if (count == 0) return cudaSuccess;
  if (rank < 0 || rank >= WORLD) return refused<Op>(WORLD, rank, count, "rank out of range", cudaErrorInvalidValue);
  if (count > tsgen::attention::MAX_LEN / WORLD)
    return refused<Op>(WORLD, rank, count, "more rows per rank than tsgen::attention::MAX_LEN / world",
                       cudaErrorInvalidValue);
  if (Op::ZIGZAG && count % 2)
    return refused<Op>(WORLD, rank, count, "zig-zag needs an even row count (two chunks of count / 2)",
                       cudaErrorInvalidValue);
  TSGEN_TRY(tsgen::use_device_of(calls));
  const Geometry g = Op::geometry(WORLD, count);
  const bool in_place = LOCAL_KV && own_in_place(g, rank, Op::Config::TILE_N);  // our rows read in place
  const tsgen::attention::LocalKv local = in_place ? own_local(g, rank, k, v) : tsgen::attention::LocalKv();
  int device, sms;
  TSGEN_TRY(cudaGetDevice(&device));
  TSGEN_TRY(tsgen::sm_count(device, &sms));
  // The persistent attention CTAs take whole SMs and wait for the gather: they must leave its SMs free.
  const int grid = Op::BLOCKS ? Op::BLOCKS : sms - Op::RESERVE_SMS;
  if (grid < 1 || grid > sms - Op::RESERVE_SMS)
    return refused<Op>(WORLD, rank, count, "the attention grid (launch.blocks) must leave the gather's SMs free",
                       cudaErrorLaunchOutOfResources);
  // query positions: causal contiguous from rank x count; zig-zag two chunks; not causal: any
  const int64_t c = (int64_t)count, half = c / 2;
  const int64_t q_offset = !Op::CAUSAL ? 0 : Op::ZIGZAG ? rank * half : rank * c;
  const int64_t q_split = Op::CAUSAL && Op::ZIGZAG ? half : c;
  const int64_t q_offset2 = Op::CAUSAL && Op::ZIGZAG ? (2 * WORLD - 1 - rank) * half : 0;
  // not waited for: the negative control's chunk (a peer's: ours, where in place, are not signalled at all)
  const int unwaited = Op::SKIP_WAIT ? first_remote_chunk(g, rank) : -1;
#ifdef TSGEN_ATTENTION_TRACE
  uint64_t* host = host_call(rank);  // the host side of the call timeline (trace variants)
#else
  uint64_t* host = nullptr;
#endif
  (void)host;
  const auto attention = [&] {
    return tsgen::attention::launch<typename Op::Config>(
        ATTENTION, q, k_full, v_full, o, lse, Op::BATCH, count, WORLD * count, q_offset, q_split, q_offset2, 0,
        sig + READY, kv_chunk(g), 0, grid, stream, calls, unwaited,
        Op::CAUSAL || tile_counter_of<Op>::value ? sig + WORK : nullptr,
        Op::TRACE ? sig + SIGNALS + STAMP_WORDS : nullptr, (uint32_t)Op::TRACE, false, local);
  };
  if constexpr (ATTENTION_ONLY) return attention();
  SYNC<<<1, 32, 0, stream>>>(peers, rank, calls, sig, ENTRY, 0, count);
  TSGEN_TRY(cudaGetLastError());
  TSGEN_CP_HOST_STEP(host, 2);
  Lanes* l;
  TSGEN_TRY(lanes(rank, &l));
  TSGEN_TRY(cudaEventRecord(l->fork, stream));
  TSGEN_TRY(cudaStreamWaitEvent(l->copy, l->fork, 0));
  // OWN_FIRST: our own rows into k_full by the SMs, then their signal, both on `stream` after the fork (the copy
  // engine's copies to the peers, which only read k and v, start beside them) and before the kernel (our previous
  // kernel, the only reader of our own slot, is before them in stream order; no peer writes it)
  constexpr bool OWN_FIRST = own_first_of<Op>::value;
  const bool own_first = OWN_FIRST && !in_place;
  if constexpr (OWN_FIRST) {
    if (own_first) {
      Op::OWN_COPY<<<2 * sms, Op::OWN_COPY_THREADS, 0, stream>>>(rank, (const char*)k, (const char*)v, (char*)k_full,
                                                             (char*)v_full, g);
      TSGEN_TRY(cudaGetLastError());
      SYNC<<<1, 32, 0, stream>>>(peers, rank, calls, sig, Op::SIGNAL_CHUNKS, rank, count);
      TSGEN_TRY(cudaGetLastError());
    }
  }
  if constexpr (Op::SM_GATHER) {
    PUSH<<<Op::GATHER_BLOCKS, Op::GATHER_THREADS, 0, l->copy>>>(peers, rank, calls, sig, k, v, k_full, v_full, count);
    TSGEN_TRY(cudaGetLastError());
    TSGEN_CP_HOST_STEP(host, 3);
  } else {
    TSGEN_TRY(cudaStreamWaitEvent(l->signal, l->fork, 0));
    SYNC<<<1, 32, 0, l->copy>>>(peers, rank, calls, sig, WAIT_FREE, 0, count);
    TSGEN_TRY(cudaGetLastError());
    TSGEN_CP_HOST_STEP(host, 3);
    const size_t src_pitch = (size_t)count * g.row_bytes, dst_pitch = WORLD * src_pitch;
    // ourselves first (in_place, own_first: not here), then rank + 1 (it reads our rows right after its own), ...
    for (int i = in_place || own_first ? 1 : 0; i < WORLD; ++i) {
      const int d = (rank + i) % WORLD;
      char* kd = host_peer_ptr((char*)k_full, peers_host, rank, d);
      char* vd = host_peer_ptr((char*)v_full, peers_host, rank, d);
      for (int s = 0; s < segments(g); ++s) {
        const Segment x = segment(g, rank, d, s);
        const size_t width = (size_t)x.rows * g.row_bytes, from = (size_t)x.src_row * g.row_bytes,
                     to = (size_t)x.dst_row * g.row_bytes;
        if (copy_1d_of<Op>::value && g.lines == 1) {  // one run: the 1-D copy (params.copy_1d)
          TSGEN_TRY(cudaMemcpyAsync(kd + to, (const char*)k + from, width, cudaMemcpyDefault, l->copy));
          TSGEN_TRY(cudaMemcpyAsync(vd + to, (const char*)v + from, width, cudaMemcpyDefault, l->copy));
        } else {
          TSGEN_TRY(cudaMemcpy2DAsync(kd + to, dst_pitch, (const char*)k + from, src_pitch, width, g.lines,
                                            cudaMemcpyDefault, l->copy));
          TSGEN_TRY(cudaMemcpy2DAsync(vd + to, dst_pitch, (const char*)v + from, src_pitch, width, g.lines,
                                            cudaMemcpyDefault, l->copy));
        }
      }
      TSGEN_TRY(cudaEventRecord(l->copied[i], l->copy));
      TSGEN_CP_HOST_STEP(host, 4 + 2 * i);
      TSGEN_TRY(cudaStreamWaitEvent(l->signal, l->copied[i], 0));
      SYNC<<<1, 32, 0, l->signal>>>(peers, rank, calls, sig, Op::SIGNAL_CHUNKS, d, count);
      TSGEN_TRY(cudaGetLastError());
      TSGEN_CP_HOST_STEP(host, 5 + 2 * i);
    }
  }
  // Its error (if any) is returned after the side streams are joined back into `stream`: a
  // capture must not end with a fork open.
  const cudaError_t launched = attention();
  TSGEN_CP_HOST_STEP(host, HOST_ATTENTION);
  TSGEN_TRY(cudaEventRecord(l->copy_done, l->copy));
  TSGEN_TRY(cudaStreamWaitEvent(stream, l->copy_done, 0));
  if constexpr (!Op::SM_GATHER) {
    TSGEN_TRY(cudaEventRecord(l->signal_done, l->signal));
    TSGEN_TRY(cudaStreamWaitEvent(stream, l->signal_done, 0));
  }
  TSGEN_CP_HOST_STEP(host, HOST_RETURN);
  return launched;
}

// Rank `rank`'s side streams and the attention kernel's shared-memory opt-in, made on `device`
// before any rank's first call (the manifest's "prepare"; see tsgen::fused::lanes).
template <class Op, auto ATTENTION>
static cudaError_t prepare(int world, int rank, int device) {
  TSGEN_TRY(tsgen::fused::prepare_rank(world, rank, device, true));
  return tsgen::attention::prepare<typename Op::Config>(reinterpret_cast<const void*>(ATTENTION));
}

}  // namespace cp
}  // namespace tsgen

#endif  // TSGEN_CP_CUH
