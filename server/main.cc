// sparseps-server: one parameter-server shard.
#include "daemon/daemon.h"
#include "server/server_daemon.h"

int main(int argc, char** argv) {
  return sparseps::DaemonMain(argc, argv, "sparseps-server",
                              "sparseps server: holds one key range of the model, aggregates the "
                              "workers' compressed pushes (BSP) and answers pulls.",
                              sparseps::RunServer);
}
