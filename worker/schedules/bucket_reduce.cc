// BucketReduce (see reduce_schedule.h).
#include <spdlog/spdlog.h>

#include <algorithm>

#include "kernels/error_feedback.h"
#include "worker/aggregator_internal.h"
#include "worker/collectives/ring.h"
#include "worker/schedules/reduce_schedules.h"

namespace sparseps {

BucketReduce::BucketReduce(const ReduceContext& ctx)
    : ctx_(ctx), bucket_sum_(ctx.params->size(), 0.0f) {
  spdlog::info(
      "train.overlap: backward: a ring allreduce per bucket of layers (at least {} bytes), each "
      "as soon as the backward pass has finished it",
      ctx_.config->train().overlap_bucket_bytes());
}

BucketReduce::~BucketReduce() {
  if (!comm_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancel_ = true;
  }
  cv_.notify_all();
  comm_.join();
}

bool BucketReduce::BeginStep(float* grad) {
  if (comm_.joinable()) comm_.join();
  {
    std::lock_guard<std::mutex> lock(mu_);
    ready_.clear();
    bucket_ready_.clear();
    reported_from_ = bucket_end_ = ctx_.params->size();
    cancel_ = false;
  }
  comm_ = std::thread([this, grad] { comm_status_ = ReduceBuckets(grad); });
  return true;
}

void BucketReduce::GradientReady(size_t key_begin) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (key_begin >= reported_from_) return;
    reported_from_ = key_begin;
    const uint64_t min_elems = ctx_.config->train().overlap_bucket_bytes() / sizeof(float);
    if (key_begin > 0 && bucket_end_ - key_begin < min_elems) return;
    ready_.push_back({key_begin, bucket_end_});
    bucket_ready_.push_back(Clock::now());
    bucket_end_ = key_begin;
  }
  cv_.notify_one();
}

Status BucketReduce::ReduceBucket(const std::pair<size_t, size_t>& bucket, float* grad,
                                  RangeTimes* t) {
  const auto [b, e] = bucket;
  const size_t len = e - b;
  std::vector<float>& acc = *ctx_.acc;
  float* params = ctx_.params->data() + b;
  float* velocity = ctx_.velocity->data() + b;
  t->encoded_from = Clock::now();
  float* g = grad + b;
  if (!kernels::AllFinite(g, len)) {
    return Status::InvalidArgument("the gradient holds NaN or Inf; nothing more was sent");
  }
  if (const float wd = static_cast<float>(ctx_.config->train().weight_decay()); wd > 0.0f) {
    kernels::Axpy(wd, params, g, len);
  }
  if (ctx_.aggregated_momentum) {
    kernels::Axpy(1.0f, g, acc.data() + b, len);
  } else {
    kernels::MomentumCorrection(velocity, acc.data() + b, g, ctx_.momentum, len);
  }
  float* sum = bucket_sum_.data() + b;
  std::copy(acc.begin() + static_cast<std::ptrdiff_t>(b),
            acc.begin() + static_cast<std::ptrdiff_t>(e), sum);
  std::fill(acc.begin() + static_cast<std::ptrdiff_t>(b),
            acc.begin() + static_cast<std::ptrdiff_t>(e), 0.0f);
  t->encoded_to = Clock::now();
  // Tags apart from the collective's (call << 32), the probe's (bit 63) and the start's (bit
  // 62): bit 61, the iteration, the bucket.
  const uint64_t tag = (uint64_t{1} << 61) | ((*ctx_.iteration & 0x1fffff) << 40) |
                       (static_cast<uint64_t>(buckets_done_) << 28);
  SPARSEPS_RETURN_IF_ERROR(RingAllreduce(
      ctx_.group, tag, sum, len,
      static_cast<size_t>(std::max<uint64_t>(1, ctx_.config->collective().segment_bytes() / 4))));
  if (ctx_.aggregated_momentum) {
    kernels::Scale(ctx_.momentum, velocity, len);
    kernels::Axpy(1.0f, sum, velocity, len);
    kernels::Axpy(-ctx_.step_scale, velocity, params, len);
  } else {
    kernels::Axpy(-ctx_.step_scale, sum, params, len);
  }
  t->acked = t->replied = Clock::now();
  t->pushed = true;
  t->collective = true;
  return Status::OK();
}

Status BucketReduce::ReduceBuckets(float* grad) {
  buckets_done_ = 0;
  times_.clear();
  while (true) {
    std::pair<size_t, size_t> bucket;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return cancel_ || buckets_done_ < ready_.size(); });
      if (cancel_) return Status::Aborted("the step was abandoned before its gradient was whole");
      bucket = ready_[buckets_done_];
      times_.push_back(RangeTimes{});
      times_.back().ready = bucket_ready_[buckets_done_];
    }
    SPARSEPS_RETURN_IF_ERROR(ReduceBucket(bucket, grad, &times_.back()));
    ++buckets_done_;
    if (bucket.first == 0) return Status::OK();
  }
}

Status BucketReduce::Step(float* grad, bool on_device, StepStats* stats) {
  const auto entered = Clock::now();
  const size_t n = ctx_.params->size();
  if (!comm_.joinable()) {
    // Not begun: the whole gradient is one bucket.
    std::lock_guard<std::mutex> lock(mu_);
    ready_.clear();
    bucket_ready_.clear();
    reported_from_ = bucket_end_ = n;
    cancel_ = false;
  }
  ctx_.will_change(0, {}, true);
  if (comm_.joinable()) {
    GradientReady(0);
    comm_.join();
  } else {
    GradientReady(0);
    comm_status_ = ReduceBuckets(grad);
  }
  SPARSEPS_RETURN_IF_ERROR(comm_status_);
  const auto left = Clock::now();
  double exposed_encode_ms = 0.0;
  for (const auto& t : times_) {
    exposed_encode_ms += std::max(0.0, Ms(std::max(t.encoded_from, entered), t.encoded_to));
  }
  stats->ranges = times_;
  stats->encode_ms = exposed_encode_ms;
  stats->comm_ms = std::max(0.0, Ms(entered, left) - exposed_encode_ms);
  stats->selected = n;
  stats->applied = static_cast<int64_t>(n);
  return Status::OK();
}

std::unique_ptr<ReduceSchedule> MakeReduceSchedule(const ReduceContext& ctx) {
  if (ctx.config->train().overlap() != proto::BACKWARD) return std::make_unique<WholeReduce>(ctx);
  if (ctx.model_on_device) {
    spdlog::warn(
        "train.overlap: backward: allreduce's buckets are not built for a model on the device "
        "yet; this worker runs the collective after the backward pass (as with "
        "train.overlap: none)");
    return std::make_unique<WholeReduce>(ctx);
  }
  return std::make_unique<BucketReduce>(ctx);
}

}  // namespace sparseps
