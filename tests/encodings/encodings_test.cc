// Round trips and property tests of the topk options (fp16 values, varint indices), sbc and
// sketch codecs on random inputs and edge cases (k = 0, k = n, ties), and rejection of
// inconsistent or hostile payloads; IEEE half conversion.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "common/sanitizers.h"
#include "encodings/codec.h"
#include "encodings/registry.h"
#include "encodings/sbc.h"
#include "encodings/sketch.h"
#include "encodings/topk.h"
#include "kernels/golomb.h"
#include "kernels/pack.h"
#include "tests/support/messages.h"
#include "transport/message.h"
#include "transport/van.h"

namespace sparseps {
namespace {

using testing::CopyOf;

std::vector<uint32_t> RandomPositions(uint32_t n, size_t k, std::mt19937* rng) {
  std::vector<uint32_t> all(n);
  for (uint32_t i = 0; i < n; ++i) all[i] = i;
  std::shuffle(all.begin(), all.end(), *rng);
  all.resize(std::min<size_t>(k, n));
  std::sort(all.begin(), all.end());
  return all;
}

TEST(Half, EveryHalfRoundTripsAndFloatsRoundToNearest) {
  for (uint32_t h = 0; h < 65536; ++h) {
    if (((h >> 10) & 31) == 31) continue;  // Inf / NaN
    ASSERT_EQ(kernels::FloatToHalf(kernels::HalfToFloat(static_cast<uint16_t>(h))), h) << h;
  }
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-70000.0f, 70000.0f);
  for (int t = 0; t < 100000; ++t) {
    const float f = u(rng) * std::pow(2.0f, -static_cast<float>(rng() % 30));
    const uint16_t h = kernels::FloatToHalf(f);
    const float r = kernels::HalfToFloat(h);
    if (std::fabs(f) >= 65504.0f) {
      ASSERT_EQ(std::fabs(r), 65504.0f);  // saturates, never Inf
      continue;
    }
    // No other half is nearer (neighbours by bit pattern, same sign).
    const float up = kernels::HalfToFloat(static_cast<uint16_t>(h + 1));
    ASSERT_LE(std::fabs(f - r), std::fabs(f - up)) << f;
    if ((h & 0x7fff) != 0) {
      const float dn = kernels::HalfToFloat(static_cast<uint16_t>(h - 1));
      ASSERT_LE(std::fabs(f - r), std::fabs(f - dn)) << f;
    }
  }
}

// The branch-free scaled conversions of the sketch's F16 tables are FloatToHalf and HalfToFloat
// times 2^e bitwise: every float bit pattern below 65504 in a sweep (every 257th, and all below
// 2^-13 around the subnormal boundary in steps of 8; under AddressSanitizer a sixteenth of that,
// 100 million checks at -O0 took 18 s), at exponents inside and beyond float's range of powers of
// two; every half back at several exponents, Inf and NaN refused; MaxAbs.
TEST(Half, ScaledConversionsAreTheScalarOnesBitwise) {
  constexpr uint32_t kThin = SPARSEPS_ADDRESS_SANITIZER ? 16 : 1;
  std::vector<float> x;
  for (uint32_t u = 0; u < 0x477fe000u; u += 257 * kThin) x.push_back(std::bit_cast<float>(u));
  for (uint32_t u = 0x33000000u; u < 0x39000000u; u += 8 * kThin) {
    x.push_back(std::bit_cast<float>(u));
  }
  const size_t n = x.size();
  for (size_t j = 0; j < n; ++j) x.push_back(-x[j]);
  std::vector<uint16_t> got(x.size());
  for (int e : {0, -3, 20}) {
    std::vector<float> scaled(x.size());
    for (size_t j = 0; j < x.size(); ++j) scaled[j] = std::ldexp(x[j], -e);
    kernels::ScaledFloatsToHalves(scaled.data(), scaled.size(), e, got.data());
    for (size_t j = 0; j < x.size(); ++j) {
      ASSERT_EQ(got[j], kernels::FloatToHalf(x[j])) << x[j] << " at 2^" << e;
    }
  }
  // 2^140, 2^130 and 2^-128 are not floats (tables of cells near 2^-140, or 2^128).
  for (int e : {140, 130, -128}) {
    std::vector<float> scaled;
    std::vector<uint16_t> want;
    for (float f : {1.0f, 0.333f, 65000.0f, 6e-8f, 3e-5f}) {
      const float s = static_cast<float>(static_cast<double>(f) * std::ldexp(1.0, -e));
      if (s == 0.0f || !std::isfinite(s)) continue;
      scaled.push_back(s);
      want.push_back(kernels::FloatToHalf(static_cast<float>(s * std::ldexp(1.0, e))));
    }
    ASSERT_FALSE(scaled.empty());
    got.resize(scaled.size());
    kernels::ScaledFloatsToHalves(scaled.data(), scaled.size(), e, got.data());
    for (size_t j = 0; j < scaled.size(); ++j) EXPECT_EQ(got[j], want[j]) << j << " at 2^" << e;
  }
  std::vector<uint16_t> finite;
  for (uint32_t h = 0; h < 65536; ++h) {
    if (((h >> 10) & 31) != 31) finite.push_back(static_cast<uint16_t>(h));
  }
  std::vector<float> back(finite.size());
  for (int e : {0, -20, 14, 100, -130, 200, -200}) {
    ASSERT_TRUE(kernels::ScaledHalvesToFloats(finite.data(), finite.size(), e, back.data()));
    for (size_t j = 0; j < finite.size(); ++j) {
      const float want = static_cast<float>(kernels::HalfToFloat(finite[j]) * std::ldexp(1.0, e));
      ASSERT_EQ(std::bit_cast<uint32_t>(back[j]), std::bit_cast<uint32_t>(want))
          << finite[j] << " at 2^" << e;
    }
  }
  // MaxAbs (the scale's choice) at every length around the SSE2 width.
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t len = 0; len < 40; ++len) {
    std::vector<float> v(len);
    float want = 0.0f;
    for (auto& y : v) {
      y = normal(rng);
      want = std::max(want, std::fabs(y));
    }
    ASSERT_EQ(kernels::MaxAbs(v.data(), len), want) << len;
  }
  for (uint16_t bad : {uint16_t{0x7c00}, uint16_t{0xfc00}, uint16_t{0x7e00}, uint16_t{0x7c01}}) {
    std::vector<uint16_t> h = {0x3c00, bad, 0x0001};
    std::vector<float> out(3);
    EXPECT_FALSE(kernels::ScaledHalvesToFloats(h.data(), 3, 0, out.data())) << bad;
    EXPECT_FALSE(kernels::ScaledHalvesToFloats(h.data(), 3, 200, out.data())) << bad;
  }
}

