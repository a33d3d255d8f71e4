#include "worker/collectives/powersgd.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kernels/dense.h"
#include "kernels/error_feedback.h"
#include "kernels/random.h"
#include "worker/collectives/ring.h"

namespace sparseps {
namespace {

// A layer of `size` elements viewed as rows x cols, compressed at rank min(rank, rows, cols)
// where that sends fewer floats than the layer has.
PowerSgdLayer MakeLayer(uint64_t first, uint64_t rows, uint64_t cols, uint32_t rank) {
  PowerSgdLayer l{first, rows, cols, 0};
  const uint64_t r = std::min<uint64_t>({rank, rows, cols});
  if (rows >= 2 && cols >= 2 && r * (rows + cols) < rows * cols) l.rank = static_cast<uint32_t>(r);
  return l;
}

// The largest divisor of n not above sqrt(n) (1 for a prime).
uint64_t SquareishRows(uint64_t n) {
  uint64_t best = 1;
  for (uint64_t d = 1; d * d <= n; ++d) {
    if (n % d == 0) best = d;
  }
  return best;
}

}  // namespace

std::vector<PowerSgdLayer> PowerSgdLayers(const CollectiveOptions& options) {
  const uint64_t n = options.num_params;
  std::vector<PowerSgdLayer> out;
  // No layout, or one tensor of everything (a loop that gave its parameters flat): the vector is
  // one near-square matrix.
  if (options.layers.empty() ||
      (options.layers.size() == 1 && options.layers[0].offset == 0 &&
       std::accumulate(options.layers[0].shape.begin(), options.layers[0].shape.end(), uint64_t{1},
                       std::multiplies<>()) == n)) {
    const uint64_t rows = SquareishRows(n);
    out.push_back(MakeLayer(0, rows, rows > 0 ? n / rows : 0, options.powersgd_rank));
    return out;
  }
  std::vector<TensorLayout> layers = options.layers;
  std::sort(layers.begin(), layers.end(),
            [](const TensorLayout& a, const TensorLayout& b) { return a.offset < b.offset; });
  uint64_t next = 0;  // the first element no layer covered yet
  for (const auto& t : layers) {
    const uint64_t size =
        std::accumulate(t.shape.begin(), t.shape.end(), uint64_t{1}, std::multiplies<>());
    if (t.offset < next || t.offset + size > n) continue;  // overlapping or outside: left dense
    if (t.offset > next) out.push_back({next, 1, t.offset - next, 0});  // a gap: dense
    const uint64_t rows = t.shape.size() >= 2 ? t.shape[0] : 1;
    out.push_back(t.shape.size() >= 2
                      ? MakeLayer(t.offset, rows, size / rows, options.powersgd_rank)
                      : PowerSgdLayer{t.offset, 1, size, 0});
    next = t.offset + size;
  }
  if (next < n) out.push_back({next, 1, n - next, 0});
  return out;
}

std::vector<float> PowerSgdInitialQ(uint64_t seed, size_t index, uint64_t cols, uint32_t rank) {
  uint64_t state = seed * 0x2545f4914f6cdd1dULL + index;
  std::vector<float> q(cols * rank);
  for (size_t i = 0; i < q.size(); i += 2) {
    // Box-Muller: two standard normal values from two uniform ones in (0, 1].
    const double u1 = (static_cast<double>(kernels::SplitMix64(&state) >> 11) + 1.0) * 0x1.0p-53;
    const double u2 = static_cast<double>(kernels::SplitMix64(&state) >> 11) * 0x1.0p-53;
    const double radius = std::sqrt(-2.0 * std::log(u1));
    q[i] = static_cast<float>(radius * std::cos(2.0 * M_PI * u2));
    if (i + 1 < q.size()) q[i + 1] = static_cast<float>(radius * std::sin(2.0 * M_PI * u2));
  }
  return q;
}

void Orthonormalize(float* p, uint64_t rows, uint32_t rank) {
  // The columns, each contiguous (rank x rows): every pass below streams one or two of them.
  std::vector<float> cols(rows * rank);
  for (uint64_t i = 0; i < rows; ++i) {
    for (uint32_t k = 0; k < rank; ++k) cols[k * rows + i] = p[i * rank + k];
  }
  for (uint32_t k = 0; k < rank; ++k) {
    float* c = cols.data() + k * rows;
    const double before = kernels::Dot(c, c, rows);
    for (uint32_t j = 0; j < k; ++j) {
      const float* earlier = cols.data() + j * rows;
      kernels::Axpy(-static_cast<float>(kernels::Dot(c, earlier, rows)), earlier, c, rows);
    }
    double norm = kernels::Dot(c, c, rows);
    // What is left of a column (nearly) in the span of the earlier ones is rounding noise:
    // normalised it would be a direction of no meaning, so it becomes 0.
    const bool spanned = norm <= 1e-10 * before;
    norm = std::sqrt(norm);
    const float scale = norm > 0.0 && !spanned ? static_cast<float>(1.0 / norm) : 0.0f;
    kernels::Scale(scale, c, rows);
  }
  for (uint64_t i = 0; i < rows; ++i) {
    for (uint32_t k = 0; k < rank; ++k) p[i * rank + k] = cols[k * rows + i];
  }
}

PowerSgd::PowerSgd(PeerGroup* group, const CollectiveOptions& options)
    : Collective(group, options.num_params, options.num_params),
      layers_(PowerSgdLayers(options)),
      segment_elems_(std::max<uint64_t>(1, options.segment_bytes / sizeof(float))) {
  size_t first = 0, second = 0;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const PowerSgdLayer& layer = layers_[l];
    if (layer.rank == 0) {
      first += layer.rows * layer.cols;
      q_.emplace_back();
      continue;
    }
    first += layer.rows * layer.rank;
    second += layer.cols * layer.rank;
    q_.push_back(PowerSgdInitialQ(options.seed, l, layer.cols, layer.rank));
  }
  first_.resize(first);
  second_.resize(second);
}

