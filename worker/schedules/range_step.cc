#include "worker/schedules/range_step.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <string>

#include "encodings/registry.h"
#include "kernels/device.h"
#include "kernels/error_feedback.h"
#include "worker/aggregator_internal.h"
#include "worker/device_buffer.h"

namespace sparseps {

std::unique_ptr<StepSchedule> RangeStep::OnHost(const PsStepContext& ctx) {
  std::vector<std::unique_ptr<Compressor>> slices;
  for (const auto& r : ctx.ps->ranges()) slices.push_back(MakeCompressor(*ctx.config, r.size()));
  return std::unique_ptr<StepSchedule>(new RangeStep(ctx, std::move(slices), false));
}

Result<std::unique_ptr<StepSchedule>> RangeStep::OnDevice(const PsStepContext& ctx) {
  const proto::JobConfig& config = *ctx.config;
  if (config.compression().local_iterations() > 1) return std::unique_ptr<StepSchedule>();
  std::vector<std::unique_ptr<Compressor>> slices;
  for (const auto& r : ctx.ps->ranges()) {
    if (r.size() == 0) {  // a server without keys (more servers than keys): nothing to compress
      slices.push_back(MakeCompressor(config, 0));
      continue;
    }
    auto made = MakeGpuCompressor(config, r.size());
    if (!made.ok()) return made.status();
    if (!*made) return std::unique_ptr<StepSchedule>();  // no device compressor
    slices.push_back(std::move(*made));
  }
  return std::unique_ptr<StepSchedule>(new RangeStep(ctx, std::move(slices), true));
}

RangeStep::RangeStep(const PsStepContext& ctx, std::vector<std::unique_ptr<Compressor>> slices,
                     bool on_device)
    : ctx_(ctx),
      slices_(std::move(slices)),
      on_device_(on_device),
      cuda_device_(on_device ? kernels::CurrentCudaDevice() : -1) {
  const proto::JobConfig& config = *ctx_.config;
  for (size_t r = 0; r < slices_.size(); ++r) {
    slices_[r]->set_key_base(ctx_.ps->ranges()[r].begin);
    // After every push the pulled parameters replace SBC's local copy.
    slices_[r]->set_pull_replaces_params(true);
  }
  times_.assign(ctx_.ps->ranges().size(), RangeTimes{});
  spdlog::info(
      "train.overlap: backward: {} key ranges, each {}pushed as soon as the backward pass has "
      "finished it ({} first)",
      slices_.size(), on_device_ ? "compressed on the device and " : "",
      config.train().overlap_priority() == proto::FRONT_FIRST ? "front" : "back");
}

RangeStep::~RangeStep() {
  if (!comm_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancel_ = true;
  }
  cv_.notify_all();
  comm_.join();
}

void RangeStep::State(StateArchive& archive) {
  // One compressor per key range: a checkpoint of train.overlap: backward resumes with it.
  for (size_t r = 0; r < slices_.size(); ++r) {
    auto scope = archive.Scope("compressor_range" + std::to_string(r));
    slices_[r]->State(archive);
  }
}

Status RangeStep::ReadResidual(std::vector<float>* out) {
  out->resize(num_params());
  std::vector<float> slice;
  for (size_t r = 0; r < slices_.size(); ++r) {
    SPARSEPS_RETURN_IF_ERROR(slices_[r]->ReadResidual(&slice));
    std::copy(slice.begin(), slice.end(),
              out->begin() + static_cast<std::ptrdiff_t>(ctx_.ps->ranges()[r].begin));
  }
  return Status::OK();
}

void RangeStep::OnChanged(uint64_t begin, std::span<const uint32_t> keys,
                          std::span<const float> delta) {
  // The range's own compressor, whose keys start at the range's first. (An empty range, of a job
  // with more servers than keys, holds no key and changes none.)
  const int r = FindKeyRange(ctx_.ps->ranges(), begin);
  if (r >= 0) slices_[static_cast<size_t>(r)]->OnChanged(0, keys, delta);
}

bool RangeStep::BeginStep(float* grad) {
  if (comm_.joinable()) comm_.join();  // a step begun and never ended (cannot happen in order)
  {
    std::lock_guard<std::mutex> lock(mu_);
    ready_from_ = num_params();
    cancel_ = false;
  }
  // Ranges past the last key (none in practice) are ready at once.
  MarkReady(num_params(), Clock::now());
  comm_ = std::thread([this, grad] {
    // A new thread starts on GPU 0: the slices' GPU first, for the thread's life.
    if (std::string error; cuda_device_ >= 0 && !kernels::SetCudaDevice(cuda_device_, &error)) {
      comm_status_ = Status::FailedPrecondition("the overlap's pushes: " + error);
      return;
    }
    comm_status_ = PushRanges(grad);
  });
  return true;
}

void RangeStep::GradientReady(size_t key_begin) {
  const auto now = Clock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (key_begin >= ready_from_) return;
    MarkReady(key_begin, now);
    ready_from_ = key_begin;
  }
  cv_.notify_one();
}

void RangeStep::MarkReady(size_t key_begin, Clock::time_point now) {
  const auto& ranges = ctx_.ps->ranges();
  for (size_t r = 0; r < ranges.size(); ++r) {
    if (ranges[r].begin >= key_begin && ranges[r].begin < ready_from_) times_[r].ready = now;
  }
  if (key_begin >= num_params()) {
    for (size_t r = 0; r < ranges.size(); ++r) {
      if (ranges[r].begin >= num_params()) times_[r].ready = now;
    }
  }
}

