// Which CUDA runtime calls block the host while a kernel of the same process spins, waiting
// for work that is launched only after the call? On a shared GPU every rank's launcher runs
// while its peers' kernels already spin for its entry signal: a launcher call that waits for
// the device to idle deadlocks the world until the spinners' timeout (docs/lab/shared_gpu.md).
//
//   nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a tools/exp_blocking_calls.cu -o exp
//   ./exp CALL [full]     one call between the spinner's launch and the release (list: ./exp);
//                         full: the spinner holds every SM and the host releases it
//   ./exp queues N PRIO   N streams (PRIO: low, high, mixed), kernel k raises flag k and waits for
//                         all N flags: a stream that shares a hardware queue with an earlier
//                         spinning stream never starts its kernel (false dependency)
// Prints one line: the call, how long it took on the host, whether the spinner timed out.
#include <cuda.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define CHECK(x)                                                                       \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                                    \
    }                                                                                  \
  } while (0)

static __device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spins until *flag >= 1 or `limit_ms` passed; *result = 1 released, 2 timed out.
__global__ void spinner(const volatile int* flag, int* result, int limit_ms) {
  const unsigned long long t0 = now_ns();
  while (*flag < 1) {
    if (now_ns() - t0 > (unsigned long long)limit_ms * 1000000ull) {
      *result = 2;
      return;
    }
  }
  *result = 1;
}

__global__ void release(int* flag) { atomicExch(flag, 1); }

// Kernels that the calls below launch or configure for the first time.
__global__ void never_launched(int* p) { p[threadIdx.x] += 1; }
__global__ void with_printf(int* p, int v) {
  if (v < 0) printf("never printed %d %d %d %d\n", v, p[0], p[1], p[2]);  // a 64-byte stack frame
  p[threadIdx.x] += v;
}
__global__ void with_printf2(int* p, int v) {
  if (v < 0) printf("never printed either %d %d %d %d\n", v, p[0], p[1], p[2]);
  p[threadIdx.x] += 2 * v;
}
__global__ void small_stack(int* p, int n) {  // a 512-byte local array (below the default stack limit), no printf
  volatile int local[128];
  for (int i = 0; i < 128; ++i) local[i] = i * n;
  p[threadIdx.x] += local[(threadIdx.x * 7 + n) % 128];
}
__global__ void big_stack(int* p, int n) {
  volatile int local[4096];  // 16 KiB per thread: above the default stack limit
  for (int i = 0; i < 4096; ++i) local[i] = i * n;
  p[threadIdx.x] += local[(threadIdx.x * 7 + n) % 4096];
}
extern __shared__ int dyn[];
__global__ void big_smem(int* p) { dyn[threadIdx.x] = 1; __syncthreads(); p[threadIdx.x] += dyn[0]; }

// Kernel k raises flag k, then waits for all n flags (limit_ms).
__global__ void all_meet(int* flags, int k, int n, int* result, int limit_ms) {
  atomicExch(flags + k, 1);
  const unsigned long long t0 = now_ns();
  for (int i = 0; i < n; ++i)
    while (((volatile int*)flags)[i] < 1)
      if (now_ns() - t0 > (unsigned long long)limit_ms * 1000000ull) {
        result[k] = 2;
        return;
      }
  result[k] = 1;
}

static int queues(int n, const std::string& prio) {
  int lo = 0, hi = 0;
  CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  std::vector<cudaStream_t> s(n);
  for (int i = 0; i < n; ++i) {
    const bool high = prio == "high" || (prio == "mixed" && i % 3 == 2);
    CHECK(cudaStreamCreateWithPriority(&s[i], cudaStreamNonBlocking, high ? hi : lo));
  }
  int *flags, *result;
  CHECK(cudaMalloc(&flags, n * sizeof(int)));
  CHECK(cudaMalloc(&result, n * sizeof(int)));
  CHECK(cudaMemset(flags, 0, n * sizeof(int)));
  CHECK(cudaMemset(result, 0, n * sizeof(int)));
  CHECK(cudaDeviceSynchronize());
  for (int k = 0; k < n; ++k) all_meet<<<1, 32, 0, s[k]>>>(flags, k, n, result, 2000);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  std::vector<int> r(n);
  CHECK(cudaMemcpy(r.data(), result, n * sizeof(int), cudaMemcpyDeviceToHost));
  int stuck = 0;
  for (int v : r) stuck += v != 1;
  std::printf("queues n=%d prio=%s max_connections=%s: %s (%d of %d kernels timed out)\n", n, prio.c_str(),
              getenv("CUDA_DEVICE_MAX_CONNECTIONS") ? getenv("CUDA_DEVICE_MAX_CONNECTIONS") : "default",
              stuck ? "FALSE DEPENDENCY" : "all met", stuck, n);
  return 0;
}

