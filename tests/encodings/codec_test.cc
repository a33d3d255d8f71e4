// Codec round trips (dense, top-k) and rejection of truncated or inconsistent payloads.
#include "encodings/codec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "encodings/dense.h"
#include "encodings/registry.h"
#include "encodings/topk.h"
#include "tests/support/messages.h"
#include "transport/message.h"

namespace sparseps {
namespace {

using testing::CopyOf;

TEST(DenseCodec, RoundTrip) {
  std::vector<float> v = {1.5f, -2.0f, 0.0f, 3.25f, 1e-30f};
  Message m;
  EncodeDense(std::vector<float>(v), &m);
  EXPECT_EQ(m.header.encoding(), proto::DENSE);
  Message wire = CopyOf(m);
  DecodedPayload p;
  ASSERT_TRUE(FindCodec(proto::DENSE)->Decode(wire, v.size(), &p).ok());
  ASSERT_TRUE(p.is_dense());
  ASSERT_EQ(p.dense.size(), v.size());
  for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(p.dense[i], v[i]);
}

TEST(DenseCodec, RejectsWrongLength) {
  Message m;
  EncodeDense(std::vector<float>(4, 1.0f), &m);
  DecodedPayload p;
  Status s = DenseCodec().Decode(m, 5, &p);
  EXPECT_EQ(s.code(), StatusCode::kProtocolError);
}

TEST(DenseCodec, RejectsNonFinite) {
  Message m;
  EncodeDense({1.0f, std::numeric_limits<float>::quiet_NaN()}, &m);
  DecodedPayload p;
  EXPECT_FALSE(DenseCodec().Decode(m, 2, &p).ok());
  Message m2;
  EncodeDense({std::numeric_limits<float>::infinity(), 1.0f}, &m2);
  EXPECT_FALSE(DenseCodec().Decode(m2, 2, &p).ok());
}

TEST(TopKCodec, RoundTrip) {
  std::vector<uint32_t> idx = {0, 3, 17, 99};
  std::vector<float> val = {-1.0f, 2.5f, 7.0f, -0.125f};
  Message m;
  EncodeTopK(std::vector<uint32_t>(idx), std::vector<float>(val), &m);
  EXPECT_EQ(m.header.encoding(), proto::TOPK);
  Message wire = CopyOf(m);
  DecodedPayload p;
  ASSERT_TRUE(FindCodec(proto::TOPK)->Decode(wire, 100, &p).ok());
  ASSERT_FALSE(p.is_dense());
  ASSERT_EQ(p.nnz(), idx.size());
  for (size_t i = 0; i < idx.size(); ++i) {
    EXPECT_EQ(p.indices[i], idx[i]);
    EXPECT_EQ(p.values[i], val[i]);
  }
}

TEST(TopKCodec, EmptyPushIsValid) {
  Message m;
  EncodeTopK({}, {}, &m);
  DecodedPayload p;
  ASSERT_TRUE(TopKCodec().Decode(CopyOf(m), 10, &p).ok());
  EXPECT_EQ(p.nnz(), 0u);
}

TEST(TopKCodec, RejectsIndexOutOfRange) {
  Message m;
  EncodeTopK({1, 10}, {1.0f, 2.0f}, &m);
  DecodedPayload p;
  EXPECT_EQ(TopKCodec().Decode(m, 10, &p).code(), StatusCode::kProtocolError);
  EXPECT_TRUE(TopKCodec().Decode(m, 11, &p).ok());
}

TEST(TopKCodec, RejectsUnsortedOrDuplicateIndices) {
  Message m;
  EncodeTopK({5, 2}, {1.0f, 2.0f}, &m);
  DecodedPayload p;
  EXPECT_FALSE(TopKCodec().Decode(m, 10, &p).ok());
  Message d;
  EncodeTopK({2, 2}, {1.0f, 2.0f}, &d);
  EXPECT_FALSE(TopKCodec().Decode(d, 10, &p).ok());
}

TEST(TopKCodec, RejectsCountMismatch) {
  Message m;
  EncodeTopK({1, 2, 3}, {1.0f, 2.0f}, &m);
  DecodedPayload p;
  EXPECT_FALSE(TopKCodec().Decode(m, 10, &p).ok());
}

TEST(TopKCodec, RejectsTruncatedFrame) {
  Message m;
  EncodeTopK({1, 2, 3}, {1.0f, 2.0f, 3.0f}, &m);
  Message cut;
  cut.header = m.header;
  cut.frames.emplace_back(m.frames[0].data(), m.frames[0].size());
  cut.frames.emplace_back(m.frames[1].data(), m.frames[1].size() - 2);  // 2 bytes short
  DecodedPayload p;
  EXPECT_FALSE(ValidateFrames(cut).ok());
  EXPECT_FALSE(TopKCodec().Decode(cut, 10, &p).ok());
}

TEST(TopKCodec, RejectsMissingFrame) {
  Message m;
  EncodeTopK({1, 2, 3}, {1.0f, 2.0f, 3.0f}, &m);
  m.frames.pop_back();
  DecodedPayload p;
  EXPECT_FALSE(TopKCodec().Decode(m, 10, &p).ok());
}

TEST(TopKCodec, RejectsWrongElementType) {
  Message m;
  EncodeTopK({1, 2}, {1.0f, 2.0f}, &m);
  m.header.mutable_frames(1)->set_type(proto::U32);  // values frame claims u32
  DecodedPayload p;
  EXPECT_FALSE(TopKCodec().Decode(m, 10, &p).ok());
}

TEST(TopKCodec, RejectsNonFiniteValue) {
  Message m;
  EncodeTopK({1, 2}, {1.0f, std::numeric_limits<float>::quiet_NaN()}, &m);
  DecodedPayload p;
  EXPECT_FALSE(TopKCodec().Decode(m, 10, &p).ok());
}

TEST(Codec, UnknownEncodingHasNoCodec) {
  EXPECT_EQ(FindCodec(proto::ENCODING_UNSPECIFIED), nullptr);
  EXPECT_EQ(FindCodec(static_cast<proto::Encoding>(12345)), nullptr);
}

}  // namespace
}  // namespace sparseps
