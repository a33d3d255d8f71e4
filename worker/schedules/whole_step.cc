#include "worker/schedules/whole_step.h"

#include "worker/aggregator_internal.h"

namespace sparseps {

WholeStep::WholeStep(const PsStepContext& ctx, std::unique_ptr<Compressor> compressor)
    : ctx_(ctx), compressor_(std::move(compressor)) {
  // After every push the pulled parameters replace SBC's local copy: the push step need not
  // update it.
  compressor_->set_pull_replaces_params(true);
}

Result<bool> WholeStep::Encode(float* grad, float* trained) {
  if (!compressor_->LocalStep(grad, trained)) return false;
  pushes_.clear();
  SPARSEPS_RETURN_IF_ERROR(compressor_->Compress(grad, ctx_.ps->ranges(), &pushes_));
  return true;
}

Status WholeStep::StartRound() {
  return ctx_.ps->StartPushPull((*ctx_.push_round)++, pushes_, ctx_.params->data());
}

Status WholeStep::AwaitRound() {
  return ctx_.ps->AwaitPull(*ctx_.push_round - 1, ctx_.params->data());
}

void WholeStep::Record(Clock::time_point t0, Clock::time_point t1, bool pushed,
                       StepStats* stats) const {
  stats->selected = compressor_->last_selected();
  stats->encode_ms = Ms(t0, t1);
  stats->comm_ms = Ms(t1, Clock::now());
  stats->ranges.resize(ctx_.ps->ranges().size());
  for (size_t r = 0; r < stats->ranges.size(); ++r) {
    stats->ranges[r] = {t0, t0, t1, ctx_.ps->acked_at(r), ctx_.ps->replied_at(r), pushed};
  }
}

Result<StepEnd> WholeStep::Step(float* grad, bool on_device, float* trained, StepStats* stats) {
  const auto t0 = Clock::now();
  auto pushed = Encode(grad, trained);
  if (!pushed.ok()) return pushed.status();
  const auto t1 = Clock::now();
  if (*pushed) {
    SPARSEPS_RETURN_IF_ERROR(StartRound());
    SPARSEPS_RETURN_IF_ERROR(AwaitRound());
    stats->push_ms = ctx_.ps->last_push_s() * 1e3;
    stats->pull_ms = ctx_.ps->last_pull_s() * 1e3;
  }
  Record(t0, t1, *pushed, stats);
  return *pushed ? StepEnd::kApplied : StepEnd::kLocal;
}

void WholeStep::State(StateArchive& archive) {
  auto scope = archive.Scope("compressor");
  compressor_->State(archive);
}

Status TwoRoundStep::StartRound() {
  return ctx_.ps->SketchTwoRounds(
      (*ctx_.push_round)++, pushes_,
      [this](size_t r, std::span<const uint32_t> candidates, Message* push) {
        return compressor_->ExactValues(ctx_.ps->ranges()[r], candidates, push);
      },
      ctx_.params->data(), /*await=*/false);
}

}  // namespace sparseps
