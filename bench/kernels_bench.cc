// Micro-benchmarks of the worker's hot path: exact top-k selection (kernels::TopKAbs) against
// std::nth_element, the baseline a user would write, and the error-feedback kernels.
// Sizes: elements of fp32; throughput reported in bytes of input per second.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/count_sketch.h"
#include "kernels/error_feedback.h"
#include "kernels/golomb.h"
#include "kernels/select.h"
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

// The check every encoder runs on the gradient before anything else (kernels::AllFinite), against
// the streaming read of the same vector. Args: n (5,824,522 is the comparison's MLP).
void BM_AllFinite(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  auto x = Gradient(n);
  for (auto _ : state) benchmark::DoNotOptimize(sparseps::kernels::AllFinite(x.data(), n));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * sizeof(float)));
}
BENCHMARK(BM_AllFinite)->Arg(235146)->Arg(5824522);

// Baselines: what a user would write (std::all_of with std::isfinite), and the serial float sum of
// x * 0 that AllFinite was until 2026-11-25 (one add chain: it cannot be vectorised without
// -ffast-math).
void BM_AllFiniteStdIsfinite(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  auto x = Gradient(n);
  for (auto _ : state) {
    benchmark::DoNotOptimize(
        std::all_of(x.begin(), x.end(), [](float v) { return std::isfinite(v); }));
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * sizeof(float)));
}
BENCHMARK(BM_AllFiniteStdIsfinite)->Arg(5824522);

void BM_AllFiniteSerialSum(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  auto x = Gradient(n);
  for (auto _ : state) {
    float acc = 0.0f;
    for (size_t i = 0; i < n; ++i) acc += x[i] * 0.0f;
    benchmark::DoNotOptimize(acc == 0.0f);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * sizeof(float)));
}
BENCHMARK(BM_AllFiniteSerialSum)->Arg(5824522);

// The top-k compressor's step at density 1% (args: n): the momentum correction and then the exact
// top-k of the residual (two passes over it), against kernels::MomentumCorrectionTopK (one).
// The residual starts at a sum of earlier gradients and the selected entries are zeroed after
// each call, as TopKCompressor does.
void MomentumTopKBench(benchmark::State& state, bool fused) {
  const size_t n = static_cast<size_t>(state.range(0));
  const size_t k = std::max<size_t>(1, n / 100);
  auto g = Gradient(n);
  std::vector<float> u(n, 0.0f), v = Gradient(n);
  std::vector<uint32_t> idx(k);
  for (auto _ : state) {
    size_t got;
    if (fused) {
      got = sparseps::kernels::MomentumCorrectionTopK(u.data(), v.data(), g.data(), 0.9f, n, k,
                                                      idx.data());
    } else {
      sparseps::kernels::MomentumCorrection(u.data(), v.data(), g.data(), 0.9f, n);
      got = sparseps::kernels::TopKAbs(v.data(), n, k, idx.data());
    }
    for (size_t j = 0; j < got; ++j) v[idx[j]] = u[idx[j]] = 0.0f;
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * sizeof(float)));
}
void BM_MomentumCorrectionThenTopKAbs(benchmark::State& state) { MomentumTopKBench(state, false); }
void BM_MomentumCorrectionTopK(benchmark::State& state) { MomentumTopKBench(state, true); }
BENCHMARK(BM_MomentumCorrectionThenTopKAbs)->Arg(235146)->Arg(5824522);
BENCHMARK(BM_MomentumCorrectionTopK)->Arg(235146)->Arg(5824522);

