#include "encodings/sketch.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <system_error>
#include <thread>

#include "encodings/topk.h"
#include "kernels/count_sketch.h"
#include "kernels/error_feedback.h"
#include "kernels/pack.h"
#include "kernels/topk.h"

namespace sparseps {

void EncodeSketch(std::vector<float>&& tables, uint32_t rows, uint64_t columns, Message* msg,
                  bool fp16) {
  msg->header.set_encoding(proto::SKETCH);
  msg->header.set_sketch_rows(rows);
  msg->header.set_sketch_columns(columns);
  // A table with NaN or Inf (which no half scale holds) goes as F32, for the receiver to refuse.
  const float largest = fp16 && kernels::AllFinite(tables.data(), tables.size())
                            ? kernels::MaxAbs(tables.data(), tables.size())
                            : -1.0f;
  if (largest < 0.0f) {
    AddFrame(msg, proto::F32, std::move(tables));
    return;
  }
  // largest = m * 2^b with m in [1, 2): times 2^-(b - 14) it is m * 2^14.
  const int e = largest > 0.0f ? std::ilogb(largest) - 14 : 0;
  std::vector<uint16_t> half(tables.size());
  kernels::ScaledFloatsToHalves(tables.data(), tables.size(), -e, half.data());
  msg->header.set_sketch_exponent(e);
  AddFrame(msg, proto::F16, std::move(half));
}

std::vector<KeyRange> FusionGroups(uint64_t range_len, uint64_t fusion_group_size) {
  std::vector<KeyRange> groups;
  const uint64_t g = fusion_group_size == 0 ? range_len : fusion_group_size;
  for (uint64_t b = 0; b < range_len; b += g) groups.push_back({b, std::min(range_len, b + g)});
  return groups;
}

uint32_t SketchColumns(const proto::CompressionConfig& c, uint64_t group_len) {
  const double cols =
      std::ceil(c.sketch().columns_per_k() * c.density() * static_cast<double>(group_len));
  return static_cast<uint32_t>(std::clamp(cols, 16.0, 4e9));
}

uint64_t SketchMaxPayloadBytes(const proto::JobConfig& job, uint64_t num_params) {
  const auto& c = job.compression();
  const auto& sk = c.sketch();
  const double n = static_cast<double>(num_params);
  const double groups = sk.fusion_group_size() == 0
                            ? 1.0
                            : std::ceil(n / static_cast<double>(sk.fusion_group_size()));
  // Summed over the groups, SketchColumns is at most columns_per_k * density * n plus, per group,
  // 1 for its ceiling and 16 for its floor.
  const double cols = sk.columns_per_k() * c.density() * n + 17.0 * groups;
  const double bytes = 4.0 * sk.rows() * cols;
  constexpr uint64_t kCap = uint64_t{1} << 62;
  return bytes >= static_cast<double>(kCap) ? kCap : static_cast<uint64_t>(bytes);
}

size_t SketchK(const proto::CompressionConfig& c, uint64_t group_len) {
  const size_t k = static_cast<size_t>(std::llround(c.density() * static_cast<double>(group_len)));
  return std::min<size_t>(group_len, std::max<size_t>(1, k));
}

Status SketchCodec::Decode(const Message& msg, uint64_t range_len, DecodedPayload* out) const {
  if (msg.frames.size() != 1) {
    return Status::ProtocolError("sketch payload needs 1 frame (the tables), got " +
                                 std::to_string(msg.frames.size()));
  }
  const uint32_t rows = msg.header.sketch_rows();
  const uint64_t columns = msg.header.sketch_columns();
  if (rows < 1 || rows > 32 || columns < 1) {
    return Status::ProtocolError("sketch layout " + std::to_string(rows) + " x " +
                                 std::to_string(columns) + " is invalid");
  }
  // The frame's count is checked before an F16 frame is expanded.
  auto check_count = [&](size_t count) {
    if (columns > count || count != uint64_t{rows} * columns) {
      return Status::ProtocolError("sketch frame has " + std::to_string(count) + " values, not " +
                                   std::to_string(rows) + " x " + std::to_string(columns));
    }
    return Status::OK();
  };
  std::span<const float> tables;
  if (msg.header.frames_size() == 1 && msg.header.frames(0).type() == proto::F16) {
    auto half = msg.FrameAs<uint16_t>(0, proto::F16);
    if (!half.ok()) return half.status();
    SPARSEPS_RETURN_IF_ERROR(check_count(half->size()));
    const int e = msg.header.sketch_exponent();
    if (e < -200 || e > 200) {
      return Status::ProtocolError("sketch_exponent " + std::to_string(e) +
                                   " is outside [-200, 200]");
    }
    out->owned_values.resize(half->size());
    if (!kernels::ScaledHalvesToFloats(half->data(), half->size(), e, out->owned_values.data())) {
      return Status::ProtocolError("sketch payload contains NaN or Inf");
    }
    tables = out->owned_values;
  } else {
    auto f32 = msg.FrameAs<float>(0, proto::F32);
    if (!f32.ok()) return f32.status();
    SPARSEPS_RETURN_IF_ERROR(check_count(f32->size()));
    tables = *f32;
  }
  if (!kernels::AllFinite(tables.data(), tables.size())) {
    return Status::ProtocolError("sketch payload contains NaN or Inf");
  }
  out->encoding = proto::SKETCH;
  out->dense = {};
  out->indices = {};
  out->values = {};
  out->sketch = tables;
  out->sketch_rows = rows;
  out->sketch_columns = columns;
  return Status::OK();
}

size_t SketchTruncateK(const proto::CompressionConfig& c, size_t n) {
  const double p1 = c.sketch().truncate_factor();
  if (p1 <= 0 || c.sketch().server_momentum()) return 0;
  return std::min(
      n, static_cast<size_t>(std::ceil(p1 * static_cast<double>(WarmupK(c.density(), 0, 0, n)))));
}

SketchCompressor::SketchCompressor(size_t num_params, const proto::CompressionConfig& c,
                                   float momentum, float lr)
    : config_(c),
      momentum_(momentum),
      lr_(lr),
      velocity_(num_params, 0.0f),
      residual_(num_params, 0.0f) {}

Status SketchCompressor::Compress(const float* grad, const std::vector<KeyRange>& ranges,
                                  std::vector<Message>* out) {
  const size_t n = residual_.size();
  SPARSEPS_RETURN_IF_ERROR(CheckFinite(grad, n, "the gradient"));
  // FetchSGD: the raw gradient is sketched whole; momentum and error live on the servers.
  const bool fetch = config_.sketch().server_momentum();
  const uint32_t rows = config_.sketch().rows();
  const size_t truncate_k = SketchTruncateK(config_, n);
  const bool truncate = truncate_k > 0;
  if (fetch) {
    std::copy(grad, grad + n, residual_.begin());
  } else if (!truncate) {
    kernels::MomentumCorrection(velocity_.data(), residual_.data(), grad, momentum_, n);
  }
  if (truncate) {
    truncated_.resize(truncate_k);
    // Without FetchSGD's server momentum the correction and the top-k share one pass.
    truncated_.resize(fetch ? kernels::TopKAbs(residual_.data(), n, truncate_k, truncated_.data())
                            : kernels::MomentumCorrectionTopK(velocity_.data(), residual_.data(),
                                                              grad, momentum_, n, truncate_k,
                                                              truncated_.data()));
    truncated_values_.resize(truncated_.size());
    for (size_t j = 0; j < truncated_.size(); ++j) truncated_values_[j] = residual_[truncated_[j]];
  }
  size_t cells = 0;
  for (const auto& r : ranges) {
    const auto groups = FusionGroups(r.size(), config_.sketch().fusion_group_size());
    uint64_t columns = 0;
    for (const auto& g : groups) columns += SketchColumns(config_, g.size());
    std::vector<float> tables(size_t{rows} * columns, 0.0f);
    float* table = tables.data();
    for (const auto& g : groups) {
      const kernels::CountSketchHash hash(rows, SketchColumns(config_, g.size()),
                                          config_.sketch().seed());
      const uint64_t begin = r.begin + g.begin, end = r.begin + g.end;
      if (truncate) {
        // The truncated entries inside this group (truncated_ is sorted).
        const auto lo = std::lower_bound(truncated_.begin(), truncated_.end(), begin);
        const auto hi = std::lower_bound(lo, truncated_.end(), end);
        const size_t first = static_cast<size_t>(lo - truncated_.begin());
        std::vector<uint32_t> idx(lo, hi);
        for (auto& i : idx) i -= static_cast<uint32_t>(begin);
        hash.InsertSparse(idx.data(), truncated_values_.data() + first, idx.size(),
                          key_base_ + begin, table);
      } else {
        hash.InsertDense(residual_.data() + begin, g.size(), key_base_ + begin, table);
      }
      table += hash.table_size();
    }
    cells += tables.size();
    Message m = NewPush(r);
    EncodeSketch(std::move(tables), rows, columns, &m, config_.fp16_values());
    out->push_back(std::move(m));
  }
  last_selected_ = cells;
  return Status::OK();
}

Status CheckSketchConfig(const proto::JobConfig& job, const ConfigSources& sources) {
  const auto& sk = job.compression().sketch();
  if (sk.partial_reset() && (sk.second_round() || sk.server_momentum())) {
    return Status::InvalidArgument(
        SourceOf(sources, "compression.sketch.partial_reset") +
        ": key 'compression.sketch.partial_reset' is on but " +
        (sk.second_round()
             ? "'compression.sketch.second_round' applies exact values (nothing to keep)"
             : "'compression.sketch.server_momentum' keeps the error on the servers (FetchSGD)"));
  }
  if (job.train().consistency() != proto::BSP) {
    const std::string why = SourceOf(sources, "train.consistency") +
                            ": key 'train.consistency' is " +
                            (job.train().consistency() == proto::SSP ? "ssp" : "async");
    if (sk.second_round()) {
      return Status::InvalidArgument(
          why +
          " but 'compression.sketch.second_round' is on: its candidates are chosen from "
          "every worker's sketch of one iteration (bsp only)");
    }
    if (job.compression().encoding() == proto::SKETCH && sk.server_momentum()) {
      return Status::InvalidArgument(
          why +
          " but 'compression.sketch.server_momentum' is on: FetchSGD's server momentum decays "
          "once per iteration of every worker's sketch (bsp only)");
    }
  }
  if (job.train().overlap() == proto::BACKWARD && sk.second_round()) {
    return Status::InvalidArgument(
        SourceOf(sources, "train.overlap") +
        ": key 'train.overlap' is backward but 'compression.sketch.second_round' is on: its "
        "candidate round follows every range's sketch (use one or the other)");
  }
  return Status::OK();
}

bool SketchSecondRound(const proto::CompressionConfig& c) {
  return c.sketch().second_round() && !c.sketch().server_momentum();
}

Status SketchCompressor::ExactValues(const KeyRange& r, std::span<const uint32_t> candidates,
                                     Message* push) {
  std::vector<float> vals(candidates.size());
  for (size_t j = 0; j < candidates.size(); ++j) {
    if (candidates[j] >= r.size()) return Status::ProtocolError("candidate outside the key range");
    vals[j] = residual_[r.begin + candidates[j]];
  }
  push->header.set_key_begin(r.begin);
  push->header.set_key_end(r.end);
  EncodeTopK(std::vector<uint32_t>(candidates.begin(), candidates.end()), std::move(vals), push);
  return Status::OK();
}

void SketchCompressor::OnChanged(uint64_t key_begin, std::span<const uint32_t> keys,
                                 std::span<const float> delta) {
  if (config_.sketch().server_momentum()) return;  // FetchSGD: no worker state
  // The servers applied params += -lr / W * (estimate of the summed residuals), so this worker's
  // share of what was applied is -delta / lr; a dense reply (no delta) resets as Sketched SGD.
  const bool partial =
      config_.sketch().partial_reset() && !second_round() && delta.size() == keys.size() && lr_ > 0;
  float* v = residual_.data() + key_begin;
  float* u = velocity_.data() + key_begin;
  if (partial) {
    const float inv_lr = 1.0f / lr_;
    for (size_t j = 0; j < keys.size(); ++j) {
      v[keys[j]] = kernels::PartialReset(v[keys[j]], -delta[j] * inv_lr);
      u[keys[j]] = 0.0f;
    }
  } else {
    for (uint32_t i : keys) {
      v[i] = 0.0f;
      u[i] = 0.0f;
    }
  }
}

std::unique_ptr<Compressor> MakeSketchCompressor(const proto::JobConfig& job, size_t num_params) {
  return std::make_unique<SketchCompressor>(num_params, job.compression(),
                                            static_cast<float>(job.train().momentum()),
                                            static_cast<float>(job.train().lr()));
}

namespace {

class SketchAggregation final : public ShardAggregation {
 public:
  explicit SketchAggregation(const AggregationOptions& o)
      : options_(o),
        rows_(o.compression.sketch().rows()),
        fetch_(o.compression.sketch().server_momentum()),
        second_round_(SketchSecondRound(o.compression)),
        threads_(o.compression.sketch().server_threads() > 0
                     ? o.compression.sketch().server_threads()
                     : std::max(1u, std::thread::hardware_concurrency())),
        exact_(o.range.size()) {
    groups_ = FusionGroups(o.range.size(), o.compression.sketch().fusion_group_size());
    for (const auto& g : groups_) {
      group_columns_.push_back(SketchColumns(o.compression, g.size()));
      columns_ += group_columns_.back();
    }
    sum_.assign(size_t{rows_} * columns_, 0.0f);
    // The keys' hashes are kept when they fit server_hash_cache_mb (4 bytes per key and row).
    bool fits = true;
    for (uint32_t c : group_columns_) fits = fits && c < (uint32_t{1} << 31);
    cache_cells_ = fits && static_cast<double>(rows_) * 4.0 * static_cast<double>(o.range.size()) <=
                               o.compression.sketch().server_hash_cache_mb() * 1048576.0;
    if (cache_cells_) cells_.resize(groups_.size());
    if (fetch_) {
      momentum_.assign(sum_.size(), 0.0f);
      error_.assign(sum_.size(), 0.0f);
    }
  }

