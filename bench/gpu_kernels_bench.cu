// Google Benchmark of the CUDA kernels (issue 5), timed with CUDA events (manual time):
//   build/bench/sparseps_gpu_bench [--benchmark_filter=...]
// Vector size SPARSEPS_GPU_BENCH_N (default 100M floats, normal values), density 0.1%. Each
// benchmark reports bytes_per_second for one read of the vector (4n bytes per iteration), so the
// ratios against BM_OneRead and the fraction of the GPU's memory bandwidth read off directly.
// Baseline for the exact top-k: a full CUB radix sort of (|x| key, index) pairs, descending, as
// a sort-based top-k does (this CUDA's CUB, 3.0, has no DeviceTopK); torch.topk is timed on the
// same problem by bench/torch_topk_baseline.py, which bench/gpu_checks.sh runs in the same call.
// Without a CUDA device every benchmark is skipped with the reason.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <cub/device/device_radix_sort.cuh>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/gpu_kernels.h"
#include "kernels/device.h"

namespace sparseps::kernels::gpu {
namespace {

size_t BenchN() {
  const char* e = std::getenv("SPARSEPS_GPU_BENCH_N");
  return e != nullptr ? static_cast<size_t>(std::strtoull(e, nullptr, 10)) : size_t{100000000};
}

// The input, made once: normal values (a gradient-like distribution), on the device.
struct Input {
  size_t n = 0;
  float* x = nullptr;
  float threshold = 0;  // selects about 0.1%
  static Input& Get() {
    static Input in = [] {
      Input i;
      i.n = BenchN();
      std::vector<float> h(i.n);
      std::mt19937_64 rng(1);
      std::normal_distribution<float> d(0.0f, 1.0f);
      for (auto& v : h) v = d(rng);
      if (cudaMalloc(reinterpret_cast<void**>(&i.x), i.n * sizeof(float)) == cudaSuccess) {
        cudaMemcpy(i.x, h.data(), i.n * sizeof(float), cudaMemcpyHostToDevice);
      }
      i.threshold = 3.29f;  // P(|z| >= 3.29) = 0.1% for a standard normal
      return i;
    }();
    return in;
  }
};

bool Ready(benchmark::State& state) {
  std::string why;
  if (!CudaDeviceAvailable(&why)) {
    state.SkipWithError(why.c_str());
    return false;
  }
  state.SetLabel(why);
  return true;
}

// Times `body` per iteration with CUDA events; body synchronises (the selections do).
template <typename Body>
void Timed(benchmark::State& state, size_t n, Body body) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  body();  // warm-up: allocations of the scratch buffers
  for (auto _ : state) {
    cudaEventRecord(a);
    body();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    state.SetIterationTime(ms / 1e3);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(n) * 4);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
}

void BM_OneRead(benchmark::State& state) {
  if (!Ready(state)) return;
  Input& in = Input::Get();
  double sum = 0;
  double* scratch = nullptr;
  cudaMalloc(reinterpret_cast<void**>(&scratch), sizeof(double));
  Timed(state, in.n, [&] { StreamingSum(in.x, in.n, scratch, &sum, nullptr); });
  benchmark::DoNotOptimize(sum);
  cudaFree(scratch);
}

// The practical bandwidth ceiling: a device-to-device copy of the vector. Its bytes_per_second
// counts bytes read plus bytes written (8n per iteration), unlike the others (4n).
void BM_DeviceCopy(benchmark::State& state) {
  if (!Ready(state)) return;
  Input& in = Input::Get();
  float* dst = nullptr;
  cudaMalloc(reinterpret_cast<void**>(&dst), in.n * sizeof(float));
  Timed(state, 2 * in.n, [&] {
    cudaMemcpyAsync(dst, in.x, in.n * sizeof(float), cudaMemcpyDeviceToDevice);
    cudaDeviceSynchronize();
  });
  cudaFree(dst);
}

void BM_TopK(benchmark::State& state) {
  if (!Ready(state)) return;
  Input& in = Input::Get();
  const size_t k = in.n / 1000;
  uint32_t* out = nullptr;
  cudaMalloc(reinterpret_cast<void**>(&out), k * sizeof(uint32_t));
  GpuTopK topk;
  size_t count = 0;
  Timed(state, in.n, [&] { topk.Select(in.x, in.n, k, out, &count, nullptr); });
  state.counters["sampled_path"] = topk.last_used_sample() ? 1 : 0;
  cudaFree(out);
}

void BM_ThresholdSelect(benchmark::State& state) {
  if (!Ready(state)) return;
  Input& in = Input::Get();
  const size_t cap = in.n / 500;
  uint32_t* idx = nullptr;
  float* vals = nullptr;
  cudaMalloc(reinterpret_cast<void**>(&idx), cap * sizeof(uint32_t));
  cudaMalloc(reinterpret_cast<void**>(&vals), cap * sizeof(float));
  GpuThresholdSelect sel;
  size_t count = 0;
  Timed(state, in.n,
        [&] { sel.Select(in.x, in.n, in.threshold, idx, vals, cap, &count, nullptr); });
  state.counters["selected"] = static_cast<double>(count);
  cudaFree(idx);
  cudaFree(vals);
}

// DGC's sampled threshold at density 0.1% with a 1% sample (the sample's rank by GpuTopK, then
// one threshold pass, refined as on the CPU): about one read plus the sample's selection.
void BM_SampledThresholdSelect(benchmark::State& state) {
  if (!Ready(state)) return;
  Input& in = Input::Get();
  GpuSampledThresholdSelect sel;
  size_t count = 0;
  Timed(state, in.n, [&] { sel.Select(in.x, in.n, in.n / 1000, 0.01, &count, nullptr); });
  state.counters["selected"] = static_cast<double>(count);
}

__global__ void KeysAndIndices(const float* x, size_t n, uint32_t* keys, uint32_t* idx) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    keys[i] = __float_as_uint(x[i]) & 0x7fffffffu;
    idx[i] = static_cast<uint32_t>(i);
  }
}