// SBC's push step at density 1%, one local iteration (args: n, and for the fused kernel 1 when it
// updates the parameters, 0 when it leaves them to the pull as the PS worker does): the step
// (u = m u + g; params -= lr u; r += u) and then TopKBySign of the residual (two passes over it,
// and the mean of each side gathered from it), against kernels::SbcPushStepTopKBySign (one pass;
// the values come with the indices). The sent side (the positive one, for the benchmark) is zeroed
// after each call.
void SbcStepTopKBench(benchmark::State& state, bool fused) {
  const size_t n = static_cast<size_t>(state.range(0));
  const bool with_params = !fused || state.range(1) != 0;
  const size_t k = std::max<size_t>(1, n / 100);
  auto g = Gradient(n);
  std::vector<float> u(n, 0.0f), params(n, 0.0f), r = Gradient(n), pos_values, neg_values;
  std::vector<uint32_t> pos, neg;
  for (auto _ : state) {
    double sum = 0.0;
    if (fused) {
      sparseps::kernels::SbcPushStepTopKBySign(u.data(), with_params ? params.data() : nullptr,
                                               nullptr, r.data(), g.data(), 0.9f, 0.05f, n, k, &pos,
                                               &neg, &pos_values, &neg_values);
      for (float v : pos_values) sum += std::fabs(v);
      for (float v : neg_values) sum += std::fabs(v);
    } else {
      for (size_t i = 0; i < n; ++i) {
        const float ui = 0.9f * u[i] + g[i];
        u[i] = ui;
        params[i] -= 0.05f * ui;
        r[i] += ui;
      }
      sparseps::kernels::TopKBySign(r.data(), n, k, &pos, &neg);
      for (uint32_t i : pos) sum += std::fabs(r[i]);
      for (uint32_t i : neg) sum += std::fabs(r[i]);
    }
    benchmark::DoNotOptimize(sum);
    for (uint32_t i : pos) r[i] = u[i] = 0.0f;
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * sizeof(float)));
}
void BM_SbcStepThenTopKBySign(benchmark::State& state) { SbcStepTopKBench(state, false); }
void BM_SbcPushStepTopKBySign(benchmark::State& state) { SbcStepTopKBench(state, true); }
BENCHMARK(BM_SbcStepThenTopKBySign)->Arg(5824522);
BENCHMARK(BM_SbcPushStepTopKBySign)->Args({5824522, 1})->Args({5824522, 0});

// ---- Issue 3's figures: 16M floats at density 0.1%, single thread (args: n, k). ----
constexpr int64_t k16M = 16 << 20;
constexpr int64_t kK = k16M / 1000;

// The baseline: one streaming read of the vector (a sum with 16 accumulators).
void BM_StreamingRead(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  auto x = Gradient(n);
  for (auto _ : state) benchmark::DoNotOptimize(sparseps::kernels::StreamingSum(x.data(), n));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * sizeof(float)));
}
BENCHMARK(BM_StreamingRead)->Arg(k16M);

void BM_TopKAbsSparse(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0)), k = static_cast<size_t>(state.range(1));
  auto x = Gradient(n);
  std::vector<uint32_t> idx(k);
  for (auto _ : state) {
    benchmark::DoNotOptimize(sparseps::kernels::TopKAbs(x.data(), n, k, idx.data()));
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * sizeof(float)));
}
BENCHMARK(BM_TopKAbsSparse)->Args({k16M, kK});

void BM_TopKAbsRadixSparse(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0)), k = static_cast<size_t>(state.range(1));
  auto x = Gradient(n);
  std::vector<uint32_t> idx(k);
  for (auto _ : state) {
    benchmark::DoNotOptimize(sparseps::kernels::TopKAbsRadix(x.data(), n, k, idx.data()));
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * sizeof(float)));
}
BENCHMARK(BM_TopKAbsRadixSparse)->Args({k16M, kK});

void BM_NthElementSparse(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0)), k = static_cast<size_t>(state.range(1));
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
BENCHMARK(BM_NthElementSparse)->Args({k16M, kK})->Unit(benchmark::kMillisecond);

void BM_SampledThreshold(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0)), k = static_cast<size_t>(state.range(1));
  auto x = Gradient(n);
  std::vector<uint32_t> idx;
  for (auto _ : state) {
    benchmark::DoNotOptimize(sparseps::kernels::SampledThresholdSelect(x.data(), n, k, 0.01, &idx));
  }
  state.counters["selected"] = static_cast<double>(idx.size());
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * sizeof(float)));
}
BENCHMARK(BM_SampledThreshold)->Args({k16M, kK});

// ExDyna's selection pass with the threshold already scaled to the target (its steady state).
void BM_ScaledThreshold(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0)), k = static_cast<size_t>(state.range(1));
  auto x = Gradient(n);
  std::vector<uint32_t> idx(k);
  sparseps::kernels::TopKAbs(x.data(), n, k, idx.data());
  sparseps::kernels::ScaledThreshold sel(k);
  sel.set_threshold(std::fabs(x[idx[0]]));
  float smallest = INFINITY;
  for (uint32_t i : idx) smallest = std::min(smallest, std::fabs(x[i]));
  for (auto _ : state) {
    sel.set_threshold(smallest);
    benchmark::DoNotOptimize(sel.Select(x.data(), n, &idx));
  }
  state.counters["selected"] = static_cast<double>(idx.size());
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * sizeof(float)));
}
BENCHMARK(BM_ScaledThreshold)->Args({k16M, kK});

