// The device twins of TopKCompressor, SbcCompressor and SketchCompressor (see gpu_compressor.h).
// Host C++ (C++20, like worker/compressor.h) calling the kernels of kernels/cuda.
#include "worker/cuda/gpu_compressor.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/codec/sketch.h"
#include "common/codec/topk.h"
#include "kernels/count_sketch.h"
#include "kernels/cuda/cuda_util.cuh"
#include "kernels/cuda/gpu_kernels.h"
#include "kernels/pack.h"
#include "kernels/select.h"
#include "worker/cuda/cuda_arrays.h"
#include "worker/cuda/cuda_status.h"

namespace sparseps {
namespace {

namespace gpu = kernels::gpu;

// InvalidArgument naming `what` when x[0, n) (device) holds NaN or Inf, after one read of it
// (scratch: one device counter). Synchronises the stream.
Status CheckFiniteOnDevice(const float* x, size_t n, unsigned long long* scratch,
                           cudaStream_t stream, const char* what) {
  uint64_t bad = 0;
  SPARSEPS_RETURN_IF_ERROR(
      CudaStatus(gpu::CountNonFinite(x, n, scratch, &bad, stream), "checking the input"));
  if (bad > 0) {
    return Status::InvalidArgument(std::string(what) + " contains NaN or Inf (" +
                                   std::to_string(bad) + " entries); nothing was pushed");
  }
  return Status::OK();
}

// What every device compressor holds: its stream, the velocity u and the residual v (n floats
// each, zero at the start), and the finiteness check.
class GpuCompressorBase : public Compressor {
 public:
  explicit GpuCompressorBase(size_t n) : n_(n) {}
  ~GpuCompressorBase() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  virtual Status Start() {
    SPARSEPS_RETURN_IF_ERROR(
        CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate"));
    SPARSEPS_RETURN_IF_ERROR(u_.Reserve(n_));
    SPARSEPS_RETURN_IF_ERROR(v_.Reserve(n_));
    SPARSEPS_RETURN_IF_ERROR(bad_.Reserve(1));
    SPARSEPS_RETURN_IF_ERROR(
        CudaStatus(cudaMemsetAsync(u_.p, 0, n_ * sizeof(float), stream_), "cudaMemset"));
    return CudaStatus(cudaMemsetAsync(v_.p, 0, n_ * sizeof(float), stream_), "cudaMemset");
  }

  bool on_device() const override { return true; }
  size_t last_selected() const override { return last_selected_; }
  Status ReadResidual(std::vector<float>* out) const override {
    std::vector<float> velocity;
    return Download(out, &velocity);
  }

  Status Download(std::vector<float>* residual, std::vector<float>* velocity) const {
    residual->resize(n_);
    velocity->resize(n_);
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "the stream"));
    SPARSEPS_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpy(residual->data(), v_.p, n_ * sizeof(float), cudaMemcpyDeviceToHost),
                   "copying the residual"));
    return CudaStatus(
        cudaMemcpy(velocity->data(), u_.p, n_ * sizeof(float), cudaMemcpyDeviceToHost),
        "copying the velocity");
  }

 protected:
  Status CheckFinite(const float* x, const char* what) {
    return CheckFiniteOnDevice(x, n_, bad_.p, stream_, what);
  }

  const size_t n_;
  cudaStream_t stream_ = nullptr;
  DeviceArray<float> u_, v_;
  DeviceArray<unsigned long long> bad_;
  size_t last_selected_ = 0;
};

// The device twin of Selector (worker/compressor.h): exact top-k, DGC's sampled threshold or
// ExDyna's scaled threshold over device memory, the same selected set as the CPU's.
class DeviceSelector {
 public:
  DeviceSelector(proto::Selection mode, double sample_ratio, size_t k)
      : mode_(mode), sample_ratio_(sample_ratio), scaled_(k) {}

