// The servers' side of an encoding (docs/algorithms.md §3-4): what a shard does with the
// validated pushes of one iteration and how it applies their sum. server/shard_server.h drives it
// (BSP, versions, pulls); each encoding makes its own through the table of encodings/registry.h:
// dense, topk and sbc add (index, value) pairs or dense ranges (PairAggregation, below), the
// sketch adds count-sketch tables (encodings/sketch.h).
//
// Thread-safety: one thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/key_range.h"
#include "encodings/codec.h"
#include "proto/config.pb.h"
#include "storage/checkpoint.h"

namespace sparseps {

// What a shard's aggregation needs to know.
struct AggregationOptions {
  KeyRange range;                        // the keys the shard owns
  proto::CompressionConfig compression;  // density, server_topk, the sketch's layout, ...
  double momentum = 0.0;                 // FetchSGD's server momentum (train.momentum)
};

class ShardAggregation {
 public:
  virtual ~ShardAggregation() = default;

  // Why a decoded push (indices relative to the range) does not fit this shard in phase `phase`
  // (another sketch layout, not a sketch where one is due, exact values at other keys than the
  // candidates), or "" when it fits. Nothing changes either way.
  virtual std::string Refuse(const DecodedPayload& p, uint32_t phase) const = 0;

  // Adds a push that Refuse accepted.
  virtual void Add(const DecodedPayload& p) = 0;

  // Every worker's push of the current phase is in. True when the iteration is complete (Apply
  // next); false when another phase follows (the sketch's second round: the candidates are
  // picked and the workers' exact values are due).
  virtual bool EndPhase() { return true; }

  // The phase pushes are due for: 0, or 1 between the sketch's two rounds.
  virtual uint32_t phase() const { return 0; }

  // True when iterations have a second round (PULL_CANDIDATES is answered).
  virtual bool second_round() const { return false; }

  // In phase 1: the candidates (keys relative to the range, increasing) and their estimates.
  virtual void Candidates(std::vector<uint32_t>* keys, std::vector<float>* estimates) const {}

  // Applies the iteration's sum: params[i] += scale * (what is applied at i), on the keys it
  // applies, and clears for the next iteration. *changed gets those keys (increasing) unless
  // every key may have changed, which sets *all.
  virtual void Apply(float scale, std::vector<float>* params, std::vector<uint32_t>* changed,
                     bool* all) = 0;

  // Saves or restores what the aggregation keeps across iterations (between iterations only; the
  // per-iteration sums are empty then). Default: nothing.
  virtual void State(StateArchive& archive) {}

  // The sketch's recovery: how many keys the last Apply (or the second round's pick of the
  // candidates) estimated in full; 0 for the other encodings. For tests and benchmarks.
  virtual uint64_t last_estimated() const { return 0; }

  // What the shard holds back across iterations (compression.server_topk's residual), empty
  // when nothing; for tests.
  virtual const std::vector<float>& residual() const { return empty_; }

 private:
  std::vector<float> empty_;
};

// The sum of one iteration's (index, value) and dense pushes, kept sparse: values in a
// dense-addressed buffer and the list of keys touched, never a densified message.
class PairAccumulator {
 public:
  explicit PairAccumulator(size_t n) : sum_(n, 0.0f), mask_(n, 0) {}

  // Adds a dense payload or (index, value) pairs.
  void Add(const DecodedPayload& p);
  // The sum at key i (relative to the range).
  float at(uint32_t i) const { return sum_[i]; }
  // params[i] += scale * sum[i] on the touched keys (every key after a dense push); *changed gets
  // the touched keys sorted (or *all); then clears.
  void ApplyAndClear(float scale, float* params, std::vector<uint32_t>* changed, bool* all);
  // r[i] += sum[i] on the touched keys (every key after a dense push); then clears.
  void MoveInto(float* r);
  // Forgets the sum.
  void Clear();

 private:
  std::vector<float> sum_;
  std::vector<uint8_t> mask_;
  std::vector<uint32_t> touched_;
  bool dense_ = false;
};

// dense, topk and sbc: pushes are dense ranges or (index, value) pairs, added up; the sum is
// applied on the touched keys, or with compression.server_topk through a server residual r
// (r += sum; the top density * (range size) entries of r are applied and zeroed in r), so that
// pulls carry at most that many entries.
std::unique_ptr<ShardAggregation> MakePairAggregation(const AggregationOptions& options);

}  // namespace sparseps
