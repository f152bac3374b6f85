// Vendoring a generated kernel: a plain C++ program (no Python, no tsgen at run time) that
// includes allgather.cu -- the one-file form of specs/allgather.yaml, tsgen's CUDA headers
// inlined (`tsgen build --amalgamate`) -- lays out each rank's symmetric heap the way the
// manifest (allgather.json beside it, "buffers") says, builds the peer table, launches every rank
// through the generated host launcher, checks the result and times it.
//
//   allgather_demo WORLD [COUNT] [CALLS]
//
// Ranks go round-robin on the visible GPUs: W GPUs with peer access, or W ranks sharing
// fewer GPUs (one GPU is enough). Each rank has its own heap (one cudaMalloc), its own
// non-blocking stream, and on a shared GPU the ranks' grids must all be resident at once
// (blocks wait on other ranks): the program checks that with the occupancy API first.
// Timings of ranks sharing a GPU say nothing about the op and are labelled so.
#include "allgather.cu"

#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(expr)                                                                    \
  do {                                                                                 \
    cudaError_t err_ = (expr);                                                         \
    if (err_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr,               \
                   cudaGetErrorString(err_));                                          \
      std::exit(2);                                                                    \
    }                                                                                  \
  } while (0)

// The manifest's buffer table (generated/allgather.json), in heap order; each buffer starts
// on a 256-byte boundary. Elements per rank = per_count * count + per_world * world + fixed.
struct BufferSpec {
  const char* name;
  size_t elem_bytes, per_count, per_world_count, fixed;
};
static const BufferSpec kBuffers[] = {
    {"calls", 8, 0, 0, 2},   // uint64 call counter (zeroed once, never reset)
    {"src", 2, 1, 0, 0},     // bf16 input: count elements
    {"dst", 2, 0, 1, 0},     // bf16 output: world * count elements
    {"entry", 8, 0, 0, 8},   // uint64 signals (zeroed once)
    {"arrive", 8, 0, 0, 8},  // uint64 signals (zeroed once)
};
constexpr int kNumBuffers = sizeof(kBuffers) / sizeof(kBuffers[0]);
constexpr size_t kAlign = 256;

struct Layout {
  size_t offset[kNumBuffers];
  size_t bytes[kNumBuffers];
  size_t heap = 0;
};

static Layout layout(size_t count, int world) {
  Layout l;
  for (int i = 0; i < kNumBuffers; ++i) {
    const BufferSpec& b = kBuffers[i];
    l.offset[i] = l.heap;
    l.bytes[i] = ((b.per_count + b.per_world_count * world) * count + b.fixed) * b.elem_bytes;
    l.heap += ((l.bytes[i] ? l.bytes[i] : 1) + kAlign - 1) / kAlign * kAlign;  // empty buffers take a slot too
  }
  return l;
}

// Input of rank r, element i: bit patterns that name (rank, index), as tsgen's tests use.
__global__ void fill_pattern(uint16_t* src, size_t count, int rank) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x)
    src[i] = (uint16_t)((rank << 11) | (i & 0x7FF));
}

using Launcher = cudaError_t (*)(char* const*, int, uint64_t*, uint64_t, __nv_bfloat16*, __nv_bfloat16*,
                                 uint64_t*, uint64_t*, cudaStream_t);

struct Entry {
  Launcher launch;
  const void* kernel;
};

static Entry entry_for(int world) {
  switch (world) {
    case 2: return {allgather_w2_launch, (const void*)allgather_w2};
    case 3: return {allgather_w3_launch, (const void*)allgather_w3};
    case 4: return {allgather_w4_launch, (const void*)allgather_w4};
    case 8: return {allgather_w8_launch, (const void*)allgather_w8};
    default: return {nullptr, nullptr};
  }
}

