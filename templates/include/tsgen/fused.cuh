// tsgen/fused.cuh -- the communication side of the fused GEMM ops (allgather_gemm,
// gemm_reduce_scatter): the producer hook that makes GEMM tiles wait for their source's
// rows, the hook that signals finished row blocks (gemm_reduce_scatter), the reduce
// kernel body, the one-block sync kernel body (entry / wait / signal), and the side
// streams of the host launcher.
//
// Hand-written; included by fused sources (it includes tsgen/gemm.cuh).
//
// Signals (u64 counters that only grow, in the `sig` buffer of every rank):
//   sig[FREE + s]  = e: rank s has entered call e, so its previous call's GEMM no longer
//                  reads its a_full: this rank may write its shard into s's a_full.
//                  (Lives in the writer's memory: raised by s, waited for by the writer.)
//   sig[READY + s] = e: source s's rows of call e have landed in this rank's a_full
//                  (raised by s after its copy completed, waited for by the GEMM here).
// gemm_reduce_scatter reads them so (see ScatterHook): FREE[q] = e: rank q has entered call
// e, so its previous call's reduce no longer reads this rank's partial (push, reduce: add:
// raised by q's GEMM once q's c is zero for this call's adds); READY[s] = e (at the owner): source s's partial
// block for this rank is stored in s's memory (push: in the owner's; add: added into its c).
// The epoch e is the device call counter: the entry kernel advances calls[0] to e on
// the caller's stream before anything else of the call, every later kernel of the call
// reads calls[0] (stream order after the entry), so CUDA graph replay works.
#ifndef TSGEN_FUSED_CUH
#define TSGEN_FUSED_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "tsgen/ptx.cuh"
#include "tsgen/sync.cuh"
#include "tsgen/gemm.cuh"

namespace tsgen {
namespace fused {

constexpr int MAX_WORLD = 8;
constexpr int FREE = 0;               // sig[FREE + s]
constexpr int READY = MAX_WORLD;      // sig[READY + s]
constexpr int SIGNALS = 2 * MAX_WORLD;

// ---------------------------------------------------------------------------
// Device: the GEMM producer's hook (gemm::NoHook describes the interface).
// Batch s of the GEMM = the rows of source rank s; the walk starts at this rank's own
// rows, read from `a` directly (its own map), then rank + 1, rank + 2, ... from a_full.
// WAIT: wait for sig[READY + s] >= epoch before the first tile of source s (overlapped);
// without it the launcher orders the GEMM after the gather (plain).
// ---------------------------------------------------------------------------
template <bool WAIT>
struct GatherHook {
  const CUtensorMap* local;  // this rank's A (M_local x K, as a 3-D map of 1 batch)
  const uint64_t* ready;     // &sig[READY]
  uint64_t epoch;
  uint32_t rank;
  uint32_t waited;  // bit s: source s already waited for by this producer

  __device__ __forceinline__ uint32_t first_batch() const { return rank; }
  __device__ __forceinline__ void wait(uint32_t batch) {
    if constexpr (WAIT) {
      if (batch != rank && !((waited >> batch) & 1u)) {
        gemm::wait_signal_ge_sys(ready + batch, epoch);
        waited |= 1u << batch;
      }
    }
  }
  __device__ __forceinline__ const CUtensorMap* a_map(const CUtensorMap* full, uint32_t batch, int& z) const {
    if (batch == rank) {
      z = 0;
      return local;
    }
    z = (int)batch;
    return full;
  }
};

// ---------------------------------------------------------------------------
// Device: gemm_reduce_scatter's hook. Batch q of the GEMM = row block q of this rank's
// partial product (count rows each), the block that rank q owns; the walk starts at
// rank + 1 and ends with this rank's own block, so the blocks peers wait for come first.
// OVERLAP: the producer waits for sig[FREE + q] >= epoch before the first tile of block q
// (rank q has entered this call, so it no longer reads our previous call's partial), and
// after each tile every consumer warpgroup leader waits for its TMA stores, fences them
// toward the generic proxy and counts the tile in sig[TILES + q]; the arrival that
// completes block q resets the counter and raises sig[READY + rank] = epoch at rank q.
// Without OVERLAP (plain) the launcher orders the GEMM between two signal exchanges.
// PushHook: the tiles of block q go straight into rank q's `partial`, at slot `rank`
// (push[q]: a tensor map of q's partial as this rank addresses it), so READY[rank] at q
// says the data is already there; ScatterHook stores them in this rank's own partial.
// ---------------------------------------------------------------------------
constexpr int TILES = 2 * MAX_WORLD;  // sig[TILES + q]: tiles of block q stored in this call
// push with reduce: add: sig[ZEROING] counts the CTAs that zeroed their share of our c in this
// call (reset by the last); sig[ZEROED] = e: all of it is zero for call e
constexpr int ZEROING = 3 * MAX_WORLD, ZEROED = ZEROING + 1;
constexpr int RS_SIGNALS = ZEROED + 1;

// push: every owner's partial as a 3-D tensor map (a kernel parameter, __grid_constant__)
template <int WORLD>
struct PushMaps {
  CUtensorMap to[WORLD];
};

template <bool OVERLAP>
struct ScatterHook {
  char* const* peers;
  uint64_t* sig;      // this rank's signals
  uint64_t epoch;
  uint32_t rank, world;
  uint32_t expected;  // arrivals that complete a block: CTA tiles per batch x consumer warpgroups
  uint32_t waited;    // bit q: FREE[q] already waited for by this producer

