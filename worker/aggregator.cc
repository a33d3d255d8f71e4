#include "worker/aggregator.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "encodings/registry.h"
#include "kernels/error_feedback.h"
#include "security/security.h"
#include "worker/aggregator_internal.h"

namespace sparseps {

Aggregator::Aggregator(const proto::JobConfig& config, size_t num_params, bool model_on_device)
    : config_(config),
      params_(num_params, 0.0f),
      model_on_device_(model_on_device),
      changed_(num_params) {
  const proto::CompressionConfig& c = config.compression();
  if (c.adaptive_comm_ratio() > 0 && config.aggregation() == proto::PS) {
    const double min_density = c.min_density() > 0 ? c.min_density() : c.density() / 10;
    adaptive_.emplace(c.adaptive_comm_ratio(), min_density / c.density());
  }
}

Status Aggregator::Flush(StepStats* stats) {
  const uint64_t sent0 = bytes_sent(), received0 = bytes_received();
  checkpoint_due_ = false;
  SPARSEPS_RETURN_IF_ERROR(AwaitInFlight(stats));
  stats->bytes_sent += bytes_sent() - sent0;
  stats->bytes_received += bytes_received() - received0;
  return Status::OK();
}

Status Aggregator::Step(float* grad, bool grad_on_device, StepStats* stats) {
  // The adaptive density's clock (read only when it is on).
  const auto begin =
      adaptive_ ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  const size_t n = num_params();
  // train.overlap: delay: the previous iteration is applied before the weight decay reads the
  // parameters (Flush, unless the caller did).
  if (delays()) SPARSEPS_RETURN_IF_ERROR(Flush(stats));
  const uint64_t sent0 = bytes_sent(), received0 = bytes_received();
  if (grad_on_device && !takes_device_gradient()) {
    // The compression or the collective runs on the host: the gradient comes down (one copy).
    grad_h_.resize(n);
    SPARSEPS_RETURN_IF_ERROR(DeviceDownload(grad, grad_h_.data(), n));
    grad = grad_h_.data();
    grad_on_device = false;
  }
  if (const float wd = static_cast<float>(config_.train().weight_decay());
      wd > 0.0f && !overlaps()) {
    if (grad_on_device) {
      SPARSEPS_RETURN_IF_ERROR(DeviceAxpy(wd, params_d_.data(), grad, n));
    } else {
      const float* model = local_params() != nullptr ? local_params() : params_.data();
      kernels::Axpy(wd, model, grad, n);
    }
  }
  SPARSEPS_RETURN_IF_ERROR(Aggregate(grad, grad_on_device, stats));
  stats->bytes_sent += bytes_sent() - sent0;
  stats->bytes_received += bytes_received() - received0;
  if (adaptive_) {
    const auto end = std::chrono::steady_clock::now();
    using Ms = std::chrono::duration<double, std::milli>;
    if (last_step_end_ &&
        adaptive_->Add(Ms(begin - *last_step_end_).count(), Ms(end - begin).count())) {
      const double d = config_.compression().density();
      spdlog::info(
          "adaptive density: the aggregation took {:.2f}x the time outside it (target {:.2f}x{}): "
          "density {:.3g} from the next step ({:.3g} of compression.density {:.3g})",
          adaptive_->share(), config_.compression().adaptive_comm_ratio(),
          adaptive_->undone() ? "; the last step down did not shorten it: undone, and held for "
                                "10 windows"
                              : "",
          d * adaptive_->scale(), adaptive_->scale(), d);
      SetDensityScale(adaptive_->scale());
    }
    last_step_end_ = end;
  }
  return Status::OK();
}

Result<const float*> Aggregator::ModelParams() {
  float* local = local_params();
  if (!model_on_device_) return local != nullptr ? local : params_.data();
  if (params_d_.size() != num_params()) SPARSEPS_RETURN_IF_ERROR(params_d_.Allocate(num_params()));
  // A local copy trained on the host goes up whole; otherwise what changed goes up.
  const bool host_local = local != nullptr && !local_on_device();
  if (host_local) changed_.AddAll();
  SPARSEPS_RETURN_IF_ERROR(
      SyncToDevice(host_local ? local : params_.data(), &changed_, &params_d_));
  return params_d_.data();
}

Result<const float*> Aggregator::JobParams() {
  if (!model_on_device_) return params_.data();
  if (local_params() != nullptr) {
    // params_d_ holds the local copy: the job's parameters go to a buffer of their own.
    if (eval_d_.size() != num_params()) SPARSEPS_RETURN_IF_ERROR(eval_d_.Allocate(num_params()));
    SPARSEPS_RETURN_IF_ERROR(eval_d_.Upload(params_.data()));
    return eval_d_.data();
  }
  return ModelParams();
}

Result<std::unique_ptr<Aggregator>> MakeAggregator(const proto::JobConfig& config,
                                                   zmq::context_t& context, size_t num_params,
                                                   bool model_on_device,
                                                   std::vector<TensorLayout> layers) {
  if (config.aggregation() == proto::ALLREDUCE) {
    const int64_t max_frame = std::max<int64_t>(
        JobMaxFrameBytes(config, num_params),
        static_cast<int64_t>(config.collective().segment_bytes()) + kControlMaxFrameBytes);
    auto group =
        PeerGroup::Bind(context, BindHost(config, config.node().host()), config.collective().port(),
                        config.cluster().request_timeout_s(), max_frame);
    if (!group.ok()) return group.status();
    return MakeAllreduceAggregator(config, std::move(*group), num_params, model_on_device,
                                   std::move(layers));
  }
  return MakePsAggregator(config, context, num_params, model_on_device);
}

}  // namespace sparseps
