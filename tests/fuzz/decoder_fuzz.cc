// libFuzzer target for one decoder (chosen at compile time by SPARSEPS_FUZZ_<NAME>): builds a
// message whose header fields, frame types, declared sizes and frame bytes all come from the
// input, runs the receive-side checks (ValidateFrames) and the decoder, and on success checks
// what the decoder promises: indices strictly increasing and below the range, values finite,
// sketch sizes consistent and its tables finite. Any out-of-bounds read is caught by ASan.
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstdlib>
#include <vector>

#include "encodings/codec.h"
#include "encodings/registry.h"
#include "kernels/golomb.h"
#include "kernels/pack.h"
#include "transport/message.h"

namespace {

[[noreturn]] void Fail(const char* what) {
  __builtin_trap();
  (void)what;
}

[[maybe_unused]] void CheckPayload(const sparseps::DecodedPayload& p, uint64_t range_len) {
  if (p.is_dense()) {
    if (p.dense.size() != range_len) Fail("dense size");
    for (float v : p.dense) {
      if (!std::isfinite(v)) Fail("dense value");
    }
    return;
  }
  if (p.is_sketch()) {
    if (p.sketch.size() != uint64_t{p.sketch_rows} * p.sketch_columns) Fail("sketch size");
    for (float v : p.sketch) {
      if (!std::isfinite(v)) Fail("sketch value");
    }
    return;
  }
  if (p.indices.size() != p.values.size() || p.indices.size() > range_len) Fail("sparse size");
  for (size_t j = 0; j < p.indices.size(); ++j) {
    if (p.indices[j] >= range_len) Fail("index bound");
    if (j > 0 && p.indices[j] <= p.indices[j - 1]) Fail("index order");
    if (!std::isfinite(p.values[j])) Fail("value");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const uint64_t range_len = in.ConsumeIntegralInRange<uint64_t>(0, 1 << 20);
#if defined(SPARSEPS_FUZZ_GOLOMB) || defined(SPARSEPS_FUZZ_VARINT)
  const size_t k = in.ConsumeIntegralInRange<size_t>(0, 4096);
  const uint32_t b = in.ConsumeIntegralInRange<uint32_t>(0, 40);
  const std::vector<uint8_t> bytes = in.ConsumeRemainingBytes<uint8_t>();
  std::vector<uint32_t> out(k);
#if defined(SPARSEPS_FUZZ_GOLOMB)
  const char* err =
      sparseps::kernels::GolombDecode(bytes.data(), bytes.size(), b, k, range_len, out.data());
#else
  (void)b;
  const char* err =
      sparseps::kernels::DecodeVarintGaps(bytes.data(), bytes.size(), k, range_len, out.data());
#endif
  if (err == nullptr) {
    for (size_t j = 0; j < k; ++j) {
      if (out[j] >= range_len || (j > 0 && out[j] <= out[j - 1])) Fail("positions");
    }
  }
  return 0;
#else
#if defined(SPARSEPS_FUZZ_DENSE)
  const auto encoding = sparseps::proto::DENSE;
#elif defined(SPARSEPS_FUZZ_TOPK)
  const auto encoding = sparseps::proto::TOPK;
#elif defined(SPARSEPS_FUZZ_SBC)
  const auto encoding = sparseps::proto::SBC;
#else
  const auto encoding = sparseps::proto::SKETCH;
#endif
  sparseps::Message msg;
  auto& h = msg.header;
  h.set_command(sparseps::proto::PUSH);
  h.set_encoding(encoding);
  h.set_count(in.ConsumeIntegral<uint64_t>() % (range_len + 2));
  h.set_golomb_b(in.ConsumeIntegralInRange<uint32_t>(0, 40));
  h.set_value(in.ConsumeFloatingPoint<float>());
  h.set_sketch_rows(in.ConsumeIntegralInRange<uint32_t>(0, 40));
  h.set_sketch_columns(in.ConsumeIntegralInRange<uint64_t>(0, 1 << 16));
  const int frames = in.ConsumeIntegralInRange<int>(0, 3);
  std::vector<std::vector<uint8_t> > payloads;
  for (int f = 0; f < frames; ++f) {
    const auto type = static_cast<sparseps::proto::ElemType>(in.ConsumeIntegralInRange<int>(0, 5));
    const bool lie = in.ConsumeBool();
    const size_t len = in.ConsumeIntegralInRange<size_t>(0, 1 << 14);
    payloads.push_back(in.ConsumeBytes<uint8_t>(len));
    sparseps::AddFrameCopy(&msg, sparseps::proto::U8, payloads.back().data(),
                           payloads.back().size());
    auto* info = h.mutable_frames(f);
    info->set_type(type);
    if (lie) info->set_bytes(in.ConsumeIntegral<uint32_t>());
  }
  // What RecvMessage does before any decoder sees a message.
  if (!sparseps::ValidateFrames(msg).ok()) return 0;
  sparseps::DecodedPayload p;
  if (sparseps::FindCodec(encoding)->Decode(msg, range_len, &p).ok()) CheckPayload(p, range_len);
  return 0;
#endif
}
