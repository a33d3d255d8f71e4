// Micro-benchmarks of the worker's hot path: exact top-k selection (kernels::TopKAbs) against
// std::nth_element, the baseline a user would write, and the error-feedback kernels.
// Sizes: elements of fp32; throughput reported in bytes of input per second.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/error_feedback.h"
#include "kernels/topk.h"

namespace {

std::vector<float> Gradient(size_t n) {
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> x(n);
  for (auto& v : x) v = normal(rng) * std::exp(normal(rng));
  return x;
}

// kernels::TopKAbs at density 1% (args: n).
void BM_TopKAbs(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  const size_t k = std::max<size_t>(1, n / 100);
  auto x = Gradient(n);
  std::vector<uint32_t> idx(k);
  for (auto _ : state) {
    benchmark::DoNotOptimize(sparseps::kernels::TopKAbs(x.data(), n, k, idx.data()));
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * sizeof(float)));
}
BENCHMARK(BM_TopKAbs)->Arg(235146)->Arg(1 << 22)->Arg(25 << 20);

// Baseline: nth_element on |x| with an index array, then sort the k indices (same output).
void BM_NthElementTopK(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  const size_t k = std::max<size_t>(1, n / 100);
  auto x = Gradient(n);
  std::vector<uint32_t> order(n);
  for (auto _ : state) {
    std::iota(order.begin(), order.end(), 0u);
    std::nth_element(order.begin(), order.begin() + static_cast<long>(k) - 1, order.end(),
                     [&](uint32_t a, uint32_t b) { return std::fabs(x[a]) > std::fabs(x[b]); });
    std::sort(order.begin(), order.begin() + static_cast<long>(k));
    benchmark::DoNotOptimize(order.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * sizeof(float)));
}
BENCHMARK(BM_NthElementTopK)->Arg(235146)->Arg(1 << 22)->Arg(25 << 20);

// DGC momentum correction u = m u + g; v += u (reads 3 and writes 2 vectors).
void BM_MomentumCorrection(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  auto g = Gradient(n);
  std::vector<float> u(n, 0.0f), v(n, 0.0f);
  for (auto _ : state) {
    sparseps::kernels::MomentumCorrection(u.data(), v.data(), g.data(), 0.9f, n);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * 5 * sizeof(float)));
}
BENCHMARK(BM_MomentumCorrection)->Arg(235146)->Arg(1 << 22)->Arg(25 << 20);

}  // namespace