  // FetchSGD's S_u and S_e live across iterations; the per-iteration sums are empty between them.
  void State(StateArchive& archive) override {
    if (!fetch_) return;
    archive.Array("sketch_momentum", &momentum_);
    archive.Array("sketch_error", &error_);
  }

  std::string Refuse(const DecodedPayload& p, uint32_t phase) const override {
    if (phase == 1) {
      if (p.encoding != proto::TOPK ||
          !std::equal(p.indices.begin(), p.indices.end(), candidates_.begin(), candidates_.end())) {
        return "phase 1 must carry exact values at exactly the candidate keys";
      }
      return "";
    }
    if (!p.is_sketch()) {
      return second_round_ ? "phase 0 of the sketch second round must be a sketch"
                           : "a sketch server takes sketches only (compression.encoding must be "
                             "the same everywhere)";
    }
    if (p.sketch_rows != rows_ || p.sketch_columns != columns_) {
      return "sketch layout " + std::to_string(p.sketch_rows) + " x " +
             std::to_string(p.sketch_columns) + " does not match this server's " +
             std::to_string(rows_) + " x " + std::to_string(columns_) +
             " (compression.sketch must be the same everywhere)";
    }
    return "";
  }

  void Add(const DecodedPayload& p) override {
    if (phase_ == 1) {
      exact_.Add(p);
    } else {
      kernels::Axpy(1.0f, p.sketch.data(), sum_.data(), sum_.size());
    }
  }

