// Every CUDA kernel against its CPU twin on the same inputs (kernels/cuda/gpu_kernels.h). Skipped
// (GTEST_SKIP) where no CUDA device answers; built only where nvcc was found.
#include "kernels/cuda/gpu_kernels.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/device.h"
#include "kernels/error_feedback.h"
#include "kernels/select.h"
#include "kernels/topk.h"
#include "tests/support/gpu_testing.h"

namespace sparseps::kernels {
namespace {

using gpu_testing::DeviceVector;

std::vector<float> Gradient(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng) * 1e-3f;
  return v;
}

TEST(GpuKernels, MomentumCorrectionBitwiseEqualsCpu) {
  SKIP_WITHOUT_GPU();
  const size_t n = 100003;
  std::vector<float> u = Gradient(n, 1), v = Gradient(n, 2), g = Gradient(n, 3);
  DeviceVector<float> du(u), dv(v), dg(g);
  CUDA_OK(gpu::MomentumCorrection(du.get(), dv.get(), dg.get(), 0.9f, n, nullptr));
  MomentumCorrection(u.data(), v.data(), g.data(), 0.9f, n);
  EXPECT_EQ(du.ToHost(), u);
  EXPECT_EQ(dv.ToHost(), v);
}

TEST(GpuKernels, AxpyBitwiseEqualsCpu) {
  SKIP_WITHOUT_GPU();
  const size_t n = 77777;
  std::vector<float> x = Gradient(n, 4), y = Gradient(n, 5);
  DeviceVector<float> dx(x), dy(y);
  CUDA_OK(gpu::Axpy(-0.0125f, dx.get(), dy.get(), n, nullptr));
  Axpy(-0.0125f, x.data(), y.data(), n);
  EXPECT_EQ(dy.ToHost(), y);
}

TEST(GpuKernels, GatherAndZeroEqualsCpu) {
  SKIP_WITHOUT_GPU();
  const size_t n = 50000;
  std::vector<float> v = Gradient(n, 6), u = Gradient(n, 7);
  std::vector<uint32_t> idx;
  for (uint32_t i = 3; i < n; i += 97) idx.push_back(i);
  DeviceVector<float> dv(v), du(u), dout(idx.size());
  DeviceVector<uint32_t> didx(idx);
  CUDA_OK(gpu::GatherAndZero(dv.get(), du.get(), didx.get(), idx.size(), dout.get(), nullptr));
  std::vector<float> out(idx.size());
  GatherAndZero(v.data(), u.data(), idx.data(), idx.size(), out.data());
  EXPECT_EQ(dout.ToHost(), out);
  EXPECT_EQ(dv.ToHost(), v);
  EXPECT_EQ(du.ToHost(), u);
}

TEST(GpuKernels, ScatterAddEqualsCpu) {
  SKIP_WITHOUT_GPU();
  const size_t n = 4096;
  std::vector<float> dst = Gradient(n, 8);
  // Distinct indices: bitwise equal. Then every index 8 times: equal within rounding.
  std::vector<uint32_t> idx;
  for (uint32_t i = 0; i < n; i += 3) idx.push_back(i);
  std::vector<float> vals = Gradient(idx.size(), 9);
  DeviceVector<float> ddst(dst), dvals(vals);
  DeviceVector<uint32_t> didx(idx);
  CUDA_OK(gpu::ScatterAdd(ddst.get(), didx.get(), dvals.get(), idx.size(), nullptr));
  ScatterAdd(dst.data(), idx.data(), vals.data(), idx.size());
  EXPECT_EQ(ddst.ToHost(), dst);

  std::vector<uint32_t> dup;
  for (int r = 0; r < 8; ++r) {
    for (uint32_t i = 0; i < n; ++i) dup.push_back(i);
  }
  std::vector<float> dvals2 = Gradient(dup.size(), 10);
  DeviceVector<uint32_t> ddup(dup);
  DeviceVector<float> dv2(dvals2);
  CUDA_OK(gpu::ScatterAdd(ddst.get(), ddup.get(), dv2.get(), dup.size(), nullptr));
  ScatterAdd(dst.data(), dup.data(), dvals2.data(), dup.size());
  const std::vector<float> got = ddst.ToHost();
  for (size_t i = 0; i < n; ++i) ASSERT_NEAR(got[i], dst[i], 1e-8f) << i;
}

TEST(GpuKernels, StreamingSumMatchesDoubleSum) {
  SKIP_WITHOUT_GPU();
  const size_t n = (1 << 20) + 3;
  std::vector<float> x = Gradient(n, 11);
  for (auto& v : x) v = std::fabs(v);  // positive, so the relative error bound is meaningful
  DeviceVector<float> dx(x);
  DeviceVector<double> scratch(1);
  double got = 0;
  CUDA_OK(gpu::StreamingSum(dx.get(), n, scratch.get(), &got, nullptr));
  const double want = std::accumulate(x.begin(), x.end(), 0.0);
  EXPECT_NEAR(got, want, 1e-5 * want);
}

// The finiteness check counts exactly the NaN and Inf entries (at the vectorised body and the
// tail), and huge finite values whose sum overflows a float are not reported.
TEST(GpuKernels, CountNonFiniteCountsNaNAndInfOnly) {
  SKIP_WITHOUT_GPU();
  const size_t n = (1 << 16) + 3;
  std::vector<float> x(n, 3.0e38f);  // finite; any float sum of a few overflows
  DeviceVector<unsigned long long> scratch(1);
  uint64_t bad = 1;
  {
    DeviceVector<float> dx(x);
    CUDA_OK(gpu::CountNonFinite(dx.get(), n, scratch.get(), &bad, nullptr));
    EXPECT_EQ(bad, 0u);
    EXPECT_TRUE(AllFinite(x.data(), n));
  }
  x[5] = std::numeric_limits<float>::quiet_NaN();
  x[4096] = std::numeric_limits<float>::infinity();
  x[n - 1] = -std::numeric_limits<float>::infinity();  // in the scalar tail
  DeviceVector<float> dx(x);
  CUDA_OK(gpu::CountNonFinite(dx.get(), n, scratch.get(), &bad, nullptr));
  EXPECT_EQ(bad, 3u);
  CUDA_OK(gpu::CountNonFinite(dx.get(), 0, scratch.get(), &bad, nullptr));
  EXPECT_EQ(bad, 0u);
}

// The GPU top-k against kernels::TopKAbs: the same indices in the same (increasing) order.
// Returns whether the GPU took the sampled path.
bool ExpectSameTopK(const std::vector<float>& x, size_t k) {
  DeviceVector<float> dx(x);
  DeviceVector<uint32_t> dout(std::max<size_t>(k, 1));
  gpu::GpuTopK topk;
  size_t count = 0;
  EXPECT_EQ(topk.Select(dx.get(), x.size(), k, dout.get(), &count, nullptr), cudaSuccess);
  std::vector<uint32_t> want(std::min(k, x.size()));
  EXPECT_EQ(TopKAbs(x.data(), x.size(), k, want.data()), want.size());
  EXPECT_EQ(count, want.size());
  EXPECT_EQ(dout.ToHost(want.size()), want) << "n " << x.size() << " k " << k;
  return topk.last_used_sample();
}

TEST(GpuTopK, SameSetAsCpuOnTheSampledPath) {
  SKIP_WITHOUT_GPU();
  for (size_t n : {size_t{1} << 18, size_t{1000003}, size_t{1} << 22}) {
    for (size_t k : {size_t{100}, n / 1000, n / 100}) {
      const bool sampled = ExpectSameTopK(Gradient(n, n + k), k);
      // Density 0.1% and 1% of a large vector is the case the sample is for.
      if (k != 100) {
        EXPECT_TRUE(sampled) << "n " << n << " k " << k;
      }
    }
  }
}

TEST(GpuTopK, SameSetAsCpuOnTheRadixPath) {
  SKIP_WITHOUT_GPU();
  EXPECT_FALSE(ExpectSameTopK(Gradient(1000, 1), 10));          // small n
  EXPECT_FALSE(ExpectSameTopK(Gradient(1 << 18, 2), 1 << 15));  // k > n / 16
  EXPECT_FALSE(ExpectSameTopK(Gradient(5000, 3), 5000));        // k = n
  EXPECT_FALSE(ExpectSameTopK(Gradient(5000, 3), 0));
}

TEST(GpuTopK, TiesGoToLowerIndicesAsOnTheCpu) {
  SKIP_WITHOUT_GPU();
  // Mostly zeros (a ReLU layer's gradient) and a few equal magnitudes of both signs.
  const size_t n = 1 << 20;
  std::vector<float> x(n, 0.0f);
  for (size_t i = 5; i < n; i += 1001) x[i] = (i % 2 ? 0.5f : -0.5f);
  for (size_t i = 17; i < n; i += 50021) x[i] = 2.0f;
  EXPECT_TRUE(ExpectSameTopK(x, 500));    // k inside the ties at 0.5: candidates suffice
  EXPECT_FALSE(ExpectSameTopK(x, 5000));  // k past them: ties at zero, the sample misleads
  // All equal: the first k indices.
  ExpectSameTopK(std::vector<float>(1 << 17, 1.0f), 1000);
}

TEST(GpuThresholdSelect, SameAsSelectAtLeast) {
  SKIP_WITHOUT_GPU();
  const size_t n = 3000017;
  const std::vector<float> x = Gradient(n, 12);
  const float threshold = 3e-3f;
  std::vector<uint32_t> want;
  std::vector<float> want_vals;
  SelectAtLeast(x.data(), n, threshold, &want, &want_vals);
  ASSERT_GT(want.size(), 1000u);
  DeviceVector<float> dx(x), dvals(want.size() + 100);
  DeviceVector<uint32_t> didx(want.size() + 100);
  gpu::GpuThresholdSelect sel;
  size_t count = 0;
  CUDA_OK(sel.Select(dx.get(), n, threshold, didx.get(), dvals.get(), want.size() + 100, &count,
                     nullptr));
  ASSERT_EQ(count, want.size());
  EXPECT_EQ(didx.ToHost(count), want);
  EXPECT_EQ(dvals.ToHost(count), want_vals);
  // Too little room: the full count is reported so the caller can retry, and the room holds the
  // first entries.
  CUDA_OK(sel.Select(dx.get(), n, threshold, didx.get(), nullptr, 10, &count, nullptr));
  EXPECT_EQ(count, want.size());
  EXPECT_EQ(didx.ToHost(10), std::vector<uint32_t>(want.begin(), want.begin() + 10));
  // A source that is not 16-byte aligned (a key range starting at an odd offset): scalar loads,
  // the same selection shifted by one.
  std::vector<uint32_t> want_shifted;
  std::vector<float> want_shifted_vals;
  SelectAtLeast(x.data() + 1, n - 1, threshold, &want_shifted, &want_shifted_vals);
  CUDA_OK(sel.Select(dx.get() + 1, n - 1, threshold, didx.get(), dvals.get(), want.size() + 100,
                     &count, nullptr));
  ASSERT_EQ(count, want_shifted.size());
  EXPECT_EQ(didx.ToHost(count), want_shifted);
  EXPECT_EQ(dvals.ToHost(count), want_shifted_vals);
}

// DGC's sampled threshold on the device: the same selected set as the CPU's on the usual path,
// on the "too many" path (all magnitudes equal: the exact top-k among the selected, the first k
// indices), on the "too few" path (one huge sampled entry: ten rounds of threshold * 0.7), for
// k >= n and for a vector shorter than one sample run.
TEST(GpuSampledThresholdSelect, SameSetAsTheCpu) {
  SKIP_WITHOUT_GPU();
  struct Case {
    std::string name;
    std::vector<float> x;
    size_t k;
    double ratio;
  };
  const size_t n = 1 << 20;
  std::vector<Case> cases;
  cases.push_back({"gradient", Gradient(n, 21), 1000, 0.01});
  cases.push_back({"ties", std::vector<float>(n, 0.25f), 1000, 0.01});
  std::vector<float> spike = Gradient(n, 22);
  ForEachSampleRun(n, 105, [&](size_t start, size_t) {
    if (start > n / 2 && spike[start] < 50.0f) spike[start] = 100.0f;
  });
  cases.push_back({"too few", spike, 100, 1e-4});
  cases.push_back({"k >= n", Gradient(100, 23), 200, 0.01});
  cases.push_back({"shorter than a run", Gradient(10, 24), 3, 0.5});
  gpu::GpuSampledThresholdSelect sel;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<uint32_t> want;
    SampledThresholdSelect(c.x.data(), c.x.size(), c.k, c.ratio, &want);
    DeviceVector<float> dx(c.x);
    size_t count = 0;
    CUDA_OK(sel.Select(dx.get(), c.x.size(), c.k, c.ratio, &count, nullptr));
    ASSERT_EQ(count, want.size());
    std::vector<uint32_t> got(count);
    ASSERT_EQ(
        cudaMemcpy(got.data(), sel.indices(), count * sizeof(uint32_t), cudaMemcpyDeviceToHost),
        cudaSuccess);
    EXPECT_EQ(got, want);
  }
}