  __device__ __forceinline__ uint32_t first_batch() const { return (rank + 1) % world; }
  __device__ __forceinline__ void wait(uint32_t batch) {
    if constexpr (OVERLAP) {
      if (batch != rank && !((waited >> batch) & 1u)) {
        gemm::wait_signal_ge_sys(sig + FREE + batch, epoch);
        waited |= 1u << batch;
      }
    }
  }
  __device__ __forceinline__ const CUtensorMap* a_map(const CUtensorMap* a, uint32_t batch, int& z) const {
    z = (int)batch;
    return a;
  }
  __device__ __forceinline__ void stored(uint32_t batch, bool leader) {
    if constexpr (OVERLAP) {
      // our own block is read after the GEMM, in stream order: nobody waits for it
      if (!leader || batch == rank) return;
      // this warpgroup's TMA stores of the tile are done (written, in the owner's memory with
      // push: the consumer waited for them); order them before what follows (generic proxy)
      gemm::fence_proxy_async_global();
      const uint64_t before = atom_add_acq_rel_gpu_global_u64(sig + TILES + batch, 1ull);
      if (before + 1 == (uint64_t)expected) {
        // every tile of block q is stored (acquired through the counter): reset it for the
        // next call (ordered after this kernel by the stream) and announce the block at q
        st_relaxed_gpu_global_u64(sig + TILES + batch, 0ull);
        fence_acq_rel_sys();
        st_release_sys_global_u64(peer_ptr(sig, peers, (int)rank, (int)batch) + READY + rank, epoch);
      }
    }
  }
};

// push: the overlapped hook whose tiles of block q are stored into rank q's partial
struct PushHook : ScatterHook<true> {
  const CUtensorMap* push;  // world maps: push[q] = rank q's partial (3-D, slot = source rank)

  __device__ __forceinline__ const CUtensorMap* c_map(const CUtensorMap*, uint32_t batch, int& z) const {
    z = (int)rank;  // our slot in the owner's partial
    return push + batch;
  }
};

// push with reduce: add: the tiles of block q are added into rank q's c itself (push[q]: q's
// c, 3-D with one batch) -- no slots, no sum after the GEMM. c must be zero first: each CTA's
// idle producer threads zero its share of our c (side_work) and the last CTA to finish raises
// FREE[rank] at every peer. The consumers wait before their first add into q's c (FREE[q], or
// ZEROED for our own), not the producer before its loads: the first tiles' MMAs run while
// every rank zeroes its c.
struct AddHook : ScatterHook<true> {
  static constexpr bool REDUCE_ADD = true;
  const CUtensorMap* push;  // world maps, push[q] for owner q
  uint4* c;                 // our c
  uint64_t vectors;         // its 16-byte vectors
  uint32_t zeroed;          // bit q: this thread has seen q's c zeroed for this call

  __device__ __forceinline__ void wait(uint32_t) {}  // loads need nothing; adds wait in c_map
  __device__ __forceinline__ void side_work(uint32_t t, uint32_t n) {
    const uint64_t stride = (uint64_t)gridDim.x * n;
    for (uint64_t i = (uint64_t)blockIdx.x * n + t; i < vectors; i += stride) c[i] = make_uint4(0u, 0u, 0u, 0u);
    __threadfence();  // our zeros, before the CTA is counted below
    gemm::named_barrier_sync(gemm::SIDE_BARRIER, n);
    if (t != 0) return;
    const uint64_t before = atom_add_acq_rel_gpu_global_u64(sig + ZEROING, 1ull);
    if (before + 1 == (uint64_t)gridDim.x) {  // every CTA's share is zero (acquired through the counter)
      st_relaxed_gpu_global_u64(sig + ZEROING, 0ull);  // for the next call (stream order)
      fence_acq_rel_sys();
      st_release_gpu_global_u64(sig + ZEROED, epoch);
      for (uint32_t q = 0; q < world; ++q)
        if (q != rank) st_release_sys_global_u64(peer_ptr(sig, peers, (int)rank, (int)q) + FREE + rank, epoch);
    }
  }
  __device__ __forceinline__ const CUtensorMap* c_map(const CUtensorMap*, uint32_t batch, int& z) {
    if (!((zeroed >> batch) & 1u)) {  // q's c is zero for this call (then: toward the async proxy)
      gemm::wait_signal_ge_sys(batch == rank ? sig + ZEROED : sig + FREE + batch, epoch);
      zeroed |= 1u << batch;
    }
    z = 0;  // the owner's c: one batch
    return push + batch;
  }
};

// ---------------------------------------------------------------------------
// Device: gemm_reduce_scatter's reductions. The row block is `elems` 16-bit values
// (count x N, a multiple of 8): 16-byte vectors, grid-stride, UNROLL vectors in flight
// per thread. Peers' partials are read over NVLink with plain loads after an acquire.
// ---------------------------------------------------------------------------
template <class T>
struct Vec8;  // 8 x 16-bit <-> 8 x fp32
template <>
struct Vec8<__nv_bfloat16> {
  static __device__ __forceinline__ void add(float (&f)[8], uint4 v) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] += __uint_as_float(w[i] << 16);
      f[2 * i + 1] += __uint_as_float(w[i] & 0xFFFF0000u);
    }
  }
};
template <>
struct Vec8<__half> {
  static __device__ __forceinline__ void add(float (&f)[8], uint4 v) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 x = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      f[2 * i] += x.x;
      f[2 * i + 1] += x.y;
    }
  }
};

