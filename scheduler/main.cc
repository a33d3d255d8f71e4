// sparseps-scheduler: membership, barriers and liveness of one job.
#include "daemon/daemon.h"
#include "scheduler/scheduler_daemon.h"

int main(int argc, char** argv) {
  return sparseps::DaemonMain(argc, argv, "sparseps-scheduler",
                              "sparseps scheduler: registers servers and workers, assigns ranks "
                              "and key ranges, runs barriers and heartbeats, writes summary.json.",
                              sparseps::RunScheduler);
}