  bool EndPhase() override {
    if (!second_round_ || phase_ == 1) return true;
    PickCandidates();
    phase_ = 1;
    return false;
  }

  uint32_t phase() const override { return phase_; }
  uint64_t last_estimated() const override { return last_estimated_; }
  bool second_round() const override { return second_round_; }

  void Candidates(std::vector<uint32_t>* keys, std::vector<float>* estimates) const override {
    *keys = candidates_;
    *estimates = candidate_estimates_;
  }

  void Apply(float scale, std::vector<float>* params, std::vector<uint32_t>* changed,
             bool* all) override {
    *all = false;
    if (second_round_) {
      ApplyExactCandidates(scale, params, changed);
    } else {
      ApplyHeavyHitters(scale, params, changed);
    }
  }

 private:
  // The `want` largest estimates of group g from its table (which starts at `table`): their keys
  // (relative to the group, increasing) into selected_ and their estimates into selected_est_;
  // returns the group's hash. The result is that of the top `want` of every key's estimate
  // (kernels::TopKAbs, ties towards lower keys); how it is found:
  // - a sample (every 64th block of 1024 keys, at least 16 blocks; groups of 256K keys or more)
  //   gives a magnitude T that about 1.5 want estimates reach;
  // - when few of the table's cells reach T, only the keys that have ceil(rows / 2) such cells
  //   are estimated (CountSketchHash::EstimateCandidates): every estimate >= T is among them;
  // - if fewer than `want` of those reach T (the sample misled), or the table is too full for
  //   the cells to tell keys apart, every key is estimated.
  kernels::CountSketchHash TopEstimates(size_t g, const float* table, size_t want) {
    const KeyRange& grp = groups_[g];
    const size_t n = grp.size();
    const kernels::CountSketchHash hash(rows_, group_columns_[g],
                                        options_.compression.sketch().seed());
    const uint64_t key_begin = options_.range.begin + grp.begin;
    const uint32_t* cells = nullptr;
    if (cache_cells_) {
      // The first round hashes the group's keys once (server_hash_cache_mb); later ones read.
      if (cells_[g].empty()) {
        cells_[g].resize(size_t{rows_} * n);
        hash.Cells(key_begin, n, n, cells_[g].data());
      }
      cells = cells_[g].data();
    }
    want = std::min(want, n);
    const float threshold =
        hash.fits_cells() ? SampledThreshold(hash, table, key_begin, cells, n, want) : 0.0f;
    if (threshold > 0.0f && FewHeavyCells(table, hash.table_size(), threshold)) {
      const size_t found = CandidatesInParallel(hash, table, key_begin, cells, n, threshold);
      size_t reach = 0;
      for (size_t q = 0; q < found; ++q) reach += std::fabs(candidate_est_[q]) >= threshold;
      if (reach >= want) {
        last_estimated_ += found;
        std::vector<uint32_t> top(want);
        top.resize(kernels::TopKAbs(candidate_est_.data(), found, want, top.data()));
        selected_.resize(top.size());
        selected_est_.resize(top.size());
        for (size_t q = 0; q < top.size(); ++q) {
          selected_[q] = candidate_keys_[top[q]];
          selected_est_[q] = candidate_est_[top[q]];
        }
        return hash;
      }
    }
    last_estimated_ += n;
    estimates_.resize(n);
    EstimateInParallel(hash, table, key_begin, cells, n, estimates_.data());
    selected_.resize(want);
    selected_.resize(kernels::TopKAbs(estimates_.data(), n, want, selected_.data()));
    selected_est_.resize(selected_.size());
    for (size_t q = 0; q < selected_.size(); ++q) selected_est_[q] = estimates_[selected_[q]];
    return hash;
  }