template <class T>
static __device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  return make_uint4(gemm::pack2<T>(f[0], f[1]), gemm::pack2<T>(f[2], f[3]),
                    gemm::pack2<T>(f[4], f[5]), gemm::pack2<T>(f[6], f[7]));
}

// acc (fp32, 8 per vector) as two float4
static __device__ __forceinline__ void load_acc(float (&f)[8], const float* acc, uint64_t v) {
  const float4 x = reinterpret_cast<const float4*>(acc)[2 * v], y = reinterpret_cast<const float4*>(acc)[2 * v + 1];
  f[0] = x.x, f[1] = x.y, f[2] = x.z, f[3] = x.w, f[4] = y.x, f[5] = y.y, f[6] = y.z, f[7] = y.w;
}
static __device__ __forceinline__ void store_acc(float* acc, uint64_t v, const float (&f)[8]) {
  reinterpret_cast<float4*>(acc)[2 * v] = make_float4(f[0], f[1], f[2], f[3]);
  reinterpret_cast<float4*>(acc)[2 * v + 1] = make_float4(f[4], f[5], f[6], f[7]);
}

enum ReduceMode : int {
  PULL_ALL = 0,  // plain: c = sum over every rank s of s's partial block `rank` (all in place)
  PULL_PEER = 1, // overlapped, one source at a time as its READY arrives: acc (=|+=) s's block
  FINISH = 2,    // overlapped, after the GEMM: c = acc + our own block
  SUM_PUSHED = 3, // push, after the GEMM: wait for every READY, c = sum of our partial's slots (local)
};

// One pass over the row block: f = (ACC_IN ? acc : 0) + sum of the NSRC sources' vectors,
// stored to acc (TO_ACC) or rounded to c. `src`: each source's partial at block `rank`.
template <class T, int NSRC, int UNROLL, bool ACC_IN, bool TO_ACC>
static __device__ __forceinline__ void reduce_pass(const T* const (&src)[NSRC], float* acc, T* c, uint64_t vectors) {
  const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  for (uint64_t base = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; base < vectors; base += stride * UNROLL) {
    float f[UNROLL][8];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
      for (int i = 0; i < 8; ++i) f[u][i] = 0.f;
      if (ACC_IN && base + u * stride < vectors) load_acc(f[u], acc, base + u * stride);
    }
#pragma unroll
    for (int s = 0; s < NSRC; ++s) {
      uint4 v[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u)
        v[u] = base + u * stride < vectors
                   ? ld_weak_na_global_v4(reinterpret_cast<const uint4*>(src[s]) + base + u * stride)
                   : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) Vec8<T>::add(f[u], v[u]);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (base + u * stride >= vectors) continue;
      if constexpr (TO_ACC) {
        store_acc(acc, base + u * stride, f[u]);
      } else {
        reinterpret_cast<uint4*>(c)[base + u * stride] = pack8<T>(f[u]);
      }
    }
  }
}