  // Selects about k entries of x[0, n) (exactly min(k, n) for exact top-k); *count of them, at
  // indices() (increasing) until the next call. Synchronises.
  Status Select(const float* x, size_t n, size_t k, size_t* count, cudaStream_t stream) {
    *count = 0;
    switch (mode_) {
      case proto::SAMPLED_THRESHOLD:
        SPARSEPS_RETURN_IF_ERROR(CudaStatus(sampled_.Select(x, n, k, sample_ratio_, count, stream),
                                            "the sampled threshold selection"));
        result_ = sampled_.indices();
        return Status::OK();
      case proto::SCALED_THRESHOLD: {
        scaled_.set_k(k);
        SPARSEPS_RETURN_IF_ERROR(out_.Reserve(std::max(out_.cap, 2 * k)));
        size_t found = 0;
        SPARSEPS_RETURN_IF_ERROR(CudaStatus(
            threshold_.Select(x, n, scaled_.threshold(), out_.p, nullptr, out_.cap, &found, stream),
            "the scaled threshold selection"));
        if (found > out_.cap) {
          // More than the buffer holds: make room and select again.
          SPARSEPS_RETURN_IF_ERROR(out_.Reserve(found + found / 4));
          SPARSEPS_RETURN_IF_ERROR(CudaStatus(threshold_.Select(x, n, scaled_.threshold(), out_.p,
                                                                nullptr, out_.cap, &found, stream),
                                              "the scaled threshold selection"));
        }
        scaled_.Update(found);
        *count = found;
        result_ = out_.p;
        return Status::OK();
      }
      default:
        SPARSEPS_RETURN_IF_ERROR(out_.Reserve(std::min(k, n)));
        SPARSEPS_RETURN_IF_ERROR(CudaStatus(topk_.Select(x, n, k, out_.p, count, stream), "top-k"));
        result_ = out_.p;
        return Status::OK();
    }
  }
  const uint32_t* indices() const { return result_; }

 private:
  proto::Selection mode_;
  double sample_ratio_;
  kernels::ScaledThreshold scaled_;  // the threshold's state; the pass runs on the device
  gpu::GpuTopK topk_;
  gpu::GpuSampledThresholdSelect sampled_;
  gpu::GpuThresholdSelect threshold_;
  DeviceArray<uint32_t> out_;
  const uint32_t* result_ = nullptr;
};

// ---- topk ----

// TopKCompressor's steps on the device: u = m u + g; v += u; select over |v|; gather the values
// and zero v and u there; the indices and values, contiguous in one device buffer, come down in
// one copy. With fp16 values the rounding errors go back into v (k entries up).
class GpuTopKCompressor final : public GpuCompressorBase {
 public:
  GpuTopKCompressor(size_t n, const proto::CompressionConfig& c, float momentum)
      : GpuCompressorBase(n),
        config_(c),
        k_(WarmupK(c.density(), c.warmup_epochs(), 0, n)),
        momentum_(momentum),
        selector_(c.selection(), c.sample_ratio(), k_),
        format_{c.fp16_values(), c.varint_indices()} {}

  void SetEpoch(uint32_t epoch) override {
    k_ = WarmupK(config_.density(), config_.warmup_epochs(), epoch, n_);
  }

