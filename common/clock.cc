#include "common/clock.h"

#include <algorithm>

namespace sparseps {

StoppedTime& StoppedTime::OfProcess() {
  static StoppedTime* t =
      new StoppedTime;  // never destroyed: a loop may round as the process exits
  return *t;
}

Clock::duration StoppedTime::Overdue(Clock::time_point now) const {
  if (loops_ == 0 || now - newest_ <= gap_) return Clock::duration::zero();
  return now - newest_ - gap_;
}

void StoppedTime::Begin(double stop_gap_s, Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  if (loops_++ == 0 || now > newest_) newest_ = now;
  gap_ = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(stop_gap_s));
}

Clock::duration StoppedTime::Round(Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  const Clock::duration stop = Overdue(now);
  stopped_ += stop;
  if (stop > Clock::duration::zero()) resumed_ = now;
  newest_ = std::max(newest_, now);
  return stop;
}

void StoppedTime::End() {
  std::lock_guard<std::mutex> lock(mu_);
  if (loops_ > 0) --loops_;
}

Clock::duration StoppedTime::Total(Clock::time_point now) const {
  std::lock_guard<std::mutex> lock(mu_);
  return stopped_ + Overdue(now);
}

bool StoppedTime::RunningFor(Clock::duration settle, Clock::time_point now) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (Overdue(now) > Clock::duration::zero()) return false;
  return !resumed_ || now - *resumed_ > settle;
}

}  // namespace sparseps
