// tsgen/sync.cuh -- signals, waits with timeouts, and barriers.
//
// Hand-written; included by every generated source.
//
// Signals are 64-bit epoch counters that only grow: call number `epoch`
// (1, 2, 3, ...) raises a signal to a value derived from `epoch`, and the
// waiter waits for that value, so back-to-back calls and CUDA graph replay
// need no reset kernel. Every spin loop has a timeout (TSGEN_TIMEOUT_NS: a
// generated source #defines it from the spec's sync.timeout_ms before its
// includes, else 10 s; 0 = wait forever) after which it prints who waited for
// what and traps: a hang becomes an error with a diagnosis.
#ifndef TSGEN_SYNC_CUH
#define TSGEN_SYNC_CUH

#include <stdint.h>
#include <stdio.h>

#include <atomic>
#include <initializer_list>

#include "tsgen/ptx.cuh"

#ifndef TSGEN_TIMEOUT_NS
#define TSGEN_TIMEOUT_NS 10000000000ull  // 10 s
#endif

namespace tsgen {

// Where a wait happens, for the timeout message.
struct site {
  const char* what;  // name of the signal array, e.g. "ready"
  int rank;          // rank that waits
  int owner;         // rank whose memory holds the signal
  int index;         // element of the signal array
};

static __device__ __forceinline__ site make_site(const char* what, int rank,
                                                int owner, int index) {
  site s;
  s.what = what;
  s.rank = rank;
  s.owner = owner;
  s.index = index;
  return s;
}

// Out of line and noreturn: the printf stays out of the spin loop, and callers
// need not save live registers around the call (which would count as spills).
static __device__ __noinline__ __attribute__((noreturn)) void timeout_trap(site at, const char* cmp,
                                                       uint64_t expected, uint64_t seen) {
  printf("tsgen: timeout: rank %d block %d thread %d waited %llu ms on %s[%d] (memory of "
         "rank %d) for a value %s %llu; last seen %llu\n",
         at.rank, (int)blockIdx.x, (int)threadIdx.x,
         (unsigned long long)(TSGEN_TIMEOUT_NS / 1000000ull), at.what, at.index, at.owner,
         cmp, (unsigned long long)expected, (unsigned long long)seen);
  __trap();
}

// wait_<cmp>_acquire_<scope>(signal, expected, site): spin until
// `*signal <cmp> expected` with acquire loads at that scope; returns the value
// seen. gpu scope for signals raised on the same GPU, sys for peers'.
#define TSGEN_DEFINE_WAIT(CMP, OP, SCOPE)                                                    \
  static __device__ __forceinline__ uint64_t wait_##CMP##_acquire_##SCOPE(                   \
      const uint64_t* signal, uint64_t expected, site at) {                                  \
    uint64_t seen = ld_acquire_##SCOPE##_global_u64(signal);                                 \
    if (seen OP expected) return seen;                                                       \
    const uint64_t start = globaltimer_ns();                                                 \
    for (uint32_t spins = 1;; ++spins) {                                                     \
      seen = ld_acquire_##SCOPE##_global_u64(signal);                                        \
      if (seen OP expected) return seen;                                                     \
      if (TSGEN_TIMEOUT_NS != 0 && (spins & 255u) == 0 &&                                    \
          globaltimer_ns() - start > (uint64_t)TSGEN_TIMEOUT_NS)                             \
        timeout_trap(at, #OP, expected, seen);                                               \
    }                                                                                        \
  }

#define TSGEN_DEFINE_WAITS(SCOPE)      \
  TSGEN_DEFINE_WAIT(eq, ==, SCOPE)     \
  TSGEN_DEFINE_WAIT(ne, !=, SCOPE)     \
  TSGEN_DEFINE_WAIT(ge, >=, SCOPE)     \
  TSGEN_DEFINE_WAIT(gt, >, SCOPE)      \
  TSGEN_DEFINE_WAIT(le, <=, SCOPE)     \
  TSGEN_DEFINE_WAIT(lt, <, SCOPE)

// wait_{eq,ne,ge,gt,le,lt}_acquire_gpu / wait_{...}_acquire_sys
TSGEN_DEFINE_WAITS(gpu)
TSGEN_DEFINE_WAITS(sys)
#undef TSGEN_DEFINE_WAITS
#undef TSGEN_DEFINE_WAIT

// Spin for about `ns` nanoseconds (test aid: staggers writers so that a
// missing barrier shows up as wrong data instead of a lucky pass).
static __device__ __forceinline__ void sleep_ns(uint64_t ns) {
  const uint64_t start = globaltimer_ns();
  while (globaltimer_ns() - start < ns) __nanosleep(256);
}

// Call counter: calls[0] = calls completed on this rank, calls[1] = blocks
// finished so far. Every block reads its epoch (calls[0] + 1) on entry; the
// last block to finish a call advances calls[0]. The next call on the stream
// starts after this kernel ends, so every block of it sees the new value.
static __device__ __forceinline__ uint64_t call_begin(const uint64_t* calls) {
  return ld_relaxed_gpu_global_u64(calls) + 1;
}

static __device__ __forceinline__ void call_end(uint64_t* calls, uint64_t epoch) {
  __syncthreads();
  if (threadIdx.x == 0) {
    // relaxed is enough: the next call is ordered after this kernel by the stream
    const uint64_t finished = atom_add_relaxed_gpu_global_u64(calls + 1, 1ull) + 1;
    if (finished == epoch * (uint64_t)gridDim.x) st_relaxed_gpu_global_u64(calls, epoch);
  }
}

// Host: launch KERNEL with its grid, block and shared memory on `stream` (the extern "C"
// NAME_launch entry points a generated source has for C++ projects that vendor it).
template <auto KERNEL, unsigned GRID, unsigned BLOCK, unsigned SMEM, typename... Args>
static cudaError_t launch(cudaStream_t stream, Args... args) {
  KERNEL<<<GRID, BLOCK, SMEM, stream>>>(args...);
  return cudaGetLastError();
}

// Symmetric memory: every rank lays its buffers out the same way inside one
// allocation whose base address, per rank, is peers[rank]. A local pointer is
// turned into the same element on rank `peer` by rebasing its offset.
template <typename T>
static __device__ __forceinline__ T* peer_ptr(T* local, char* const* peers, int rank,
                                              int peer) {
  return (T*)(peers[peer] + ((const char*)local - peers[rank]));
}

// Barrier over all blocks of one grid (they must all be resident: the
// runtime checks the grid fits on the device). `counter` is a zero-initialized
// u64 that only grows: use number `generation` (1, 2, ...) of it waits for
// generation * gridDim.x arrivals. A grid that uses the barrier k times per
// call passes generation = (epoch - 1) * k + j for its j-th use (j = 1..k).
static __device__ __forceinline__ void barrier_blocks(uint64_t* counter,
                                                      uint64_t generation, int rank) {
  __syncthreads();
  if (threadIdx.x == 0) {
    // release: this block's writes (ordered before by __syncthreads) become
    // visible to every block that acquires the counter after our arrival.
    red_add_release_gpu_global_u64(counter, 1ull);
    wait_ge_acquire_gpu(counter, generation * (uint64_t)gridDim.x,
                        make_site("barrier_blocks", rank, rank, 0));
  }
  __syncthreads();
}

// Barrier over all ranks and all their blocks. `counter` is as above (two
// uses per barrier); `flags` holds WORLD u64 slots per rank: rank r raises
// slot r in every peer's flags to `generation`, then waits until all its own
// slots reach it. Pass generation as for barrier_blocks, counting uses
// of this barrier.
template <int WORLD>
static __device__ __forceinline__ void barrier_all(uint64_t* counter, uint64_t* flags,
                                                   char* const* peers, int rank,
                                                   uint64_t generation) {
  barrier_blocks(counter, 2 * generation - 1, rank);
  if (blockIdx.x == 0 && threadIdx.x < WORLD) {
    const int peer = threadIdx.x;
    st_release_sys_global_u64(peer_ptr(flags, peers, rank, peer) + rank, generation);
    wait_ge_acquire_sys(flags + peer, generation,
                        make_site("barrier_all.flags", rank, rank, peer));
  }
  barrier_blocks(counter, 2 * generation, rank);
}

// Host launchers: make the device that holds `local` (a buffer of the calling rank)
// current for the CUDA runtime linked into this library, whichever thread calls:
// the runtime launches ranks from one thread each, and a thread's current device
// is per CUDA runtime instance.
static inline cudaError_t use_device_of(const void* local) {
  cudaPointerAttributes attr;
  cudaError_t err = cudaPointerGetAttributes(&attr, local);
  if (err != cudaSuccess) return err;
  if (attr.type != cudaMemoryTypeDevice) return cudaErrorInvalidValue;
  return cudaSetDevice(attr.device);
}

// Host launchers: a value worked out once per device and kept, in a static of the function that needs it
// (`static PerDevice<int> known;`: declare it static only, as its zero start is static storage's): get(device,
// out, compute) gives the kept value, or calls compute(out) and keeps what it gave where it returned cudaSuccess
// (on an error *out is unspecified and nothing is kept). T{} (0, nullptr) means "not yet worked out", so compute
// must give another value. Devices past the first MAX_DEVICES (and negative ids) are worked out at every call.
// Two threads that ask at once may both compute (the same value); neither reads a half-written one.
template <class T>
struct PerDevice {
  static constexpr int MAX_DEVICES = 64;
  std::atomic<T> known[MAX_DEVICES];  // static storage: zero-initialized

  template <class Compute>
  cudaError_t get(int device, T* out, Compute&& compute) {
    const bool kept = device >= 0 && device < MAX_DEVICES;
    if (kept && (*out = known[device].load()) != T{}) return cudaSuccess;
    const cudaError_t err = compute(out);
    if (err == cudaSuccess && kept) known[device].store(*out);
    return err;
  }
};

// Host launchers: the SM count of `device` (the grids of persistent kernels and of split work), read once
// per device.
static inline cudaError_t sm_count(int device, int* sms) {
  static PerDevice<int> known;
  return known.get(device, sms, [&](int* n) { return cudaDeviceGetAttribute(n, cudaDevAttrMultiProcessorCount, device); });
}

// Host launchers with side streams ("lanes": streams and events per rank, in tsgen/ce.cuh,
// tsgen/fused.cuh, tsgen/grid.cuh, made by make_lanes below): made on one device, never used
// on another. Sets `device` to the current one; cudaErrorInvalidDevice when lanes already
// made (`made`) on `made_on` are asked for on another device.
static inline cudaError_t lanes_device(bool made, int made_on, int* device) {
  cudaError_t err = cudaGetDevice(device);
  if (err != cudaSuccess) return err;
  return made && made_on != *device ? cudaErrorInvalidDevice : cudaSuccess;
}

// Host launchers: return the first CUDA error of an expression from the enclosing function.
#define TSGEN_TRY(expr)                                 \
  do {                                                  \
    const cudaError_t tsgen_err_ = (expr);              \
    if (tsgen_err_ != cudaSuccess) return tsgen_err_;   \
  } while (0)

// Making lanes: the streams of each group of `streams` (non-blocking; at the device's highest
// priority where `high`: their small kernels are on a GEMM's critical path) and the events of
// `events` (no timing), on the current device. All or none: when a creation fails, those this
// call made are destroyed, every slot is left null, and the error is returned (the caller's lanes
// stay unmade; a later call tries again).
struct stream_slots {
  cudaStream_t* at;
  int n;
  bool high;
};
struct event_slots {
  cudaEvent_t* at;
  int n;
};
static inline cudaError_t make_lanes(std::initializer_list<stream_slots> streams,
                                     std::initializer_list<event_slots> events) {
  for (const stream_slots& g : streams)
    for (int i = 0; i < g.n; ++i) g.at[i] = nullptr;
  for (const event_slots& g : events)
    for (int i = 0; i < g.n; ++i) g.at[i] = nullptr;
  int lo = 0, hi = 0;
  cudaError_t err = cudaDeviceGetStreamPriorityRange(&lo, &hi);
  for (const stream_slots& g : streams)
    for (int i = 0; i < g.n && err == cudaSuccess; ++i) {
      cudaStream_t made = nullptr;
      err = g.high ? cudaStreamCreateWithPriority(&made, cudaStreamNonBlocking, hi)
                   : cudaStreamCreateWithFlags(&made, cudaStreamNonBlocking);
      if (err == cudaSuccess) g.at[i] = made;
    }
  for (const event_slots& g : events)
    for (int i = 0; i < g.n && err == cudaSuccess; ++i) {
      cudaEvent_t made = nullptr;
      err = cudaEventCreateWithFlags(&made, cudaEventDisableTiming);
      if (err == cudaSuccess) g.at[i] = made;
    }
  if (err != cudaSuccess) {
    for (const stream_slots& g : streams)
      for (int i = 0; i < g.n; ++i) {
        if (g.at[i]) cudaStreamDestroy(g.at[i]);
        g.at[i] = nullptr;
      }
    for (const event_slots& g : events)
      for (int i = 0; i < g.n; ++i) {
        if (g.at[i]) cudaEventDestroy(g.at[i]);
        g.at[i] = nullptr;
      }
  }
  return err;
}

// The start of a module's NAME_wW_prepare(rank, device): the rank checked against the world,
// `device` made current (the rank's lanes and kernel attributes are then made there).
static inline cudaError_t prepare_on(int world, int rank, int device) {
  if (rank < 0 || rank >= world) return cudaErrorInvalidValue;
  return cudaSetDevice(device);
}

}  // namespace tsgen

#endif  // TSGEN_SYNC_CUH