  Status Compress(const float* grad, const std::vector<KeyRange>& ranges,
                  std::vector<Message>* out) override {
    SPARSEPS_RETURN_IF_ERROR(CheckFinite(grad, "the gradient"));
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(
        gpu::MomentumCorrection(u_.p, v_.p, grad, momentum_, n_, stream_), "momentum correction"));
    size_t k = 0;
    SPARSEPS_RETURN_IF_ERROR(selector_.Select(v_.p, n_, k_, &k, stream_));
    // The payload: k indices, then k values.
    SPARSEPS_RETURN_IF_ERROR(payload_.Reserve(2 * k));
    SPARSEPS_RETURN_IF_ERROR(host_.Reserve(2 * k));
    uint32_t* idx = payload_.p;
    float* vals = reinterpret_cast<float*>(payload_.p + k);
    SPARSEPS_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(idx, selector_.indices(), k * sizeof(uint32_t),
                                   cudaMemcpyDeviceToDevice, stream_),
                   "copying the indices"));
    SPARSEPS_RETURN_IF_ERROR(
        CudaStatus(gpu::GatherAndZero(v_.p, u_.p, idx, k, vals, stream_), "gathering the values"));
    SPARSEPS_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(host_.p, payload_.p, 2 * k * sizeof(uint32_t),
                                   cudaMemcpyDeviceToHost, stream_),
                   "copying the payload"));
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "the selection"));
    selected_.assign(host_.p, host_.p + k);
    values_.resize(k);
    if (k > 0) std::memcpy(values_.data(), host_.p + k, k * sizeof(float));
    if (format_.fp16_values) {
      // Send what a half holds; the rounding error goes back into v (zero there after the
      // gather, so adding it sets it, as the CPU does).
      float* errors = reinterpret_cast<float*>(host_.p + k);
      for (size_t j = 0; j < k; ++j) {
        const float sent = kernels::RoundToHalf(values_[j]);
        errors[j] = values_[j] - sent;
        values_[j] = sent;
      }
      SPARSEPS_RETURN_IF_ERROR(CudaStatus(
          cudaMemcpyAsync(vals, errors, k * sizeof(float), cudaMemcpyHostToDevice, stream_),
          "copying the rounding errors"));
      SPARSEPS_RETURN_IF_ERROR(
          CudaStatus(gpu::ScatterAdd(v_.p, idx, vals, k, stream_), "keeping the rounding errors"));
      SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "the rounding errors"));
    }
    last_selected_ = k;
    EncodeTopKPushes(selected_, values_, ranges, format_, out);
    return Status::OK();
  }

 private:
  proto::CompressionConfig config_;
  size_t k_;
  float momentum_;
  DeviceSelector selector_;
  TopKFormat format_;
  DeviceArray<uint32_t> payload_;
  PinnedArray<uint32_t> host_;
  std::vector<uint32_t> selected_;
  std::vector<float> values_;
};

// ---- sbc ----

// SbcCompressor's steps on the device: LocalStep trains the device copy of the parameters
// (u = m u + g; a += u; params -= lr u); Compress forms A = a + R in the residual, binarises it
// (GpuSbc: the side with the larger mean magnitude, R = A - sent, u zeroed there) and brings the
// positions down (4 k bytes); the Golomb coding runs on the host, as the CPU's.
class GpuSbcCompressor final : public GpuCompressorBase {
 public:
  GpuSbcCompressor(size_t n, const proto::CompressionConfig& c, float momentum, float lr)
      : GpuCompressorBase(n),
        config_(c),
        k_(WarmupK(c.density(), c.warmup_epochs(), 0, n)),
        momentum_(momentum),
        lr_(lr),
        pos_selector_(c.selection(), c.sample_ratio(), k_),
        neg_selector_(c.selection(), c.sample_ratio(), k_) {}

  Status Start() override {
    SPARSEPS_RETURN_IF_ERROR(GpuCompressorBase::Start());
    SPARSEPS_RETURN_IF_ERROR(a_.Reserve(n_));
    return CudaStatus(cudaMemsetAsync(a_.p, 0, n_ * sizeof(float), stream_), "cudaMemset");
  }

  void SetEpoch(uint32_t epoch) override {
    k_ = WarmupK(config_.density(), config_.warmup_epochs(), epoch, n_);
  }

  // grad and params: device memory. A CUDA error ends the local steps at once (returns true) and
  // Compress reports it.
  bool LocalStep(const float* grad, float* params) override {
    if (status_.ok()) {
      status_ = CudaStatus(gpu::SbcLocalStep(u_.p, a_.p, params, grad, momentum_, lr_, n_, stream_),
                           "local step");
    }
    if (status_.ok()) status_ = CudaStatus(cudaStreamSynchronize(stream_), "local step");
    return !status_.ok() || ++local_steps_ % config_.local_iterations() == 0;
  }