int main(int argc, char** argv) {
  const char* calls =
      "stream_create stream_create_high event_create func_set_attribute first_launch first_launch_printf "
      "first_launch_big_stack launch_again malloc free malloc_host host_register tensor_map none "
      "second_printf_kernel small_stack small_stack_after_printf printf_after_stack_limit printf_after_fifo_limit "
      "big_stack_after_stack_limit second_printf_after_get_attributes second_printf_after_func_load "
      "second_printf_after_local_size";
  if (argc < 2) {
    std::printf("calls: %s; or: queues N low|high|mixed\n", calls);
    return 1;
  }
  const std::string call = argv[1];
  CHECK(cudaSetDevice(0));
  if (call == "printf_after_stack_limit" || call == "big_stack_after_stack_limit")
    CHECK(cudaDeviceSetLimit(cudaLimitStackSize, call == "big_stack_after_stack_limit" ? 20 * 1024 : 1024));
  if (call == "printf_after_fifo_limit") CHECK(cudaDeviceSetLimit(cudaLimitPrintfFifoSize, 1 << 20));
  if (call == "queues") return queues(argc > 2 ? std::atoi(argv[2]) : 8, argc > 3 ? argv[3] : "low");

  cudaStream_t a, b;
  CHECK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  int *flag, *result, *scratch;
  CHECK(cudaMalloc(&flag, sizeof(int)));
  CHECK(cudaMalloc(&result, sizeof(int)));
  CHECK(cudaMalloc(&scratch, 1 << 20));
  CHECK(cudaMemset(flag, 0, sizeof(int)));
  CHECK(cudaMemset(result, 0, sizeof(int)));
  CHECK(cudaMemset(scratch, 0, 1 << 20));
  // warm: every kernel the spinner / release path needs has run once
  release<<<1, 1, 0, b>>>(scratch);
  spinner<<<1, 1, 0, a>>>(scratch, scratch + 1, 10);
  if (call == "launch_again" || call == "second_printf_kernel" || call == "small_stack_after_printf" ||
      call == "second_printf_after_get_attributes" || call == "second_printf_after_func_load" ||
      call == "second_printf_after_local_size")
    with_printf<<<1, 32, 0, b>>>(scratch + 64, 1);
  if (call == "second_printf_after_get_attributes") {
    cudaFuncAttributes attr;
    CHECK(cudaFuncGetAttributes(&attr, with_printf2));
  }
  if (call == "second_printf_after_func_load" || call == "second_printf_after_local_size") {
    cudaFunction_t f;
    CHECK(cudaGetFuncBySymbol(&f, (const void*)with_printf2));
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (call == "second_printf_after_func_load") {
      CHECK(cudaGetDriverEntryPointByVersion("cuFuncLoad", &fn, 12040, cudaEnableDefault, &found));
      if (((CUresult(*)(CUfunction))fn)((CUfunction)f) != CUDA_SUCCESS) std::exit(3);
    } else {
      CHECK(cudaGetDriverEntryPointByVersion("cuFuncGetAttribute", &fn, 12000, cudaEnableDefault, &found));
      int bytes = 0;
      if (((CUresult(*)(int*, CUfunction_attribute, CUfunction))fn)(&bytes, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES,
                                                                     (CUfunction)f) != CUDA_SUCCESS) std::exit(3);
    }
  }
  CHECK(cudaDeviceSynchronize());

  // "full" (argv[2]): the spinner fills every SM (one CTA per SM: 200 KiB of shared memory each) and
  // the host releases it through mapped host memory, as ranks' persistent grids fill a shared GPU
  const bool full = argc > 2 && std::string(argv[2]) == "full";
  int* host_flag = nullptr;
  int* mapped_flag = nullptr;
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (full) {
    CHECK(cudaHostAlloc(&host_flag, sizeof(int), cudaHostAllocMapped));
    *(volatile int*)host_flag = 0;
    CHECK(cudaHostGetDevicePointer(&mapped_flag, host_flag, 0));
    CHECK(cudaFuncSetAttribute(spinner, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    spinner<<<sms, 1, 200 * 1024, a>>>(mapped_flag, result, 1500);
  } else {
    spinner<<<1, 1, 0, a>>>(flag, result, 1500);
  }
  CHECK(cudaGetLastError());
  void* host = nullptr;
  cudaStream_t extra;
  cudaEvent_t ev;
  const auto t0 = std::chrono::steady_clock::now();
  if (call == "stream_create") {
    CHECK(cudaStreamCreateWithFlags(&extra, cudaStreamNonBlocking));
  } else if (call == "stream_create_high") {
    int lo = 0, hi = 0;
    CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    CHECK(cudaStreamCreateWithPriority(&extra, cudaStreamNonBlocking, hi));
  } else if (call == "event_create") {
    CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  } else if (call == "func_set_attribute") {
    CHECK(cudaFuncSetAttribute(big_smem, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  } else if (call == "first_launch") {
    never_launched<<<1, 32, 0, b>>>(scratch + 64);
  } else if (call == "second_printf_kernel" || call == "second_printf_after_get_attributes" ||
             call == "second_printf_after_func_load" || call == "second_printf_after_local_size") {
    with_printf2<<<1, 32, 0, b>>>(scratch + 64, 1);
  } else if (call == "small_stack" || call == "small_stack_after_printf") {
    small_stack<<<1, 32, 0, b>>>(scratch + 64, 3);
  } else if (call == "first_launch_printf" || call == "launch_again" || call == "printf_after_stack_limit" ||
             call == "printf_after_fifo_limit") {
    with_printf<<<1, 32, 0, b>>>(scratch + 64, 1);
  } else if (call == "first_launch_big_stack" || call == "big_stack_after_stack_limit") {
    big_stack<<<1, 32, 0, b>>>(scratch + 64, 3);
  } else if (call == "malloc") {
    void* p;
    CHECK(cudaMalloc(&p, 64 << 20));
  } else if (call == "free") {
    CHECK(cudaFree(scratch));
  } else if (call == "malloc_host") {
    CHECK(cudaMallocHost(&host, 64 << 20));
  } else if (call == "host_register") {
    host = std::malloc(64 << 20);
    CHECK(cudaHostRegister(host, 64 << 20, cudaHostRegisterDefault));
  } else if (call == "tensor_map") {
    using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    CUtensorMap map;
    cuuint64_t dims[2] = {1024, 256}, strides[1] = {1024 * 2};
    cuuint32_t box[2] = {64, 64}, elem[2] = {1, 1};
    if (((Encode)fn)(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, scratch, dims, strides, box, elem,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                               CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
      std::exit(2);
  } else if (call != "none") {
    std::printf("unknown call %s; calls: %s\n", call.c_str(), calls);
    return 1;
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (full)
    *(volatile int*)host_flag = 1;
  else
    release<<<1, 1, 0, b>>>(flag);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  int r = 0;
  CHECK(cudaMemcpy(&r, result, sizeof(int), cudaMemcpyDeviceToHost));
  std::printf("%-24s %-4s %9.2f ms on the host  spinner %s  (CUDA_MODULE_LOADING=%s)\n", call.c_str(),
              full ? "full" : "one", ms,
              r == 1 ? "released" : "TIMED OUT: the call waited for it",
              getenv("CUDA_MODULE_LOADING") ? getenv("CUDA_MODULE_LOADING") : "default");
  return 0;
}
