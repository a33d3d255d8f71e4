// The Python module `sparseps._sparseps` (pybind11): a training loop written in Python joins a
// sparseps job as one of its workers. The scheduler and the servers run as the usual daemons;
// this process registers, and each push_pull aggregates a gradient with the job's encoding,
// selection and collective exactly as the C++ worker does (the same WorkerSession and
// Aggregator, worker/session.h), returning the update to apply.
//
// Tensors come in without a copy: objects with __cuda_array_interface__ or __dlpack__ (PyTorch,
// NumPy >= 1.22, CuPy) or the buffer protocol (NumPy arrays, PyTorch CPU tensors through NumPy).
// They must be float32, C-contiguous, on the CPU (or, in a CUDA build, all on one CUDA device).
// The module does not link libtorch.
//
// Errors become Python exceptions: ValueError for bad input or configuration, TimeoutError for a
// deadline (naming who is missing), sparseps.Error (a RuntimeError) for the rest.
//
// Thread-safety: a Worker belongs to one Python thread; blocking calls release the GIL.
#include <dlpack/dlpack.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "config/config.h"
#include "transport/van.h"
#include "worker/device_buffer.h"
#include "worker/session.h"
#include "worker/training_log.h"

#if SPARSEPS_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace py = pybind11;

namespace sparseps {
namespace {

PyObject* g_error = nullptr;  // sparseps.Error

[[noreturn]] void Raise(const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
      throw py::value_error(s.message());
    case StatusCode::kDeadlineExceeded:
      PyErr_SetString(PyExc_TimeoutError, s.message().c_str());
      throw py::error_already_set();
    default:
      PyErr_SetString(g_error, s.ToString().c_str());
      throw py::error_already_set();
  }
}

void Check(const Status& s) {
  if (!s.ok()) Raise(s);
}

// After a wait that Ctrl-C ended (ScopedStopOnInterrupt): KeyboardInterrupt, as Python would.
[[noreturn]] void RaiseInterrupt(const Status& s) {
  PyErr_SetString(PyExc_KeyboardInterrupt, s.message().c_str());
  throw py::error_already_set();
}

// One float32 array lent by Python for the length of a call: host or CUDA memory, contiguous.
class Borrowed {
 public:
  Borrowed() = default;
  Borrowed(Borrowed&& o) noexcept { *this = std::move(o); }
  Borrowed& operator=(Borrowed&& o) noexcept {
    std::swap(data, o.data);
    std::swap(size, o.size);
    std::swap(cuda, o.cuda);
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
  size_t size = 0;  // elements
  bool cuda = false;
  int device = -1;  // CUDA device ordinal
  std::vector<py::ssize_t> shape;

  // Takes obj's memory. `what` names it in errors ("grads[2]").
  static Borrowed From(py::handle obj, const std::string& what) {
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

 private:
  static Borrowed FromDlpack(py::object capsule, const std::string& what) {
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
      b.cuda = true;
      b.device = t.device.device_id;
    } else if (t.device.device_type != kDLCPU && t.device.device_type != kDLCUDAHost) {
      throw py::value_error(what + ": on a device sparseps does not take (DLPack device type " +
                            std::to_string(t.device.device_type) + "); use the CPU or CUDA");
    }
    return b;
  }

  static Borrowed FromCudaArrayInterface(py::handle obj, const std::string& what) {
    py::dict cai = obj.attr("__cuda_array_interface__");
    const std::string typestr = py::str(cai["typestr"]);
    if (typestr != "<f4") {
      throw py::value_error(what + ": dtype " + typestr +
                            "; sparseps takes float32 (<f4, call .float())");
    }
    Borrowed b;
    b.cuda = true;
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
#if SPARSEPS_HAVE_CUDA
    cudaPointerAttributes attr{};
    if (b.data != nullptr && cudaPointerGetAttributes(&attr, b.data) == cudaSuccess) {
      b.device = attr.device;
    }
#endif
    return b;
  }

  static Borrowed FromBuffer(py::buffer buf, const std::string& what) {
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

  DLManagedTensor* managed_ = nullptr;
  std::unique_ptr<py::buffer_info> buffer_;
};

// A single tensor, or a list / tuple of them.
struct Arrays {
  bool listed = false;
  std::vector<Borrowed> parts;
  size_t total = 0;
  bool cuda = false;
  int device = -1;
};

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
  a.cuda = a.parts[0].cuda;
  a.device = a.parts[0].device;
  for (size_t i = 0; i < a.parts.size(); ++i) {
    const Borrowed& b = a.parts[i];
    if (b.cuda != a.cuda || b.device != a.device) {
      throw py::value_error(name + "[" + std::to_string(i) +
                            "]: on another device than the first; sparseps takes every tensor "
                            "on one device");
    }
    a.total += b.size;
  }
  return a;
}

Status CopyBytes(void* dst, const void* src, size_t bytes, bool dst_cuda, bool src_cuda) {
  if (!dst_cuda && !src_cuda) {
    std::memcpy(dst, src, bytes);
    return Status::OK();
  }
#if SPARSEPS_HAVE_CUDA
  const cudaMemcpyKind kind = dst_cuda
                                  ? (src_cuda ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                                  : cudaMemcpyDeviceToHost;
  const cudaError_t e = cudaMemcpy(dst, src, bytes, kind);
  if (e != cudaSuccess) {
    return Status::FailedPrecondition(std::string("cudaMemcpy: ") + cudaGetErrorString(e));
  }
  return Status::OK();
#else
  return Status::FailedPrecondition("this build has no CUDA");
#endif
}

// sparseps.Worker.
class Worker {
 public:
  Worker(const std::string& config_path, std::optional<int> rank,
         const std::vector<std::string>& overrides) {
    auto config =
        LoadOwnLoopConfig(config_path, overrides, rank.value_or(-1), "a Python training loop");
    Check(config.status());
    config_ = std::move(*config);
  }

  // Joins the job with `params`' size, makes the job's starting parameters (worker 0's) and
  // writes them into params in place.
  void Init(py::object params, std::optional<std::vector<std::string>> names) {
    if (session_) Raise(Status::FailedPrecondition("init was called already"));
    Arrays a = Borrow(params, "params");
    if (names && names->size() != a.parts.size()) {
      Raise(Status::InvalidArgument("names: " + std::to_string(names->size()) + " names for " +
                                    std::to_string(a.parts.size()) + " tensors"));
    }
    if (a.cuda) {
#if !SPARSEPS_HAVE_CUDA
      Raise(Status::InvalidArgument(
          "params: on a CUDA device, but this sparseps was built without CUDA (move the "
          "tensors to the CPU, or build where nvcc is found)"));
#endif
      // The device SBC compressor trains its local copy on the device, where the update's old
      // values cannot be read between pushes.
      if (config_.compression().encoding() == proto::SBC &&
          config_.compression().local_iterations() > 1) {
        Raise(Status::InvalidArgument(
            "params: CUDA tensors with sbc and compression.local_iterations > 1 are not "
            "supported; use CPU tensors or local_iterations: 1"));
      }
    }
    listed_ = a.listed;
    uint64_t first = 0;
    for (size_t i = 0; i < a.parts.size(); ++i) {
      const auto& b = a.parts[i];
      sizes_.push_back(b.size);
      shapes_.push_back(b.shape);
      // The model file's tensors: one per tensor of params, named as given.
      std::vector<uint64_t> shape(b.shape.begin(), b.shape.end());
      layers_.push_back({names      ? (*names)[i]
                         : a.listed ? "param" + std::to_string(i)
                                    : "params",
                         shape, first});
      first += b.size;
    }
    cuda_ = a.cuda;
    device_ = a.device;
    std::vector<float> initial(a.total);
    size_t offset = 0;
    for (const auto& b : a.parts) {
      Check(CopyBytes(initial.data() + offset, b.data, b.size * 4, false, b.cuda));
      offset += b.size;
    }
    Status s;
    bool interrupted = false;
    {
      ScopedStopOnInterrupt stop_on_interrupt;
      py::gil_scoped_release release;
      auto joined = JoinOwnLoop(config_, initial, cuda_, LoopState(), "a Python training loop");
      s = joined.status();
      if (s.ok()) session_ = std::move(*joined);
      interrupted = stop_on_interrupt.interrupted();
    }
    if (!s.ok()) {
      if (interrupted) RaiseInterrupt(s);
      Raise(s);
    }
    Aggregator& agg = session_->aggregator();
    agg.set_change_observer([this](uint64_t begin, std::span<const uint32_t> keys, bool all) {
      Observe(begin, keys, all);
    });
    // Live metrics (metrics.port), as sparseps-worker serves them; no CSV files or progress
    // lines, which the loop writes itself.
    log_ = std::make_unique<TrainingLog>(config_, session_->rank(), 0, 0, /*leader=*/false);
    Check(log_->StartMetrics());
    last_return_ = Clock::now();
    offset = 0;
    for (auto& b : a.parts) {
      Check(CopyBytes(b.data, agg.params().data() + offset, b.size * 4, b.cuda, false));
      offset += b.size;
    }
  }

  // Aggregates `grads` (the same layout as init's params) and returns the update: what to
  // subtract from the parameters to hold the job's new ones (a float32 NumPy array, or a list of
  // them shaped like grads, views of one array); with `sparse`, (keys, update, params): the flat
  // keys that changed (int64, increasing), the update and the new parameters there.
  py::object PushPull(py::object grads, bool sparse, std::optional<double> loss) {
    if (!session_) Raise(Status::FailedPrecondition("call init(params) before push_pull"));
    // The loop's forward and backward: the time since the previous push_pull returned.
    const double compute_ms =
        steps_ == 0
            ? 0.0
            : std::chrono::duration<double, std::milli>(Clock::now() - last_return_).count();
    Arrays a = Borrow(grads, "grads");
    Aggregator& agg = session_->aggregator();
    const size_t n = agg.num_params();
    // Laid out as init's params, or one flat tensor of them all (then the update is flat too).
    const bool flat = !a.listed && a.parts[0].size == n;
    if (a.cuda != cuda_ || a.device != device_) {
      Raise(Status::InvalidArgument(std::string("grads: on another device than init's params (") +
                                    (cuda_ ? "CUDA" : "the CPU") + ")"));
    }
    if (!flat && (a.listed != listed_ || a.parts.size() != sizes_.size())) {
      Raise(Status::InvalidArgument(
          "grads: not laid out as init's params (" +
          (listed_ ? "a list of " + std::to_string(sizes_.size()) + " tensors" : "one tensor") +
          ") nor one flat tensor of all " + std::to_string(n) + " elements"));
    }
    for (size_t i = 0; !flat && i < sizes_.size(); ++i) {
      if (a.parts[i].size != sizes_[i]) {
        Raise(Status::InvalidArgument("grads" + (listed_ ? "[" + std::to_string(i) + "]" : "") +
                                      ": " + std::to_string(a.parts[i].size) +
                                      " elements; init's params had " + std::to_string(sizes_[i])));
      }
    }
    // One flat gradient: a single tensor is taken as it is (no copy); a list is gathered.
    float* grad = a.parts[0].data;
    if (a.parts.size() > 1) {
      if (cuda_) {
        if (gather_d_.size() != n) Check(gather_d_.Allocate(n));
        grad = gather_d_.data();
      } else {
        gather_.resize(n);
        grad = gather_.data();
      }
      size_t offset = 0;
      for (const auto& b : a.parts) {
        Check(CopyBytes(grad + offset, b.data, b.size * 4, cuda_, cuda_));
        offset += b.size;
      }
    }
    // The update comes into a zeroed array (numpy.zeros: pages the step does not touch stay
    // untouched): the observer copies the old values of the keys about to change, and after the
    // step the new values are subtracted there.
    // Sparse, the old values are kept in the order announced (old_), with their keys; dense,
    // in a zeroed array at their keys.
    py::array_t<float> update;
    sparse_ = sparse;
    if (sparse) {
      scratch_.resize(n);
      out_ = scratch_.data();
    } else {
      if (!np_zeros_) np_zeros_ = py::module_::import("numpy").attr("zeros");
      update = np_zeros_(n, "float32");
      out_ = update.mutable_data();
    }
    touched_.clear();
    old_.clear();
    segments_.clear();
    all_ = false;
    Status s;
    bool interrupted = false;
    {
      ScopedStopOnInterrupt stop_on_interrupt;
      py::gil_scoped_release release;
      if (cuda_) {
        auto p = agg.ModelParams();  // the device copy, brought up to date
        s = p.status();
      }
      last_ = StepStats{};
      if (s.ok()) s = agg.Step(grad, cuda_, &last_);
      if (s.ok()) {
        const float* now = agg.host_model_params();
        if (all_) {
          for (size_t i = 0; i < n; ++i) out_[i] -= now[i];
        } else if (sparse) {
          OrderTouched();
        } else {
          for (uint32_t k : touched_) out_[k] -= now[k];
        }
      }
      interrupted = stop_on_interrupt.interrupted();
    }
    out_ = nullptr;
    if (!s.ok()) {
      // A bad gradient changes nothing and the job goes on; anything else ends it.
      if (s.code() != StatusCode::kInvalidArgument) session_->ReportFailure(s);
      if (interrupted) RaiseInterrupt(s);
      Raise(s);
    }
    ++steps_;
    log_->Step(steps_, epoch_ + 1, loss.value_or(std::nan("")), compute_ms, last_, agg);
    Check(log_->SampleResidual(agg));
    Check(session_->AfterStep(LoopState(), layers_));
    last_return_ = Clock::now();
    if (sparse) {
      const size_t m = all_ ? n : touched_.size();
      py::array_t<int64_t> keys(static_cast<py::ssize_t>(m));
      py::array_t<float> values(static_cast<py::ssize_t>(m)), now(static_cast<py::ssize_t>(m));
      int64_t* k = keys.mutable_data();
      float* v = values.mutable_data();
      float* p = now.mutable_data();
      const float* params = agg.host_model_params();
      for (size_t j = 0; j < m; ++j) {
        const size_t key = all_ ? j : touched_[j];
        k[j] = static_cast<int64_t>(key);
        p[j] = params[key];
        v[j] = all_ ? scratch_[key] : old_[j] - p[j];
      }
      return py::make_tuple(keys, values, now);
    }
    if (!a.listed) return update;
    py::list out;
    size_t offset = 0;
    for (size_t i = 0; i < sizes_.size(); ++i) {
      py::object part = update[py::slice(static_cast<py::ssize_t>(offset),
                                         static_cast<py::ssize_t>(offset + sizes_[i]), 1)];
      out.append(part.attr("reshape")(py::tuple(py::cast(shapes_[i]))));
      offset += sizes_[i];
    }
    return out;
  }

  // The job's parameters as this worker holds them (a copy, float32).
  py::array_t<float> Params() {
    if (!session_) Raise(Status::FailedPrecondition("call init(params) first"));
    const auto& p = session_->aggregator().params();
    return py::array_t<float>(static_cast<py::ssize_t>(p.size()), p.data());
  }

  // What this worker holds back (its residual), for tests and diagnostics.
  py::array_t<float> Residual() {
    if (!session_) Raise(Status::FailedPrecondition("call init(params) first"));
    std::vector<float> r;
    Check(session_->aggregator().ReadResidual(&r));
    return py::array_t<float>(static_cast<py::ssize_t>(r.size()), r.data());
  }

  void SetEpoch(uint32_t epoch) {
    epoch_ = epoch;
    if (session_) session_->aggregator().SetEpoch(epoch);
  }

  // ssp / async: waits until every worker pushed as many steps as this one; the job's parameters
  // then (a copy). bsp, allreduce: the parameters at once.
  py::array_t<float> Synchronize() {
    if (!session_) Raise(Status::FailedPrecondition("call init(params) first"));
    Status s;
    bool interrupted = false;
    {
      ScopedStopOnInterrupt stop_on_interrupt;
      py::gil_scoped_release release;
      s = session_->aggregator().Synchronize();
      interrupted = stop_on_interrupt.interrupted();
    }
    if (!s.ok()) {
      session_->ReportFailure(s);
      if (interrupted) RaiseInterrupt(s);
      Raise(s);
    }
    return Params();
  }

  // Tells the scheduler this worker is done (DONE with its statistics) and waits until every
  // worker is (SHUTDOWN). test_accuracy: a fraction, -1 when this worker did not evaluate.
  // The loop's position in a checkpoint: the steps done.
  std::function<void(StateArchive&)> LoopState() {
    return [this](StateArchive& archive) { archive.Value("step", &steps_); };
  }

  void Finish(double test_accuracy, double train_loss, double samples_per_s, double train_s) {
    if (!session_) Raise(Status::FailedPrecondition("call init(params) first"));
    proto::WorkerStats stats;
    stats.set_steps(steps_);
    stats.set_bytes_sent(session_->aggregator().bytes_sent());
    stats.set_bytes_received(session_->aggregator().bytes_received());
    stats.set_final_test_accuracy(test_accuracy);
    stats.set_final_train_loss(train_loss);
    stats.set_samples_per_s(samples_per_s);
    stats.set_wall_s(train_s);
    Status s;
    bool interrupted = false;
    {
      ScopedStopOnInterrupt stop_on_interrupt;
      py::gil_scoped_release release;
      // The trained model, as the C++ worker 0 writes it (checkpoint.save_model).
      if (session_->is_leader() && config_.checkpoint().save_model() &&
          !config_.run().dir().empty()) {
        s = session_->aggregator().Synchronize();  // ssp / async: every worker's every push
        if (s.ok()) s = session_->SaveModel(config_.run().dir() + "/model.safetensors", layers_);
      }
      if (s.ok()) s = session_->Finish(stats);
      interrupted = stop_on_interrupt.interrupted();
    }
    if (!s.ok() && interrupted) {
      session_.reset();
      RaiseInterrupt(s);
    }
    session_.reset();
    Check(s);
  }

  py::dict LastStep() const {
    py::dict d;
    d["bytes_sent"] = last_.bytes_sent;
    d["bytes_received"] = last_.bytes_received;
    d["selected"] = last_.selected;
    d["applied"] = last_.applied;
    d["encode_ms"] = last_.encode_ms;
    d["comm_ms"] = last_.comm_ms;
    return d;
  }

  // Every key of the resolved config with its value as `--get` prints it ("train.lr": "0.05").
  py::dict Config() const {
    py::dict d;
    for (const std::string& line : DescribeConfig(config_)) {
      const size_t eq = line.find(" = ");
      d[py::str(line.substr(0, eq))] = line.substr(eq + 3);
    }
    return d;
  }

  uint64_t step() const { return steps_; }
  bool resumed() const { return session_ && session_->resuming(); }
  bool checkpoint_due() const { return session_ && session_->aggregator().checkpoint_due(); }
  int rank() const { return session_ ? session_->rank() : config_.node().rank(); }
  int num_workers() const { return static_cast<int>(config_.cluster().num_workers()); }
  // The ranks of the workers still in the job (cluster.on_worker_failure: continue drops dead
  // ones).
  std::vector<int> live_workers() const {
    std::vector<int> ranks;
    if (!session_) return ranks;
    for (const auto& n : session_->control().membership().nodes()) {
      if (n.role() == proto::WORKER) ranks.push_back(n.rank());
    }
    std::sort(ranks.begin(), ranks.end());
    return ranks;
  }
  bool is_leader() const { return session_ && session_->is_leader(); }
  size_t num_params() const { return session_ ? session_->aggregator().num_params() : 0; }
  double lr() const { return config_.train().lr(); }
  uint64_t bytes_sent() const { return session_ ? session_->aggregator().bytes_sent() : 0; }
  uint64_t bytes_received() const { return session_ ? session_->aggregator().bytes_received() : 0; }
  std::string aggregation() const {
    return config_.aggregation() == proto::ALLREDUCE ? "allreduce" : "ps";
  }

 private:
  // The aggregator's change observer: keeps the old values of what is about to change.
  void Observe(uint64_t begin, std::span<const uint32_t> keys, bool all) {
    if (out_ == nullptr || all_) return;
    const float* p = session_->aggregator().host_model_params();
    if (all) {
      all_ = true;
      std::copy(p, p + session_->aggregator().num_params(), out_);
      return;
    }
    if (!keys.empty()) segments_.push_back(touched_.size());
    for (uint32_t k : keys) {
      const size_t key = begin + k;
      touched_.push_back(static_cast<uint32_t>(key));
      if (sparse_) {
        old_.push_back(p[key]);
      } else {
        out_[key] = p[key];
      }
    }
  }

  // Puts touched_ in increasing order. Each announcement is one key range's keys, increasing, and
  // the ranges are disjoint, but the servers' replies arrive in any order: the segments are
  // ordered by their first key (a few per step) instead of sorting every key.
  void OrderTouched() {
    const size_t m = segments_.size();
    bool ordered = true;
    for (size_t i = 1; i < m && ordered; ++i) {
      ordered = touched_[segments_[i - 1]] < touched_[segments_[i]];
    }
    if (!ordered) {
      std::vector<size_t> order(m);
      for (size_t i = 0; i < m; ++i) order[i] = i;
      std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
        return touched_[segments_[a]] < touched_[segments_[b]];
      });
      std::vector<uint32_t> keys;
      std::vector<float> old;
      keys.reserve(touched_.size());
      old.reserve(old_.size());
      for (size_t i : order) {
        const auto from = static_cast<std::ptrdiff_t>(segments_[i]);
        const auto to = static_cast<std::ptrdiff_t>(i + 1 < m ? segments_[i + 1] : touched_.size());
        keys.insert(keys.end(), touched_.begin() + from, touched_.begin() + to);
        old.insert(old.end(), old_.begin() + from, old_.begin() + to);
      }
      touched_.swap(keys);
      old_.swap(old);
    }
  }

