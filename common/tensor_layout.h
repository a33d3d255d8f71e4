// Where each named tensor of a model lies in its flat parameter vector (the model file's
// layout). Plain C++17: CUDA sources include it through worker/model.h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sparseps {

// One tensor of a flat parameter vector: its name, shape and first element.
struct TensorLayout {
  std::string name;             // e.g. "fc0.weight"
  std::vector<uint64_t> shape;  // elements per dimension
  uint64_t offset = 0;          // first element in the flat vector
};

}  // namespace sparseps