  // A magnitude that about 1.5 `want` of the n estimates reach, from the estimates of a sample of
  // blocks of 1024 keys; 0 when the group is under 256K keys or `want` over n / 16.
  float SampledThreshold(const kernels::CountSketchHash& hash, const float* table,
                         uint64_t key_begin, const uint32_t* cells, size_t n, size_t want) {
    constexpr size_t kBlock = 1024;
    if (n < 256 * kBlock || want > n / 16) return 0.0f;
    // Every 64th block, or every 16th of smaller groups (at least 16 blocks).
    const size_t every = std::min<size_t>(64, n / kBlock / 16);
    sample_.clear();
    for (size_t start = 0; start + kBlock <= n; start += every * kBlock) {
      const size_t at = sample_.size();
      sample_.resize(at + kBlock);
      if (cells != nullptr) {
        hash.EstimateFromCells(table, cells + start, n, kBlock, sample_.data() + at);
      } else {
        hash.Estimate(table, key_begin + start, kBlock, sample_.data() + at);
      }
    }
    // The rank that 1.5 want of n keys would hold in the sample; too few for a quantile: no
    // filter.
    const double rank = 1.5 * static_cast<double>(want) * static_cast<double>(sample_.size()) /
                        static_cast<double>(n);
    if (rank < 16.0 || rank >= static_cast<double>(sample_.size())) return 0.0f;
    for (float& x : sample_) x = std::fabs(x);
    const auto nth = sample_.begin() + static_cast<std::ptrdiff_t>(rank);
    std::nth_element(sample_.begin(), nth, sample_.end(), std::greater<float>());
    return *nth;
  }