Status PowerSgd::Allreduce(Contribution* x, CollectiveUpdate* update) {
  m_.resize(n_);
  SPARSEPS_RETURN_IF_ERROR(x->Read(m_.data(), /*zero=*/false));  // Write replaces it
  // P = M Q for every compressed layer, then the dense layers' elements: one ring.
  size_t at = 0;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const PowerSgdLayer& y = layers_[l];
    const float* m = m_.data() + y.first;
    if (y.rank == 0) {
      std::copy(m, m + y.rows * y.cols, first_.begin() + static_cast<std::ptrdiff_t>(at));
      at += y.rows * y.cols;
      continue;
    }
    // This worker's own product (OpenBLAS): only the ring's sums must be bitwise the same.
    kernels::Gemm(false, false, y.rows, y.rank, y.cols, 1.0f, m, y.cols, q_[l].data(), y.rank, 0.0f,
                  first_.data() + at, y.rank);
    at += y.rows * y.rank;
  }
  const uint64_t call = NextCall();
  SPARSEPS_RETURN_IF_ERROR(
      RingAllreduce(group_, call, first_.data(), first_.size(), segment_elems_));
  // P^ (orthonormal, the same on every worker), then Q_w = M^T P^: the second ring.
  at = 0;
  size_t at_q = 0;
  for (const PowerSgdLayer& y : layers_) {
    if (y.rank == 0) {
      at += y.rows * y.cols;
      continue;
    }
    float* p = first_.data() + at;
    Orthonormalize(p, y.rows, y.rank);
    kernels::Gemm(true, false, y.cols, y.rank, y.rows, 1.0f, m_.data() + y.first, y.cols, p, y.rank,
                  0.0f, second_.data() + at_q, y.rank);
    at += y.rows * y.rank;
    at_q += y.cols * y.rank;
  }
  mine_ = second_;  // this worker's Q_w, for its residual (the buffer is reused)
  if (!second_.empty()) {
    SPARSEPS_RETURN_IF_ERROR(RingAllreduce(group_, call + (uint64_t{1} << 31), second_.data(),
                                           second_.size(), segment_elems_));
  }
  // The update P^ Q^^T (dense layers: their sum), the residual M - P^ Q_w^T, and the warm start.
  update->dense = true;
  update->sum.resize(n_);
  at = 0;
  at_q = 0;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const PowerSgdLayer& y = layers_[l];
    float* sum = update->sum.data() + y.first;
    float* m = m_.data() + y.first;
    if (y.rank == 0) {
      std::copy_n(first_.data() + at, y.rows * y.cols, sum);
      std::fill_n(m, y.rows * y.cols, 0.0f);  // summed exactly: nothing left behind
      at += y.rows * y.cols;
      continue;
    }
    const float* p = first_.data() + at;
    const float* q = second_.data() + at_q;
    // The update from the ring's sums in a fixed order (not BLAS): bitwise the same everywhere.
    // Q^ transposed (rank x cols), so that each row of the update is rank passes over contiguous
    // floats, each entry summed over k in order from 0 as a dot product would be.
    qt_.resize(y.cols * y.rank);
    for (uint64_t j = 0; j < y.cols; ++j) {
      for (uint32_t k = 0; k < y.rank; ++k) qt_[k * y.cols + j] = q[j * y.rank + k];
    }
    kernels::LowRankProduct(p, qt_.data(), y.rows, y.cols, y.rank, sum);
    // This worker's residual M - P^ Q_w^T, in place of M.
    kernels::Gemm(false, true, y.rows, y.cols, y.rank, -1.0f, p, y.rank, mine_.data() + at_q,
                  y.rank, 1.0f, m, y.cols);
    std::copy_n(q, y.cols * y.rank, q_[l].begin());
    at += y.rows * y.rank;
    at_q += y.cols * y.rank;
  }
  // The residual replaces the contribution read above, whole (a failed ring left it as it was).
  return x->Write(m_.data());
}