  Status Compress(const float* /*grad*/, const std::vector<KeyRange>& ranges,
                  std::vector<Message>* out) override {
    SPARSEPS_RETURN_IF_ERROR(status_);
    SPARSEPS_RETURN_IF_ERROR(CheckFinite(a_.p, "the accumulated update"));
    SPARSEPS_RETURN_IF_ERROR(
        CudaStatus(gpu::Axpy(1.0f, a_.p, v_.p, n_, stream_), "adding the accumulator"));
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(a_.p, 0, n_ * sizeof(float), stream_),
                                        "clearing the accumulator"));
    size_t count = 0;
    float value = 0.0f;
    const uint32_t* chosen = nullptr;
    if (config_.selection() == proto::EXACT) {
      SPARSEPS_RETURN_IF_ERROR(idx_.Reserve(k_));
      SPARSEPS_RETURN_IF_ERROR(CudaStatus(
          sbc_.Binarize(v_.p, u_.p, n_, k_, idx_.p, &count, &value, stream_), "SBC binarisation"));
      chosen = idx_.p;
    } else {
      // The threshold selections, one selector state per side as the CPU's.
      Status selected;
      auto select = [&](int side, const float* values, size_t n, size_t k, const uint32_t** idx,
                        size_t* found) {
        DeviceSelector& selector = side == 0 ? pos_selector_ : neg_selector_;
        selected = selector.Select(values, n, k, found, stream_);
        *idx = selector.indices();
        return selected.ok() ? cudaSuccess : cudaErrorUnknown;
      };
      const cudaError_t e =
          sbc_.BinarizeSelected(select, v_.p, u_.p, n_, k_, &chosen, &count, &value, stream_);
      SPARSEPS_RETURN_IF_ERROR(selected);
      SPARSEPS_RETURN_IF_ERROR(CudaStatus(e, "SBC binarisation"));
    }
    SPARSEPS_RETURN_IF_ERROR(host_.Reserve(count));
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(host_.p, chosen, count * sizeof(uint32_t), cudaMemcpyDeviceToHost, stream_),
        "copying the positions"));
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "copying the positions"));
    chosen_.assign(host_.p, host_.p + count);
    last_selected_ = count;
    EncodeSbcPushes(chosen_, value, ranges, out);
    return Status::OK();
  }

 private:
  proto::CompressionConfig config_;
  size_t k_;
  float momentum_, lr_;
  uint32_t local_steps_ = 0;
  Status status_;
  DeviceSelector pos_selector_, neg_selector_;  // threshold selections (SbcCompressor's twins)
  DeviceArray<float> a_;                        // the accumulator a
  DeviceArray<uint32_t> idx_;
  PinnedArray<uint32_t> host_;
  gpu::GpuSbc sbc_;
  std::vector<uint32_t> chosen_;
};

// ---- sketch ----

// SketchCompressor's steps on the device: u = m u + g; v += u (FetchSGD: v = g); the truncation
// to the top truncate_factor * k of |v| (GpuTopK); each key range's fusion groups sketched into
// one device table (GpuCountSketch, the CPU's hashes), which comes down whole. The second round
// gathers v at the candidates on the device; the keys a pull changed get u = v = 0 there.
class GpuSketchCompressor final : public GpuCompressorBase {
 public:
  GpuSketchCompressor(size_t n, const proto::CompressionConfig& c, float momentum)
      : GpuCompressorBase(n), config_(c), momentum_(momentum) {}