int main(int argc, char** argv) {
  const int world = argc > 1 ? std::atoi(argv[1]) : 2;
  const size_t count = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1000003;
  const int calls = argc > 3 ? std::atoi(argv[3]) : 20;
  const Entry entry = entry_for(world);
  if (!entry.launch || calls < 1) {
    std::fprintf(stderr, "usage: %s WORLD [COUNT] [CALLS]; generated/allgather.cu has world sizes 2, 3, 4, 8\n",
                 argv[0]);
    return 2;
  }
  int gpus = 0;
  const cudaError_t found = cudaGetDeviceCount(&gpus);  // no driver, no device: an error, or 0
  if (found != cudaSuccess || gpus == 0) {
    std::fprintf(stderr, "%s: no CUDA GPU found (cudaGetDeviceCount: %s)\n", argv[0],
                 found != cudaSuccess ? cudaGetErrorString(found) : "0 devices");
    return 2;
  }
  std::vector<int> device(world);
  std::vector<int> ranks_on(gpus, 0);
  for (int r = 0; r < world; ++r) ranks_on[device[r] = r % gpus]++;
  const bool shared = world > gpus;

  // Residency: every co-located rank's grid at once (their blocks wait on each other).
  for (int g = 0; g < gpus && g < world; ++g) {
    CHECK(cudaSetDevice(g));
    int sms = 0, per_sm = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, g));
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, entry.kernel, allgather::THREADS, 0));
    if ((long)ranks_on[g] * allgather::BLOCKS > (long)sms * per_sm) {
      std::fprintf(stderr, "GPU %d: %d ranks x %d blocks cannot all be resident (%d SMs x %d blocks per SM): "
                   "use more GPUs or a spec with fewer launch.blocks\n", g, ranks_on[g], allgather::BLOCKS, sms, per_sm);
      return 2;
    }
  }
  // Peer access between distinct GPUs only (a GPU reaches its own memory anyway).
  for (int a = 0; a < gpus && a < world; ++a)
    for (int b = 0; b < gpus && b < world; ++b) {
      if (a == b) continue;
      int ok = 0;
      CHECK(cudaDeviceCanAccessPeer(&ok, a, b));
      if (!ok) {
        std::fprintf(stderr, "GPU %d cannot access GPU %d directly\n", a, b);
        return 2;
      }
      CHECK(cudaSetDevice(a));
      const cudaError_t e = cudaDeviceEnablePeerAccess(b, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) (void)cudaGetLastError();
      else CHECK(e);
    }

  // One heap per rank; signals and the call counter zeroed once; a peer table per rank.
  const Layout l = layout(count, world);
  std::vector<char*> heap(world);
  std::vector<char**> peers(world);
  std::vector<cudaStream_t> stream(world);
  for (int r = 0; r < world; ++r) {
    CHECK(cudaSetDevice(device[r]));
    CHECK(cudaMalloc(&heap[r], l.heap));
    CHECK(cudaMemset(heap[r], 0, l.heap));
    CHECK(cudaStreamCreateWithFlags(&stream[r], cudaStreamNonBlocking));
  }
  for (int r = 0; r < world; ++r) {
    CHECK(cudaSetDevice(device[r]));
    CHECK(cudaMalloc(&peers[r], world * sizeof(char*)));
    CHECK(cudaMemcpy(peers[r], heap.data(), world * sizeof(char*), cudaMemcpyHostToDevice));
    fill_pattern<<<256, 256, 0, stream[r]>>>((uint16_t*)(heap[r] + l.offset[1]), count, r);
    CHECK(cudaGetLastError());
    CHECK(cudaStreamSynchronize(stream[r]));
  }
  auto buf = [&](int r, int i) { return heap[r] + l.offset[i]; };
  auto call_all = [&]() {
    for (int r = 0; r < world; ++r) {
      CHECK(cudaSetDevice(device[r]));
      CHECK(entry.launch(peers[r], r, (uint64_t*)buf(r, 0), count, (__nv_bfloat16*)buf(r, 1),
                         (__nv_bfloat16*)buf(r, 2), (uint64_t*)buf(r, 3), (uint64_t*)buf(r, 4), stream[r]));
    }
  };
  auto sync_all = [&]() {
    for (int r = 0; r < world; ++r) {
      CHECK(cudaSetDevice(device[r]));
      CHECK(cudaStreamSynchronize(stream[r]));
    }
  };

  // Correctness: poison every output, one call, every element of every rank checked.
  for (int r = 0; r < world; ++r) {
    CHECK(cudaSetDevice(device[r]));
    CHECK(cudaMemset(buf(r, 2), 0xA5, l.bytes[2]));
  }
  call_all();
  sync_all();
  size_t wrong = 0;
  std::vector<uint16_t> got(world * count);
  for (int r = 0; r < world; ++r) {
    CHECK(cudaSetDevice(device[r]));
    CHECK(cudaMemcpy(got.data(), buf(r, 2), l.bytes[2], cudaMemcpyDeviceToHost));
    for (int s = 0; s < world; ++s)
      for (size_t i = 0; i < count; ++i) wrong += got[s * count + i] != (uint16_t)((s << 11) | (i & 0x7FF));
  }

  // Timing: `calls` back-to-back calls (signals count up; nothing is reset), events on rank
  // 0's stream, after every rank has finished a warm-up call.
  call_all();
  sync_all();
  cudaEvent_t start, stop;
  CHECK(cudaSetDevice(device[0]));
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  CHECK(cudaEventRecord(start, stream[0]));
  for (int c = 0; c < calls; ++c) call_all();
  CHECK(cudaSetDevice(device[0]));
  CHECK(cudaEventRecord(stop, stream[0]));
  sync_all();
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, start, stop));
  // the timed calls' outputs, checked again on rank 0 (every call writes the same values)
  CHECK(cudaMemcpy(got.data(), buf(0, 2), l.bytes[2], cudaMemcpyDeviceToHost));
  for (int s = 0; s < world; ++s)
    for (size_t i = 0; i < count; ++i) wrong += got[s * count + i] != (uint16_t)((s << 11) | (i & 0x7FF));

  std::printf("allgather_demo: world %d on %d GPU(s)%s, %zu bf16 elements per rank: %s (%zu wrong); "
              "%.1f us per call over %d calls%s\n",
              world, gpus < world ? gpus : world, shared ? " (ranks share GPUs)" : "", count,
              wrong ? "FAIL" : "PASS", wrong, 1000.0 * ms / calls, calls,
              shared ? " [shared GPU: timing not comparable]" : "");
  for (int r = 0; r < world; ++r) {
    CHECK(cudaSetDevice(device[r]));
    CHECK(cudaFree(peers[r]));
    CHECK(cudaFree(heap[r]));
    CHECK(cudaStreamDestroy(stream[r]));
  }
  return wrong ? 1 : 0;
}
