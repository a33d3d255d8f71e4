#include "common/clock.h"

#include <gtest/gtest.h>

#include <chrono>

namespace sparseps {
namespace {

using std::chrono::milliseconds;

// A stopped-time record of the test's own, at times of the test's choosing (the process's record
// is fed by the heartbeat threads).
class StoppedTimeTest : public ::testing::Test {
 protected:
  static double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
  const Clock::time_point t0_ = Clock::now();
  StoppedTime t_;
};

TEST_F(StoppedTimeTest, NothingIsStoppedWithoutAPacedLoop) {
  EXPECT_EQ(t_.Total(t0_ + std::chrono::hours(1)), Clock::duration::zero());
  EXPECT_EQ(t_.Round(t0_ + std::chrono::hours(2)), Clock::duration::zero());
}

TEST_F(StoppedTimeTest, ALateRoundCountsTheTimeBeyondTheStopGap) {
  // A loop every 0.25 s, stop gap 1.25 s: rounds on time, then one 10 s after the last (the
  // process stopped for about 10 s): 8.75 s of it counts, before and after that round.
  t_.Begin(1.25, t0_);
  for (int ms = 250; ms <= 2000; ms += 250) {
    EXPECT_EQ(t_.Round(t0_ + milliseconds(ms)), Clock::duration::zero()) << ms;
  }
  EXPECT_EQ(t_.Total(t0_ + milliseconds(3200)), Clock::duration::zero());  // late, but in the gap
  EXPECT_DOUBLE_EQ(Seconds(t_.Total(t0_ + milliseconds(12000))), 8.75);    // not come round yet
  EXPECT_DOUBLE_EQ(Seconds(t_.Round(t0_ + milliseconds(12000))), 8.75);
  EXPECT_DOUBLE_EQ(Seconds(t_.Total(t0_ + milliseconds(12250))), 8.75);
  // A second stop adds to the first.
  EXPECT_DOUBLE_EQ(Seconds(t_.Round(t0_ + milliseconds(15250))), 2.0);
  EXPECT_DOUBLE_EQ(Seconds(t_.Total(t0_ + milliseconds(15250))), 10.75);
}

TEST_F(StoppedTimeTest, TheClockLessTheStopsNeverGoesBack) {
  // What RunNow() is: through a stop, before and after its round, now - Total(now) only grows.
  t_.Begin(1.25, t0_);
  Clock::time_point last = t0_;
  for (int ms = 0; ms <= 20000; ms += 10) {
    const auto now = t0_ + milliseconds(ms);
    if (ms == 250 || ms == 9000 || ms == 9250) t_.Round(now);  // stopped from 0.25 s to 9 s
    const auto run = now - t_.Total(now);
    ASSERT_GE(run, last) << ms;
    last = run;
  }
  // 9 s - 0.25 s, less the gap, was stopped; after 9.25 s the loop stopped coming round, and the
  // time since beyond the gap counts too (20 s - 9.25 s - 1.25 s).
  EXPECT_DOUBLE_EQ(Seconds(t_.Total(t0_ + milliseconds(20000))), 7.5 + 9.5);
}

TEST_F(StoppedTimeTest, AStopIsCountedOnceWhateverTheLoopsThatSeeIt) {
  // Two heartbeat threads in one process: the first round after the stop ends it.
  t_.Begin(1.25, t0_);
  t_.Begin(1.25, t0_ + milliseconds(100));
  EXPECT_DOUBLE_EQ(Seconds(t_.Round(t0_ + milliseconds(5100))), 3.75);
  EXPECT_EQ(t_.Round(t0_ + milliseconds(5110)), Clock::duration::zero());
  t_.End();
  EXPECT_DOUBLE_EQ(Seconds(t_.Total(t0_ + milliseconds(5500))), 3.75);
}

TEST_F(StoppedTimeTest, TheProcessRunsOnlyOnceAStopIsOverAndSettled) {
  // What a node's Listening() asks: never stopped, it runs; while its heartbeat thread is overdue
  // it does not, nor for the settling time after the round that ended the stop.
  const auto settle = milliseconds(1000);
  t_.Begin(1.25, t0_);
  EXPECT_TRUE(t_.RunningFor(settle, t0_ + milliseconds(1000)));
  EXPECT_FALSE(t_.RunningFor(settle, t0_ + milliseconds(5000)));  // overdue: stopped
  t_.Round(t0_ + milliseconds(9000));                             // the stop ends
  EXPECT_FALSE(t_.RunningFor(settle, t0_ + milliseconds(9500)));
  EXPECT_TRUE(t_.RunningFor(settle, t0_ + milliseconds(10010)));
  t_.Round(t0_ + milliseconds(9250));  // a round on time is no stop: still running
  EXPECT_TRUE(t_.RunningFor(settle, t0_ + milliseconds(10020)));
}

TEST_F(StoppedTimeTest, WithNoLoopLeftNoStopIsSeen) {
  t_.Begin(1.25, t0_);
  t_.End();
  EXPECT_EQ(t_.Total(t0_ + std::chrono::hours(1)), Clock::duration::zero());
  // A loop that begins later starts from its own first round.
  t_.Begin(1.25, t0_ + std::chrono::hours(1));
  EXPECT_EQ(t_.Round(t0_ + std::chrono::hours(1) + milliseconds(250)), Clock::duration::zero());
}

}  // namespace
}  // namespace sparseps