  Status Compress(const float* grad, const std::vector<KeyRange>& ranges,
                  std::vector<Message>* out) override {
    SPARSEPS_RETURN_IF_ERROR(status_);
    SPARSEPS_RETURN_IF_ERROR(CheckFinite(grad, "the gradient"));
    if (config_.sketch().server_momentum()) {
      // FetchSGD: the raw gradient is sketched whole; momentum and error live on the servers.
      SPARSEPS_RETURN_IF_ERROR(CudaStatus(
          cudaMemcpyAsync(v_.p, grad, n_ * sizeof(float), cudaMemcpyDeviceToDevice, stream_),
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
          CudaStatus(cudaMemcpyAsync(host_idx_.p, trunc_idx_.p, kept * sizeof(uint32_t),
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
          CudaStatus(cudaMemcpyAsync(host_table_.p, table_.p, range_cells * sizeof(float),
                                     cudaMemcpyDeviceToHost, stream_),
                     "copying the sketch"));
      SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "copying the sketch"));
      Message m = NewPush(r);
      EncodeSketch(std::vector<float>(host_table_.p, host_table_.p + range_cells), rows, rs.columns,
                   &m);
      out->push_back(std::move(m));
      cells += range_cells;
    }
    last_selected_ = cells;
    return Status::OK();
  }

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
        CudaStatus(cudaMemcpyAsync(keys_.p, candidates.data(), m * sizeof(uint32_t),
                                   cudaMemcpyHostToDevice, stream_),
                   "copying the candidates"));
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(gpu::Gather(v_.p + r.begin, keys_.p, m, vals_.p, stream_),
                                        "gathering the candidates' values"));
    SPARSEPS_RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(host_vals_.p, vals_.p, m * sizeof(float), cudaMemcpyDeviceToHost, stream_),
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
  void OnChanged(uint64_t key_begin, std::span<const uint32_t> keys) override {
    if (config_.sketch().server_momentum() || keys.empty() || !status_.ok()) return;
    status_ = keys_.Reserve(keys.size());
    if (status_.ok()) {
      status_ = CudaStatus(cudaMemcpyAsync(keys_.p, keys.data(), keys.size() * sizeof(uint32_t),
                                           cudaMemcpyHostToDevice, stream_),
                           "copying the changed keys");
    }
    if (status_.ok()) {
      status_ =
          CudaStatus(gpu::ZeroAt(v_.p + key_begin, u_.p + key_begin, keys_.p, keys.size(), stream_),
                     "the error reset");
    }
    if (status_.ok()) status_ = CudaStatus(cudaStreamSynchronize(stream_), "the error reset");
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
  Status status_;
  gpu::GpuTopK topk_;
  DeviceArray<uint32_t> trunc_idx_, keys_;
  DeviceArray<float> trunc_vals_, table_, vals_;
  PinnedArray<uint32_t> host_idx_;
  PinnedArray<float> host_table_, host_vals_;
  std::vector<RangeSketch> layout_;
};

}  // namespace

Result<std::unique_ptr<Compressor>> MakeGpuCompressor(size_t num_params,
                                                      const proto::CompressionConfig& c,
                                                      float momentum, float lr) {
  std::unique_ptr<GpuCompressorBase> compressor;
  switch (c.encoding()) {
    case proto::TOPK:
      compressor = std::make_unique<GpuTopKCompressor>(num_params, c, momentum);
      break;
    case proto::SBC:
      compressor = std::make_unique<GpuSbcCompressor>(num_params, c, momentum, lr);
      break;
    case proto::SKETCH:
      compressor = std::make_unique<GpuSketchCompressor>(num_params, c, momentum);
      break;
    default:
      return std::unique_ptr<Compressor>();
  }
  SPARSEPS_RETURN_IF_ERROR(compressor->Start());
  return std::unique_ptr<Compressor>(std::move(compressor));
}

// ---- allreduce ----

struct GpuContribution::State {
  State(size_t n, proto::Selection selection, double sample_ratio, size_t k, float momentum,
        bool aggregated)
      : n(n), momentum(momentum), aggregated(aggregated), selector(selection, sample_ratio, k) {}
  ~State() {
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
  size_t n;
  float momentum;
  bool aggregated;
  cudaStream_t stream = nullptr;
  DeviceSelector selector;
  gpu::GpuThresholdSelect threshold;
  DeviceArray<float> u, x;
  DeviceArray<unsigned long long> bad;
  DeviceArray<uint32_t> entries;  // keys, then as many values (floats)
  PinnedArray<uint32_t> host;     // the same on the host
};

GpuContribution::GpuContribution(std::unique_ptr<State> state) : state_(std::move(state)) {}
GpuContribution::~GpuContribution() = default;

Result<std::unique_ptr<GpuContribution>> GpuContribution::Make(size_t n, proto::Selection selection,
                                                               double sample_ratio, size_t k,
                                                               float momentum, bool aggregated) {
  auto st = std::make_unique<State>(n, selection, sample_ratio, k, momentum, aggregated);
  SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&st->stream, cudaStreamNonBlocking),
                                      "cudaStreamCreate"));
  SPARSEPS_RETURN_IF_ERROR(st->x.Reserve(n));
  SPARSEPS_RETURN_IF_ERROR(st->bad.Reserve(1));
  SPARSEPS_RETURN_IF_ERROR(
      CudaStatus(cudaMemsetAsync(st->x.p, 0, n * sizeof(float), st->stream), "cudaMemset"));
  if (!aggregated) {
    SPARSEPS_RETURN_IF_ERROR(st->u.Reserve(n));
    SPARSEPS_RETURN_IF_ERROR(
        CudaStatus(cudaMemsetAsync(st->u.p, 0, n * sizeof(float), st->stream), "cudaMemset"));
  }
  return std::unique_ptr<GpuContribution>(new GpuContribution(std::move(st)));
}