void PowerSgd::State(StateArchive& archive) {
  Collective::State(archive);
  std::vector<float> all;
  for (const auto& q : q_) all.insert(all.end(), q.begin(), q.end());
  archive.Array("powersgd_q", &all);
  if (!archive.saving() && archive.status().ok()) {
    if (all.size() != second_.size()) {
      archive.Fail("powersgd_q has " + std::to_string(all.size()) + " floats, not " +
                   std::to_string(second_.size()));
      return;
    }
    size_t at = 0;
    for (auto& q : q_) {
      std::copy_n(all.begin() + static_cast<std::ptrdiff_t>(at), q.size(), q.begin());
      at += q.size();
    }
  }
}

Status CheckPowerSgdConfig(const proto::JobConfig& job, const ConfigSources& sources) {
  if (job.aggregation() == proto::ALLREDUCE && job.collective().algorithm() == proto::POWERSGD &&
      job.collective().momentum() == proto::CORRECTION && job.train().momentum() > 0) {
    return Status::InvalidArgument(
        SourceOf(sources, "collective.momentum") +
        ": key 'collective.momentum' is correction but 'collective.algorithm' is powersgd: set "
        "collective.momentum: aggregated (PowerSGD takes the momentum on the summed update, as "
        "Vogels et al. 2019 do; a correction before its lossy update is counted twice, and rank 1 "
        "diverged so) or train.momentum: 0");
  }
  return Status::OK();
}

Result<std::unique_ptr<Collective>> MakePowerSgd(PeerGroup* group,
                                                 const CollectiveOptions& options) {
  return std::unique_ptr<Collective>(new PowerSgd(group, options));
}

}  // namespace sparseps
