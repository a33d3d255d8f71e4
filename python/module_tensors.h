// Tensors from Python for the module sparseps._sparseps (sparseps_module.cc): float32 arrays lent
// without a copy (__cuda_array_interface__, __dlpack__ or the buffer protocol: PyTorch, NumPy,
// CuPy), host copies of anything NumPy converts, and NumPy arrays that own a result. Bad input is
// a ValueError naming the argument.
//
// Thread-safety: with the GIL held, except Buffers (plain data).
#pragma once

#include <dlpack/dlpack.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "sparseps/client.h"

namespace sparseps::pymodule {

namespace py = pybind11;

using HostArray = py::array_t<float, py::array::c_style | py::array::forcecast>;

// A contiguous float32 host copy (or view) of `obj`, as sparseps.capi takes such arguments: a NumPy
// array, anything NumPy converts, or a torch.Tensor on any device (detached, then copied to the
// host). `what` names it in the ValueError for anything else.
HostArray HostFloats(py::object obj, const std::string& what);

// One float32 array lent by Python for the length of a call: host or CUDA memory, contiguous.
class Borrowed {
 public:
  Borrowed() = default;
  Borrowed(Borrowed&& o) noexcept { *this = std::move(o); }
  Borrowed& operator=(Borrowed&& o) noexcept {
    std::swap(data, o.data);
    std::swap(size, o.size);
    std::swap(device, o.device);
    std::swap(shape, o.shape);
    std::swap(managed_, o.managed_);
    std::swap(buffer_, o.buffer_);
    return *this;
  }
  ~Borrowed() {
    if (managed_ != nullptr && managed_->deleter != nullptr) managed_->deleter(managed_);
  }

  float* data = nullptr;
  size_t size = 0;             // elements
  int device = client::kHost;  // else the CUDA device's ordinal
  std::vector<py::ssize_t> shape;

  // Takes obj's memory. `what` names it in errors ("grads[2]").
  static Borrowed From(py::handle obj, const std::string& what);

 private:
  static Borrowed FromDlpack(py::object capsule, const std::string& what);
  static Borrowed FromCudaArrayInterface(py::handle obj, const std::string& what);
  static Borrowed FromBuffer(py::buffer buf, const std::string& what);

  DLManagedTensor* managed_ = nullptr;
  std::unique_ptr<py::buffer_info> buffer_;
};

// A single tensor, or a list / tuple of them.
struct Arrays {
  bool listed = false;
  std::vector<Borrowed> parts;
};

// obj's tensors (a list or tuple of them: parts `name[i]`); ValueError for an empty list.
Arrays Borrow(py::handle obj, const std::string& name);

// A Python object's tensors as the client library's buffers (lent for the length of a call).
std::vector<client::Buffer> Buffers(const Arrays& a);

// A NumPy array that owns `v` (moved, not copied): freed when the array is.
template <typename T>
py::array_t<T> Owned(std::vector<T>&& v) {
  auto* owned = new std::vector<T>(std::move(v));
  py::capsule owner(owned, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>(static_cast<py::ssize_t>(owned->size()), owned->data(), owner);
}

}  // namespace sparseps::pymodule