class TopKFormats : public ::testing::TestWithParam<TopKFormat> {};

TEST_P(TopKFormats, RoundTripsRandomAndEdgeCases) {
  const TopKFormat fmt = GetParam();
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  for (uint32_t n : {1u, 7u, 1000u, 70000u}) {
    for (size_t k : {size_t{0}, size_t{1}, size_t{n / 10}, size_t{n}}) {
      auto idx = RandomPositions(n, k, &rng);
      std::vector<float> vals(idx.size());
      for (auto& v : vals) v = fmt.fp16_values ? kernels::RoundToHalf(normal(rng)) : normal(rng);
      if (!vals.empty()) vals[0] = vals.back();  // a tie
      Message m;
      EncodeTopK(std::vector<uint32_t>(idx), std::vector<float>(vals), &m, fmt);
      DecodedPayload p;
      const Message wire = CopyOf(m);  // the payload views the message's frames
      Status s = FindCodec(proto::TOPK)->Decode(wire, n, &p);
      ASSERT_TRUE(s.ok()) << s.message();
      ASSERT_EQ(std::vector<uint32_t>(p.indices.begin(), p.indices.end()), idx);
      ASSERT_EQ(std::vector<float>(p.values.begin(), p.values.end()), vals);
    }
  }
}

TEST_P(TopKFormats, RejectsPositionsBeyondTheRangeAndCountMismatch) {
  const TopKFormat fmt = GetParam();
  Message m;
  EncodeTopK({1, 5, 9}, {1.0f, 2.0f, 3.0f}, &m, fmt);
  DecodedPayload p;
  EXPECT_FALSE(FindCodec(proto::TOPK)->Decode(CopyOf(m), 9, &p).ok());  // index 9 in 9 keys
  EXPECT_FALSE(FindCodec(proto::TOPK)->Decode(CopyOf(m), 2, &p).ok());  // 3 entries > 2 keys
  EXPECT_TRUE(FindCodec(proto::TOPK)->Decode(CopyOf(m), 10, &p).ok());
}