std::vector<uint32_t> Positions(size_t n, size_t k) {
  auto x = Gradient(n);
  std::vector<uint32_t> idx(k);
  sparseps::kernels::TopKAbs(x.data(), n, k, idx.data());
  return idx;
}

// Golomb encode + decode of the k positions; bytes = the positions as uint32 (4 B each).
void BM_GolombEncodeDecode(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0)), k = static_cast<size_t>(state.range(1));
  const auto idx = Positions(n, k);
  const uint32_t b = sparseps::kernels::GolombParameter(static_cast<double>(k) / n);
  std::vector<uint8_t> code;
  std::vector<uint32_t> out(k);
  for (auto _ : state) {
    code.clear();
    sparseps::kernels::GolombEncode(idx.data(), k, b, &code);
    benchmark::DoNotOptimize(
        sparseps::kernels::GolombDecode(code.data(), code.size(), b, k, n, out.data()));
  }
  state.counters["bits_per_position"] = 8.0 * static_cast<double>(code.size()) / k;
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * k * sizeof(uint32_t)));
}
BENCHMARK(BM_GolombEncodeDecode)->Args({k16M, kK});

// Golomb encode alone of the k positions (what a worker's push costs on the host; the decode is
// the server's), at 0.1% of 16M and of 100M entries (whether packing on the GPU would pay).
void BM_GolombEncode(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0)), k = static_cast<size_t>(state.range(1));
  const auto idx = Positions(n, k);
  const uint32_t b = sparseps::kernels::GolombParameter(static_cast<double>(k) / n);
  std::vector<uint8_t> code;
  for (auto _ : state) {
    code.clear();
    benchmark::DoNotOptimize(sparseps::kernels::GolombEncode(idx.data(), k, b, &code));
  }
  state.counters["bits_per_position"] = 8.0 * static_cast<double>(code.size()) / k;
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * k * sizeof(uint32_t)));
}
BENCHMARK(BM_GolombEncode)->Args({k16M, kK})->Args({100'000'000, 100'000});

// memcpy of arg bytes (the Golomb and aggregation baselines).
void BM_Memcpy(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  std::vector<char> a(bytes, 1), b(bytes);
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
}
BENCHMARK(BM_Memcpy)->Arg(kK * 4)->Arg(kK * 8)->Arg(k16M * 4);

// Server aggregation of one push of k (index, value) pairs into a 16M shard (scatter-add at
// sorted indices); bytes = the pairs (8 B each).
void BM_ScatterAddPairs(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0)), k = static_cast<size_t>(state.range(1));
  const auto idx = Positions(n, k);
  std::vector<float> vals(k, 1.0f), shard(n, 0.0f);
  for (auto _ : state) {
    sparseps::kernels::ScatterAdd(shard.data(), idx.data(), vals.data(), k);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * k * 8));
}
BENCHMARK(BM_ScatterAddPairs)->Args({k16M, kK});

// Count-sketch insert, 5 rows: a 16M vector with 0.1% non-zeros (what a worker sketches after
// truncation; zeros are skipped), and the sparse form of the same k entries.
void BM_SketchInsertDense(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0)), k = static_cast<size_t>(state.range(1));
  const auto idx = Positions(n, k);
  std::vector<float> v(n, 0.0f);
  for (uint32_t i : idx) v[i] = 1.0f;
  sparseps::kernels::CountSketchHash h(5, static_cast<uint32_t>(10 * k), 42);
  std::vector<float> table(h.table_size());
  for (auto _ : state) {
    h.InsertDense(v.data(), n, 0, table.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * sizeof(float)));
}
BENCHMARK(BM_SketchInsertDense)->Args({k16M, kK});

// Insert cost per element when every entry is non-zero (5 rows, hashes computed per element).
void BM_SketchInsertAllNonZero(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  auto v = Gradient(n);
  sparseps::kernels::CountSketchHash h(5, 16384, 42);
  std::vector<float> table(h.table_size());
  for (auto _ : state) {
    h.InsertDense(v.data(), n, 0, table.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * sizeof(float)));
}
BENCHMARK(BM_SketchInsertAllNonZero)->Arg(1 << 20);

}  // namespace
