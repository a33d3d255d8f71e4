#include "worker/schedules/delayed_step.h"

#include "worker/aggregator_internal.h"

namespace sparseps {

Result<StepEnd> DelayedStep::Step(float* grad, bool on_device, float* trained, StepStats* stats) {
  if (!delays()) return inner_->Step(grad, on_device, trained, stats);
  const auto t0 = Clock::now();
  auto pushed = inner_->Encode(grad, trained);
  if (!pushed.ok()) return pushed.status();
  const auto t1 = Clock::now();
  if (!*pushed) {
    inner_->Record(t0, Clock::now(), false, stats);
    return StepEnd::kLocal;
  }
  SPARSEPS_RETURN_IF_ERROR(inner_->StartRound());
  in_flight_ = true;
  // The iteration is in flight until the next AwaitInFlight. The trace shows the one this step
  // applied (its AwaitInFlight); this one's encoding is kept for the next.
  // (+=: the step's start applied the previous iteration into the same stats.)
  stats->selected = inner_->last_selected();
  stats->encode_ms += Ms(t0, t1);
  stats->comm_ms += Ms(t1, Clock::now());
  stats->ranges = flushed_;
  flushed_.assign(ctx_.ps->ranges().size(), RangeTimes{t0, t0, t1, t0, t0, true});
  return StepEnd::kInFlight;
}

Status DelayedStep::AwaitInFlight(StepStats* stats, bool* applied) {
  *applied = false;
  if (!in_flight_) return Status::OK();
  const auto t0 = Clock::now();
  in_flight_ = false;  // after an error the iteration is void: the job rolls back or ends
  SPARSEPS_RETURN_IF_ERROR(inner_->AwaitRound());
  *applied = true;
  stats->comm_ms += Ms(t0, Clock::now());
  stats->push_ms = ctx_.ps->last_push_s() * 1e3;
  stats->pull_ms = ctx_.ps->last_pull_s() * 1e3;
  for (size_t r = 0; r < flushed_.size(); ++r) {
    flushed_[r].acked = ctx_.ps->acked_at(r);
    flushed_[r].replied = ctx_.ps->replied_at(r);
  }
  return Status::OK();
}

}  // namespace sparseps