INSTANTIATE_TEST_SUITE_P(Formats, TopKFormats,
                         ::testing::Values(TopKFormat{false, false}, TopKFormat{true, false},
                                           TopKFormat{false, true}, TopKFormat{true, true}),
                         [](const auto& info) {
                           return std::string(info.param.fp16_values ? "f16" : "f32") +
                                  (info.param.varint_indices ? "_varint" : "_u32");
                         });

TEST(TopKCodec, CompactFormatsAreSmaller) {
  std::mt19937 rng(2);
  auto idx = RandomPositions(100000, 1000, &rng);
  Message plain, compact;
  EncodeTopK(std::vector<uint32_t>(idx), std::vector<float>(idx.size(), 1.0f), &plain);
  EncodeTopK(std::vector<uint32_t>(idx), std::vector<float>(idx.size(), 1.0f), &compact,
             {true, true});
  // 8 B per entry plain; fp16 (2 B) + gaps of ~100 (1-2 B) compact.
  EXPECT_EQ(plain.frames[0].size() + plain.frames[1].size(), 8000u);
  EXPECT_LT(compact.frames[0].size() + compact.frames[1].size(), 4000u);
}

TEST(SbcCodec, RoundTripsRandomPositionsAndEdgeCases) {
  std::mt19937 rng(4);
  for (uint32_t n : {1u, 100u, 100000u}) {
    for (size_t k : {size_t{0}, size_t{1}, size_t{n / 100}, size_t{n}}) {
      auto idx = RandomPositions(n, k, &rng);
      const double p = std::clamp(static_cast<double>(idx.size()) / n, 1e-9, 0.5);
      Message m;
      EncodeSbc(idx, -0.75f, kernels::GolombParameter(p), &m);
      DecodedPayload d;
      Status s = FindCodec(proto::SBC)->Decode(CopyOf(m), n, &d);
      ASSERT_TRUE(s.ok()) << s.message();
      ASSERT_EQ(std::vector<uint32_t>(d.indices.begin(), d.indices.end()), idx);
      for (float v : d.values) ASSERT_EQ(v, -0.75f);
    }
  }
}

TEST(SbcCodec, RejectsInconsistentHeaders) {
  Message m;
  EncodeSbc({3, 50, 99}, 2.0f, 4, &m);
  DecodedPayload d;
  const Codec* c = FindCodec(proto::SBC);
  EXPECT_TRUE(c->Decode(CopyOf(m), 100, &d).ok());
  EXPECT_FALSE(c->Decode(CopyOf(m), 99, &d).ok());  // position 99 outside 99 keys
  Message more = CopyOf(m);
  more.header.set_count(4);  // claims more positions than coded
  EXPECT_FALSE(c->Decode(more, 100, &d).ok());
  Message huge = CopyOf(m);
  huge.header.set_count(uint64_t{1} << 40);  // would allocate; refused first
  EXPECT_FALSE(c->Decode(huge, uint64_t{1} << 41, &d).ok());
  Message nan = CopyOf(m);
  nan.header.set_value(std::numeric_limits<float>::quiet_NaN());
  Status s = c->Decode(nan, 100, &d);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("NaN"), std::string::npos);
  Message badb = CopyOf(m);
  badb.header.set_golomb_b(31);
  EXPECT_FALSE(c->Decode(badb, 100, &d).ok());
}