size_t GpuContribution::size() const { return state_->n; }

Status GpuContribution::Accumulate(const float* grad) {
  State& st = *state_;
  SPARSEPS_RETURN_IF_ERROR(CheckFiniteOnDevice(grad, st.n, st.bad.p, st.stream, "the gradient"));
  if (st.aggregated) {
    return CudaStatus(gpu::Axpy(1.0f, grad, st.x.p, st.n, st.stream), "accumulating the gradient");
  }
  return CudaStatus(gpu::MomentumCorrection(st.u.p, st.x.p, grad, st.momentum, st.n, st.stream),
                    "momentum correction");
}

Status GpuContribution::Upload(std::span<const uint32_t> keys, const float* values) {
  State& st = *state_;
  const size_t m = keys.size(), words = values != nullptr ? 2 * m : m;
  SPARSEPS_RETURN_IF_ERROR(st.entries.Reserve(2 * m));
  SPARSEPS_RETURN_IF_ERROR(st.host.Reserve(2 * m));
  std::memcpy(st.host.p, keys.data(), m * sizeof(uint32_t));
  if (values != nullptr) std::memcpy(st.host.p + m, values, m * sizeof(float));
  return CudaStatus(cudaMemcpyAsync(st.entries.p, st.host.p, words * sizeof(uint32_t),
                                    cudaMemcpyHostToDevice, st.stream),
                    "copying keys to the device");
}

Status GpuContribution::Select(size_t k, std::vector<uint32_t>* keys) {
  State& st = *state_;
  size_t count = 0;
  SPARSEPS_RETURN_IF_ERROR(st.selector.Select(st.x.p, st.n, k, &count, st.stream));
  SPARSEPS_RETURN_IF_ERROR(st.host.Reserve(count));
  SPARSEPS_RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(st.host.p, st.selector.indices(), count * sizeof(uint32_t),
                                 cudaMemcpyDeviceToHost, st.stream),
                 "copying the selected keys"));
  SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(st.stream), "the selection"));
  keys->assign(st.host.p, st.host.p + count);
  return Status::OK();
}

Status GpuContribution::SelectAtLeast(size_t begin, size_t end, float threshold,
                                      std::vector<uint32_t>* keys) {
  State& st = *state_;
  size_t found = 0;
  for (size_t room = std::max<size_t>(st.entries.cap, 1024);;) {
    SPARSEPS_RETURN_IF_ERROR(st.entries.Reserve(room));
    SPARSEPS_RETURN_IF_ERROR(
        CudaStatus(st.threshold.Select(st.x.p + begin, end - begin, threshold, st.entries.p,
                                       nullptr, st.entries.cap, &found, st.stream),
                   "the threshold selection"));
    if (found <= st.entries.cap) break;
    room = found + found / 4;  // more than the buffer holds: make room and select again
  }
  SPARSEPS_RETURN_IF_ERROR(st.host.Reserve(found));
  SPARSEPS_RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(st.host.p, st.entries.p, found * sizeof(uint32_t),
                                 cudaMemcpyDeviceToHost, st.stream),
                 "copying the selected keys"));
  SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(st.stream), "the selection"));
  keys->resize(found);
  for (size_t j = 0; j < found; ++j) (*keys)[j] = st.host.p[j] + static_cast<uint32_t>(begin);
  return Status::OK();
}

Status GpuContribution::SampledMagnitude(size_t begin, size_t end, size_t sample, size_t rank,
                                         float* out) {
  // Once per job (ExDyna's first threshold): the range comes to the host.
  State& st = *state_;
  std::vector<float> range(end - begin);
  SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(st.stream), "the stream"));
  SPARSEPS_RETURN_IF_ERROR(
      CudaStatus(cudaMemcpy(range.data(), st.x.p + begin, range.size() * sizeof(float),
                            cudaMemcpyDeviceToHost),
                 "copying the sampled range"));
  *out = kernels::SampledMagnitude(range.data(), range.size(), sample, rank);
  return Status::OK();
}