  proto::JobConfig config_;
  std::unique_ptr<WorkerSession> session_;
  bool listed_ = false, cuda_ = false;
  int device_ = -1;
  std::vector<size_t> sizes_;
  std::vector<std::vector<py::ssize_t>> shapes_;
  std::vector<float> gather_;
  DeviceBuffer gather_d_;
  float* out_ = nullptr;
  py::object np_zeros_;         // numpy.zeros, looked up once
  bool sparse_ = false;         // the push_pull in progress returns the sparse form
  std::vector<float> old_;      // sparse: the old values, in the order of touched_
  std::vector<float> scratch_;  // sparse after a dense change: the old values, then the update
  std::vector<uint32_t> touched_;
  std::vector<size_t> segments_;  // where each announcement's keys start in touched_
  bool all_ = false;
  uint64_t steps_ = 0;
  uint32_t epoch_ = 0;                // set_epoch's (0-based)
  std::unique_ptr<TrainingLog> log_;  // the live metrics; reads config_
  Clock::time_point last_return_;     // when the last push_pull (or init) returned
  std::vector<TensorLayout> layers_;  // the model file's tensors (init's params)
  StepStats last_;
};

}  // namespace
}  // namespace sparseps

PYBIND11_MODULE(_sparseps, m) {
  using sparseps::Worker;
  m.doc() = "sparseps: sparse, compressed gradient aggregation (parameter server or allreduce)";
  static py::exception<std::runtime_error> error(m, "Error", PyExc_RuntimeError);
  sparseps::g_error = error.ptr();
#if SPARSEPS_HAVE_CUDA
  m.attr("cuda") = true;  // CUDA tensors are compressed on the device
#else
  m.attr("cuda") = false;
#endif
  py::class_<Worker>(m, "Worker", R"doc(
One worker of a sparseps job, driven by a Python training loop.

Worker(config, rank=None, overrides=())
  config: path of the job's YAML config (proto/config.proto; "" for the defaults). The scheduler's
  address comes from it or from SPARSEPS_SCHEDULER=host:port; overrides are "key=value" strings
  as --set takes them; rank (or SPARSEPS_RANK, else RANK as torchrun sets it) requests this worker's rank.
)doc")
      .def(py::init<const std::string&, std::optional<int>, const std::vector<std::string>&>(),
           py::arg("config"), py::arg("rank") = py::none(),
           py::arg("overrides") = std::vector<std::string>())
      .def("init", &Worker::Init, py::arg("params"), py::arg("names") = py::none(), R"doc(
Joins the job (registers with the scheduler and waits for every node) with the size of params (a
float32 tensor or array, or a list of them), and makes the job's starting parameters worker 0's:
they are written into params in place on every worker. names (one per tensor) name the tensors of
the model file (model.safetensors; default param0, param1, ...). When the job resumes from a
checkpoint (--resume), params get the checkpoint's parameters instead, and `step` the steps done
then: the loop goes on from there (its own optimizer state it restores itself).)doc")
      .def("push_pull", &Worker::PushPull, py::arg("grads"), py::arg("sparse") = false,
           py::arg("loss") = py::none(), R"doc(
Aggregates grads (laid out as init's params, or one flat tensor of all of them) with the job's
encoding or collective, and returns the update: subtract it from the parameters to hold the job's
new ones (params -= update). A float32 NumPy array, or a list of arrays shaped like grads (views
of one array). A single tensor is read in place; a list is gathered into one buffer first.
With sparse=True it returns (keys, update, params) instead: the flat keys whose parameters changed
(int64, increasing; every key after a dense update), the update there and the new parameters
there, without a dense array. loss (optional, a float): the step's training loss, for the live
metrics (metrics.port: sparseps_worker_loss). Raises ValueError for a gradient with
NaN or Inf (nothing is sent; the job goes on), TimeoutError naming a missing peer.)doc")
      .def("params", &Worker::Params, "The job's parameters as this worker holds them (a copy).")
      .def("residual", &Worker::Residual,
           "What this worker holds back for later steps (its residual; a copy).")
      .def("synchronize", &Worker::Synchronize, R"doc(
train.consistency ssp / async: waits until every worker has pushed as many steps as this one and
returns the job's parameters then, with no staleness (a flat float32 NumPy array, a copy): call it
before the final evaluation and before saving the model. bsp and allreduce: the parameters at once.
Raises TimeoutError naming a missing peer.)doc")
      .def("set_epoch", &Worker::SetEpoch, py::arg("epoch"),
           "Sets the epoch (0-based) for the density warm-up (compression.warmup_epochs).")
      .def("finish", &Worker::Finish, py::arg("test_accuracy") = -1.0, py::arg("train_loss") = 0.0,
           py::arg("samples_per_s") = 0.0, py::arg("train_s") = 0.0,
           R"doc(
Tells the scheduler this worker is done and waits until every worker is; the scheduler then
writes summary.json (run.dir) with these statistics: test_accuracy (a fraction; -1: not evaluated
here), train_loss (the last epoch's mean), samples_per_s (this worker's), train_s (seconds).)doc")
      .def_property_readonly("last_step", &Worker::LastStep,
                             "What the last push_pull did: bytes, entries selected and applied, "
                             "encode and communication milliseconds.")
      .def_property_readonly("config", &Worker::Config,
                             "Every key of the job's resolved config: {'train.lr': '0.05', ...} "
                             "(values as `sparseps-worker --get` prints them; Worker.get parses)")
      .def_property_readonly("step", &Worker::step,
                             "Steps (push_pull calls) done, from the checkpoint's on a resumed job")
      .def_property_readonly("resumed", &Worker::resumed,
                             "True when the job resumed from a checkpoint (after init)")
      .def_property_readonly("checkpoint_due", &Worker::checkpoint_due,
                             "True when the last push_pull ended an iteration of which every node "
                             "writes a checkpoint (save your own optimizer state then)")
      .def_property_readonly("rank", &Worker::rank)
      .def_property_readonly("num_workers", &Worker::num_workers)
      .def_property_readonly("live_workers", &Worker::live_workers,
                             "sorted ranks of the workers still in the job: a worker lost under "
                             "cluster.on_worker_failure: continue is gone from it (re-split your "
                             "data among these at your next epoch, as sparseps-worker does)")
      .def_property_readonly("is_leader", &Worker::is_leader,
                             "true on the lowest live rank: worker 0, or the one that took over "
                             "evaluating and writing the model after worker 0 was lost")
      .def_property_readonly("num_params", &Worker::num_params)
      .def_property_readonly("lr", &Worker::lr, "train.lr of the job")
      .def_property_readonly("aggregation", &Worker::aggregation, "'ps' or 'allreduce'")
      .def_property_readonly("bytes_sent", &Worker::bytes_sent)
      .def_property_readonly("bytes_received", &Worker::bytes_received);
}