  // True when at most 2/5 of the table's cells reach `threshold`: then a key without a true
  // heavy hitter has ceil(rows / 2) such cells rarely enough for the filter to pay.
  static bool FewHeavyCells(const float* table, size_t cells, float threshold) {
    size_t heavy = 0;
    for (size_t x = 0; x < cells; ++x) heavy += std::fabs(table[x]) >= threshold;
    return heavy * 5 <= cells * 2;
  }

  // fn(part, from, len) on threads_ threads (this one and threads_ - 1 more), each an equal slice
  // of whole 1024-key blocks of n keys; returns the number of parts. Slices under 64K keys are
  // not split.
  template <typename Fn>
  size_t InParallel(size_t n, Fn&& fn) const {
    constexpr size_t kMinSlice = 64 * 1024, kBlock = 1024;
    const size_t parts = std::max<size_t>(1, std::min<size_t>(threads_, n / kMinSlice));
    if (parts == 1) {
      fn(size_t{0}, size_t{0}, n);
      return 1;
    }
    const size_t slice = (n / parts + kBlock - 1) / kBlock * kBlock;
    std::vector<std::thread> helpers;
    size_t begin = 0, part = 0;
    for (size_t p = 1; p < parts && begin + slice < n; ++p, begin += slice, ++part) {
      const size_t from = begin, index = part;
      try {
        helpers.emplace_back([&fn, index, from, slice] { fn(index, from, slice); });
      } catch (const std::system_error&) {
        fn(index, from, slice);  // no thread to be had
      }
    }
    fn(part, begin, n - begin);
    for (auto& t : helpers) t.join();
    return part + 1;
  }