Status GpuContribution::Take(std::span<const uint32_t> keys, float* values) {
  State& st = *state_;
  const size_t m = keys.size();
  if (m == 0) return Status::OK();
  SPARSEPS_RETURN_IF_ERROR(Upload(keys, nullptr));
  float* vals = reinterpret_cast<float*>(st.entries.p + m);
  SPARSEPS_RETURN_IF_ERROR(CudaStatus(
      gpu::GatherAndZero(st.x.p, nullptr, st.entries.p, m, vals, st.stream), "taking entries"));
  SPARSEPS_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(st.host.p + m, vals, m * sizeof(float), cudaMemcpyDeviceToHost, st.stream),
      "copying the taken values"));
  SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(st.stream), "taking entries"));
  std::memcpy(values, st.host.p + m, m * sizeof(float));
  return Status::OK();
}

Status GpuContribution::Add(const SparseVector& entries) { return Scatter(entries, true); }

Status GpuContribution::Set(const SparseVector& entries) { return Scatter(entries, false); }

Status GpuContribution::Scatter(const SparseVector& entries, bool add) {
  State& st = *state_;
  const size_t m = entries.size();
  if (m == 0) return Status::OK();
  SPARSEPS_RETURN_IF_ERROR(Upload(entries.indices, entries.values.data()));
  const float* vals = reinterpret_cast<const float*>(st.entries.p + m);
  SPARSEPS_RETURN_IF_ERROR(
      CudaStatus(add ? gpu::ScatterAdd(st.x.p, st.entries.p, vals, m, st.stream)
                     : gpu::ScatterSet(st.x.p, st.entries.p, vals, m, st.stream),
                 add ? "adding entries" : "setting entries"));
  return CudaStatus(cudaStreamSynchronize(st.stream), "scattering entries");
}

Status GpuContribution::Read(float* out, bool zero) {
  State& st = *state_;
  SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(st.stream), "the stream"));
  SPARSEPS_RETURN_IF_ERROR(
      CudaStatus(cudaMemcpy(out, st.x.p, st.n * sizeof(float), cudaMemcpyDeviceToHost),
                 "copying the contribution"));
  if (!zero) return Status::OK();
  SPARSEPS_RETURN_IF_ERROR(
      CudaStatus(cudaMemsetAsync(st.x.p, 0, st.n * sizeof(float), st.stream), "cudaMemset"));
  return CudaStatus(cudaStreamSynchronize(st.stream), "cudaMemset");
}

Status GpuContribution::MaskMomentum(std::span<const uint32_t> keys) {
  State& st = *state_;
  if (st.aggregated || keys.empty()) return Status::OK();
  SPARSEPS_RETURN_IF_ERROR(Upload(keys, nullptr));
  SPARSEPS_RETURN_IF_ERROR(CudaStatus(
      gpu::ZeroAt(st.u.p, nullptr, st.entries.p, keys.size(), st.stream), "momentum masking"));
  return CudaStatus(cudaStreamSynchronize(st.stream), "momentum masking");
}

Status GpuContribution::ReadVelocity(float* out) const {
  const State& st = *state_;
  if (st.aggregated) {
    std::fill(out, out + st.n, 0.0f);
    return Status::OK();
  }
  SPARSEPS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(st.stream), "the stream"));
  return CudaStatus(cudaMemcpy(out, st.u.p, st.n * sizeof(float), cudaMemcpyDeviceToHost),
                    "copying the velocity");
}

Status DownloadGpuCompressorState(const Compressor& compressor, std::vector<float>* residual,
                                  std::vector<float>* velocity) {
  const auto* on_gpu = dynamic_cast<const GpuCompressorBase*>(&compressor);
  if (on_gpu == nullptr) return Status::InvalidArgument("not a GPU compressor");
  return on_gpu->Download(residual, velocity);
}

}  // namespace sparseps
