#include "encodings/compressor.h"

#include <algorithm>
#include <cmath>

#include "kernels/error_feedback.h"
#include "kernels/topk.h"

namespace sparseps {

Status CheckFinite(const float* x, size_t n, const char* what) {
  if (!kernels::AllFinite(x, n)) {
    return Status::InvalidArgument(std::string(what) + " contains NaN or Inf; nothing was pushed");
  }
  return Status::OK();
}

std::vector<uint32_t> RangeSlice(const std::vector<uint32_t>& sorted, const KeyRange& r,
                                 size_t* first) {
  auto lo = std::lower_bound(sorted.begin(), sorted.end(), r.begin);
  auto hi = std::lower_bound(lo, sorted.end(), r.end);
  *first = static_cast<size_t>(lo - sorted.begin());
  std::vector<uint32_t> idx(lo, hi);
  for (auto& i : idx) i -= static_cast<uint32_t>(r.begin);
  return idx;
}

Message NewPush(const KeyRange& r) {
  Message m;
  m.header.set_command(proto::PUSH);
  m.header.set_key_begin(r.begin);
  m.header.set_key_end(r.end);
  return m;
}

size_t WarmupK(double density, uint32_t warmup_epochs, uint32_t epoch, size_t n,
               double warmup_density) {
  double d = density;
  if (epoch < warmup_epochs && warmup_density > 0) {
    d = warmup_density * std::pow(density / warmup_density,
                                  static_cast<double>(epoch) / static_cast<double>(warmup_epochs));
  } else if (epoch < warmup_epochs) {
    d = std::pow(density, static_cast<double>(epoch + 1) / static_cast<double>(warmup_epochs + 1));
  }
  const size_t k = static_cast<size_t>(std::llround(d * static_cast<double>(n)));
  return std::min(n, std::max<size_t>(1, k));
}

size_t ScaledK(size_t k, double scale) {
  if (scale == 1.0) return k;
  return std::max<size_t>(1, static_cast<size_t>(std::llround(scale * static_cast<double>(k))));
}

Selector::Selector(proto::Selection mode, double sample_ratio, size_t k)
    : mode_(mode), sample_ratio_(sample_ratio), scaled_(k) {}

void Selector::State(StateArchive& archive) {
  float threshold = scaled_.threshold();
  archive.Value("scaled_threshold", &threshold);
  scaled_.set_threshold(threshold);
}

void Selector::Select(const float* x, size_t n, size_t k, std::vector<uint32_t>* out) {
  switch (mode_) {
    case proto::SAMPLED_THRESHOLD:
      kernels::SampledThresholdSelect(x, n, k, sample_ratio_, out);
      return;
    case proto::SCALED_THRESHOLD:
      scaled_.set_k(k);
      scaled_.Select(x, n, out);
      return;
    default:
      out->resize(std::min(k, n));
      out->resize(kernels::TopKAbs(x, n, k, out->data()));
  }
}

}  // namespace sparseps
