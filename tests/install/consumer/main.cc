// Joins a sparseps job through the installed client library (sparseps/client.h) as its only
// worker and checks the job's arithmetic exactly: with dense pushes, train.lr 1 and momentum 0,
// each step's new parameters are the old ones minus the gradient (integers in float: exact).
//   consumer CONFIG [key=value ...]
// Prints "consumer: ok" and exits 0, or names what differed and exits 1.
#include <sparseps/client.h>

#include <algorithm>
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
    // The forms a loop that applies the update itself uses: the update into a zeroed array, and
    // the sparse form; dense pushes change every key, by exactly the gradient.
    std::vector<float> update(n, 0.0f);
    const sparseps::client::Buffer g{grad.data(), n, sparseps::client::kHost};
    worker.PushPull(std::span<const sparseps::client::Buffer>(&g, 1), update.data());
    for (size_t i = 0; i < n; ++i) {
      if (update[i] != grad[i] || worker.params()[i] != params[i] - grad[i]) {
        std::fprintf(stderr, "consumer: the update at %zu is %g, expected %g\n", i,
                     static_cast<double>(update[i]), static_cast<double>(grad[i]));
        return 1;
      }
      params[i] -= update[i];
    }
    // The sparse form: the keys whose parameters moved (the gradient's nonzero ones, here).
    const sparseps::client::SparseUpdate sparse =
        worker.PushPullSparse(std::span<const sparseps::client::Buffer>(&g, 1));
    const size_t nonzero = static_cast<size_t>(
        std::count_if(grad.begin(), grad.end(), [](float v) { return v != 0.0f; }));
    bool exact = sparse.keys.size() == nonzero;
    for (size_t j = 0; exact && j < sparse.keys.size(); ++j) {
      const auto key = static_cast<size_t>(sparse.keys[j]);
      exact = sparse.update[j] == grad[key] && sparse.params[j] == params[key] - grad[key];
    }
    if (!exact) {
      std::fprintf(stderr,
                   "consumer: the sparse update has %zu keys, not the %zu of the gradient\n",
                   sparse.keys.size(), nonzero);
      return 1;
    }
    for (size_t j = 0; j < sparse.keys.size(); ++j) params[sparse.keys[j]] = sparse.params[j];
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