// The reduce kernel body. Every rank's partial is (WORLD x count) x N; block q at q x elems.
template <class T, int WORLD, int UNROLL>
static __device__ __forceinline__ void reduce_body(char* const* peers, int rank, const uint64_t* calls,
                                                   const uint64_t* sig, const T* partial, float* acc, T* c,
                                                   uint64_t elems, int mode) {
  const uint64_t vectors = elems / 8;
  const uint64_t epoch = ld_relaxed_gpu_global_u64(calls);
  if (mode == PULL_ALL) {  // the launcher ran the signal exchange before this kernel
    const T* src[WORLD];
#pragma unroll
    for (int i = 0; i < WORLD; ++i)
      src[i] = peer_ptr(partial, peers, rank, (rank + i) % WORLD) + (uint64_t)rank * elems;
    reduce_pass<T, WORLD, UNROLL, false, false>(src, acc, c, vectors);
  } else if (mode == FINISH) {
    const T* src[1] = {partial + (uint64_t)rank * elems};
    reduce_pass<T, 1, UNROLL, true, false>(src, acc, c, vectors);
  } else if (mode == SUM_PUSHED) {
    // slot s of our partial = source s's part of our block, stored there by s's GEMM
    if (threadIdx.x < WORLD && threadIdx.x != rank)
      wait_ge_acquire_sys(sig + READY + threadIdx.x, epoch,
                          make_site("sig.ready", rank, rank, READY + (int)threadIdx.x));
    __syncthreads();
    const T* src[WORLD];
#pragma unroll
    for (int i = 0; i < WORLD; ++i) src[i] = partial + (uint64_t)((rank + i) % WORLD) * elems;
    reduce_pass<T, WORLD, UNROLL, false, false>(src, acc, c, vectors);
  } else {
    // sources in the order they compute our block: rank - 1 first (its first batch), ...
    for (int j = 1; j < WORLD; ++j) {
      const int s = (rank - j + WORLD) % WORLD;
      if (threadIdx.x == 0)
        wait_ge_acquire_sys(sig + READY + s, epoch, make_site("sig.ready", rank, rank, READY + s));
      __syncthreads();
      const T* src[1] = {peer_ptr(partial, peers, rank, s) + (uint64_t)rank * elems};
      if (j == 1) {
        reduce_pass<T, 1, UNROLL, false, true>(src, acc, c, vectors);
      } else {
        reduce_pass<T, 1, UNROLL, true, true>(src, acc, c, vectors);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Device: one-block sync kernel body (blockDim.x >= WORLD), by mode.
// ---------------------------------------------------------------------------
enum SyncMode : int {
  ENTRY = 0,       // advance calls[0] to this call's epoch; raise FREE[rank] at every peer
  WAIT_FREE = 1,   // wait until every peer raised FREE[peer] here (its a_full is ours to write)
  SIGNAL = 2,      // the copy to `target` completed: raise READY[rank] at target
  SIGNAL_ALL = 3,  // every copy completed: raise READY[rank] at every peer, then wait for all READY here
  WAIT_READY = 4,  // wait until every peer raised READY[peer] here (its adds into our c are done)
  BEGIN = 5,       // advance calls[0] only (push add: the GEMM raises FREE once our c is zero)
};

template <int WORLD>
static __device__ __forceinline__ void sync_body(char* const* peers, int rank, uint64_t* calls, uint64_t* sig,
                                                 int mode, int target) {
  const int t = threadIdx.x;
  if (mode == ENTRY || mode == BEGIN) {
    // the previous call's kernels on this stream (its GEMM included) are done: stream order
    const uint64_t epoch = ld_relaxed_gpu_global_u64(calls) + 1;
    __syncthreads();  // everyone has read calls[0] before thread 0 advances it
    if (t == 0) st_relaxed_gpu_global_u64(calls, epoch);
    if (mode == ENTRY && t < WORLD && t != rank)
      st_release_sys_global_u64(peer_ptr(sig, peers, rank, t) + FREE + rank, epoch);
    return;
  }
  const uint64_t epoch = ld_relaxed_gpu_global_u64(calls);
  if (mode == WAIT_FREE || mode == WAIT_READY) {
    const int base = mode == WAIT_FREE ? FREE : READY;
    if (t < WORLD && t != rank)
      wait_ge_acquire_sys(sig + base + t, epoch,
                          make_site(mode == WAIT_FREE ? "sig.free" : "sig.ready", rank, rank, base + t));
    return;
  }
  // The copy engine's writes completed before this kernel started (stream order); the
  // fence makes them visible at system scope before the release that announces them.
  __threadfence_system();
  if (mode == SIGNAL) {
    if (t == 0) st_release_sys_global_u64(peer_ptr(sig, peers, rank, target) + READY + rank, epoch);
    return;
  }
  if (t < WORLD && t != rank) st_release_sys_global_u64(peer_ptr(sig, peers, rank, t) + READY + rank, epoch);
  if (t < WORLD && t != rank)
    wait_ge_acquire_sys(sig + READY + t, epoch, make_site("sig.ready", rank, rank, READY + t));
}

// ---------------------------------------------------------------------------
// Host: side streams per rank (made on its first call, kept for the process).
// ---------------------------------------------------------------------------
struct Lanes {
  cudaStream_t copy, signal;  // the gather's copies; the signal kernels after each copy
  cudaEvent_t fork, copied[MAX_WORLD], copy_done, signal_done;
  int device;  // where they were made
  bool ready;
};

// One set per rank this process drives, made on the current device (the rank's) by the
// module's NAME_wW_prepare before any rank's first call, else at the rank's first call: ranks
// that share a GPU must not share side streams and events (each would wait on the other's).
// Made at a first call, they can stall it: on a GPU shared by ranks, creating a stream waited
// for the peers' kernels already spinning there (measured: docs/lab/shared_gpu.md).
static cudaError_t lanes(int rank, Lanes** out) {
  static Lanes all[MAX_WORLD];
  if (rank < 0 || rank >= MAX_WORLD) return cudaErrorInvalidValue;
  Lanes* l = &all[rank];
  int device;
  TSGEN_TRY(tsgen::lanes_device(l->ready, l->device, &device));  // prepared on another device?
  if (!l->ready) {
    l->device = device;
    // signals are on the GEMM's critical path: their kernels go first when SMs free up
    TSGEN_TRY(tsgen::make_lanes({{&l->copy, 1, false}, {&l->signal, 1, true}},
                                      {{&l->fork, 1}, {&l->copy_done, 1}, {&l->signal_done, 1}, {l->copied, MAX_WORLD}}));
    l->ready = true;
  }
  *out = l;
  return cudaSuccess;
}

// The start of a module's NAME_wW_prepare: `device` current, and rank `rank`'s side streams
// made there when its launcher uses them (`with_lanes`).
static cudaError_t prepare_rank(int world, int rank, int device, bool with_lanes) {
  TSGEN_TRY(tsgen::prepare_on(world, rank, device));
  Lanes* l;
  return with_lanes ? lanes(rank, &l) : cudaSuccess;
}

// The same element on rank `peer`, as this process addresses it (peers_host: every
// rank's heap base; the same offsets in every heap).
template <typename T>
static T* host_peer_ptr(T* local, char* const* peers_host, int rank, int peer) {
  return (T*)(peers_host[peer] + ((const char*)local - peers_host[rank]));
}

// A small per-thread cache of encoded tensor maps, keyed by the pointers and sizes they
// were made from (encoding takes microseconds; one process may drive several ranks).
template <int N_MAPS>
struct MapCache {
  struct Entry {
    const void* key[6];
    CUtensorMap maps[N_MAPS];
    bool valid;
  };
  Entry entries[8];
  unsigned next;

  Entry* find(const void* const (&key)[6]) {
    for (Entry& e : entries) {
      if (!e.valid) continue;
      bool same = true;
      for (int i = 0; i < 6; ++i) same = same && e.key[i] == key[i];
      if (same) return &e;
    }
    return nullptr;
  }
  Entry* slot(const void* const (&key)[6]) {
    Entry* e = &entries[next++ % 8];
    e->valid = false;
    for (int i = 0; i < 6; ++i) e->key[i] = key[i];
    return e;
  }
  // The entry for `key`; when it is not cached, a slot whose maps encode(maps) fills (nullptr and
  // the error in *err when that fails: the slot stays invalid).
  template <class Encode>
  Entry* get(const void* const (&key)[6], Encode encode, cudaError_t* err) {
    Entry* e = find(key);
    if (e) return e;
    e = slot(key);
    *err = encode(e->maps);
    if (*err != cudaSuccess) return nullptr;
    e->valid = true;
    return e;
  }
};

// ---------------------------------------------------------------------------
// Host side of one call of an allgather_gemm op (its NAME_wW_launch) and its prepare.
// ---------------------------------------------------------------------------
// C: the GEMM's Config at world size WORLD (templates/ops/allgather_gemm.cu.j2); OVERLAPPED: the
// copies on side streams, the GEMM waiting per source (else gathered first, then one GEMM);
// RESERVE_SMS: SMs the persistent GEMM leaves to the copy and signal kernels. GEMM and SYNC are
// world size WORLD's kernels.
template <class C, bool OVERLAPPED, int RESERVE_SMS, int WORLD, auto GEMM, auto SYNC, class T>
static cudaError_t allgather_gemm_launch(char* const* peers, char* const* peers_host, int rank, uint64_t* calls,
                                         uint64_t count, T* a, T* b, T* c, T* a_full, uint64_t* sig,
                                         cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  TSGEN_TRY(tsgen::use_device_of(calls));
  if (count > tsgen::gemm::MAX_ROWS || rank < 0 || rank >= WORLD) return cudaErrorInvalidValue;
  const uint32_t rows = (uint32_t)count;
  // tensor maps: gathered A (3-D: column, row, source), our A (3-D, one source), B, C (3-D)
  thread_local MapCache<4> cache;
  const void* const key[6] = {a, a_full, b, c, (const void*)(uintptr_t)count, (const void*)(uintptr_t)rank};
  auto encode = [&](CUtensorMap* m) {
    using L = tsgen::gemm::Layout<C>;
    constexpr CUtensorMapDataType dtype = tsgen::gemm::tensor_map_dtype<typename C::Element>();
    TSGEN_TRY(tsgen::gemm::encode_matrix(&m[0], dtype, a_full, rows, C::K, L::A_BOX_ROWS, WORLD, true));
    TSGEN_TRY(tsgen::gemm::encode_matrix(&m[1], dtype, a, rows, C::K, L::A_BOX_ROWS, 1, true));
    TSGEN_TRY(tsgen::gemm::encode_matrix(&m[2], dtype, b, C::K, C::N, C::TILE_K));
    return tsgen::gemm::encode_matrix(&m[3], dtype, c, rows, C::N, 64, WORLD, true);
  };
  cudaError_t err = cudaSuccess;
  auto* maps = cache.get(key, encode, &err);
  if (!maps) return err;
  unsigned grid;
  TSGEN_TRY(tsgen::gemm::grid_size<C>(reinterpret_cast<const void*>(GEMM), rows, RESERVE_SMS, &grid));
  const size_t shard = (size_t)rows * C::K * sizeof(typename C::Element);
  SYNC<<<1, 32, 0, stream>>>(peers, rank, calls, sig, ENTRY, 0);
  TSGEN_TRY(cudaGetLastError());
  [[maybe_unused]] Lanes* l = nullptr;  // the side streams: OVERLAPPED only
  if constexpr (OVERLAPPED) {
    TSGEN_TRY(lanes(rank, &l));
    TSGEN_TRY(cudaEventRecord(l->fork, stream));
    TSGEN_TRY(cudaStreamWaitEvent(l->copy, l->fork, 0));
    TSGEN_TRY(cudaStreamWaitEvent(l->signal, l->fork, 0));
    SYNC<<<1, 32, 0, l->copy>>>(peers, rank, calls, sig, WAIT_FREE, 0);
    TSGEN_TRY(cudaGetLastError());
    for (int i = 1; i < WORLD; ++i) {  // rank - 1 first: its GEMM needs our rows right after its own
      const int peer = (rank - i + WORLD) % WORLD;
      char* dst = host_peer_ptr((char*)a_full, peers_host, rank, peer) + (size_t)rank * shard;
      TSGEN_TRY(cudaMemcpyAsync(dst, a, shard, cudaMemcpyDefault, l->copy));
      TSGEN_TRY(cudaEventRecord(l->copied[i], l->copy));
      TSGEN_TRY(cudaStreamWaitEvent(l->signal, l->copied[i], 0));
      SYNC<<<1, 32, 0, l->signal>>>(peers, rank, calls, sig, SIGNAL, peer);
      TSGEN_TRY(cudaGetLastError());
    }
  } else {
    SYNC<<<1, 32, 0, stream>>>(peers, rank, calls, sig, WAIT_FREE, 0);
    TSGEN_TRY(cudaGetLastError());
    for (int i = 1; i < WORLD; ++i) {
      const int peer = (rank - i + WORLD) % WORLD;
      char* dst = host_peer_ptr((char*)a_full, peers_host, rank, peer) + (size_t)rank * shard;
      TSGEN_TRY(cudaMemcpyAsync(dst, a, shard, cudaMemcpyDefault, stream));
    }
    SYNC<<<1, 32, 0, stream>>>(peers, rank, calls, sig, SIGNAL_ALL, 0);
    TSGEN_TRY(cudaGetLastError());
  }
  GEMM<<<grid, tsgen::gemm::Layout<C>::THREADS, tsgen::gemm::Layout<C>::SMEM_BYTES, stream>>>(
      maps->maps[0], maps->maps[1], maps->maps[2], maps->maps[3], calls, sig, rank, count);
  TSGEN_TRY(cudaGetLastError());
  if constexpr (OVERLAPPED) {
    TSGEN_TRY(cudaEventRecord(l->copy_done, l->copy));
    TSGEN_TRY(cudaEventRecord(l->signal_done, l->signal));
    TSGEN_TRY(cudaStreamWaitEvent(stream, l->copy_done, 0));
    TSGEN_TRY(cudaStreamWaitEvent(stream, l->signal_done, 0));
  }
  return cudaSuccess;
}

// Rank `rank`'s GEMM shared-memory opt-in (and with OVERLAPPED its side streams), made on `device`
// before any rank's first call (the manifest's "prepare"; see lanes).
template <class C, bool OVERLAPPED, int WORLD, auto GEMM>
static cudaError_t allgather_gemm_prepare(int rank, int device) {
  TSGEN_TRY(prepare_rank(WORLD, rank, device, OVERLAPPED));
  int ctas;
  return tsgen::gemm::resident_ctas<C>(reinterpret_cast<const void*>(GEMM), &ctas);
}

// ---------------------------------------------------------------------------
// Host side of one call of a gemm_reduce_scatter op (its NAME_wW_launch) and its prepare.
// ---------------------------------------------------------------------------
// How a gemm_reduce_scatter op moves the partial products (the spec's overlap and reduce; the
// protocol of each is described at the top of a generated source):
//   PLAIN: the whole GEMM into `partial`, then every rank pulls and sums its row block;
//   PULL: a reduce kernel on a side stream pulls each source's block as soon as it is ready,
//         beside the GEMM (which leaves H::RESERVE_SMS SMs to it);
//   PUSH: the GEMM's epilogue stores each block into its owner's `partial` slot;
//   PUSH_ADD: the epilogue adds each block into its owner's c (TMA reduce-add), no reduce kernel.
enum class ScatterMode { PLAIN, PULL, PUSH, PUSH_ADD };

// H: the op's host constants (templates/ops/gemm_reduce_scatter.cu.j2: MODE, RESERVE_SMS,
// FULL_GRID (the reduce's grid: every SM, whole clusters), REDUCE_THREADS, REDUCE_SMEM); C: the
// GEMM's Config at world size WORLD; GEMM, REDUCE (nullptr for PUSH_ADD) and SYNC: world size
// WORLD's kernels. Arguments a mode does not use (peers_host but for PUSH and PUSH_ADD, partial
// for PUSH_ADD, acc but for PULL) are nullptr.
template <class H, class C, int WORLD, auto GEMM, auto REDUCE, auto SYNC>
static cudaError_t gemm_reduce_scatter_launch(char* const* peers, char* const* peers_host, int rank, uint64_t* calls,
                                              uint64_t count, typename C::Element* a, typename C::Element* b,
                                              typename C::Element* c, typename C::Element* partial, float* acc,
                                              uint64_t* sig, cudaStream_t stream) {
  constexpr ScatterMode MODE = H::MODE;
  constexpr bool PUSHED = MODE == ScatterMode::PUSH || MODE == ScatterMode::PUSH_ADD;
  if (count == 0) return cudaSuccess;
  TSGEN_TRY(tsgen::use_device_of(calls));
  if (count > tsgen::gemm::MAX_ROWS / WORLD || rank < 0 || rank >= WORLD) return cudaErrorInvalidValue;
  const uint32_t rows = (uint32_t)count;  // per batch (row block)
  // tensor maps: A (3-D: column, row, block), B (K/world x N), then partial (3-D), or with PUSHED
  // every owner q's partial (PUSH_ADD: c) as this process addresses it (the cache key names the
  // peer table it came from)
  thread_local MapCache<PUSHED ? 2 + WORLD : 3> cache;
  typename C::Element* const out = MODE == ScatterMode::PUSH_ADD ? c : partial;
  const void* const key[6] = {a, b, out, (const void*)(uintptr_t)count, PUSHED ? (const void*)peers_host : nullptr,
                              PUSHED ? (const void*)peers_host[(rank + 1) % WORLD] : nullptr};
  auto encode = [&](CUtensorMap* m) {
    using L = tsgen::gemm::Layout<C>;
    constexpr CUtensorMapDataType dtype = tsgen::gemm::tensor_map_dtype<typename C::Element>();
    TSGEN_TRY(tsgen::gemm::encode_matrix(&m[0], dtype, a, rows, C::K, L::A_BOX_ROWS, WORLD, true));
    TSGEN_TRY(tsgen::gemm::encode_matrix(&m[1], dtype, b, C::K, C::N, C::TILE_K));
    if constexpr (PUSHED) {
      for (int q = 0; q < WORLD; ++q)  // q's partial (WORLD slots), or q's c (count x N, one batch)
        TSGEN_TRY(tsgen::gemm::encode_matrix(&m[2 + q], dtype, host_peer_ptr(out, peers_host, rank, q), rows,
                                                   C::N, 64, MODE == ScatterMode::PUSH_ADD ? 1 : WORLD, true));
      return cudaSuccess;
    } else {
      return tsgen::gemm::encode_matrix(&m[2], dtype, partial, rows, C::N, 64, WORLD, true);
    }
  };
  cudaError_t err = cudaSuccess;
  auto* maps = cache.get(key, encode, &err);
  if (!maps) return err;
  if constexpr (MODE != ScatterMode::PUSH_ADD) {
    static PerDevice<int> reduce_ready;  // the reduce kernel's shared-memory opt-in, once per device
    int dev = 0, ready;
    TSGEN_TRY(cudaGetDevice(&dev));
    TSGEN_TRY(reduce_ready.get(dev, &ready, [&](int* done) {
      *done = 1;
      return cudaFuncSetAttribute(REDUCE, cudaFuncAttributeMaxDynamicSharedMemorySize, H::REDUCE_SMEM);
    }));
  }
  unsigned grid;
  TSGEN_TRY(tsgen::gemm::grid_size<C>(reinterpret_cast<const void*>(GEMM), rows, H::RESERVE_SMS, &grid));
  constexpr unsigned FULL = H::FULL_GRID;
  constexpr int T = H::REDUCE_THREADS, SMEM = H::REDUCE_SMEM;
  Lanes* l = nullptr;  // PULL's side stream, made (first call) before anything is enqueued: a failure
  if constexpr (MODE == ScatterMode::PULL) TSGEN_TRY(lanes(rank, &l));  // leaves the call counter alone
  // the entry: calls[0] -> this call's epoch; FREE raised at every peer (PUSH_ADD: once the GEMM
  // has zeroed our c)
  SYNC<<<1, 32, 0, stream>>>(peers, rank, calls, sig, MODE == ScatterMode::PUSH_ADD ? BEGIN : ENTRY, 0);
  TSGEN_TRY(cudaGetLastError());
  if constexpr (PUSHED) {
    PushMaps<WORLD> push;
    for (int q = 0; q < WORLD; ++q) push.to[q] = maps->maps[2 + q];
    if constexpr (MODE == ScatterMode::PUSH_ADD) {
      GEMM<<<grid, tsgen::gemm::Layout<C>::THREADS, tsgen::gemm::Layout<C>::SMEM_BYTES, stream>>>(
          maps->maps[0], maps->maps[1], push, peers, calls, sig, rank, count, c);
      TSGEN_TRY(cudaGetLastError());
      SYNC<<<1, 32, 0, stream>>>(peers, rank, calls, sig, WAIT_READY, 0);
    } else {
      GEMM<<<grid, tsgen::gemm::Layout<C>::THREADS, tsgen::gemm::Layout<C>::SMEM_BYTES, stream>>>(
          maps->maps[0], maps->maps[1], push, peers, calls, sig, rank, count);
      TSGEN_TRY(cudaGetLastError());
      REDUCE<<<FULL, T, SMEM, stream>>>(peers, rank, calls, sig, partial, nullptr, c, count, SUM_PUSHED);
    }
    TSGEN_TRY(cudaGetLastError());
  } else if constexpr (MODE == ScatterMode::PULL) {
    TSGEN_TRY(cudaEventRecord(l->fork, stream));
    TSGEN_TRY(cudaStreamWaitEvent(l->signal, l->fork, 0));
    GEMM<<<grid, tsgen::gemm::Layout<C>::THREADS, tsgen::gemm::Layout<C>::SMEM_BYTES, stream>>>(
        maps->maps[0], maps->maps[1], maps->maps[2], peers, calls, sig, rank, count);
    TSGEN_TRY(cudaGetLastError());
    REDUCE<<<H::RESERVE_SMS, T, SMEM, l->signal>>>(peers, rank, calls, sig, partial, acc, c, count, PULL_PEER);
    TSGEN_TRY(cudaGetLastError());
    TSGEN_TRY(cudaEventRecord(l->signal_done, l->signal));
    TSGEN_TRY(cudaStreamWaitEvent(stream, l->signal_done, 0));
    REDUCE<<<FULL, T, SMEM, stream>>>(peers, rank, calls, sig, partial, acc, c, count, FINISH);
    TSGEN_TRY(cudaGetLastError());
  } else {
    SYNC<<<1, 32, 0, stream>>>(peers, rank, calls, sig, WAIT_FREE, 0);
    TSGEN_TRY(cudaGetLastError());
    GEMM<<<grid, tsgen::gemm::Layout<C>::THREADS, tsgen::gemm::Layout<C>::SMEM_BYTES, stream>>>(
        maps->maps[0], maps->maps[1], maps->maps[2], peers, calls, sig, rank, count);
    TSGEN_TRY(cudaGetLastError());
    SYNC<<<1, 32, 0, stream>>>(peers, rank, calls, sig, SIGNAL_ALL, 0);
    TSGEN_TRY(cudaGetLastError());
    REDUCE<<<FULL, T, SMEM, stream>>>(peers, rank, calls, sig, partial, nullptr, c, count, PULL_ALL);
    TSGEN_TRY(cudaGetLastError());
  }
  return cudaSuccess;
}

// Rank `rank`'s GEMM and reduce shared-memory opt-ins (and with PULL its side streams), made on
// `device` before any rank's first call (the manifest's "prepare"; see lanes).
template <class H, class C, int WORLD, auto GEMM, auto REDUCE>
static cudaError_t gemm_reduce_scatter_prepare(int rank, int device) {
  TSGEN_TRY(prepare_rank(WORLD, rank, device, H::MODE == ScatterMode::PULL));
  int ctas;
  TSGEN_TRY(tsgen::gemm::resident_ctas<C>(reinterpret_cast<const void*>(GEMM), &ctas));
  if constexpr (H::MODE != ScatterMode::PUSH_ADD)
    TSGEN_TRY(cudaFuncSetAttribute(REDUCE, cudaFuncAttributeMaxDynamicSharedMemorySize, H::REDUCE_SMEM));
  return cudaSuccess;
}

}  // namespace fused
}  // namespace tsgen

#endif  // TSGEN_FUSED_CUH
