// tsgen_fused.cuh -- the communication side of the fused GEMM ops (allgather_gemm):
// the producer hook that makes GEMM tiles wait for their source's rows, the one-block
// sync kernel body (entry / wait / signal), and the side streams of the host launcher.
//
// Hand-written; inlined into fused sources after tsgen_gemm.cuh.
//
// Signals (u64 counters that only grow, in the `sig` buffer of every rank):
//   sig[FREE + s]  = e: rank s has entered call e, so its previous call's GEMM no longer
//                  reads its a_full: this rank may write its shard into s's a_full.
//                  (Lives in the writer's memory: raised by s, waited for by the writer.)
//   sig[READY + s] = e: source s's rows of call e have landed in this rank's a_full
//                  (raised by s after its copy completed, waited for by the GEMM here).
// The epoch e is the device call counter: the entry kernel advances calls[0] to e on
// the caller's stream before anything else of the call, every later kernel of the call
// reads calls[0] (stream order after the entry), so CUDA graph replay works.
#ifndef TSGEN_FUSED_CUH
#define TSGEN_FUSED_CUH

#include <cuda_runtime.h>
#include <stdint.h>

namespace tsgen_fused {

constexpr int MAX_WORLD = 8;
constexpr int FREE = 0;               // sig[FREE + s]
constexpr int READY = MAX_WORLD;      // sig[READY + s]
constexpr int SIGNALS = 2 * MAX_WORLD;

// ---------------------------------------------------------------------------
// Device: the GEMM producer's hook (tsgen_gemm::NoHook describes the interface).
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
        tsgen_gemm::wait_signal_ge_sys(ready + batch, epoch);
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
// Device: one-block sync kernel body (blockDim.x >= WORLD), by mode.
// ---------------------------------------------------------------------------
enum SyncMode : int {
  ENTRY = 0,       // advance calls[0] to this call's epoch; raise FREE[rank] at every peer
  WAIT_FREE = 1,   // wait until every peer raised FREE[peer] here (its a_full is ours to write)
  SIGNAL = 2,      // the copy to `target` completed: raise READY[rank] at target
  SIGNAL_ALL = 3,  // every copy completed: raise READY[rank] at every peer, then wait for all READY here
};

template <int WORLD>
static __device__ __forceinline__ void sync_body(char* const* peers, int rank, uint64_t* calls, uint64_t* sig,
                                                 int mode, int target) {
  const int t = threadIdx.x;
  if (mode == ENTRY) {
    // the previous call's kernels on this stream (its GEMM included) are done: stream order
    const uint64_t epoch = ld_relaxed_gpu_global_u64(calls) + 1;
    __syncthreads();  // everyone has read calls[0] before thread 0 advances it
    if (t == 0) st_relaxed_gpu_global_u64(calls, epoch);
    if (t < WORLD && t != rank)
      st_release_sys_global_u64(tsgen_peer_ptr(sig, peers, rank, t) + FREE + rank, epoch);
    return;
  }
  const uint64_t epoch = ld_relaxed_gpu_global_u64(calls);
  if (mode == WAIT_FREE) {
    if (t < WORLD && t != rank)
      wait_ge_acquire_sys(sig + FREE + t, epoch, tsgen_make_site("sig.free", rank, rank, FREE + t));
    return;
  }
  // The copy engine's writes completed before this kernel started (stream order); the
  // fence makes them visible at system scope before the release that announces them.
  __threadfence_system();
  if (mode == SIGNAL) {
    if (t == 0) st_release_sys_global_u64(tsgen_peer_ptr(sig, peers, rank, target) + READY + rank, epoch);
    return;
  }
  if (t < WORLD && t != rank) st_release_sys_global_u64(tsgen_peer_ptr(sig, peers, rank, t) + READY + rank, epoch);
  if (t < WORLD && t != rank)
    wait_ge_acquire_sys(sig + READY + t, epoch, tsgen_make_site("sig.ready", rank, rank, READY + t));
}

// ---------------------------------------------------------------------------
// Host: side streams per device (made on the first call, kept for the process).
// ---------------------------------------------------------------------------
#define TSGEN_FUSED_TRY(expr)                           \
  do {                                                  \
    const cudaError_t tsgen_err_ = (expr);              \
    if (tsgen_err_ != cudaSuccess) return tsgen_err_;   \
  } while (0)

struct Lanes {
  cudaStream_t copy, signal;  // the gather's copies; the signal kernels after each copy
  cudaEvent_t fork, copied[MAX_WORLD], copy_done, signal_done;
  bool ready;
};

static cudaError_t lanes(Lanes** out) {
  constexpr int MAX_DEVICES = 64;
  static Lanes all[MAX_DEVICES];
  int dev = 0;
  TSGEN_FUSED_TRY(cudaGetDevice(&dev));
  if (dev < 0 || dev >= MAX_DEVICES) return cudaErrorInvalidDevice;
  Lanes* l = &all[dev];
  if (!l->ready) {
    int lo = 0, hi = 0;
    TSGEN_FUSED_TRY(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    TSGEN_FUSED_TRY(cudaStreamCreateWithFlags(&l->copy, cudaStreamNonBlocking));
    // signals are on the GEMM's critical path: their kernels go first when SMs free up
    TSGEN_FUSED_TRY(cudaStreamCreateWithPriority(&l->signal, cudaStreamNonBlocking, hi));
    TSGEN_FUSED_TRY(cudaEventCreateWithFlags(&l->fork, cudaEventDisableTiming));
    TSGEN_FUSED_TRY(cudaEventCreateWithFlags(&l->copy_done, cudaEventDisableTiming));
    TSGEN_FUSED_TRY(cudaEventCreateWithFlags(&l->signal_done, cudaEventDisableTiming));
    for (int i = 0; i < MAX_WORLD; ++i) TSGEN_FUSED_TRY(cudaEventCreateWithFlags(&l->copied[i], cudaEventDisableTiming));
    l->ready = true;
  }
  *out = l;
  return cudaSuccess;
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
};

}  // namespace tsgen_fused

#endif  // TSGEN_FUSED_CUH
