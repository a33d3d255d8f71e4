#include "worker/schedules/step_schedule.h"

#include <spdlog/spdlog.h>

#include "encodings/registry.h"
#include "worker/schedules/delayed_step.h"
#include "worker/schedules/range_step.h"
#include "worker/schedules/whole_step.h"

namespace sparseps {

Result<std::unique_ptr<StepSchedule>> MakeStepSchedule(const PsStepContext& ctx,
                                                       bool model_on_device) {
  const proto::JobConfig& config = *ctx.config;
  SPARSEPS_RETURN_IF_ERROR(CheckEncoding(config));
  const proto::Overlap overlap = config.train().overlap();
  if (overlap == proto::BACKWARD) {
    if (!model_on_device) return RangeStep::OnHost(ctx);
    auto ranged = RangeStep::OnDevice(ctx);
    if (!ranged.ok()) return ranged.status();
    if (*ranged) return std::move(*ranged);
    spdlog::warn(
        "train.overlap: backward: compression.encoding {} {} on the device range by range; this "
        "worker pushes after the backward pass (as with train.overlap: none)",
        FindEncoding(config.compression().encoding())->name,
        config.compression().local_iterations() > 1 ? "with local_iterations > 1 does not run"
                                                    : "has no compressor that runs");
  }
  std::unique_ptr<Compressor> compressor;
  if (model_on_device) {
    auto made = MakeGpuCompressor(config, ctx.params->size());  // null: the encoding has none
    if (!made.ok()) return made.status();
    compressor = std::move(*made);
  }
  if (!compressor) compressor = MakeCompressor(config, ctx.params->size());
  if (model_on_device) {
    spdlog::info("compression on the {}", compressor->on_device()
                                              ? "GPU (only the encoded payload comes to the host)"
                                              : "CPU (the gradient comes to the host)");
  }
  std::unique_ptr<WholeStep> step;
  if (compressor->second_round()) {
    step = std::make_unique<TwoRoundStep>(ctx, std::move(compressor));
  } else {
    step = std::make_unique<WholeStep>(ctx, std::move(compressor));
  }
  if (overlap != proto::DELAY) return std::unique_ptr<StepSchedule>(std::move(step));
  spdlog::info(
      "train.overlap: delay: each iteration's pull is taken after the next gradient is computed "
      "(one iteration in flight)");
  return std::unique_ptr<StepSchedule>(new DelayedStep(ctx, std::move(step)));
}

}  // namespace sparseps
