// Micro-benchmarks of the workers' compressors on one push (encodings/): top-k with error feedback
// against SBC (Sattler et al., arXiv 1805.08768) on the same gradient, so that SBC's encode can be
// read as a ratio to top-k's (issue 21: SBC's encode at most 1.5x top-k's). Sizes: elements of
// fp32 (5.8M is the comparison's MLP, 784-2048-2048-10); density 1%; two key ranges (two servers).
#include <benchmark/benchmark.h>

#include <cmath>
#include <random>
#include <vector>

#include "encodings/sbc.h"
#include "encodings/topk.h"

namespace {

std::vector<float> Gradient(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> x(n);
  for (auto& v : x) v = 1e-3f * normal(rng) * std::exp(normal(rng));
  return x;
}

std::vector<sparseps::KeyRange> TwoRanges(size_t n) { return {{0, n / 2}, {n / 2, n}}; }

sparseps::proto::CompressionConfig Config(sparseps::proto::Encoding e) {
  sparseps::proto::CompressionConfig c;
  c.set_encoding(e);
  c.set_density(0.01);
  return c;
}

// TopKCompressor::Compress (momentum correction, exact top-k, gather, encode), momentum 0.9.
void BM_TopKCompress(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  const auto grads = std::vector<std::vector<float>>{Gradient(n, 1), Gradient(n, 2)};
  sparseps::TopKCompressor c(n, Config(sparseps::proto::TOPK), 0.9f);
  const auto ranges = TwoRanges(n);
  size_t step = 0;
  for (auto _ : state) {
    std::vector<sparseps::Message> out;
    auto s = c.Compress(grads[step++ % 2].data(), ranges, &out);
    if (!s.ok()) state.SkipWithError(s.ToString().c_str());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * sizeof(float)));
}
BENCHMARK(BM_TopKCompress)->Arg(5'800'000)->Unit(benchmark::kMillisecond);

// SbcCompressor: one LocalStep (momentum 0.9, lr 0.05) and Compress (A = a + R, top-k of each sign,
// mean, residual update, Golomb code), local_iterations 1 as in the comparison.
void BM_SbcCompress(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  const auto grads = std::vector<std::vector<float>>{Gradient(n, 1), Gradient(n, 2)};
  sparseps::SbcCompressor c(n, Config(sparseps::proto::SBC), 0.9f, 0.05f);
  std::vector<float> params(n, 0.0f);
  const auto ranges = TwoRanges(n);
  size_t step = 0;
  for (auto _ : state) {
    const float* g = grads[step++ % 2].data();
    c.LocalStep(g, params.data());
    std::vector<sparseps::Message> out;
    auto s = c.Compress(g, ranges, &out);
    if (!s.ok()) state.SkipWithError(s.ToString().c_str());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * sizeof(float)));
}
BENCHMARK(BM_SbcCompress)->Arg(5'800'000)->Unit(benchmark::kMillisecond);

}  // namespace
