// Joins a sparseps job through the installed client library (sparseps/client.h) as its only
// worker and checks the job's arithmetic exactly: with dense pushes, train.lr 1 and momentum 0,
// each step's new parameters are the old ones minus the gradient (integers in float: exact).
//   consumer CONFIG [key=value ...]
// Prints "consumer: ok" and exits 0, or names what differed and exits 1.
#include <sparseps/client.h>

#include <cstdio>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: consumer CONFIG [key=value ...]\n");
    return 2;
  }
  std::vector<std::string> overrides(argv + 2, argv + argc);
  try {
    sparseps::client::Worker worker(argv[1], overrides);
    const size_t n = 1000;
    std::vector<float> params(n);
    for (size_t i = 0; i < n; ++i) params[i] = static_cast<float>(i % 17) - 8.0f;
    const std::vector<float> initial = params;
    worker.Init(params);
    if (params != initial || worker.num_params() != n) {
      std::fprintf(stderr, "consumer: Init changed the only worker's parameters\n");
      return 1;
    }
    std::vector<float> grad(n), expect(n);
    for (int step = 1; step <= 5; ++step) {
      for (size_t i = 0; i < n; ++i) {
        grad[i] = static_cast<float>((i * 7 + static_cast<size_t>(step)) % 11) - 5.0f;
        expect[i] = params[i] - grad[i];
      }
      worker.PushPull(grad, params);
      for (size_t i = 0; i < n; ++i) {
        if (params[i] != expect[i]) {
          std::fprintf(stderr, "consumer: step %d, parameter %zu is %g, expected %g\n", step, i,
                       static_cast<double>(params[i]), static_cast<double>(expect[i]));
          return 1;
        }
      }
    }
    // A gradient of the wrong size is refused with kInvalidArgument, and the job goes on.
    std::vector<float> short_grad(n - 1);
    try {
      worker.PushPull(short_grad, params);
      std::fprintf(stderr, "consumer: a short gradient was taken\n");
      return 1;
    } catch (const sparseps::client::Error& e) {
      if (e.code() != sparseps::client::ErrorCode::kInvalidArgument) throw;
    }
    worker.Finish(/*test_accuracy=*/-1.0, /*train_loss=*/0.0);
    std::printf("consumer: ok, sparseps %s, %llu steps, %llu bytes sent\n",
                sparseps::client::Version().c_str(), static_cast<unsigned long long>(worker.step()),
                static_cast<unsigned long long>(worker.bytes_sent()));
  } catch (const sparseps::client::Error& e) {
    std::fprintf(stderr, "consumer: %s\n", e.what());
    return 1;
  }
  return 0;
}
