// sparseps-worker: trains on its data shard and pushes compressed gradients to the servers.
#include "daemon/daemon.h"
#include "worker/trainer.h"

int main(int argc, char** argv) {
  return sparseps::DaemonMain(argc, argv, "sparseps-worker",
                              "sparseps worker: trains the model on its data shard, compresses "
                              "gradients with error feedback, pushes to and pulls from the "
                              "servers.",
                              sparseps::RunWorker);
}