TEST(SketchCodec, RoundTripAndLayoutChecks) {
  std::vector<float> t(5 * 40);
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<float>(i) - 50.0f;
  Message m;
  EncodeSketch(std::vector<float>(t), 5, 40, &m);
  DecodedPayload d;
  const Codec* c = FindCodec(proto::SKETCH);
  const Message wire = CopyOf(m);  // the payload views the message's frames
  ASSERT_TRUE(c->Decode(wire, 1000, &d).ok());
  ASSERT_TRUE(d.is_sketch());
  EXPECT_EQ(d.sketch_rows, 5u);
  EXPECT_EQ(d.sketch_columns, 40u);
  EXPECT_EQ(std::vector<float>(d.sketch.begin(), d.sketch.end()), t);
  Message wrong = CopyOf(m);
  wrong.header.set_sketch_columns(41);
  EXPECT_FALSE(c->Decode(wrong, 1000, &d).ok());
  wrong.header.set_sketch_rows(0);
  EXPECT_FALSE(c->Decode(wrong, 1000, &d).ok());
  t[7] = INFINITY;
  Message inf;
  EncodeSketch(std::move(t), 5, 40, &inf);
  EXPECT_FALSE(c->Decode(CopyOf(inf), 1000, &d).ok());
}

// compression.fp16_values with the sketch: the tables travel as halves scaled by 2^exponent so
// that the largest cell is 2^14 to 2^15; every cell comes back within 2^-11 of itself (plus the
// half's subnormal step, 2^-38 of the largest cell), at any magnitude; a malformed F16 table is
// refused.
TEST(SketchCodec, HalfTablesKeepElevenBitsAtAnyScale) {
  const Codec* c = FindCodec(proto::SKETCH);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float scale : {1.0f, 1e-30f, 3e-7f, 1e5f, 1e30f}) {
    SCOPED_TRACE(scale);
    std::vector<float> t(5 * 40);
    for (auto& x : t) x = scale * normal(rng);
    t[3] = 0.0f;
    t[11] = scale * 1000.0f;                           // the largest
    t[12] = -std::ldexp(1.0f, std::ilogb(t[11]) - 5);  // a power of two below it: exact
    t[13] = scale * 1e-9f;  // below the half's range at this scale: 0 or a subnormal
    Message m;
    EncodeSketch(std::vector<float>(t), 5, 40, &m, /*fp16=*/true);
    ASSERT_EQ(m.header.frames(0).type(), proto::F16);
    EXPECT_LT(m.WireBytes(), 5u * 40u * 3u);  // 2 bytes a cell and the header
    DecodedPayload d;
    const Message wire = CopyOf(m);
    ASSERT_TRUE(c->Decode(wire, 1000, &d).ok());
    ASSERT_EQ(d.sketch.size(), t.size());
    const float largest = std::fabs(t[11]);
    for (size_t x = 0; x < t.size(); ++x) {
      EXPECT_LE(std::fabs(d.sketch[x] - t[x]),
                std::fabs(t[x]) * std::ldexp(1.0f, -11) + largest * std::ldexp(1.0f, -38))
          << x;
    }
    EXPECT_EQ(d.sketch[3], 0.0f);
    EXPECT_EQ(d.sketch[12], t[12]);
    EXPECT_LE(std::fabs(d.sketch[13]), largest * std::ldexp(1.0f, -24));
  }
  // An all-zero table.
  Message zero;
  EncodeSketch(std::vector<float>(10, 0.0f), 1, 10, &zero, true);
  EXPECT_EQ(zero.header.sketch_exponent(), 0);
  DecodedPayload d;
  const Message zero_wire = CopyOf(zero);
  ASSERT_TRUE(c->Decode(zero_wire, 1000, &d).ok());
  EXPECT_EQ(std::vector<float>(d.sketch.begin(), d.sketch.end()), std::vector<float>(10, 0.0f));
  // Refused: an exponent out of bounds, a half Inf or NaN, a frame of the wrong size.
  Message m;
  EncodeSketch(std::vector<float>(10, 1.0f), 1, 10, &m, true);
  Message far = CopyOf(m);
  far.header.set_sketch_exponent(201);
  Status s = c->Decode(far, 1000, &d);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("sketch_exponent"), std::string::npos);
  for (uint16_t bad : {uint16_t{0x7c00}, uint16_t{0xfe00}}) {
    Message nonfinite;
    std::vector<uint16_t> half(10, 0x3c00);
    half[4] = bad;
    nonfinite.header.set_encoding(proto::SKETCH);
    nonfinite.header.set_sketch_rows(1);
    nonfinite.header.set_sketch_columns(10);
    AddFrame(&nonfinite, proto::F16, std::move(half));
    s = c->Decode(CopyOf(nonfinite), 1000, &d);
    EXPECT_FALSE(s.ok());
    EXPECT_NE(s.message().find("NaN or Inf"), std::string::npos);
  }
  Message wrong = CopyOf(m);
  wrong.header.set_sketch_columns(11);
  EXPECT_FALSE(c->Decode(wrong, 1000, &d).ok());
  // A table with Inf goes as F32, and is refused.
  std::vector<float> inf(10, 1.0f);
  inf[2] = INFINITY;
  Message f32;
  EncodeSketch(std::move(inf), 1, 10, &f32, true);
  EXPECT_EQ(f32.header.frames(0).type(), proto::F32);
  EXPECT_FALSE(c->Decode(CopyOf(f32), 1000, &d).ok());
}

