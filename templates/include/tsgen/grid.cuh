// tsgen/grid.cuh -- the communication side of the process-grid GEMMs (cannon, summa):
// the producer hook that rotates the GEMM's K loop and waits per K panel, the one-block
// sync kernel body (entry / wait free / signal / wait ready), the copy schedule's table
// entry and the side streams of the host launcher.
//
// Hand-written; included by grid GEMM sources (it includes tsgen/gemm.cuh).
//
// Signals (u64 counters that only grow, in the `sig` buffer of every rank):
//   sig[FREE + s]      = e: rank s has entered call e (its previous GEMM, which read its
//                      panels, is done): this rank may push into s's a_pan / b_pan.
//   sig[A_READY + p]   = e: panel p of A (of B: B_READY + p) has landed in this rank's
//                      a_pan (b_pan) in call e (raised by the rank that pushed it, after
//                      its copy completed: each panel arrives exactly once per call).
// The epoch e is the device call counter: the entry kernel advances calls[0] on the
// caller's stream before anything else of the call, later kernels read it (stream order),
// so CUDA graph replay needs no host-side epoch.
#ifndef TSGEN_GRID_CUH
#define TSGEN_GRID_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "tsgen/ptx.cuh"
#include "tsgen/sync.cuh"
#include "tsgen/gemm.cuh"

namespace tsgen {
namespace grid {

constexpr int MAX_Q = 8;
constexpr int MAX_WORLD = MAX_Q * MAX_Q;
constexpr int FREE = 0;
constexpr int A_READY = MAX_WORLD;
constexpr int B_READY = MAX_WORLD + MAX_Q;
constexpr int SIGNALS = MAX_WORLD + 2 * MAX_Q;
constexpr int SYNC_THREADS = MAX_WORLD;  // the sync kernel: one thread per peer

// One push of the copy schedule (tsgen/ops/grid_gemm.py Copy): operand 0 = A, 1 = B;
// from the input block or the own panel `slot`; into panel `slot` of rank `dst`; after
// waiting for the own panel `wait` of the operand to arrive (-1: no wait).
struct CopyStep {
  int8_t operand, from_input, slot, wait;
  int16_t dst;
};

// ---------------------------------------------------------------------------
// Device: the GEMM producer's hook (gemm::NoHook + k_block). The GEMM's K is the q
// panels of K/q (KBP K blocks each); rank (i, j) starts at panel (i + j) mod q
// (`start` = its first K block) and wraps around. Before the first load of panel p the
// producer waits for A_READY[p] and B_READY[p] >= epoch (then remembers it).
// ---------------------------------------------------------------------------
template <int K_BLOCKS, int KBP>
struct PanelHook {
  const uint64_t* sig;  // this rank's signals
  uint64_t epoch;
  uint32_t start;   // the first K block of the walk
  uint32_t waited;  // bit p: panel p already waited for by this producer