size_t RangeStep::NextRange(const std::vector<bool>& done) const {
  const auto& ranges = ctx_.ps->ranges();
  const size_t count = ranges.size();
  const bool front = ctx_.config->train().overlap_priority() == proto::FRONT_FIRST;
  for (size_t i = 0; i < count; ++i) {
    const size_t r = front ? i : count - 1 - i;
    if (!done[r] && ranges[r].begin >= ready_from_) return r;
  }
  return count;
}

Status RangeStep::PushRange(size_t r, float* grad, bool* pushed) {
  const KeyRange& range = ctx_.ps->ranges()[r];
  RangeTimes& t = times_[r];
  t.encoded_from = Clock::now();
  float* g = grad + range.begin;
  Compressor& c = *slices_[r];
  // Where the model computes (ModelCopy::Trained, as the aggregator hands it to WholeStep); on
  // the device null until the parameters are there.
  const bool there =
      !on_device_ || (ctx_.params_d != nullptr && ctx_.params_d->size() == num_params());
  float* model = there ? (*ctx_.model)->Trained(on_device_, ctx_.params_d) + range.begin : nullptr;
  if (const float wd = static_cast<float>(ctx_.config->train().weight_decay()); wd > 0.0f) {
    if (!on_device_) {
      kernels::Axpy(wd, model, g, range.size());
    } else if (model == nullptr) {
      return Status::FailedPrecondition(
          "train.weight_decay with train.overlap: backward on the device: the model's "
          "parameters are not on the device");
    } else {
      SPARSEPS_RETURN_IF_ERROR(DeviceAxpy(wd, model, g, range.size()));
    }
  }
  *pushed = c.LocalStep(g, model);
  if (*pushed) {
    one_.clear();
    SPARSEPS_RETURN_IF_ERROR(c.Compress(g, {KeyRange{0, range.size()}}, &one_));
    one_.front().header.set_key_begin(range.begin);
    one_.front().header.set_key_end(range.end);
  }
  t.encoded_to = Clock::now();
  t.pushed = *pushed;
  return *pushed ? ctx_.ps->PushRange(*ctx_.push_round, r, one_.front()) : Status::OK();
}

Status RangeStep::PushRanges(float* grad) {
  const size_t count = ctx_.ps->ranges().size();
  std::vector<bool> done(count, false);
  bool pushed = false;
  ctx_.ps->BeginPushes();
  for (size_t left = count; left > 0; --left) {
    size_t r = count;
    while (true) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        // Once something is pushed, the replies that came are taken every millisecond while the
        // next range is computed (its ack's time is then right, its pull applied early).
        const auto ready = [&] { return cancel_ || NextRange(done) < count; };
        if (left == count) {
          cv_.wait(lock, ready);
        } else {
          cv_.wait_for(lock, std::chrono::milliseconds(1), ready);
        }
        if (cancel_) return Status::Aborted("the step was abandoned before its gradient was whole");
        r = NextRange(done);
      }
      if (r < count) break;
      SPARSEPS_RETURN_IF_ERROR(ctx_.ps->Drain(ctx_.params->data()));
    }
    done[r] = true;
    bool range_pushed = false;
    SPARSEPS_RETURN_IF_ERROR(PushRange(r, grad, &range_pushed));
    pushed = pushed || range_pushed;
  }
  if (!pushed) return Status::OK();  // SBC: a local step
  return ctx_.ps->FinishPushes((*ctx_.push_round)++, ctx_.params->data());
}

Result<StepEnd> RangeStep::Step(float* grad, bool on_device, float* trained, StepStats* stats) {
  const auto entered = Clock::now();
  if (comm_.joinable()) {
    GradientReady(0);
    comm_.join();
  } else {
    // Not begun (a loop that does not report its layers): every range is ready now.
    {
      std::lock_guard<std::mutex> lock(mu_);
      ready_from_ = num_params();
      cancel_ = false;
      MarkReady(0, entered);
      ready_from_ = 0;
    }
    comm_status_ = PushRanges(grad);
  }
  SPARSEPS_RETURN_IF_ERROR(comm_status_);
  const auto left = Clock::now();
  bool pushed = false;
  size_t selected = 0;
  double exposed_encode_ms = 0.0;
  stats->ranges.resize(times_.size());
  for (size_t r = 0; r < times_.size(); ++r) {
    RangeTimes& t = times_[r];
    pushed = pushed || t.pushed;
    if (t.pushed) {
      t.acked = ctx_.ps->acked_at(r);
      t.replied = ctx_.ps->replied_at(r);
    }
    selected += slices_[r]->last_selected();
    // The part of the encoding that Step waited for (the rest ran during the backward pass).
    exposed_encode_ms += std::max(0.0, Ms(std::max(t.encoded_from, entered), t.encoded_to));
    stats->ranges[r] = t;
  }
  if (pushed) {
    stats->push_ms = ctx_.ps->last_push_s() * 1e3;
    stats->pull_ms = ctx_.ps->last_pull_s() * 1e3;
  }
  stats->selected = selected;
  stats->encode_ms = exposed_encode_ms;
  stats->comm_ms = std::max(0.0, Ms(entered, left) - exposed_encode_ms);
  return pushed ? StepEnd::kApplied : StepEnd::kLocal;
}

}  // namespace sparseps
