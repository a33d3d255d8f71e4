#include "python/module_tensors.h"

#include <cstdint>

namespace sparseps::pymodule {

HostArray HostFloats(py::object obj, const std::string& what) {
  if (py::hasattr(obj, "detach") && py::hasattr(obj, "cpu"))
    obj = obj.attr("detach")().attr("cpu")();
  auto a = HostArray::ensure(obj);
  if (!a) {
    throw py::value_error(what + ": expected a float32 array or tensor, got " +
                          std::string(py::str(py::type::of(obj))));
  }
  return a;
}

Borrowed Borrowed::From(py::handle obj, const std::string& what) {
  if (py::hasattr(obj, "__cuda_array_interface__")) return FromCudaArrayInterface(obj, what);
  if (py::hasattr(obj, "__dlpack__")) {
    py::object capsule;
    try {
      capsule = obj.attr("__dlpack__")();
    } catch (py::error_already_set& e) {
      // NumPy refuses read-only arrays, PyTorch tensors that require grad: say why.
      if (!py::isinstance<py::buffer>(obj)) {
        throw py::value_error(what + ": cannot be read through DLPack: " + std::string(e.what()) +
                              " (pass tensor.detach(), or a writable array)");
      }
    }
    if (capsule) return FromDlpack(capsule, what);
  }
  if (py::isinstance<py::buffer>(obj))
    return FromBuffer(py::reinterpret_borrow<py::buffer>(obj), what);
  throw py::value_error(what +
                        ": expected a float32 tensor or array (DLPack, "
                        "__cuda_array_interface__ or the buffer protocol), got " +
                        std::string(py::str(py::type::of(obj))));
}

Borrowed Borrowed::FromDlpack(py::object capsule, const std::string& what) {
  auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  if (m == nullptr) {
    PyErr_Clear();
    throw py::value_error(what + ": __dlpack__ did not return a DLPack capsule");
  }
  // Consumed: the capsule no longer frees the tensor; this Borrowed does.
  PyCapsule_SetName(capsule.ptr(), "used_dltensor");
  Borrowed b;
  b.managed_ = m;
  const DLTensor& t = m->dl_tensor;
  if (t.dtype.code != kDLFloat || t.dtype.bits != 32 || t.dtype.lanes != 1) {
    throw py::value_error(what + ": dtype is not float32 (DLPack code " +
                          std::to_string(t.dtype.code) + ", " + std::to_string(t.dtype.bits) +
                          " bits); sparseps takes float32 (call .float())");
  }
  b.size = 1;
  for (int d = 0; d < t.ndim; ++d) {
    b.shape.push_back(static_cast<py::ssize_t>(t.shape[d]));
    b.size *= static_cast<size_t>(t.shape[d]);
  }
  if (t.strides != nullptr) {
    int64_t expect = 1;
    for (int d = t.ndim - 1; d >= 0; --d) {
      if (t.shape[d] != 1 && t.strides[d] != expect) {
        throw py::value_error(what + ": not contiguous (call .contiguous())");
      }
      expect *= t.shape[d];
    }
  }
  b.data = reinterpret_cast<float*>(static_cast<char*>(t.data) + t.byte_offset);
  if (t.device.device_type == kDLCUDA) {
    b.device = t.device.device_id;
  } else if (t.device.device_type != kDLCPU && t.device.device_type != kDLCUDAHost) {
    throw py::value_error(what + ": on a device sparseps does not take (DLPack device type " +
                          std::to_string(t.device.device_type) + "); use the CPU or CUDA");
  }
  return b;
}

Borrowed Borrowed::FromCudaArrayInterface(py::handle obj, const std::string& what) {
  py::dict cai = obj.attr("__cuda_array_interface__");
  const std::string typestr = py::str(cai["typestr"]);
  if (typestr != "<f4") {
    throw py::value_error(what + ": dtype " + typestr +
                          "; sparseps takes float32 (<f4, call .float())");
  }
  Borrowed b;
  b.size = 1;
  for (auto d : py::tuple(cai["shape"])) {
    b.shape.push_back(d.cast<py::ssize_t>());
    b.size *= d.cast<size_t>();
  }
  if (cai.contains("strides") && !cai["strides"].is_none()) {
    py::ssize_t expect = 4;
    py::tuple strides = cai["strides"];
    for (size_t d = b.shape.size(); d-- > 0;) {
      if (b.shape[d] != 1 && strides[d].cast<py::ssize_t>() != expect) {
        throw py::value_error(what + ": not contiguous (call .contiguous())");
      }
      expect *= b.shape[d];
    }
  }
  b.data = reinterpret_cast<float*>(py::tuple(cai["data"])[0].cast<uintptr_t>());
  b.device = client::DeviceOf(b.data);
  if (b.device == client::kHost) b.device = 0;  // a library without CUDA refuses it by name
  return b;
}

Borrowed Borrowed::FromBuffer(py::buffer buf, const std::string& what) {
  py::buffer_info info = buf.request(/*writable=*/false);
  if (info.format != py::format_descriptor<float>::format() || info.itemsize != 4) {
    throw py::value_error(what + ": buffer format '" + info.format + "'; sparseps takes float32");
  }
  Borrowed b;
  b.size = static_cast<size_t>(info.size);
  b.shape = info.shape;
  py::ssize_t expect = 4;
  for (size_t d = info.shape.size(); d-- > 0;) {
    if (info.shape[d] != 1 && info.strides[d] != expect) {
      throw py::value_error(what + ": not contiguous (call numpy.ascontiguousarray)");
    }
    expect *= info.shape[d];
  }
  b.data = static_cast<float*>(info.ptr);
  b.buffer_ = std::make_unique<py::buffer_info>(std::move(info));
  return b;
}

Arrays Borrow(py::handle obj, const std::string& name) {
  Arrays a;
  if (py::isinstance<py::list>(obj) || py::isinstance<py::tuple>(obj)) {
    a.listed = true;
    size_t i = 0;
    for (auto item : obj) {
      a.parts.push_back(Borrowed::From(item, name + "[" + std::to_string(i++) + "]"));
    }
    if (a.parts.empty()) throw py::value_error(name + ": the list is empty");
  } else {
    a.parts.push_back(Borrowed::From(obj, name));
  }
  return a;
}

std::vector<client::Buffer> Buffers(const Arrays& a) {
  std::vector<client::Buffer> out;
  for (const Borrowed& b : a.parts) out.push_back({b.data, b.size, b.device});
  return out;
}

}  // namespace sparseps::pymodule