  // hash.Estimate of n keys from key_begin into out (from `cells`, the keys' hashes for rows of
  // stride n, when not null), on threads_ threads; each key's estimate is its own, so the result
  // is the same for every thread count.
  void EstimateInParallel(const kernels::CountSketchHash& hash, const float* table,
                          uint64_t key_begin, const uint32_t* cells, size_t n, float* out) const {
    InParallel(n, [&hash, table, key_begin, cells, n, out](size_t, size_t from, size_t len) {
      if (cells != nullptr) {
        hash.EstimateFromCells(table, cells + from, n, len, out + from);
      } else {
        hash.Estimate(table, key_begin + from, len, out + from);
      }
    });
  }

  // hash.EstimateCandidates of n keys on threads_ threads, into candidate_keys_ and
  // candidate_est_ (keys increasing, as one thread gives them); returns how many.
  size_t CandidatesInParallel(const kernels::CountSketchHash& hash, const float* table,
                              uint64_t key_begin, const uint32_t* cells, size_t n,
                              float threshold) {
    candidate_keys_.resize(n);
    candidate_est_.resize(n);
    std::vector<size_t> from_of(threads_ + 1), found_of(threads_ + 1);
    const size_t parts = InParallel(n, [&](size_t part, size_t from, size_t len) {
      from_of[part] = from;
      found_of[part] = hash.EstimateCandidates(
          table, key_begin + from, cells == nullptr ? nullptr : cells + from, n, len, threshold,
          candidate_keys_.data() + from, candidate_est_.data() + from);
    });
    // Each part wrote its keys (relative to its slice) at its slice's start: close the gaps.
    size_t found = 0;
    for (size_t p = 0; p < parts; ++p) {
      const size_t from = from_of[p];
      for (size_t q = 0; q < found_of[p]; ++q) {
        candidate_keys_[found + q] = static_cast<uint32_t>(from + candidate_keys_[from + q]);
        candidate_est_[found + q] = candidate_est_[from + q];
      }
      found += found_of[p];
    }
    return found;
  }

  // The top candidates_factor * k estimates of each group become the candidates.
  void PickCandidates() {
    const float* table = sum_.data();
    last_estimated_ = 0;
    candidates_.clear();
    candidate_estimates_.clear();
    for (size_t g = 0; g < groups_.size(); ++g) {
      const KeyRange& grp = groups_[g];
      const size_t want = static_cast<size_t>(
          std::ceil(options_.compression.sketch().candidates_factor() *
                    static_cast<double>(SketchK(options_.compression, grp.size()))));
      table += TopEstimates(g, table, want).table_size();
      for (size_t q = 0; q < selected_.size(); ++q) {
        candidates_.push_back(static_cast<uint32_t>(grp.begin + selected_[q]));
        candidate_estimates_.push_back(selected_est_[q]);
      }
    }
    std::fill(sum_.begin(), sum_.end(), 0.0f);
  }

