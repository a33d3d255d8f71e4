// The clock every deadline and duration of ours is measured with.
#pragma once

#include <chrono>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>

namespace sparseps {

// Monotonic: deadlines and durations do not jump with the wall clock.
using Clock = std::chrono::steady_clock;

// Seconds from `from` to `to` (negative when `to` is earlier).
inline double SecondsBetween(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

// Seconds since `start`.
inline double SecondsSince(Clock::time_point start) { return SecondsBetween(start, Clock::now()); }

// How late a loop that heartbeats every `heartbeat_interval_s` must come round for its process to
// have been stopped (SIGSTOP, Ctrl-Z) rather than delayed by a busy machine: an interval plus the
// larger of an interval and 1 s. A node's heartbeat thread and the scheduler's loop judge by it.
inline double StopGapSeconds(double heartbeat_interval_s) {
  return heartbeat_interval_s + (heartbeat_interval_s > 1.0 ? heartbeat_interval_s : 1.0);
}

// The time this process was stopped (SIGSTOP, Ctrl-Z, a paused VM), left out of its deadlines so
// that a job stopped whole and continued goes on. A loop that comes round at a known pace (a
// node's heartbeat thread, the scheduler's loop) reports each round; a round later than its stop
// gap after the process-wide newest one means the process did not run meanwhile. A suspended
// machine needs none of this: Clock (CLOCK_MONOTONIC) does not advance in suspend. Thread-safe.
// A stop counts from the stop gap on (a loop that late on a busy machine is no stop), so that
// RunNow() never goes back.
class StoppedTime {
 public:
  // The process's own, which the heartbeat threads and the scheduler's loop feed.
  static StoppedTime& OfProcess();

  // A paced loop starts at `now`: `stop_gap_s` is how late its round must come for the process to
  // have been stopped (StopGapSeconds of its pace). Pair with End().
  void Begin(double stop_gap_s, Clock::time_point now);
  // One round of a paced loop at `now`: a round more than the stop gap after the newest round of
  // any paced loop adds the time beyond the gap to the stopped time, and returns it (zero: no
  // stop).
  Clock::duration Round(Clock::time_point now);
  // A paced loop ends; with none left no stop can be seen.
  void End();
  // The time this process was stopped until `now`, including a stop that no paced loop has come
  // round from yet (its newest round more than the stop gap ago). Never decreases.
  Clock::duration Total(Clock::time_point now) const;
  // Whether the process has run for more than `settle` since its latest stop, at `now`: false
  // while a paced loop is overdue (a stop that no round has ended yet) and for `settle` after
  // the round that ended one; true when it was never stopped.
  bool RunningFor(Clock::duration settle, Clock::time_point now) const;

 private:
  // The stop a round at `now` would end, with mu_ held: zero when none.
  Clock::duration Overdue(Clock::time_point now) const;

  mutable std::mutex mu_;
  int loops_ = 0;                             // paced loops running
  Clock::time_point newest_;                  // the newest round of any of them
  Clock::duration gap_{};                     // of the loop that began last
  Clock::duration stopped_{};                 // the stops that a round ended
  std::optional<Clock::time_point> resumed_;  // the round that ended the latest stop
};

// Clock::now() less the time this process was stopped: the clock for deadlines.
inline Clock::time_point RunNow() {
  const auto now = Clock::now();
  return now - StoppedTime::OfProcess().Total(now);
}

// Seconds this process ran since the timer was made, the time it was stopped left out: for
// deadlines ("timed out after N s waiting for ..."). Thread-compatible.
class RunTimer {
 public:
  RunTimer() : start_(RunNow()) {}
  double Seconds() const { return SecondsBetween(start_, RunNow()); }

 private:
  Clock::time_point start_;
};

// A duration for a message: "8 s", "0.25 s", "1.23e+03 s" (three significant digits).
inline std::string FormatSeconds(double s) {
  std::ostringstream os;
  os.precision(3);
  os << s << " s";
  return os.str();
}

}  // namespace sparseps