TEST(SketchLayout, FusionGroupsCoverTheRange) {
  const auto groups = FusionGroups(1000, 300);
  ASSERT_EQ(groups.size(), 4u);
  EXPECT_EQ(groups[0].begin, 0u);
  EXPECT_EQ(groups[3].end, 1000u);
  for (size_t g = 1; g < groups.size(); ++g) EXPECT_EQ(groups[g].begin, groups[g - 1].end);
  EXPECT_EQ(FusionGroups(1000, 0).size(), 1u);
  proto::CompressionConfig c;
  c.set_density(0.01);
  c.mutable_sketch()->set_columns_per_k(10);
  EXPECT_EQ(SketchColumns(c, 100000), 10000u);
  EXPECT_EQ(SketchColumns(c, 10), 16u);  // at least 16
  EXPECT_EQ(SketchK(c, 100000), 1000u);
}

// The registry's bound on a push (the data sockets' ZMQ_MAXMSGSIZE): a top-k push with every
// index, or the sketch's tables of every fusion group, which the encoding's own row computes from
// the same columns as its compressor (SketchColumns).
TEST(EncodingTable, LargestFrameBoundsEveryPush) {
  constexpr uint64_t n = 1000003;
  proto::JobConfig job;
  job.mutable_compression()->set_encoding(proto::TOPK);
  EXPECT_EQ(JobMaxFrameBytes(job, n), static_cast<int64_t>(8 * n) + kControlMaxFrameBytes);
  job.mutable_compression()->set_encoding(proto::SKETCH);
  job.mutable_compression()->set_density(0.5);
  auto& sk = *job.mutable_compression()->mutable_sketch();
  sk.set_rows(5);
  sk.set_columns_per_k(8);  // tables larger than every index: 5 x 8 x 0.5 x 4 bytes an element
  for (uint64_t group : {uint64_t{0}, uint64_t{10}, uint64_t{4096}, uint64_t{999999}}) {
    SCOPED_TRACE("fusion_group_size " + std::to_string(group));
    sk.set_fusion_group_size(group);
    uint64_t columns = 0;
    const auto groups = FusionGroups(n, group);
    for (const auto& g : groups) columns += SketchColumns(job.compression(), g.size());
    const uint64_t tables = 4 * sk.rows() * columns;
    const uint64_t bound = SketchMaxPayloadBytes(job, n);
    EXPECT_GE(bound, tables);
    EXPECT_LE(bound, tables + 4 * sk.rows() * 17 * groups.size()) << "a loose bound";
    EXPECT_EQ(JobMaxFrameBytes(job, n),
              static_cast<int64_t>(std::max(bound, 8 * n)) + kControlMaxFrameBytes);
  }
  // Saturates instead of overflowing.
  EXPECT_EQ(JobMaxFrameBytes(job, uint64_t{1} << 62), int64_t{1} << 62);
}

}  // namespace
}  // namespace sparseps
