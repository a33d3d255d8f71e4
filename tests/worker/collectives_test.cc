// The allreduce-mode collectives, run by 2 to 5 worker processes on loopback.
//
// Every worker feeds integer-valued gradients (so float sums are exact) and accumulates them into
// its x as the trainer does; after each call the test checks, across all processes:
//  - the update is bitwise identical on every worker;
//  - conservation: sum over workers of x (the residuals) + all updates so far == all gradients
//    so far, exactly;
//  - dense collectives: the residual is zero, so the update is the exact sum;
//  - the budget: gtopk applies at most k entries, spardl at most B k_b, topk_allgather P k,
//    and ExDyna's global count stays within 20% of k once its threshold has settled.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>

#include "common/sanitizers.h"
#include "encodings/compressor.h"
#include "kernels/error_feedback.h"
#include "tests/support/process.h"
#include "transport/control_client.h"
#include "worker/collectives/collective.h"
#include "worker/collectives/exdyna.h"
#include "worker/collectives/powersgd.h"
#if SPARSEPS_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "worker/cuda/gpu_contribution.h"
#endif

namespace sparseps {
namespace {

// Gradient of worker w at iteration t: integers in [-100, 100], ten times larger on every 37th
// key so that the workers' selections overlap.
float Grad(int w, int t, size_t i) {
  uint64_t h =
      (static_cast<uint64_t>(w) * 1000003u + static_cast<uint64_t>(t)) * 0x9e3779b97f4a7c15ULL +
      i * 0xbf58476d1ce4e5b9ULL;
  h ^= h >> 31;
  h *= 0x94d049bb133111ebULL;
  h ^= h >> 29;
  const float v = static_cast<float>(static_cast<int>(h % 201) - 100);
  return i % 37 == 0 ? 10.0f * v : v;
}

// Where the contribution lives.
enum class Input {
  kHost,      // a host vector (HostContribution)
  kCounting,  // a host vector behind CountingContribution (below)
  kGpu,       // device memory (GpuContribution; CUDA builds)
  kDeferred,  // a host vector whose accumulation (a momentum correction with m = 0: u = g;
              // x += u) the collective applies (Collective::Allreduce(x, u, g, m, ...))
};

// A HostContribution that counts the floats (keys and values) each operation moves between the
// contribution and the collective: what a GPU worker's contribution copies between device and
// host.
class CountingContribution final : public Contribution {
 public:
  CountingContribution(std::vector<float>* x, Selector* selector) : host_(x, selector) {}
  size_t size() const override { return host_.size(); }
  Status Select(size_t k, std::vector<uint32_t>* keys) override {
    Status s = host_.Select(k, keys);
    moved_ += keys->size();
    selected_ += keys->size();
    return s;
  }
  Status SelectAtLeast(size_t begin, size_t end, float threshold,
                       std::vector<uint32_t>* keys) override {
    Status s = host_.SelectAtLeast(begin, end, threshold, keys);
    moved_ += keys->size();
    selected_ += keys->size();
    return s;
  }
  Status SampledMagnitude(size_t begin, size_t end, size_t sample, size_t rank,
                          float* out) override {
    moved_ += end - begin;  // the GPU reads the range on the host
    return host_.SampledMagnitude(begin, end, sample, rank, out);
  }
  Status Take(std::span<const uint32_t> keys, float* values) override {
    moved_ += 2 * keys.size();
    return host_.Take(keys, values);
  }
  Status Add(const SparseVector& entries) override {
    moved_ += 2 * entries.size();
    return host_.Add(entries);
  }
  Status Set(const SparseVector& entries) override {
    moved_ += 2 * entries.size();
    return host_.Set(entries);
  }
  Status Read(float* out, bool zero) override {
    moved_ += size();
    return host_.Read(out, zero);
  }
  Status Write(const float* in) override {
    moved_ += size();
    return host_.Write(in);
  }
  uint64_t moved() const { return moved_; }
  // Keys the selections returned.
  uint64_t selected() const { return selected_; }

