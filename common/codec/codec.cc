#include "common/codec/codec.h"

#include "common/codec/dense.h"
#include "common/codec/topk.h"

namespace sparseps {

const Codec* FindCodec(proto::Encoding encoding) {
  static const DenseCodec dense;
  static const TopKCodec topk;
  switch (encoding) {
    case proto::DENSE:
      return &dense;
    case proto::TOPK:
      return &topk;
    default:
      return nullptr;
  }
}

}  // namespace sparseps
