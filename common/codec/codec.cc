#include "common/codec/codec.h"

#include "common/codec/dense.h"
#include "common/codec/sbc.h"
#include "common/codec/sketch.h"
#include "common/codec/topk.h"

namespace sparseps {

const Codec* FindCodec(proto::Encoding encoding) {
  static const DenseCodec dense;
  static const TopKCodec topk;
  static const SbcCodec sbc;
  static const SketchCodec sketch;
  switch (encoding) {
    case proto::SBC:
      return &sbc;
    case proto::SKETCH:
      return &sketch;
    case proto::DENSE:
      return &dense;
    case proto::TOPK:
      return &topk;
    default:
      return nullptr;
  }
}

}  // namespace sparseps
