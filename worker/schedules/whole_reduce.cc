// WholeReduce (see reduce_schedule.h).
#include <algorithm>
#include <functional>

#include "kernels/error_feedback.h"
#include "worker/aggregator_internal.h"
#include "worker/collectives/ring.h"
#include "worker/schedules/reduce_schedule.h"
#include "worker/schedules/reduce_schedules.h"
#if SPARSEPS_HAVE_CUDA
#include "worker/cuda/gpu_contribution.h"
#endif

namespace sparseps {
namespace {

// collective.measure_quality: the share of the squared L2 mass of the exact global top-K of
// `sum` (the dense sum of the workers' contributions, K = entries applied) that the update's keys
// hold. 1 for a dense update or an empty sum.
double TopKMassShare(const std::vector<float>& sum, const CollectiveUpdate& update) {
  if (update.dense || update.indices.empty()) return 1.0;
  double applied = 0.0;
  for (uint32_t key : update.indices) applied += double{sum[key]} * sum[key];
  std::vector<float> sq(sum.size());
  for (size_t i = 0; i < sum.size(); ++i) sq[i] = sum[i] * sum[i];
  const size_t k = std::min(update.indices.size(), sq.size());
  std::nth_element(sq.begin(), sq.begin() + static_cast<std::ptrdiff_t>(k - 1), sq.end(),
                   std::greater<float>());
  double best = 0.0;
  for (size_t i = 0; i < k; ++i) best += sq[i];
  return best > 0.0 ? applied / best : 1.0;
}

}  // namespace

WholeReduce::WholeReduce(const ReduceContext& ctx)
    : ctx_(ctx), measure_quality_(ctx.config->collective().measure_quality()) {}

Status WholeReduce::Contribute(float* grad, bool on_device) {
  const size_t n = ctx_.params->size();
  const uint32_t segment = static_cast<uint32_t>(ctx_.config->collective().segment_bytes() / 4);
  if (on_device) {
#if SPARSEPS_HAVE_CUDA
    SPARSEPS_RETURN_IF_ERROR(ctx_.contribution_d->Accumulate(grad));
    if (measure_quality_) {
      probe_.resize(n);
      SPARSEPS_RETURN_IF_ERROR(ctx_.contribution_d->Read(probe_.data(), /*zero=*/false));
      SPARSEPS_RETURN_IF_ERROR(
          RingAllreduce(ctx_.group, NextProbeTag(), probe_.data(), n, segment));
    }
#endif
    return Status::OK();
  }
  if (!kernels::AllFinite(grad, n)) {
    return Status::InvalidArgument("the gradient holds NaN or Inf; nothing was sent");
  }
  if (ctx_.aggregated_momentum) {
    kernels::Axpy(1.0f, grad, ctx_.acc->data(), n);
  } else if (!DefersCorrection()) {
    kernels::MomentumCorrection(ctx_.velocity->data(), ctx_.acc->data(), grad, ctx_.momentum, n);
  }
  if (measure_quality_) {
    probe_ = *ctx_.acc;
    SPARSEPS_RETURN_IF_ERROR(RingAllreduce(ctx_.group, NextProbeTag(), probe_.data(), n, segment));
  }
  return Status::OK();
}

Status WholeReduce::Reduce(float* grad, bool on_device) {
  if (on_device) {
#if SPARSEPS_HAVE_CUDA
    SPARSEPS_RETURN_IF_ERROR(ctx_.collective->Allreduce(ctx_.contribution_d, &update_));
    if (!ctx_.aggregated_momentum && !update_.dense) {
      SPARSEPS_RETURN_IF_ERROR(ctx_.contribution_d->MaskMomentum(update_.indices));
    }
#endif
    return Status::OK();
  }
  // The momentum correction is left to the collective's first operation on acc (with exact
  // top-k, one pass with the selection; it then counts as communication), unless the probe reads
  // acc first.
  return DefersCorrection() ? ctx_.collective->Allreduce(ctx_.acc, ctx_.velocity->data(), grad,
                                                         ctx_.momentum, &update_)
                            : ctx_.collective->Allreduce(ctx_.acc, &update_);
}

Status WholeReduce::Step(float* grad, bool on_device, StepStats* stats) {
  const size_t n = ctx_.params->size();
  const auto t0 = Clock::now();
  SPARSEPS_RETURN_IF_ERROR(Contribute(grad, on_device));
  const auto t1 = Clock::now();  // the collective starts
  SPARSEPS_RETURN_IF_ERROR(Reduce(grad, on_device));
  Apply();
  stats->encode_ms = Ms(t0, t1);
  stats->comm_ms = Ms(t1, Clock::now());
  if (measure_quality_) stats->topk_mass = TopKMassShare(probe_, update_);
  stats->selected = ctx_.collective->last_selected();
  stats->applied = static_cast<int64_t>(update_.dense ? n : update_.indices.size());
  return Status::OK();
}

void WholeReduce::Apply() {
  const size_t n = ctx_.params->size();
  float* params = ctx_.params->data();
  float* velocity = ctx_.velocity->data();
  const bool dense = ctx_.aggregated_momentum || update_.dense;
  ctx_.will_change(
      0, dense ? std::span<const uint32_t>() : std::span<const uint32_t>(update_.indices), dense);
  if (ctx_.aggregated_momentum) {
    // v = m v + update; params -= lr / W v (dense: v decays everywhere).
    kernels::Scale(ctx_.momentum, velocity, n);
    if (update_.dense) {
      kernels::Axpy(1.0f, update_.sum.data(), velocity, n);
    } else {
      kernels::ScatterAdd(velocity, update_.indices.data(), update_.values.data(),
                          update_.indices.size());
    }
    kernels::Axpy(-ctx_.step_scale, velocity, params, n);
    ctx_.changed->AddAll();
  } else if (update_.dense) {
    kernels::Axpy(-ctx_.step_scale, update_.sum.data(), params, n);
    ctx_.changed->AddAll();
  } else {
    for (size_t e = 0; e < update_.indices.size(); ++e) {
      params[update_.indices[e]] -= ctx_.step_scale * update_.values[e];
      velocity[update_.indices[e]] = 0.0f;
    }
    if (ctx_.model_on_device) ctx_.changed->Add(0, update_.indices);
  }
}

uint64_t WholeReduce::NextProbeTag() {
  const uint64_t tag = probe_tag_;
  probe_tag_ += uint64_t{1} << 32;
  return tag;
}

}  // namespace sparseps