// Baseline: top-k by a full descending radix sort of (key, index) pairs.
void BM_CubSortTopK(benchmark::State& state) {
  if (!Ready(state)) return;
  Input& in = Input::Get();
  uint32_t *keys = nullptr, *idx = nullptr, *keys2 = nullptr, *idx2 = nullptr;
  for (uint32_t** p : {&keys, &idx, &keys2, &idx2}) {
    cudaMalloc(reinterpret_cast<void**>(p), in.n * sizeof(uint32_t));
  }
  cub::DoubleBuffer<uint32_t> k(keys, keys2), v(idx, idx2);
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairsDescending(nullptr, bytes, k, v, static_cast<int>(in.n));
  void* tmp = nullptr;
  cudaMalloc(&tmp, bytes);
  Timed(state, in.n, [&] {
    KeysAndIndices<<<4096, 256>>>(in.x, in.n, k.Current(), v.Current());
    cub::DeviceRadixSort::SortPairsDescending(tmp, bytes, k, v, static_cast<int>(in.n));
    cudaDeviceSynchronize();
  });
  for (void* p : {static_cast<void*>(keys), static_cast<void*>(idx), static_cast<void*>(keys2),
                  static_cast<void*>(idx2), tmp}) {
    cudaFree(p);
  }
}

// Count-sketch insertion of the whole vector (every entry non-zero), hashes on the fly. Arg 0:
// 5 rows x n/100 columns (FetchSGD's proportions; the table, 20 MB at 100M, stays in L2): one
// global atomic per row and entry. Arg 1: 5 rows x 10,000 columns (configs/sketch.yaml's table,
// 200 KB): block-private tables in shared memory.
void BM_CountSketchInsertDense(benchmark::State& state) {
  if (!Ready(state)) return;
  Input& in = Input::Get();
  const uint32_t columns = state.range(0) == 0 ? static_cast<uint32_t>(in.n / 100) : 10000;
  CountSketchHash hash(5, columns, 7);
  GpuCountSketch sketch(hash);
  float* table = nullptr;
  cudaMalloc(reinterpret_cast<void**>(&table), hash.table_size() * sizeof(float));
  Timed(state, in.n, [&] {
    cudaMemsetAsync(table, 0, hash.table_size() * sizeof(float));
    sketch.InsertDense(in.x, in.n, 0, table, nullptr);
    cudaDeviceSynchronize();
  });
  cudaFree(table);
}

// The sketch encoding's default insertion (Sketched SGD's truncation, truncate_factor 1): the
// exact top-k of |x| at density 0.1%, a gather of their values, and their sparse insertion into
// 5 rows x n/100 columns: 500k atomics instead of 500M. The dense case above is FetchSGD's.
void BM_CountSketchInsertTruncated(benchmark::State& state) {
  if (!Ready(state)) return;
  Input& in = Input::Get();
  const size_t k = in.n / 1000;
  CountSketchHash hash(5, static_cast<uint32_t>(in.n / 100), 7);
  GpuCountSketch sketch(hash);
  GpuTopK topk;
  float *table = nullptr, *vals = nullptr;
  uint32_t* idx = nullptr;
  cudaMalloc(reinterpret_cast<void**>(&table), hash.table_size() * sizeof(float));
  cudaMalloc(reinterpret_cast<void**>(&vals), k * sizeof(float));
  cudaMalloc(reinterpret_cast<void**>(&idx), k * sizeof(uint32_t));
  size_t count = 0;
  Timed(state, in.n, [&] {
    cudaMemsetAsync(table, 0, hash.table_size() * sizeof(float));
    topk.Select(in.x, in.n, k, idx, &count, nullptr);
    Gather(in.x, idx, count, vals, nullptr);
    sketch.InsertSparse(idx, vals, count, 0, table, nullptr);
    cudaDeviceSynchronize();
  });
  state.counters["inserted"] = static_cast<double>(count);
  cudaFree(table);
  cudaFree(vals);
  cudaFree(idx);
}

// SBC binarisation at density 0.1%: two passes writing a side, two exact top-k selections.
void BM_SbcBinarize(benchmark::State& state) {
  if (!Ready(state)) return;
  Input& in = Input::Get();
  const size_t k = in.n / 1000;
  float* residual = nullptr;
  uint32_t* idx = nullptr;
  cudaMalloc(reinterpret_cast<void**>(&residual), in.n * sizeof(float));
  cudaMalloc(reinterpret_cast<void**>(&idx), k * sizeof(uint32_t));
  GpuSbc sbc;
  size_t count = 0;
  float value = 0;
  Timed(state, in.n, [&] {
    // Binarize changes its input; time it on a fresh copy (the copy is one read + one write).
    cudaMemcpyAsync(residual, in.x, in.n * sizeof(float), cudaMemcpyDeviceToDevice);
    sbc.Binarize(residual, nullptr, in.n, k, idx, &count, &value, nullptr);
  });
  state.counters["selected"] = static_cast<double>(count);
  cudaFree(residual);
  cudaFree(idx);
}

BENCHMARK(BM_DeviceCopy)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_OneRead)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CountSketchInsertDense)
    ->Arg(0)
    ->Arg(1)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CountSketchInsertTruncated)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_SbcBinarize)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_TopK)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ThresholdSelect)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_SampledThresholdSelect)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CubSortTopK)->UseManualTime()->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace sparseps::kernels::gpu
