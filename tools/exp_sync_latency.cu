// Experiment kernels for tools/exp_sync_latency.py: what does the bare synchronization of a
// small all_reduce cost on this machine, apart from tsgen's plan interpreter?
//
// Every kernel is one call of a collective-shaped exchange on every rank, timed in a CUDA
// graph of back-to-back calls per GPU. `calls` (2 x u64, this rank's memory) numbers the
// calls as tsgen's kernels do: epoch = calls[0] + 1 at entry; the last block to finish
// stores calls[0] = epoch. `sig` (this rank's memory, symmetric): ENTRY and DONE counters,
// MAX_BLOCKS x MAX_WORLD each; slot [b][q] counts signals from rank q's block b.
//
//   empty        nothing (the floor: a graph node)
//   epoch        tsgen's call numbering only (every block: an atomic on calls[1])
//   hops         two hops like one_shot: each block b signals ENTRY[b][rank] at every peer
//                (relaxed), waits for its own ENTRY[b][q] from every peer, then signals
//                DONE[b][rank] (release) and waits for DONE[b][q] (acquire): block-pairwise,
//                no block of a rank waits for another block of the same rank
//   hops_fenced  the same with a release (fence.sys) on the entry signal too
//
// The signal and wait helpers are tsgen's (templates/include/tsgen_ptx.cuh semantics),
// written out here so the file compiles alone.
#include <cstdint>

#define MAX_WORLD 8
#define MAX_BLOCKS 64
#define ENTRY 0
#define DONE (MAX_BLOCKS * MAX_WORLD)

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void red_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void wait_ge(const uint64_t* p, uint64_t v) {
  while (ld_acquire_sys(p) < v) {
  }
}
__device__ __forceinline__ uint64_t* on(char* const* peers, int rank, int peer, uint64_t* local) {
  return reinterpret_cast<uint64_t*>(peers[peer] + (reinterpret_cast<char*>(local) - peers[rank]));
}

__device__ __forceinline__ uint64_t call_begin(const uint64_t* calls) {
  uint64_t v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(calls) : "memory");
  return v + 1;
}
__device__ __forceinline__ void call_end(uint64_t* calls, uint64_t epoch) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned long long before = atomicAdd(reinterpret_cast<unsigned long long*>(calls + 1), 1ull);
    if (before + 1 == epoch * gridDim.x) *reinterpret_cast<volatile uint64_t*>(calls) = epoch;
  }
}

extern "C" __global__ void empty(char* const*, int, int, uint64_t*, uint64_t*) {}

extern "C" __global__ void epoch(char* const*, int, int, uint64_t* calls, uint64_t*) {
  call_end(calls, call_begin(calls));
}

template <bool FENCED_ENTRY>
__device__ __forceinline__ void hops_body(char* const* peers, int rank, int world, uint64_t* calls, uint64_t* sig) {
  const uint64_t e = call_begin(calls);
  const int b = blockIdx.x, t = threadIdx.x;
  uint64_t* entry = sig + ENTRY + b * MAX_WORLD;
  uint64_t* done = sig + DONE + b * MAX_WORLD;
  if (t < world && t != rank) {
    if (FENCED_ENTRY)
      red_release_sys(on(peers, rank, t, entry + rank), 1);
    else
      red_relaxed_sys(on(peers, rank, t, entry + rank), 1);
    wait_ge(entry + t, e);
  }
  __syncthreads();
  // (a one_shot would read the peers' inputs here)
  __syncthreads();
  if (t < world && t != rank) {
    red_release_sys(on(peers, rank, t, done + rank), 1);
    wait_ge(done + t, e);
  }
  call_end(calls, e);
}

extern "C" __global__ void hops(char* const* peers, int rank, int world, uint64_t* calls, uint64_t* sig) {
  hops_body<false>(peers, rank, world, calls, sig);
}

extern "C" __global__ void hops_fenced(char* const* peers, int rank, int world, uint64_t* calls, uint64_t* sig) {
  hops_body<true>(peers, rank, world, calls, sig);
}