  __device__ __forceinline__ uint32_t first_batch() const { return 0; }
  __device__ __forceinline__ void wait(uint32_t) {}
  __device__ __forceinline__ const CUtensorMap* a_map(const CUtensorMap* a, uint32_t batch, int& z) const {
    z = (int)batch;
    return a;
  }
  // The kb-th K block of the walk that starts at K block `first` (host and device: the
  // tests walk it on the CPU).
  __host__ __device__ static uint32_t rotate(uint32_t kb, uint32_t first) {
    const uint32_t k = kb + first;
    return k >= (uint32_t)K_BLOCKS ? k - K_BLOCKS : k;
  }
  __device__ __forceinline__ int k_block(int kb) {
    const uint32_t k = rotate((uint32_t)kb, start);
    const uint32_t p = k / KBP;
    if (!((waited >> p) & 1u)) {
      gemm::wait_signal_ge_sys(sig + A_READY + p, epoch);
      gemm::wait_signal_ge_sys(sig + B_READY + p, epoch);
      waited |= 1u << p;
    }
    return (int)k;
  }
};

// ---------------------------------------------------------------------------
// Device: one-block sync kernel body (blockDim.x >= WORLD), by mode.
// ---------------------------------------------------------------------------
enum SyncMode : int {
  ENTRY = 0,       // advance calls[0] to this call's epoch; raise FREE[rank] at every peer
  WAIT_FREE = 1,   // wait until every peer raised FREE[peer] here (its panels are ours to write)
  SIGNAL = 2,      // the copy before this kernel (stream order) completed: sig[index] = epoch at target
  WAIT_READY = 3,  // wait for our own sig[index] >= epoch (a panel we forward has arrived)
};

template <int WORLD>
static __device__ __forceinline__ void sync_body(char* const* peers, int rank, uint64_t* calls, uint64_t* sig,
                                                 int mode, int target, int index) {
  const int t = threadIdx.x;
  if (mode == ENTRY) {
    // the previous call's kernels on this stream (its GEMM included) are done: stream order
    const uint64_t epoch = ld_relaxed_gpu_global_u64(calls) + 1;
    __syncthreads();  // everyone has read calls[0] before thread 0 advances it
    if (t == 0) st_relaxed_gpu_global_u64(calls, epoch);
    if (t < WORLD && t != rank)
      st_release_sys_global_u64(peer_ptr(sig, peers, rank, t) + FREE + rank, epoch);
    return;
  }
  const uint64_t epoch = ld_relaxed_gpu_global_u64(calls);
  if (mode == WAIT_FREE) {
    if (t < WORLD && t != rank)
      wait_ge_acquire_sys(sig + FREE + t, epoch, make_site("sig.free", rank, rank, FREE + t));
    return;
  }
  if (mode == WAIT_READY) {
    if (t == 0) wait_ge_acquire_sys(sig + index, epoch, make_site("sig.ready", rank, rank, index));
    return;
  }
  // SIGNAL: the copy engine's writes completed before this kernel started (stream order);
  // the fence makes them visible at system scope before the release that announces them.
  __threadfence_system();
  if (t == 0) st_release_sys_global_u64(peer_ptr(sig, peers, rank, target) + index, epoch);
}

// ---------------------------------------------------------------------------
// Host: side streams per rank (made on its first call, kept for the process).
// ---------------------------------------------------------------------------
struct Lanes {
  cudaStream_t copy[2];  // the pushes of A, of B (copy engine + their signal / wait kernels)
  cudaEvent_t fork, done[2];
  int device;  // where they were made
  bool ready;
};

// One set per rank this process drives, made on the current device (the rank's) by the
// module's NAME_wW_prepare before any rank's first call, else at the rank's first call: ranks
// that share a GPU must not share side streams and events (each would wait on the other's).
// Made at a first call, they can stall it (see tsgen::fused::lanes).
static cudaError_t lanes(int rank, Lanes** out) {
  constexpr int MAX_RANKS = 64;
  static Lanes all[MAX_RANKS];
  if (rank < 0 || rank >= MAX_RANKS) return cudaErrorInvalidValue;
  Lanes* l = &all[rank];
  int device;
  TSGEN_TRY(tsgen::lanes_device(l->ready, l->device, &device));  // prepared on another device?
  if (!l->ready) {
    l->device = device;
    // their small kernels are on the GEMM's critical path: they go first when SMs free up
    TSGEN_TRY(tsgen::make_lanes({{l->copy, 2, true}}, {{l->done, 2}, {&l->fork, 1}}));
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


// ---------------------------------------------------------------------------
// Host side of one call of a cannon or summa op (its NAME_wW_launch) and its prepare.
// ---------------------------------------------------------------------------
// C: the GEMM's Config on a q x q grid (world size WORLD, templates/ops/grid_gemm.cu.j2);
// RESERVE_SMS: SMs the persistent GEMM leaves to the copy streams' kernels; GEMM and SYNC:
// world size WORLD's kernels; `schedule`: per rank, its pushes in order (the op's STEPS_W table).
template <class C, int WORLD, int RESERVE_SMS, auto GEMM, auto SYNC, int NSTEPS>
static cudaError_t launch(const CopyStep (&schedule)[WORLD][NSTEPS], char* const* peers, char* const* peers_host,
                          int rank, uint64_t* calls, uint64_t count, typename C::Element* a, typename C::Element* b,
                          typename C::Element* c, typename C::Element* a_pan, typename C::Element* b_pan,
                          uint64_t* sig, cudaStream_t stream) {
  using E = typename C::Element;
  if (count == 0) return cudaSuccess;
  TSGEN_TRY(tsgen::use_device_of(calls));
  if (count > tsgen::gemm::MAX_ROWS || rank < 0 || rank >= WORLD) return cudaErrorInvalidValue;
  const uint32_t rows = (uint32_t)count;
  const tsgen::gemm::TensorMaps* maps;  // a_pan (rows x K), b_pan (K x N/q), c (rows x N/q)
  TSGEN_TRY(tsgen::gemm::tensor_maps<C>(a_pan, b_pan, c, rows, &maps));
  unsigned grid;
  TSGEN_TRY(tsgen::gemm::grid_size<C>(reinterpret_cast<const void*>(GEMM), rows, RESERVE_SMS, &grid));
  Lanes* l;  // made (first call) before anything is enqueued: a failure here leaves the call counter alone
  TSGEN_TRY(lanes(rank, &l));
  SYNC<<<1, SYNC_THREADS, 0, stream>>>(peers, rank, calls, sig, ENTRY, 0, 0);
  TSGEN_TRY(cudaGetLastError());
  TSGEN_TRY(cudaEventRecord(l->fork, stream));
  for (int o = 0; o < 2; ++o) {
    TSGEN_TRY(cudaStreamWaitEvent(l->copy[o], l->fork, 0));
    SYNC<<<1, SYNC_THREADS, 0, l->copy[o]>>>(peers, rank, calls, sig, WAIT_FREE, 0, 0);
    TSGEN_TRY(cudaGetLastError());
  }
  for (const CopyStep& s : schedule[rank]) {
    cudaStream_t lane = l->copy[s.operand];
    const int ready = (s.operand == 0 ? A_READY : B_READY);
    if (s.wait >= 0) {
      SYNC<<<1, SYNC_THREADS, 0, lane>>>(peers, rank, calls, sig, WAIT_READY, 0, ready + s.wait);
      TSGEN_TRY(cudaGetLastError());
    }
    if (s.operand == 0) {  // rows x K/q columns into columns [slot K/q, ...) of the peer's a_pan
      E* dst = host_peer_ptr(a_pan, peers_host, rank, s.dst) + (size_t)s.slot * C::KB;
      const E* src = s.from_input ? a : a_pan + (size_t)s.slot * C::KB;
      const size_t src_pitch = (s.from_input ? C::KB : C::K) * sizeof(E);
      TSGEN_TRY(cudaMemcpy2DAsync(dst, C::K * sizeof(E), src, src_pitch, C::KB * sizeof(E), rows,
                                       cudaMemcpyDefault, lane));
    } else {  // K/q rows x N/q into rows [slot K/q, ...) of the peer's b_pan
      const size_t panel = (size_t)C::KB * C::N;
      E* dst = host_peer_ptr(b_pan, peers_host, rank, s.dst) + (size_t)s.slot * panel;
      const E* src = s.from_input ? b : b_pan + (size_t)s.slot * panel;
      TSGEN_TRY(cudaMemcpyAsync(dst, src, panel * sizeof(E), cudaMemcpyDefault, lane));
    }
    SYNC<<<1, SYNC_THREADS, 0, lane>>>(peers, rank, calls, sig, SIGNAL, s.dst, ready + s.slot);
    TSGEN_TRY(cudaGetLastError());
  }
  GEMM<<<grid, tsgen::gemm::Layout<C>::THREADS, tsgen::gemm::Layout<C>::SMEM_BYTES, stream>>>(
      maps->a, maps->b, maps->c, calls, sig, rank, count);
  TSGEN_TRY(cudaGetLastError());
  for (int o = 0; o < 2; ++o) {
    TSGEN_TRY(cudaEventRecord(l->done[o], l->copy[o]));
    TSGEN_TRY(cudaStreamWaitEvent(stream, l->done[o], 0));
  }
  return cudaSuccess;
}

// Rank `rank`'s GEMM shared-memory opt-in and side streams, made on `device` before any rank's
// first call (the manifest's "prepare"; see lanes).
template <class C, int WORLD, auto GEMM>
static cudaError_t prepare(int rank, int device) {
  TSGEN_TRY(tsgen::prepare_on(WORLD, rank, device));
  int ctas;
  TSGEN_TRY(tsgen::gemm::resident_ctas<C>(reinterpret_cast<const void*>(GEMM), &ctas));
  Lanes* l;
  return lanes(rank, &l);
}

}  // namespace grid
}  // namespace tsgen

#endif  // TSGEN_GRID_CUH
