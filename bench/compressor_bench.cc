// Micro-benchmarks of the workers' compressors on one push (encodings/): top-k with error feedback
// against SBC (Sattler et al., arXiv 1805.08768) on the same gradient, so that SBC's encode can be
// read as a ratio to top-k's (issue 21: SBC's encode at most 1.5x top-k's). Sizes: elements of
// fp32 (5.8M is the comparison's MLP, 784-2048-2048-10); density 1%; two key ranges (two servers).
// And one server's round (BM_*ServerRound): add 4 workers' pushes of one key range (half of the
// 5.8M) and apply them, top-k against the count sketch's recovery (median estimates of every key,
// top k per fusion group) at the sketch's table sizes.
#include <benchmark/benchmark.h>

#include <cmath>
#include <random>
#include <vector>

#include "daemon/daemon.h"
#include "encodings/dense.h"
#include "encodings/registry.h"
#include "encodings/sbc.h"
#include "encodings/sketch.h"
#include "encodings/topk.h"
#include "server/shard_server.h"

namespace {

// As the daemons run (daemon/daemon.h): freed message buffers stay with the process instead of
// being page-faulted in again at every push.
const bool kAllocatorTuned = [] {
  sparseps::KeepFreedMessageBuffers();
  return true;
}();

std::vector<float> Gradient(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> x(n);
  for (auto& v : x) v = 1e-3f * normal(rng) * std::exp(normal(rng));
  return x;
}

std::vector<sparseps::KeyRange> TwoRanges(size_t n) { return {{0, n / 2}, {n / 2, n}}; }

// ps_dense_4h's 16 servers' key ranges.
std::vector<sparseps::KeyRange> SixteenRanges(size_t n) {
  std::vector<sparseps::KeyRange> ranges;
  for (size_t s = 0; s < 16; ++s) ranges.push_back({n * s / 16, n * (s + 1) / 16});
  return ranges;
}

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

// DenseCompressor::Compress (momentum 0.9) over 16 key ranges (ps_dense_4h's 16 servers): the
// finiteness check, then one pass per range updating the velocity and writing the push's frame.
void BM_DenseCompress(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  const auto grad = Gradient(n, 1);
  sparseps::DenseCompressor c(n, 0.9f);
  const auto ranges = SixteenRanges(n);
  for (auto _ : state) {
    std::vector<sparseps::Message> out;
    auto s = c.Compress(grad.data(), ranges, &out);
    if (!s.ok()) state.SkipWithError(s.ToString().c_str());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * sizeof(float)));
}
BENCHMARK(BM_DenseCompress)->Arg(5'800'000)->Unit(benchmark::kMillisecond);

// The baseline for BM_DenseCompress, in the same run: the dense compressor as it was before
// (commit 80ef040): the check, a pass over the velocity, then a zeroed std::vector per range that
// the velocity is copied into.
void BM_DenseCompressThreePasses(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  const auto grad = Gradient(n, 1);
  std::vector<float> velocity(n, 0.0f);
  const auto ranges = SixteenRanges(n);
  for (auto _ : state) {
    std::vector<sparseps::Message> out;
    auto s = sparseps::CheckFinite(grad.data(), n, "the gradient");
    if (!s.ok()) state.SkipWithError(s.ToString().c_str());
    for (size_t i = 0; i < n; ++i) velocity[i] = 0.9f * velocity[i] + grad[i];
    for (const auto& r : ranges) {
      sparseps::Message m;
      sparseps::EncodeDense(
          std::vector<float>(velocity.begin() + static_cast<std::ptrdiff_t>(r.begin),
                             velocity.begin() + static_cast<std::ptrdiff_t>(r.end)),
          &m);
      out.push_back(std::move(m));
    }
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * sizeof(float)));
}
BENCHMARK(BM_DenseCompressThreePasses)->Arg(5'800'000)->Unit(benchmark::kMillisecond);

// The comparison's 5 x 2k sketch truncated to k/2, the tables as F32 or IEEE halves.
sparseps::proto::CompressionConfig SketchConfig(bool fp16) {
  auto cfg = Config(sparseps::proto::SKETCH);
  cfg.mutable_sketch()->set_columns_per_k(2);
  cfg.mutable_sketch()->set_truncate_factor(0.5);
  cfg.set_fp16_values(fp16);
  return cfg;
}

// SketchCompressor::Compress with the comparison's 5 x 2k tables and truncation to k/2 (momentum
// correction and top-k in one pass, the sketch of each range, the push), the tables as F32
// (arg 1: 0) or IEEE halves (1: compression.fp16_values).
void BM_SketchCompress(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  const auto grads = std::vector<std::vector<float>>{Gradient(n, 1), Gradient(n, 2)};
  sparseps::SketchCompressor c(n, SketchConfig(state.range(1) != 0), 0.9f, 0.1f);
  const auto ranges = TwoRanges(n);
  size_t step = 0;
  for (auto _ : state) {
    std::vector<sparseps::Message> out;
    auto s = c.Compress(grads[step++ % 2].data(), ranges, &out);
    if (!s.ok()) state.SkipWithError(s.ToString().c_str());
    benchmark::DoNotOptimize(out.data());
  }
}
BENCHMARK(BM_SketchCompress)
    ->Args({5'800'000, 0})
    ->Args({5'800'000, 1})
    ->Unit(benchmark::kMillisecond);

