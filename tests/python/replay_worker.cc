// A C++ worker that pushes known gradients, for tests/python/test_worker.py: it joins the job of
// --config (with --set overrides) through WorkerSession, as the worker daemon does, starts from
// the parameters p0[i] = ((i % 13) - 6) / 8 and for step t = 0 .. steps-1 aggregates the integer
// gradient g[i] = ((i * 7919 + t * 104729 + rank * 1299709) mod 41) - 20, appending the job's
// parameters after every step (num_params float32 each) to --out. The Python test does the same
// through sparseps.Worker and compares the two bitwise.
//
// With --final-out, after the last step it synchronizes (Aggregator::Synchronize: ssp / async's
// final pull, train.overlap: delay's last iteration) and writes the parameters, then its residual
// (num_params float32 each).
//
//   replay_worker --config F --num-params N --steps T --out FILE [--final-out FILE] [--set k=v]
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "common/command_line.h"
#include "config/config.h"
#include "worker/session.h"

namespace sparseps {
namespace {

int Run(int argc, char** argv) {
  CommandLine cli("push known gradients through a sparseps job (a test helper)", "replay_worker");
  std::string config_path, out_path, final_path;
  std::vector<std::string> overrides;
  int64_t num_params = 0, steps = 0;
  cli.Option("--config", &config_path, "", CommandLine::kRequired);
  cli.Option("--set", &overrides);
  cli.Option("--num-params", &num_params, "", CommandLine::kRequired);
  cli.Option("--steps", &steps, "", CommandLine::kRequired);
  cli.Option("--out", &out_path, "", CommandLine::kRequired);
  cli.Option("--final-out", &final_path);
  if (const int rc = cli.Parse(argc, argv); rc >= 0) return rc;
  if (num_params < 0) {
    std::fprintf(stderr, "replay_worker: --num-params must be >= 0\n");
    return 2;
  }
  const auto n = static_cast<size_t>(num_params);
  auto config = LoadConfig(config_path, overrides);
  if (!config.ok()) {
    std::fprintf(stderr, "replay_worker: %s\n", config.status().ToString().c_str());
    return 2;
  }
  auto session = WorkerSession::Join(*config, n, /*model_on_device=*/false);
  if (!session.ok()) {
    std::fprintf(stderr, "replay_worker: %s\n", session.status().ToString().c_str());
    return 1;
  }
  if (*session == nullptr) return 0;  // a replacement for a job that finished first
  WorkerSession& s = **session;
  Aggregator& agg = s.aggregator();
  std::vector<float> initial(n), grad(n);
  for (size_t i = 0; i < n; ++i) initial[i] = static_cast<float>(static_cast<int>(i % 13) - 6) / 8;
  Status st = agg.Init(initial);
  std::ofstream out(out_path, std::ios::binary | std::ios::trunc);
  const int64_t rank = s.rank();
  for (int64_t t = 0; st.ok() && t < steps; ++t) {
    for (size_t i = 0; i < n; ++i) {
      const int64_t v = (static_cast<int64_t>(i) * 7919 + t * 104729 + rank * 1299709) % 41;
      grad[i] = static_cast<float>(v - 20);
    }
    StepStats stats;
    st = agg.Step(grad.data(), false, &stats);
    out.write(reinterpret_cast<const char*>(agg.params().data()),
              static_cast<std::streamsize>(n * sizeof(float)));
  }
  if (st.ok() && !final_path.empty()) {
    st = agg.Synchronize();
    std::vector<float> residual;
    if (st.ok()) st = agg.ReadResidual(&residual);
    std::ofstream final_out(final_path, std::ios::binary | std::ios::trunc);
    final_out.write(reinterpret_cast<const char*>(agg.params().data()),
                    static_cast<std::streamsize>(n * sizeof(float)));
    final_out.write(reinterpret_cast<const char*>(residual.data()),
                    static_cast<std::streamsize>(residual.size() * sizeof(float)));
  }
  if (st.ok()) st = s.Finish(proto::WorkerStats());
  if (!st.ok()) {
    s.ReportFailure(st);
    std::fprintf(stderr, "replay_worker: %s\n", st.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace sparseps

int main(int argc, char** argv) { return sparseps::Run(argc, argv); }