// Gather, ScatterSet, ZeroAt and SBC's local step against plain loops (the local step bitwise:
// each operation rounded as on the CPU).
TEST(GpuKernels, GatherScatterSetZeroAtAndSbcLocalStep) {
  SKIP_WITHOUT_GPU();
  const size_t n = 100003;
  const auto x = Gradient(n, 31);
  const std::vector<uint32_t> idx = {0, 7, 5000, 100002};
  DeviceVector<float> dx(x), dout(idx.size());
  DeviceVector<uint32_t> didx(idx), dkeys(idx.size());
  CUDA_OK(gpu::Gather(dx.get(), didx.get(), idx.size(), dout.get(), nullptr));
  EXPECT_EQ(dout.ToHost(), (std::vector<float>{x[0], x[7], x[5000], x[100002]}));
  std::vector<uint32_t> src(n);
  std::iota(src.begin(), src.end(), 1000u);
  DeviceVector<uint32_t> dsrc(src);
  CUDA_OK(gpu::Gather(dsrc.get(), didx.get(), idx.size(), dkeys.get(), nullptr));
  EXPECT_EQ(dkeys.ToHost(), (std::vector<uint32_t>{1000, 1007, 6000, 101002}));
  const std::vector<float> vals = {1, 2, 3, 4};
  DeviceVector<float> dvals(vals);
  CUDA_OK(gpu::ScatterSet(dx.get(), didx.get(), dvals.get(), idx.size(), nullptr));
  auto want = x;
  for (size_t j = 0; j < idx.size(); ++j) want[idx[j]] = vals[j];
  EXPECT_EQ(dx.ToHost(), want);
  DeviceVector<float> du(x);
  CUDA_OK(gpu::ZeroAt(dx.get(), du.get(), didx.get(), idx.size(), nullptr));
  auto want_u = x;
  for (uint32_t i : idx) want[i] = want_u[i] = 0.0f;
  EXPECT_EQ(dx.ToHost(), want);
  EXPECT_EQ(du.ToHost(), want_u);

  auto u = Gradient(n, 32), a = Gradient(n, 33), params = Gradient(n, 34);
  const auto g = Gradient(n, 35);
  DeviceVector<float> dU(u), dA(a), dP(params), dG(g);
  CUDA_OK(gpu::SbcLocalStep(dU.get(), dA.get(), dP.get(), dG.get(), 0.9f, 0.05f, n, nullptr));
  for (size_t i = 0; i < n; ++i) {
    u[i] = 0.9f * u[i] + g[i];
    a[i] += u[i];
    params[i] -= 0.05f * u[i];
  }
  EXPECT_EQ(dU.ToHost(), u);
  EXPECT_EQ(dA.ToHost(), a);
  EXPECT_EQ(dP.ToHost(), params);
}

}  // namespace
}  // namespace sparseps::kernels