// SketchCodec::Decode of one such push (a server's check of every push before adding it): a view
// and a finiteness check of F32 tables (arg 1: 0), or the halves expanded (1).
void BM_SketchDecode(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  sparseps::SketchCompressor c(n, SketchConfig(state.range(1) != 0), 0.9f, 0.1f);
  const auto ranges = TwoRanges(n);
  std::vector<sparseps::Message> out;
  auto s = c.Compress(Gradient(n, 1).data(), ranges, &out);
  if (!s.ok()) return state.SkipWithError(s.ToString().c_str());
  const sparseps::Codec* codec = sparseps::FindCodec(sparseps::proto::SKETCH);
  sparseps::DecodedPayload p;
  for (auto _ : state) {
    s = codec->Decode(out[0], ranges[0].size(), &p);
    if (!s.ok()) return state.SkipWithError(s.ToString().c_str());
    benchmark::DoNotOptimize(p.sketch.data());
  }
  state.counters["push_bytes"] = static_cast<double>(out[0].WireBytes());
}
BENCHMARK(BM_SketchDecode)
    ->Args({5'800'000, 0})
    ->Args({5'800'000, 1})
    ->Unit(benchmark::kMillisecond);

// SbcCompressor: one LocalStep (momentum 0.9, lr 0.05) and Compress (A = a + R, top-k of each sign,
// mean, residual update, Golomb code), local_iterations 1 as in the comparison; the push step
// leaves the parameters to the pull, as in the PS worker (set_pull_replaces_params).
void BM_SbcCompress(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  const auto grads = std::vector<std::vector<float>>{Gradient(n, 1), Gradient(n, 2)};
  sparseps::SbcCompressor c(n, Config(sparseps::proto::SBC), 0.9f, 0.05f);
  c.set_pull_replaces_params(true);
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

// One server's round on range 0 of TwoRanges(n): Add the 4 workers' decoded pushes (made by the
// encoding's compressor from 4 gradients, momentum 0.9), EndPhase, Apply. Args: n, and for the
// sketch its rows, columns_per_k (the comparison's default: 5 rows x 10 k), server_threads and
// server_hash_cache_mb (0: the keys are hashed again every round).
void ServerRound(benchmark::State& state, sparseps::proto::Encoding e) {
  const size_t n = static_cast<size_t>(state.range(0));
  sparseps::proto::JobConfig job;
  *job.mutable_compression() = Config(e);
  job.mutable_train()->set_momentum(0.9);
  if (e == sparseps::proto::SKETCH) {
    job.mutable_compression()->mutable_sketch()->set_rows(static_cast<uint32_t>(state.range(1)));
    job.mutable_compression()->mutable_sketch()->set_columns_per_k(
        static_cast<double>(state.range(2)));
    job.mutable_compression()->mutable_sketch()->set_server_threads(
        static_cast<uint32_t>(state.range(3)));
    job.mutable_compression()->mutable_sketch()->set_server_hash_cache_mb(
        static_cast<uint32_t>(state.range(4)));
  }
  const auto ranges = TwoRanges(n);
  const sparseps::Codec* codec = sparseps::FindCodec(e);
  std::vector<sparseps::Message> pushes;
  std::vector<sparseps::DecodedPayload> payloads(4);
  for (uint32_t w = 0; w < 4; ++w) {
    auto c = sparseps::MakeCompressor(job, n);
    std::vector<sparseps::Message> out;
    auto s = c->Compress(Gradient(n, 10 + w).data(), ranges, &out);
    if (!s.ok()) return state.SkipWithError(s.ToString().c_str());
    pushes.push_back(std::move(out[0]));
  }
  for (uint32_t w = 0; w < 4; ++w) {
    auto s = codec->Decode(pushes[w], ranges[0].size(), &payloads[w]);
    if (!s.ok()) return state.SkipWithError(s.ToString().c_str());
  }
  sparseps::AggregationOptions options;
  options.range = ranges[0];
  options.compression = job.compression();
  options.momentum = 0.9;
  auto aggregation = sparseps::MakeShardAggregation(options);
  std::vector<float> params(ranges[0].size(), 0.0f);
  std::vector<uint32_t> changed;
  bool all = false;
  for (auto _ : state) {
    for (const auto& p : payloads) aggregation->Add(p);
    aggregation->EndPhase();
    aggregation->Apply(-0.0125f, &params, &changed, &all);
    benchmark::DoNotOptimize(changed.data());
  }
  state.counters["applied"] = static_cast<double>(changed.size());
  state.counters["estimated"] = static_cast<double>(aggregation->last_estimated());
  state.counters["push_bytes"] = static_cast<double>(pushes[0].WireBytes());
}
void BM_TopKServerRound(benchmark::State& state) { ServerRound(state, sparseps::proto::TOPK); }
BENCHMARK(BM_TopKServerRound)->Arg(5'800'000)->Unit(benchmark::kMillisecond);
void BM_SketchServerRound(benchmark::State& state) { ServerRound(state, sparseps::proto::SKETCH); }
BENCHMARK(BM_SketchServerRound)
    ->Args({5'800'000, 5, 10, 1, 256})
    ->Args({5'800'000, 5, 10, 1, 0})
    ->Args({5'800'000, 5, 10, 2, 256})
    ->Args({5'800'000, 5, 2, 1, 256})
    ->Args({5'800'000, 5, 2, 1, 0})
    ->Args({5'800'000, 5, 2, 2, 256})
    ->Args({5'800'000, 3, 2, 1, 256})
    ->Args({5'800'000, 3, 2, 1, 0})
    ->Args({5'800'000, 3, 1, 1, 256})
    ->Unit(benchmark::kMillisecond);

// One ShardServer's whole iteration on range 0 of TwoRanges(n), as the server daemon runs it:
// Handle the 4 workers' top-k pushes (decode, add, apply), then their 4 pulls, each answered with
// the iteration's changes (PULL_REPLY). Args: n, compression.server_topk, compression
// .varint_indices (the compact replies), dense pushes (1: PS dense, the whole shard in every
// reply). The pushes are made outside the timing.
void BM_ShardServerIteration(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  auto config = Config(state.range(3) != 0 ? sparseps::proto::DENSE : sparseps::proto::TOPK);
  config.set_server_topk(state.range(1) != 0);
  config.set_varint_indices(state.range(2) != 0);
  constexpr int kWorkers = 4;
  const auto ranges = TwoRanges(n);
  const sparseps::KeyRange r = ranges[0];
  // Two iterations' pushes of every worker (two gradients each, through its own compressor),
  // copied into each timed iteration (zmq::message_t::copy shares the payload).
  std::vector<std::vector<sparseps::Message>> made(2 * kWorkers);
  for (int w = 0; w < kWorkers; ++w) {
    sparseps::proto::JobConfig job;
    *job.mutable_compression() = config;
    job.mutable_train()->set_momentum(0.9);
    auto c = sparseps::MakeCompressor(job, n);
    for (int i = 0; i < 2; ++i) {
      auto s = c->Compress(Gradient(n, static_cast<uint32_t>(10 * w + i)).data(), ranges,
                           &made[static_cast<size_t>(2 * w + i)]);
      if (!s.ok()) return state.SkipWithError(s.ToString().c_str());
    }
  }
  sparseps::ShardServer shard({r, 0, kWorkers, 0.05, config, 0.9});
  auto header = [&](sparseps::proto::Command c, int64_t iteration, int rank) {
    sparseps::proto::Header h;
    h.set_command(c);
    h.set_sender_role(sparseps::proto::WORKER);
    h.set_sender_rank(rank);
    h.set_iteration(iteration);
    h.set_key_begin(r.begin);
    h.set_key_end(r.end);
    return h;
  };
  std::vector<sparseps::Outgoing> out;
  {
    sparseps::Message init;
    init.header = header(sparseps::proto::INIT, -1, 0);
    sparseps::EncodeDense(std::vector<float>(r.size(), 0.0f), &init);
    shard.Handle("w0", sparseps::Result<sparseps::Message>(std::move(init)), &out);
  }
  int64_t t = 0;
  size_t reply_bytes = 0;
  for (auto _ : state) {
    state.PauseTiming();
    std::vector<sparseps::Message> pushes(kWorkers);
    for (int w = 0; w < kWorkers; ++w) {
      sparseps::Message& m = made[static_cast<size_t>(2 * w + t % 2)][0];
      auto& push = pushes[static_cast<size_t>(w)];
      push.header = m.header;
      push.header.MergeFrom(header(sparseps::proto::PUSH, t, w));
      for (auto& f : m.frames) push.frames.emplace_back().copy(f);
    }
    out.clear();
    state.ResumeTiming();
    for (int w = 0; w < kWorkers; ++w) {
      const std::string peer = "w" + std::to_string(w);
      shard.Handle(peer,
                   sparseps::Result<sparseps::Message>(std::move(pushes[static_cast<size_t>(w)])),
                   &out);
      sparseps::Message pull;
      pull.header = header(sparseps::proto::PULL, t, w);
      pull.header.set_have_version(t);
      pull.header.set_request_id(static_cast<uint64_t>(w + 1));
      shard.Handle(peer, sparseps::Result<sparseps::Message>(std::move(pull)), &out);
    }
    ++t;
    benchmark::DoNotOptimize(out.data());
    reply_bytes = out.back().msg.WireBytes();
  }
  if (shard.counters().rejected != 0) state.SkipWithError("the shard rejected a message");
  state.counters["reply_bytes"] = static_cast<double>(reply_bytes);
  state.counters["sparse_replies"] = static_cast<double>(shard.counters().sparse_pull_replies);
}
BENCHMARK(BM_ShardServerIteration)
    ->Args({5'800'000, 0, 0, 0})
    ->Args({5'800'000, 1, 0, 0})
    ->Args({5'800'000, 1, 1, 0})
    ->Args({5'800'000, 0, 0, 1})
    ->Unit(benchmark::kMillisecond);

}  // namespace
