// The device twin of SketchCompressor (encodings/sketch.h): `sketch` compressed on a GPU.
#include "encodings/sketch.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "encodings/cuda/gpu_compressor_base.h"
#include "encodings/cuda/gpu_compressors.h"
#include "encodings/topk.h"
#include "kernels/count_sketch.h"
#include "kernels/cuda/counted_memcpy.h"
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/gpu_kernels.h"

namespace sparseps {
namespace {

namespace gpu = kernels::gpu;

// ---- sketch ----

// SketchCompressor's steps on the device: u = m u + g; v += u (FetchSGD: v = g); the truncation
// to the top truncate_factor * k of |v| (GpuTopK); each key range's fusion groups sketched into
// one device table (GpuCountSketch, the CPU's hashes), which comes down whole. The second round
// gathers v at the candidates on the device; the keys a pull changed get u = 0 and v = 0 there
// (or, with partial_reset, v -= its share of the applied value, clipped to v).
class GpuSketchCompressor final : public GpuCompressorBase {
 public:
  GpuSketchCompressor(size_t n, const proto::CompressionConfig& c, float momentum, float lr)
      : GpuCompressorBase(n), config_(c), momentum_(momentum), lr_(lr) {}

  Status Compress(const float* grad, const std::vector<KeyRange>& ranges,
                  std::vector<Message>* out) override {
    SPARSEPS_RETURN_IF_ERROR(status_);
    SPARSEPS_RETURN_IF_ERROR(CheckFinite(grad, "the gradient"));
    if (config_.sketch().server_momentum()) {
      // FetchSGD: the raw gradient is sketched whole; momentum and error live on the servers.
      SPARSEPS_RETURN_IF_ERROR(CudaStatus(
          CountedMemcpyAsync(v_.p, grad, n_ * sizeof(float), cudaMemcpyDeviceToDevice, stream_),
          "copying the gradient"));
    } else {
      SPARSEPS_RETURN_IF_ERROR(
          CudaStatus(gpu::MomentumCorrection(u_.p, v_.p, grad, momentum_, n_, stream_),
                     "momentum correction"));
    }
    const size_t truncate_k = SketchTruncateK(config_, n_);
    size_t kept = 0;
    if (truncate_k > 0) {
      SPARSEPS_RETURN_IF_ERROR(trunc_idx_.Reserve(truncate_k));
      SPARSEPS_RETURN_IF_ERROR(trunc_vals_.Reserve(truncate_k));
      SPARSEPS_RETURN_IF_ERROR(host_idx_.Reserve(truncate_k));
      SPARSEPS_RETURN_IF_ERROR(CudaStatus(
          topk_.Select(v_.p, n_, truncate_k, trunc_idx_.p, &kept, stream_), "the truncation"));
      SPARSEPS_RETURN_IF_ERROR(CudaStatus(
          gpu::Gather(v_.p, trunc_idx_.p, kept, trunc_vals_.p, stream_), "the truncation"));
      SPARSEPS_RETURN_IF_ERROR(
          CudaStatus(CountedMemcpyAsync(host_idx_.p, trunc_idx_.p, kept * sizeof(uint32_t),
                                        cudaMemcpyDeviceToHost, stream_),
                     "the truncation"));
      SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "the truncation"));
    }
    SPARSEPS_RETURN_IF_ERROR(Layout(ranges));
    const uint32_t rows = config_.sketch().rows();
    size_t cells = 0;
    for (size_t ri = 0; ri < ranges.size(); ++ri) {
      const KeyRange& r = ranges[ri];
      const RangeSketch& rs = layout_[ri];
      const size_t range_cells = size_t{rows} * rs.columns;
      SPARSEPS_RETURN_IF_ERROR(table_.Reserve(range_cells));
      SPARSEPS_RETURN_IF_ERROR(host_table_.Reserve(range_cells));
      SPARSEPS_RETURN_IF_ERROR(CudaStatus(
          cudaMemsetAsync(table_.p, 0, range_cells * sizeof(float), stream_), "cudaMemset"));
      float* table = table_.p;
      for (const auto& g : rs.groups) {
        const uint64_t begin = r.begin + g.range.begin, end = r.begin + g.range.end;
        if (truncate_k > 0) {
          // The truncated entries inside this group (sorted), with their global keys.
          const uint32_t* sorted = host_idx_.p;
          const uint32_t* lo = std::lower_bound(sorted, sorted + kept, begin);
          const uint32_t* hi = std::lower_bound(lo, sorted + kept, end);
          const size_t first = static_cast<size_t>(lo - host_idx_.p);
          SPARSEPS_RETURN_IF_ERROR(
              CudaStatus(g.sketch->InsertSparse(trunc_idx_.p + first, trunc_vals_.p + first,
                                                static_cast<size_t>(hi - lo), 0, table, stream_),
                         "the sketch"));
        } else {
          SPARSEPS_RETURN_IF_ERROR(
              CudaStatus(g.sketch->InsertDense(v_.p + begin, g.range.size(), begin, table, stream_),
                         "the sketch"));
        }
        table += g.table_size;
      }
      SPARSEPS_RETURN_IF_ERROR(
          CudaStatus(CountedMemcpyAsync(host_table_.p, table_.p, range_cells * sizeof(float),
                                        cudaMemcpyDeviceToHost, stream_),
                     "copying the sketch"));
      SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "copying the sketch"));
      Message m = NewPush(r);
      EncodeSketch(std::vector<float>(host_table_.p, host_table_.p + range_cells), rows, rs.columns,
                   &m, config_.fp16_values());
      out->push_back(std::move(m));
      cells += range_cells;
    }
    last_selected_ = cells;
    return Status::OK();
  }

  // As SketchCompressor's: without it the worker would push one round to servers that wait for
  // a second.
  bool second_round() const override { return SketchSecondRound(config_); }

  Status ExactValues(const KeyRange& r, std::span<const uint32_t> candidates,
                     Message* push) override {
    for (uint32_t c : candidates) {
      if (c >= r.size()) return Status::ProtocolError("candidate outside the key range");
    }
    const size_t m = candidates.size();
    SPARSEPS_RETURN_IF_ERROR(keys_.Reserve(m));
    SPARSEPS_RETURN_IF_ERROR(vals_.Reserve(m));
    SPARSEPS_RETURN_IF_ERROR(host_vals_.Reserve(m));
    SPARSEPS_RETURN_IF_ERROR(
        CudaStatus(CountedMemcpyAsync(keys_.p, candidates.data(), m * sizeof(uint32_t),
                                      cudaMemcpyHostToDevice, stream_),
                   "copying the candidates"));
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(gpu::Gather(v_.p + r.begin, keys_.p, m, vals_.p, stream_),
                                        "gathering the candidates' values"));
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(CountedMemcpyAsync(host_vals_.p, vals_.p, m * sizeof(float),
                                                           cudaMemcpyDeviceToHost, stream_),
                                        "copying the candidates' values"));
    SPARSEPS_RETURN_IF_ERROR(
        CudaStatus(cudaStreamSynchronize(stream_), "copying the candidates' values"));
    push->header.set_key_begin(r.begin);
    push->header.set_key_end(r.end);
    EncodeTopK(std::vector<uint32_t>(candidates.begin(), candidates.end()),
               std::vector<float>(host_vals_.p, host_vals_.p + m), push);
    return Status::OK();
  }

  // A CUDA error here is kept and reported by the next Compress.
  void OnChanged(uint64_t key_begin, std::span<const uint32_t> keys,
                 std::span<const float> delta) override {
    if (config_.sketch().server_momentum() || keys.empty() || !status_.ok()) return;
    status_ = keys_.Reserve(keys.size());
    if (status_.ok()) {
      status_ = CudaStatus(CountedMemcpyAsync(keys_.p, keys.data(), keys.size() * sizeof(uint32_t),
                                              cudaMemcpyHostToDevice, stream_),
                           "copying the changed keys");
    }
    // partial_reset: v -= this worker's share of what the servers applied, -delta / lr, clipped
    // to v (SketchCompressor::OnChanged); otherwise, and for a dense reply, the error reset.
    const bool partial = config_.sketch().partial_reset() && !second_round() &&
                         delta.size() == keys.size() && lr_ > 0;
    if (status_.ok() && partial) {
      status_ = delta_.Reserve(delta.size());
      if (status_.ok()) {
        status_ =
            CudaStatus(CountedMemcpyAsync(delta_.p, delta.data(), delta.size() * sizeof(float),
                                          cudaMemcpyHostToDevice, stream_),
                       "copying the pulled changes");
      }
      if (status_.ok()) {
        status_ = CudaStatus(gpu::PartialResetAt(v_.p + key_begin, u_.p + key_begin, keys_.p,
                                                 delta_.p, 1.0f / lr_, keys.size(), stream_),
                             "the partial reset");
      }
    } else if (status_.ok()) {
      status_ =
          CudaStatus(gpu::ZeroAt(v_.p + key_begin, u_.p + key_begin, keys_.p, keys.size(), stream_),
                     "the error reset");
    }
    if (status_.ok()) status_ = CudaStatus(cudaStreamSynchronize(stream_), "the error reset");
  }

  // SketchCompressor's state under its names: a checkpoint resumes on either device.
  void State(StateArchive& archive) override {
    DeviceArrayState(archive, "velocity", u_.p);
    DeviceArrayState(archive, "residual", v_.p);
  }

 private:
  struct Group {
    KeyRange range;  // relative to the key range
    size_t table_size = 0;
    std::unique_ptr<gpu::GpuCountSketch> sketch;
  };
  struct RangeSketch {
    KeyRange range;
    uint64_t columns = 0;  // over all its groups
    std::vector<Group> groups;
  };

  // The fusion groups and their sketches for `ranges` (built at the first call, the same after).
  Status Layout(const std::vector<KeyRange>& ranges) {
    bool same = layout_.size() == ranges.size();
    for (size_t i = 0; same && i < ranges.size(); ++i) {
      same = layout_[i].range.begin == ranges[i].begin && layout_[i].range.end == ranges[i].end;
    }
    if (same) return Status::OK();
    layout_.clear();
    for (const auto& r : ranges) {
      RangeSketch rs;
      rs.range = r;
      for (const auto& g : FusionGroups(r.size(), config_.sketch().fusion_group_size())) {
        const kernels::CountSketchHash hash(
            config_.sketch().rows(), SketchColumns(config_, g.size()), config_.sketch().seed());
        Group group;
        group.range = g;
        group.table_size = hash.table_size();
        group.sketch = std::make_unique<gpu::GpuCountSketch>(hash);
        rs.columns += hash.columns();
        rs.groups.push_back(std::move(group));
      }
      layout_.push_back(std::move(rs));
    }
    return Status::OK();
  }

  proto::CompressionConfig config_;
  float momentum_;
  float lr_;  // train.lr (partial_reset)
  Status status_;
  gpu::GpuTopK topk_;
  DeviceArray<uint32_t> trunc_idx_, keys_;
  DeviceArray<float> trunc_vals_, table_, vals_, delta_;
  PinnedArray<uint32_t> host_idx_;
  PinnedArray<float> host_table_, host_vals_;
  std::vector<RangeSketch> layout_;
};

}  // namespace

Result<std::unique_ptr<Compressor>> MakeGpuSketchCompressor(const proto::JobConfig& job,
                                                            size_t num_params) {
  auto c = std::make_unique<GpuSketchCompressor>(num_params, job.compression(),
                                                 static_cast<float>(job.train().momentum()),
                                                 static_cast<float>(job.train().lr()));
  SPARSEPS_RETURN_IF_ERROR(c->Start());
  return std::unique_ptr<Compressor>(std::move(c));
}

}  // namespace sparseps