  // The k largest exact sums per group among the candidates are applied; the rest of the sums
  // is dropped here because every worker still holds its share in its residual.
  void ApplyExactCandidates(float scale, std::vector<float>* params,
                            std::vector<uint32_t>* changed) {
    changed->clear();
    auto it = candidates_.begin();
    std::vector<float> sums;
    for (const KeyRange& grp : groups_) {
      auto end = std::lower_bound(it, candidates_.end(), static_cast<uint32_t>(grp.end));
      sums.clear();
      for (auto x = it; x != end; ++x) sums.push_back(exact_.at(*x));
      selected_.resize(std::min(sums.size(), SketchK(options_.compression, grp.size())));
      selected_.resize(
          kernels::TopKAbs(sums.data(), sums.size(), selected_.size(), selected_.data()));
      for (uint32_t j : selected_) {
        const uint32_t i = *(it + j);
        if (exact_.at(i) == 0.0f) continue;
        (*params)[i] += scale * exact_.at(i);
        changed->push_back(i);
      }
      it = end;
    }
    exact_.Clear();
    phase_ = 0;
  }

  // Heavy hitters per fusion group: the top k of the median estimates of the summed tables; with
  // FetchSGD of the error sketch S_e, whose cells (and S_u's) under the applied keys are zeroed.
  void ApplyHeavyHitters(float scale, std::vector<float>* params, std::vector<uint32_t>* changed) {
    if (fetch_) {
      const float m = static_cast<float>(options_.momentum);
      for (size_t x = 0; x < sum_.size(); ++x) {
        momentum_[x] = m * momentum_[x] + sum_[x];
        error_[x] += momentum_[x];
      }
    }
    float* table = fetch_ ? error_.data() : sum_.data();
    changed->clear();
    last_estimated_ = 0;
    for (size_t g = 0; g < groups_.size(); ++g) {
      const KeyRange& grp = groups_[g];
      const kernels::CountSketchHash hash =
          TopEstimates(g, table, SketchK(options_.compression, grp.size()));
      for (size_t q = 0; q < selected_.size(); ++q) {
        if (selected_est_[q] == 0.0f) continue;
        const size_t i = grp.begin + selected_[q];
        (*params)[i] += scale * selected_est_[q];
        changed->push_back(static_cast<uint32_t>(i));
      }
      if (fetch_) {
        const size_t offset = static_cast<size_t>(table - error_.data());
        for (uint32_t j : selected_) {
          const uint64_t key = options_.range.begin + grp.begin + j;
          for (uint32_t r = 0; r < rows_; ++r) {
            const size_t cell = offset + size_t{r} * hash.columns() + hash.Bucket(r, key);
            error_[cell] = 0.0f;
            momentum_[cell] = 0.0f;
          }
        }
      }
      table += hash.table_size();
    }
    std::sort(changed->begin(), changed->end());
    std::fill(sum_.begin(), sum_.end(), 0.0f);
  }

  const AggregationOptions options_;
  const uint32_t rows_;
  const bool fetch_, second_round_;
  const uint32_t threads_;  // compression.sketch.server_threads, resolved
  std::vector<KeyRange> groups_;
  std::vector<uint32_t> group_columns_;
  uint64_t columns_ = 0;
  std::vector<float> sum_;                // this iteration's summed tables, rows x columns_
  std::vector<float> momentum_, error_;   // FetchSGD's S_u and S_e
  std::vector<float> estimates_;          // every key's estimate (when the filter is not used)
  std::vector<float> sample_;             // SampledThreshold's estimates
  std::vector<uint32_t> candidate_keys_;  // EstimateCandidates' keys and estimates
  std::vector<float> candidate_est_;
  std::vector<float> selected_est_;  // the estimates at selected_
  uint64_t last_estimated_ = 0;      // keys estimated in the last recovery
  bool cache_cells_ = false;         // server_hash_cache_mb holds the keys' hashes
  // The keys' hashes per group, rows x group size (CountSketchHash::Cells); filled in the first
  // round when cache_cells_.
  std::vector<std::vector<uint32_t>> cells_;
  std::vector<uint32_t> selected_;
  uint32_t phase_ = 0;                      // second round: 1 while exact values come in
  std::vector<uint32_t> candidates_;        // increasing, relative to the range
  std::vector<float> candidate_estimates_;  // same order
  PairAccumulator exact_;                   // the second round's exact sums
};

}  // namespace

std::unique_ptr<ShardAggregation> MakeSketchAggregation(const AggregationOptions& options) {
  return std::make_unique<SketchAggregation>(options);
}

}  // namespace sparseps