 private:
  HostContribution host_;
  uint64_t moved_ = 0, selected_ = 0;
};

struct RunSetup {
  proto::CollectiveAlgorithm algorithm = proto::RING;
  Input input = Input::kHost;
  proto::Selection selection = proto::EXACT;
  int workers = 2;
  size_t n = 5003;
  double density = 0.02;
  int iterations = 12;
  uint32_t teams = 1;
  uint64_t segment_bytes = 1024;  // several segments per chunk even at this size
  uint32_t powersgd_rank = 4;
  // At iteration switch_at (when >= 0) k becomes density_after * n (set_k, as SetEpoch does when
  // DGC's density warm-up ends an epoch).
  int switch_at = -1;
  double density_after = 0;
};

// One child: runs the collective and writes, per iteration, the update (dense, n floats), the
// residual (n floats) and the update's entry count to `path`. Exits 0 on success.
[[noreturn]] void Child(const RunSetup& s, int rank, int up_fd, int down_fd,
                        const std::string& path) {
  auto fail = [&](const std::string& why) {
    std::fprintf(stderr, "worker %d: %s\n", rank, why.c_str());
    std::fflush(stderr);
    _exit(1);
  };
  {
    // The ZeroMQ objects must be destroyed before _exit: that flushes the last queued sends.
    zmq::context_t context(1);
    auto group = PeerGroup::Bind(context, "127.0.0.1", 0, 30.0);
    if (!group.ok()) fail(group.status().ToString());
    const uint32_t msg[2] = {static_cast<uint32_t>(rank), (*group)->port()};
    if (write(up_fd, msg, sizeof msg) != static_cast<ssize_t>(sizeof msg)) fail("write port");
    std::vector<uint32_t> ports(static_cast<size_t>(s.workers));
    size_t got = 0;
    while (got < ports.size() * 4) {
      const ssize_t r =
          read(down_fd, reinterpret_cast<char*>(ports.data()) + got, ports.size() * 4 - got);
      if (r <= 0) fail("read ports");
      got += static_cast<size_t>(r);
    }
    std::vector<PeerGroup::PeerAddress> peers;
    for (uint32_t p : ports) peers.push_back({"127.0.0.1", p, "", ""});
    (*group)->Connect(rank, peers);

    proto::JobConfig config;
    config.set_aggregation(proto::ALLREDUCE);
    config.mutable_node()->set_host("127.0.0.1");
    config.mutable_compression()->set_density(s.density);
    config.mutable_collective()->set_algorithm(s.algorithm);
    config.mutable_collective()->set_teams(s.teams);
    config.mutable_collective()->set_segment_bytes(s.segment_bytes);
    config.mutable_compression()->set_selection(s.selection);
    config.mutable_compression()->set_sample_ratio(0.05);
    config.mutable_collective()->set_powersgd_rank(s.powersgd_rank);
    auto collective = MakeCollective(config, group->get(), s.n);
    if (!collective.ok()) fail(collective.status().ToString());
    const size_t k = (*collective)->k();
    Selector selector(s.selection, 0.05, k);
#if SPARSEPS_HAVE_CUDA
    std::unique_ptr<GpuContribution> gpu;
    float* grad_d = nullptr;
    if (s.input == Input::kGpu) {
      // Momentum 0: u = g, so x gains the integer gradient as on the host.
      auto made = GpuContribution::Make(s.n, s.selection, 0.05, k, 0.0f, false);
      if (!made.ok()) fail(made.status().ToString());
      gpu = std::move(*made);
      if (cudaMalloc(reinterpret_cast<void**>(&grad_d), s.n * sizeof(float)) != cudaSuccess) {
        fail("cudaMalloc");
      }
    }
#else
    if (s.input == Input::kGpu) fail("no CUDA in this build");
#endif

    std::ofstream out(path, std::ios::binary);
    std::vector<float> x(s.n, 0.0f), dense(s.n), g(s.n), u(s.n, 0.0f);
    CollectiveUpdate update;
    CountingContribution counting(&x, &selector);
    for (int t = 0; t < s.iterations; ++t) {
      if (t == s.switch_at) {
        (*collective)->set_k(static_cast<size_t>(s.density_after * static_cast<double>(s.n)));
      }
      for (size_t i = 0; i < s.n; ++i) g[i] = Grad(rank, t, i);
      Status st;
      const uint64_t moved_before = counting.moved(), selected_before = counting.selected();
      switch (s.input) {
        case Input::kHost:
          for (size_t i = 0; i < s.n; ++i) x[i] += g[i];
          st = (*collective)->Allreduce(&x, &update);
          break;
        case Input::kCounting:
          for (size_t i = 0; i < s.n; ++i) x[i] += g[i];
          st = (*collective)->Allreduce(&counting, &update);
          break;
        case Input::kDeferred:
          st = (*collective)->Allreduce(&x, u.data(), g.data(), 0.0f, &update);
          break;
        case Input::kGpu: {
#if SPARSEPS_HAVE_CUDA
          if (cudaMemcpy(grad_d, g.data(), s.n * sizeof(float), cudaMemcpyHostToDevice) !=
              cudaSuccess) {
            fail("cudaMemcpy");
          }
          st = gpu->Accumulate(grad_d);
          if (st.ok()) st = (*collective)->Allreduce(gpu.get(), &update);
          if (st.ok() && !update.dense) st = gpu->MaskMomentum(update.indices);
          if (st.ok()) st = gpu->Read(x.data(), /*zero=*/false);
#endif
          break;
        }
      }
      if (!st.ok()) fail("iteration " + std::to_string(t) + ": " + st.ToString());
      uint64_t count = s.n;
      if (update.dense) {
        dense = update.sum;
      } else {
        std::fill(dense.begin(), dense.end(), 0.0f);
        for (size_t e = 0; e < update.indices.size(); ++e) {
          if (e > 0 && update.indices[e] <= update.indices[e - 1]) fail("keys not increasing");
          dense[update.indices[e]] = update.values[e];
        }
        count = update.indices.size();
      }
      out.write(reinterpret_cast<const char*>(dense.data()), static_cast<std::streamsize>(s.n * 4));
      out.write(reinterpret_cast<const char*>(x.data()), static_cast<std::streamsize>(s.n * 4));
      out.write(reinterpret_cast<const char*>(&count), sizeof count);
      const uint64_t moved[2] = {counting.moved() - moved_before,
                                 counting.selected() - selected_before};
      out.write(reinterpret_cast<const char*>(moved), sizeof moved);
    }
    out.close();
    if (!out) fail("write " + path);
    collective->reset();
#if SPARSEPS_HAVE_CUDA
    gpu.reset();
    if (grad_d != nullptr) cudaFree(grad_d);
#endif
  }
  _exit(0);
}

struct Result {
  // [worker][iteration]
  std::vector<std::vector<std::vector<float>>> updates, residuals;
  std::vector<std::vector<uint64_t>> counts;
  // Input::kCounting, per iteration: floats moved, keys selected.
  std::vector<std::vector<uint64_t>> moved, selected;
};

// Forks s.workers children, hands them each other's ports, waits (60 s deadline, then kills them
// by pid) and reads what they wrote. Fails the test when a child fails.
bool RunWorkers(const RunSetup& s, Result* result) {
  char dir_template[] = "/tmp/sparseps-collectives-XXXXXX";
  const char* dir = mkdtemp(dir_template);
  if (dir == nullptr) {
    ADD_FAILURE() << "mkdtemp failed";
    return false;
  }
  struct Cleanup {
    std::string dir;
    ~Cleanup() { std::filesystem::remove_all(dir); }
  } cleanup{dir};
  int up[2];
  if (pipe(up) != 0) return false;
  std::vector<std::array<int, 2>> down(static_cast<size_t>(s.workers));
  std::vector<pid_t> pids;
  for (int w = 0; w < s.workers; ++w) {
    if (pipe(down[static_cast<size_t>(w)].data()) != 0) return false;
  }
  for (int w = 0; w < s.workers; ++w) {
    const pid_t pid = fork();
    if (pid == 0) {
      close(up[0]);
      Child(s, w, up[1], down[static_cast<size_t>(w)][0],
            std::string(dir) + "/w" + std::to_string(w) + ".bin");
    }
    pids.push_back(pid);
  }
  close(up[1]);
  struct Killer {
    std::vector<pid_t>* pids;
    ~Killer() {
      for (pid_t p : *pids) {
        if (p > 0 && kill(p, 0) == 0) {
          kill(p, SIGKILL);
          waitpid(p, nullptr, 0);
        }
      }
    }
  } killer{&pids};
  std::vector<uint32_t> ports(static_cast<size_t>(s.workers), 0);
  for (int i = 0; i < s.workers; ++i) {
    pollfd pfd{up[0], POLLIN, 0};
    if (poll(&pfd, 1, 20000) <= 0) {
      ADD_FAILURE() << "a worker did not report its port";
      return false;
    }
    uint32_t msg[2];
    if (read(up[0], msg, sizeof msg) != static_cast<ssize_t>(sizeof msg) ||
        msg[0] >= ports.size()) {
      ADD_FAILURE() << "bad port report";
      return false;
    }
    ports[msg[0]] = msg[1];
  }
  close(up[0]);
  for (auto& d : down) {
    if (write(d[1], ports.data(), ports.size() * 4) != static_cast<ssize_t>(ports.size() * 4)) {
      return false;
    }
    close(d[0]);
    close(d[1]);
  }
  bool ok = true;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (size_t w = 0; w < pids.size(); ++w) {
    int status = 0;
    while (waitpid(pids[w], &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        ADD_FAILURE() << "worker " << w << " did not finish within 60 s";
        return false;
      }
      usleep(10000);
    }
    pids[w] = -1;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      ADD_FAILURE() << "worker " << w << " failed (status " << status << "); see its stderr";
      ok = false;
    }
  }
  if (!ok) return false;
  result->updates.assign(static_cast<size_t>(s.workers), {});
  result->residuals.assign(static_cast<size_t>(s.workers), {});
  result->counts.assign(static_cast<size_t>(s.workers), {});
  result->moved.assign(static_cast<size_t>(s.workers), {});
  result->selected.assign(static_cast<size_t>(s.workers), {});
  for (int w = 0; w < s.workers; ++w) {
    std::ifstream in(std::string(dir) + "/w" + std::to_string(w) + ".bin", std::ios::binary);
    for (int t = 0; t < s.iterations; ++t) {
      std::vector<float> u(s.n), r(s.n);
      uint64_t count = 0, moved[2] = {0, 0};
      in.read(reinterpret_cast<char*>(u.data()), static_cast<std::streamsize>(s.n * 4));
      in.read(reinterpret_cast<char*>(r.data()), static_cast<std::streamsize>(s.n * 4));
      in.read(reinterpret_cast<char*>(&count), sizeof count);
      in.read(reinterpret_cast<char*>(moved), sizeof moved);
      if (!in) {
        ADD_FAILURE() << "short output of worker " << w;
        return false;
      }
      result->updates[static_cast<size_t>(w)].push_back(std::move(u));
      result->residuals[static_cast<size_t>(w)].push_back(std::move(r));
      result->counts[static_cast<size_t>(w)].push_back(count);
      result->moved[static_cast<size_t>(w)].push_back(moved[0]);
      result->selected[static_cast<size_t>(w)].push_back(moved[1]);
    }
  }
  return true;
}

// Identical updates and exact conservation at every iteration; returns false at the first breach.
void CheckInvariants(const RunSetup& s, const Result& r) {
  std::vector<double> pushed(s.n, 0.0), applied(s.n, 0.0);
  for (int t = 0; t < s.iterations; ++t) {
    const auto& u0 = r.updates[0][static_cast<size_t>(t)];
    for (int w = 1; w < s.workers; ++w) {
      ASSERT_EQ(
          0, std::memcmp(u0.data(),
                         r.updates[static_cast<size_t>(w)][static_cast<size_t>(t)].data(), s.n * 4))
          << "worker " << w << " applied a different update at iteration " << t;
    }
    for (size_t i = 0; i < s.n; ++i) {
      for (int w = 0; w < s.workers; ++w) pushed[i] += Grad(w, t, i);
      applied[i] += u0[i];
      double held = 0.0;
      for (int w = 0; w < s.workers; ++w) {
        held += r.residuals[static_cast<size_t>(w)][static_cast<size_t>(t)][i];
      }
      ASSERT_EQ(applied[i] + held, pushed[i])
          << "conservation broken at iteration " << t << ", key " << i << ": applied " << applied[i]
          << " + residuals " << held << " != pushed " << pushed[i];
    }
  }
}

class CollectiveTest
    : public ::testing::TestWithParam<std::tuple<proto::CollectiveAlgorithm, int>> {};

TEST_P(CollectiveTest, UpdatesAreIdenticalAndNothingIsLost) {
  RunSetup s;
  s.algorithm = std::get<0>(GetParam());
  s.workers = std::get<1>(GetParam());
  Result r;
  ASSERT_TRUE(RunWorkers(s, &r));
  CheckInvariants(s, r);
  const size_t k = static_cast<size_t>(std::llround(s.density * static_cast<double>(s.n)));
  for (int t = 0; t < s.iterations; ++t) {
    const uint64_t count = r.counts[0][static_cast<size_t>(t)];
    switch (s.algorithm) {
      case proto::RING:
      case proto::GLOO:
        for (int w = 0; w < s.workers; ++w) {
          for (float v : r.residuals[static_cast<size_t>(w)][static_cast<size_t>(t)]) {
            ASSERT_EQ(v, 0.0f);
          }
        }
        break;
      case proto::GTOPK:
        EXPECT_LE(count, k);
        EXPECT_GT(count, 0u);
        break;
      case proto::SPARDL: {
        const size_t kb = (k + static_cast<size_t>(s.workers) - 1) / static_cast<size_t>(s.workers);
        EXPECT_LE(count, kb * static_cast<size_t>(s.workers));
        EXPECT_GT(count, 0u);
        break;
      }
      case proto::TOPK_ALLGATHER:
        EXPECT_LE(count, k * static_cast<size_t>(s.workers));
        EXPECT_GE(count, k);
        break;
      default:
        break;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(ProcessesOnLoopback, CollectiveTest,
                         ::testing::Combine(::testing::Values(proto::RING, proto::GLOO,
                                                              proto::TOPK_ALLGATHER, proto::GTOPK,
                                                              proto::SPARDL, proto::EXDYNA),
                                            ::testing::Values(2, 3, 4, 5)),
                         [](const auto& info) {
                           std::string name =
                               proto::CollectiveAlgorithm_Name(std::get<0>(info.param));
                           return name + "_" + std::to_string(std::get<1>(info.param)) + "workers";
                         });

// PowerSGD (Vogels et al. 2019, Algorithm 1) in double precision: the updates and residuals of
// `workers` workers whose contributions gain Grad(w, t, .) each iteration, for the layers of
// `options` (rank options.powersgd_rank, seed options.seed).
struct PowerSgdReference {
  std::vector<std::vector<double>> updates;                 // [iteration][key]
  std::vector<std::vector<std::vector<double>>> residuals;  // [iteration][worker][key]
};

PowerSgdReference ReferencePowerSgd(const CollectiveOptions& options, int workers, int iterations) {
  const auto layers = PowerSgdLayers(options);
  const size_t n = options.num_params;
  std::vector<std::vector<double>> q(layers.size()),
      x(static_cast<size_t>(workers), std::vector<double>(n, 0.0));
  for (size_t l = 0; l < layers.size(); ++l) {
    if (layers[l].rank == 0) continue;
    const auto f = PowerSgdInitialQ(options.seed, l, layers[l].cols, layers[l].rank);
    q[l].assign(f.begin(), f.end());
  }
  PowerSgdReference ref;
  for (int t = 0; t < iterations; ++t) {
    std::vector<double> update(n, 0.0);
    for (int w = 0; w < workers; ++w) {
      for (size_t i = 0; i < n; ++i) x[static_cast<size_t>(w)][i] += Grad(w, t, i);
    }
    for (size_t l = 0; l < layers.size(); ++l) {
      const auto& y = layers[l];
      const size_t rows = y.rows, cols = y.cols, r = y.rank;
      auto m = [&](int w, size_t i, size_t j) -> double& {
        return x[static_cast<size_t>(w)][y.first + i * cols + j];
      };
      if (r == 0) {
        for (size_t i = 0; i < rows * cols; ++i) {
          for (int w = 0; w < workers; ++w) {
            update[y.first + i] += x[static_cast<size_t>(w)][y.first + i];
            x[static_cast<size_t>(w)][y.first + i] = 0.0;
          }
        }
        continue;
      }
      std::vector<double> p(rows * r, 0.0);  // sum over workers of M_w Q
      for (int w = 0; w < workers; ++w) {
        for (size_t i = 0; i < rows; ++i) {
          for (size_t j = 0; j < cols; ++j) {
            for (size_t k = 0; k < r; ++k) p[i * r + k] += m(w, i, j) * q[l][j * r + k];
          }
        }
      }
      for (size_t k = 0; k < r; ++k) {  // Gram-Schmidt
        double before = 0.0;
        for (size_t i = 0; i < rows; ++i) before += p[i * r + k] * p[i * r + k];
        for (size_t j = 0; j < k; ++j) {
          double dot = 0.0;
          for (size_t i = 0; i < rows; ++i) dot += p[i * r + k] * p[i * r + j];
          for (size_t i = 0; i < rows; ++i) p[i * r + k] -= dot * p[i * r + j];
        }
        double norm = 0.0;
        for (size_t i = 0; i < rows; ++i) norm += p[i * r + k] * p[i * r + k];
        const double scale = norm > 1e-10 * before ? 1.0 / std::sqrt(norm) : 0.0;
        for (size_t i = 0; i < rows; ++i) p[i * r + k] *= scale;
      }
      std::vector<double> qsum(cols * r, 0.0);
      for (int w = 0; w < workers; ++w) {
        std::vector<double> qw(cols * r, 0.0);
        for (size_t i = 0; i < rows; ++i) {
          for (size_t j = 0; j < cols; ++j) {
            for (size_t k = 0; k < r; ++k) qw[j * r + k] += m(w, i, j) * p[i * r + k];
          }
        }
        for (size_t i = 0; i < rows; ++i) {
          for (size_t j = 0; j < cols; ++j) {
            double own = 0.0;
            for (size_t k = 0; k < r; ++k) own += p[i * r + k] * qw[j * r + k];
            m(w, i, j) -= own;
          }
        }
        for (size_t e = 0; e < qw.size(); ++e) qsum[e] += qw[e];
      }
      for (size_t i = 0; i < rows; ++i) {
        for (size_t j = 0; j < cols; ++j) {
          double a = 0.0;
          for (size_t k = 0; k < r; ++k) a += p[i * r + k] * qsum[j * r + k];
          update[y.first + i * cols + j] = a;
        }
      }
      q[l] = qsum;
    }
    ref.updates.push_back(update);
    ref.residuals.push_back(x);
  }
  return ref;
}

TEST(PowerSgd, OrthonormalizeGivesOrthonormalColumnsAndKeepsAZeroColumnZero) {
  constexpr uint64_t kRows = 50;
  constexpr uint32_t kRank = 4;
  std::vector<float> p(kRows * kRank);
  for (size_t i = 0; i < p.size(); ++i) p[i] = Grad(0, 0, i) / 7.0f;
  for (uint64_t i = 0; i < kRows; ++i) p[i * kRank + 3] = 2.0f * p[i * kRank + 1];  // dependent
  Orthonormalize(p.data(), kRows, kRank);
  for (uint32_t a = 0; a < kRank; ++a) {
    for (uint32_t b = 0; b < kRank; ++b) {
      double dot = 0.0;
      for (uint64_t i = 0; i < kRows; ++i) dot += double{p[i * kRank + a]} * p[i * kRank + b];
      const double expect = a == b && a != 3 ? 1.0 : 0.0;
      EXPECT_NEAR(dot, expect, 1e-5) << "columns " << a << " and " << b;
    }
  }
}

TEST(PowerSgd, LayersAreMatricesWhereRankRSendsLessAndTheRestIsDense) {
  CollectiveOptions o;
  o.powersgd_rank = 4;
  o.layers = {{"fc0.weight", {784, 256}, 0},
              {"fc0.bias", {256}, 200704},
              {"fc1.weight", {256, 10}, 200960},
              {"fc1.bias", {10}, 203520}};
  o.num_params = 203530;
  const auto layers = PowerSgdLayers(o);
  ASSERT_EQ(layers.size(), 4u);
  EXPECT_EQ((std::vector<uint64_t>{layers[0].rows, layers[0].cols, layers[0].rank}),
            (std::vector<uint64_t>{784, 256, 4}));
  EXPECT_EQ(layers[1].rank, 0u);  // a bias: summed densely
  EXPECT_EQ(layers[2].rank, 4u);  // 4 (256 + 10) = 1064 < 2560
  EXPECT_EQ(layers[3].rank, 0u);
  o.powersgd_rank = 8;
  EXPECT_EQ(PowerSgdLayers(o)[2].rank, 8u);  // 8 (266) = 2128 < 2560
  o.powersgd_rank = 10;
  EXPECT_EQ(PowerSgdLayers(o)[2].rank, 0u) << "10 (266) = 2660 >= 2560: dense";
  o.layers.clear();
  o.num_params = 4800;  // 64 x 75: 64 is the largest divisor not above sqrt(4800)
  o.powersgd_rank = 4;
  const auto flat = PowerSgdLayers(o);
  ASSERT_EQ(flat.size(), 1u);
  EXPECT_EQ((std::vector<uint64_t>{flat[0].rows, flat[0].cols}), (std::vector<uint64_t>{64, 75}));
}

// Processes on loopback: every worker applies the same update, bitwise; the updates and
// residuals are those of a double-precision reference of the algorithm within 1e-4 of the largest
// update (2e-6 measured);
// nothing is lost (applied + residuals == pushed, within float rounding).
TEST(PowerSgd, MatchesTheReferenceAndConservesWithErrorFeedback) {
  for (int workers : {2, 3}) {
    SCOPED_TRACE(std::to_string(workers) + " workers");
    RunSetup s;
    s.algorithm = proto::POWERSGD;
    s.workers = workers;
    s.n = 4800;  // one 64 x 75 matrix
    s.iterations = 6;
    Result r;
    ASSERT_TRUE(RunWorkers(s, &r));
    CollectiveOptions o;
    o.num_params = s.n;
    o.powersgd_rank = s.powersgd_rank;
    o.seed = proto::JobConfig().train().seed();  // the children's config: the default
    const PowerSgdReference ref = ReferencePowerSgd(o, s.workers, s.iterations);
    std::vector<double> pushed(s.n, 0.0), applied(s.n, 0.0);
    for (int t = 0; t < s.iterations; ++t) {
      const size_t ti = static_cast<size_t>(t);
      const auto& u0 = r.updates[0][ti];
      for (int w = 1; w < s.workers; ++w) {
        ASSERT_EQ(0, std::memcmp(u0.data(), r.updates[static_cast<size_t>(w)][ti].data(), s.n * 4))
            << "worker " << w << " applied a different update at iteration " << t;
      }
      double scale = 0.0;
      for (double v : ref.updates[ti]) scale = std::max(scale, std::abs(v));
      ASSERT_GT(scale, 0.0);
      for (size_t i = 0; i < s.n; ++i) {
        ASSERT_NEAR(u0[i], ref.updates[ti][i], 1e-4 * scale) << "iteration " << t << ", key " << i;
        double held = 0.0;
        for (int w = 0; w < s.workers; ++w) {
          const float mine = r.residuals[static_cast<size_t>(w)][ti][i];
          ASSERT_NEAR(mine, ref.residuals[ti][static_cast<size_t>(w)][i], 1e-4 * scale)
              << "worker " << w << ", iteration " << t << ", key " << i;
          held += mine;
          pushed[i] += Grad(w, t, i);
        }
        applied[i] += u0[i];
        ASSERT_NEAR(applied[i] + held, pushed[i], 1e-4 * (std::abs(pushed[i]) + scale))
            << "conservation, iteration " << t << ", key " << i;
      }
    }
  }
}

TEST(SparDLTeams, TwoTeamsOfTwoAndThreeTeamsOfTwoConserveExactly) {
  for (auto [workers, teams] : {std::pair{4, 2u}, std::pair{6, 3u}, std::pair{3, 3u}}) {
    SCOPED_TRACE(std::to_string(workers) + " workers, " + std::to_string(teams) + " teams");
    RunSetup s;
    s.algorithm = proto::SPARDL;
    s.workers = workers;
    s.teams = teams;
    Result r;
    ASSERT_TRUE(RunWorkers(s, &r));
    CheckInvariants(s, r);
  }
}

// Worker 0's mean global count over iterations [from, to).
double MeanCount(const Result& r, int from, int to) {
  double sum = 0;
  for (int t = from; t < to; ++t) sum += static_cast<double>(r.counts[0][static_cast<size_t>(t)]);
  return sum / (to - from);
}

// An ExDyna run of `workers` workers over n keys at `density` for `iterations` iterations.
RunSetup ExDynaSetup(int workers, size_t n, double density, int iterations) {
  RunSetup s;
  s.algorithm = proto::EXDYNA;
  s.workers = workers;
  s.n = n;
  s.density = density;
  s.iterations = iterations;
  return s;
}

TEST(ExDynaDensity, GlobalCountStaysWithinTwentyPercentOfTheTarget) {
  // Under ASan (-O0: 14 s for all four) the smallest and the largest group.
  const std::vector<int> groups =
      SPARSEPS_ADDRESS_SANITIZER ? std::vector<int>{2, 5} : std::vector<int>{2, 3, 4, 5};
  for (int workers : groups) {
    SCOPED_TRACE(std::to_string(workers) + " workers");
    const RunSetup s = ExDynaSetup(workers, 8192, 0.05, 160);
    Result r;
    ASSERT_TRUE(RunWorkers(s, &r));
    CheckInvariants(s, r);
    const double k = s.density * static_cast<double>(s.n);
    const double mean = MeanCount(r, s.iterations / 2, s.iterations);
    EXPECT_NEAR(mean / k, 1.0, 0.2) << "mean global count " << mean << " for k = " << k;
  }
}

// DGC's density warm-up ends an epoch with 10x fewer keys (set_k): ExDyna estimates its threshold
// afresh, so the global count is near the new k within a few iterations (walking there at 3% a
// step took about 80 iterations, selecting several times k meanwhile).
TEST(ExDynaDensity, ANewKIsReachedWithinAFewIterations) {
  RunSetup s = ExDynaSetup(3, 32768, 0.05, 80);
  s.switch_at = 40;
  s.density_after = 0.005;
  Result r;
  ASSERT_TRUE(RunWorkers(s, &r));
  CheckInvariants(s, r);
  const double k = s.density_after * static_cast<double>(s.n);
  const double mean = MeanCount(r, s.switch_at + 5, s.iterations);
  EXPECT_GT(mean / k, 0.5) << "mean global count " << mean << " for k = " << k;
  EXPECT_LT(mean / k, 1.6) << "mean global count " << mean << " for k = " << k;
}

// Runs a and b (the same collective, another contribution) and expects bitwise the same
// updates and residuals, and b to keep the invariants.
void ExpectSameRuns(const RunSetup& a, const RunSetup& b, Result* rb) {
  Result ra;
  ASSERT_TRUE(RunWorkers(a, &ra));
  ASSERT_TRUE(RunWorkers(b, rb));
  CheckInvariants(b, *rb);
  for (int w = 0; w < a.workers; ++w) {
    for (int t = 0; t < a.iterations; ++t) {
      const size_t ws = static_cast<size_t>(w), ts = static_cast<size_t>(t);
      ASSERT_EQ(0, std::memcmp(ra.updates[ws][ts].data(), rb->updates[ws][ts].data(), a.n * 4))
          << "worker " << w << ", iteration " << t << ": another update";
      ASSERT_EQ(0, std::memcmp(ra.residuals[ws][ts].data(), rb->residuals[ws][ts].data(), a.n * 4))
          << "worker " << w << ", iteration " << t << ": another residual";
    }
  }
}

// Every collective, and the sparse ones in every selection mode, on 3 workers.
std::vector<RunSetup> ContributionSetups() {
  std::vector<RunSetup> setups;
  for (auto algorithm : {proto::RING, proto::GLOO, proto::SPARDL, proto::EXDYNA}) {
    RunSetup s;
    s.algorithm = algorithm;
    s.workers = 3;
    setups.push_back(s);
  }
  for (auto algorithm : {proto::TOPK_ALLGATHER, proto::GTOPK}) {
    for (auto selection : {proto::EXACT, proto::SAMPLED_THRESHOLD, proto::SCALED_THRESHOLD}) {
      RunSetup s;
      s.algorithm = algorithm;
      s.selection = selection;
      s.workers = 3;
      setups.push_back(s);
    }
  }
  return setups;
}

std::string SetupName(const RunSetup& s) {
  return proto::CollectiveAlgorithm_Name(s.algorithm) + ", " + proto::Selection_Name(s.selection);
}

// What a GPU worker copies between device and host per iteration, counted on the host, for s
// keys selected and an update of c entries: TopK-AllGather s keys and s entries taken (3 s);
// gTop-k the same and its put-backs (own values at at most s keys, dropped sums at at most c);
// ExDyna its own keys and the union's entries (s + 2 c) after the first iteration's sampled
// range; the dense collectives the vector; SparDL the vector and its dropped sums at the update's
// keys. Exact top-k selects k, the sampled threshold at most 1.3 k. The results are bitwise those
// of the plain host vector.
TEST(Contribution, SparseCollectivesMoveOnlyTheSelectedEntries) {
  for (const RunSetup& s : ContributionSetups()) {
    SCOPED_TRACE(SetupName(s));
    RunSetup counted = s;
    counted.input = Input::kCounting;
    Result r;
    ExpectSameRuns(s, counted, &r);
    const uint64_t k = static_cast<uint64_t>(std::llround(s.density * static_cast<double>(s.n)));
    for (int w = 0; w < s.workers; ++w) {
      for (int t = 0; t < s.iterations; ++t) {
        SCOPED_TRACE("worker " + std::to_string(w) + ", iteration " + std::to_string(t));
        const size_t ws = static_cast<size_t>(w), ts = static_cast<size_t>(t);
        const uint64_t moved = r.moved[ws][ts], sel = r.selected[ws][ts], c = r.counts[ws][ts];
        switch (s.algorithm) {
          case proto::RING:
          case proto::GLOO:
            ASSERT_EQ(moved, s.n);
            break;
          case proto::SPARDL:
            ASSERT_EQ(moved, s.n + 2 * c);
            break;
          case proto::EXDYNA:
            if (t > 0) {
              ASSERT_EQ(moved, sel + 2 * c);
            }
            break;
          case proto::TOPK_ALLGATHER:
            ASSERT_EQ(moved, 3 * sel);
            break;
          default:
            ASSERT_GE(moved, 3 * sel);
            ASSERT_LE(moved, 5 * sel + 2 * c);
        }
        if (s.selection == proto::EXACT && s.algorithm != proto::EXDYNA) {
          ASSERT_EQ(sel,
                    s.algorithm == proto::TOPK_ALLGATHER || s.algorithm == proto::GTOPK ? k : 0);
        }
        if (s.selection == proto::SAMPLED_THRESHOLD) {
          ASSERT_LE(sel, 13 * k / 10 + 1);
          ASSERT_GT(sel, 0u);
        }
      }
    }
  }
}

// The momentum correction left to the collective (what the allreduce worker does): bitwise the
// runs of correcting first, for every collective and selection mode, and at a size where exact
// top-k takes the fused pass (kernels::MomentumCorrectionTopK: n >= 65536, k <= n / 16).
TEST(Contribution, DeferredMomentumCorrectionGivesTheSameRuns) {
  std::vector<RunSetup> setups = ContributionSetups();
  for (auto algorithm : {proto::TOPK_ALLGATHER, proto::GTOPK}) {
    RunSetup s;
    s.algorithm = algorithm;
    s.workers = 3;
    s.n = (1 << 17) + 5;
    s.iterations = 4;
    setups.push_back(s);
  }
  for (const RunSetup& s : setups) {
    SCOPED_TRACE(SetupName(s) + ", n " + std::to_string(s.n));
    RunSetup deferred = s;
    deferred.input = Input::kDeferred;
    Result r;
    ExpectSameRuns(s, deferred, &r);
  }
}

// A GPU worker's allreduce (GpuContribution: momentum correction, residual and the collective's
// operations on the device) gives bitwise the updates and residuals of the host path, for every
// collective and selection mode.
TEST(GpuContribution, SameUpdatesAndResidualsAsTheHostPath) {
#if !SPARSEPS_HAVE_CUDA
  GTEST_SKIP() << "no CUDA in this build";
#else
  if (const std::string why = sparseps::testing::NoGpuInAChild(); !why.empty()) GTEST_SKIP() << why;
  for (const RunSetup& s : ContributionSetups()) {
    SCOPED_TRACE(SetupName(s));
    RunSetup on_gpu = s;
    on_gpu.input = Input::kGpu;
    Result r;
    ExpectSameRuns(s, on_gpu, &r);
  }
#endif
}

// In-process checks of the transport: a silent peer ends a wait with its name, a malformed
// message is rejected and counted, never a crash.
TEST(PeerGroup, DeadlineNamesTheSilentPeer) {
  zmq::context_t context(1);
  auto a = PeerGroup::Bind(context, "127.0.0.1", 0, 0.3);
  auto b = PeerGroup::Bind(context, "127.0.0.1", 0, 0.3);
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<PeerGroup::PeerAddress> peers{{"127.0.0.1", (*a)->port(), "", ""},
                                            {"127.0.0.1", (*b)->port(), "", ""}};
  (*a)->Connect(0, peers);
  (*b)->Connect(1, peers);
  auto m = (*a)->Recv(1, 7);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(m.status().message().find("worker 1 at 127.0.0.1:" + std::to_string((*b)->port())),
            std::string::npos)
      << m.status().message();
  // A message sent early waits in the queue for its tag.
  Message early;
  AddFrameCopy(&early, proto::F32, std::vector<float>{1.0f, 2.0f}.data(), 2);
  ASSERT_TRUE((*b)->Send(0, 9, early).ok());
  Message first;
  AddFrameCopy(&first, proto::F32, std::vector<float>{3.0f}.data(), 1);
  ASSERT_TRUE((*b)->Send(0, 8, first).ok());
  auto got8 = (*a)->Recv(1, 8);
  ASSERT_TRUE(got8.ok()) << got8.status().ToString();
  EXPECT_EQ((*got8->FrameAs<float>(0, proto::F32))[0], 3.0f);
  auto got9 = (*a)->Recv(1, 9);
  ASSERT_TRUE(got9.ok());
  EXPECT_EQ(got9->FrameAs<float>(0, proto::F32)->size(), 2u);
}

TEST(PeerGroup, MalformedMessagesAreRejectedAndCounted) {
  zmq::context_t context(1);
  auto a = PeerGroup::Bind(context, "127.0.0.1", 0, 1.0);
  ASSERT_TRUE(a.ok());
  (*a)->Connect(0, {{"127.0.0.1", (*a)->port(), "", ""}, {"127.0.0.1", 1, "", ""}});
  // A stranger with an unknown routing id is dropped and counted, and ends nothing: the wait runs
  // into its own deadline. Then garbage from a known id is an error.
  auto stranger = ConnectDealer(context, "127.0.0.1", (*a)->port(), "intruder");
  zmq::message_t junk("not a header", 12);
  stranger.send(junk, zmq::send_flags::none);
  auto m = (*a)->Recv(1, 1);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kDeadlineExceeded) << m.status().ToString();
  EXPECT_EQ((*a)->rejected(), 1u);
  EXPECT_EQ((*a)->strangers(), 1u);
  auto liar = ConnectDealer(context, "127.0.0.1", (*a)->port(), "w1");
  Message bad;
  bad.header.set_command(proto::COLLECTIVE);
  bad.header.set_sender_rank(1);
  bad.header.set_request_id(1);
  auto* f = bad.header.add_frames();
  f->set_type(proto::F32);
  f->set_bytes(400);  // declares more than it sends
  bad.frames.emplace_back(8);
  ASSERT_TRUE(SendMessage(liar, bad).ok());
  m = (*a)->Recv(1, 1);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kProtocolError);
  EXPECT_EQ((*a)->rejected(), 2u);
  // And a well-formed sparse message whose keys leave the block is refused by the parser.
  Message out;
  SparseVector v;
  v.indices = {5, 3};
  v.values = {1.0f, 2.0f};
  AddSparseBlocks(&out, std::span<const SparseVector>(&v, 1));
  std::vector<SparseVector> parsed;
  const std::pair<uint64_t, uint64_t> bounds{0, 10};
  Status s = ParseSparseBlocks(out, std::span(&bounds, 1), "test", &parsed);
  EXPECT_EQ(s.code(), StatusCode::kProtocolError);
}

// With the membership's routing ids (random, as in a job): the guessable "w1" is a stranger's, and
// a connection made again with worker 1's routing id, while the old one still stands (its TCP
// connection broke and came back before this side noticed), is heard at once.
TEST(PeerGroup, RoutingIdsFromTheMembershipTakeAConnectionMadeAgainAndRefuseTheGuessable) {
  zmq::context_t context(1);
  auto a = PeerGroup::Bind(context, "127.0.0.1", 0, 2.0);
  ASSERT_TRUE(a.ok());
  const std::string id1 = MakeRoutingId(proto::WORKER, "data");
  (*a)->Connect(0, {{"127.0.0.1", (*a)->port(), "", MakeRoutingId(proto::WORKER, "data")},
                    {"127.0.0.1", 1, "", id1}});
  // Sends COLLECTIVE `tag` as worker 1 on a new connection with routing id `id`.
  auto send = [&](const std::string& id, uint64_t tag) {
    zmq::socket_t d = ConnectDealer(context, "127.0.0.1", (*a)->port(), id);
    d.set(zmq::sockopt::linger, 0);
    Message m;
    m.header.set_command(proto::COLLECTIVE);
    m.header.set_sender_rank(1);
    m.header.set_request_id(tag);
    AddFrameCopy(&m, proto::F32, std::vector<float>{1.0f}.data(), 1);
    EXPECT_TRUE(SendMessage(d, m).ok());
    return d;
  };
  zmq::socket_t guess = send("w1", 1);
  zmq::socket_t first = send(id1, 2);
  auto got = (*a)->Recv(1, 2);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  zmq::socket_t again = send(id1, 3);  // while `first` still stands
  got = (*a)->Recv(1, 3);
  EXPECT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ((*a)->Recv(1, 1).status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ((*a)->strangers(), 1u);
}

}  // namespace
}  // namespace sparseps
