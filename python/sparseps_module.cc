// The Python module `sparseps._sparseps` (pybind11): a training loop written in Python joins a
// sparseps job as one of its workers. A thin layer on the client library
// (include/sparseps/client.h, libsparseps_client.so): what a loop of the user's own does (joining,
// resuming, the refusals, the update it gets back) is written there once, for C++, C, ctypes
// (sparseps.capi) and this module.
//
// Tensors come in without a copy: objects with __cuda_array_interface__ or __dlpack__ (PyTorch,
// NumPy >= 1.22, CuPy) or the buffer protocol (NumPy arrays, PyTorch CPU tensors through NumPy).
// They must be float32, C-contiguous, on the CPU (or, in a CUDA build, all on one CUDA device).
// The module does not link libtorch.
//
// Errors become Python exceptions: ValueError for bad input or configuration, TimeoutError for a
// deadline (naming who is missing), KeyboardInterrupt when Ctrl-C ended a wait, sparseps.Lost when
// this worker is out of the job, sparseps.JobEnded when a replacement came after the end,
// sparseps.Error (a RuntimeError) for the rest.
//
// Thread-safety: a Worker belongs to one Python thread; blocking calls release the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "python/module_tensors.h"
#include "sparseps/client.h"

namespace py = pybind11;

namespace sparseps {
namespace {

using pymodule::Arrays;
using pymodule::Borrow;
using pymodule::Borrowed;
using pymodule::Buffers;
using pymodule::HostArray;
using pymodule::HostFloats;
using pymodule::Owned;

PyObject* g_error = nullptr;        // sparseps.Error
PyObject* g_rolled_back = nullptr;  // sparseps.RolledBack
PyObject* g_lost = nullptr;         // sparseps.Lost
PyObject* g_job_ended = nullptr;    // sparseps.JobEnded

// The client library's errors as Python's: ValueError, TimeoutError, KeyboardInterrupt (Ctrl-C
// ended a wait), sparseps.RolledBack (a server was replaced), sparseps.Lost (this worker is out
// of the job), sparseps.JobEnded (a replacement came after the end), sparseps.Error.
[[noreturn]] void Raise(const client::Error& e) {
  switch (e.code()) {
    case client::ErrorCode::kInvalidArgument:
      throw py::value_error(e.what());
    case client::ErrorCode::kDeadlineExceeded:
      PyErr_SetString(PyExc_TimeoutError, e.what());
      break;
    case client::ErrorCode::kInterrupted:
      PyErr_SetString(PyExc_KeyboardInterrupt, e.what());
      break;
    case client::ErrorCode::kRolledBack:
      PyErr_SetString(g_rolled_back, e.what());
      break;
    case client::ErrorCode::kLost:
      PyErr_SetString(g_lost, e.what());
      break;
    case client::ErrorCode::kJobEnded:
      PyErr_SetString(g_job_ended, e.what());
      break;
    default:
      PyErr_SetString(g_error, e.what());
  }
  throw py::error_already_set();
}

// Runs a call of the client library with the GIL released; its errors become Python's.
template <typename F>
void Call(F&& f) {
  try {
    py::gil_scoped_release release;
    f();
  } catch (const client::Error& e) {
    Raise(e);
  }
}

// Runs `call(state, model)` (Call) with a loop's `state` (bytes) and `model` (None: empty, else
// host floats; a ValueError names `what` for anything else) as the client library takes them.
template <typename F>
void WithStateAndModel(py::bytes state, py::object model, const std::string& what, F&& call) {
  const std::string_view bytes = state;
  const std::span<const uint8_t> s(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  HostArray m;
  std::span<const float> p;
  if (!model.is_none()) {
    m = HostFloats(model, what + ": model");
    p = std::span<const float>(m.data(), static_cast<size_t>(m.size()));
  }
  Call([&] { call(s, p); });
}

// sparseps.Worker: the client library's Worker (include/sparseps/client.h) with tensors taken
// from Python objects and results returned as NumPy arrays.
class Worker {
 public:
  Worker(const std::string& config_path, std::optional<int> rank,
         const std::vector<std::string>& overrides) {
    try {
      worker_.emplace(config_path, overrides, rank.value_or(-1));
    } catch (const client::Error& e) {
      Raise(e);
    }
    live().set_interruptible(true);  // Ctrl-C ends a wait as KeyboardInterrupt
  }

  // Joins the job with `params`' size, makes the job's starting parameters (worker 0's) and
  // writes them into params in place.
  void Init(py::object params, std::optional<std::vector<std::string>> names) {
    Arrays a = Borrow(params, "params");
    if (names && names->size() != a.parts.size()) {
      throw py::value_error("names: " + std::to_string(names->size()) + " names for " +
                            std::to_string(a.parts.size()) + " tensors");
    }
    // The model file's tensors: one per tensor of params, named as given.
    std::vector<client::TensorInfo> tensors;
    for (size_t i = 0; i < a.parts.size(); ++i) {
      const auto& shape = a.parts[i].shape;
      tensors.push_back({names      ? (*names)[i]
                         : a.listed ? "param" + std::to_string(i)
                                    : "params",
                         std::vector<uint64_t>(shape.begin(), shape.end())});
      sizes_.push_back(a.parts[i].size);
      shapes_.push_back(shape);
    }
    const auto buffers = Buffers(a);
    Call([&] { live().Init(buffers, tensors); });
    listed_ = a.listed;
  }

  // Aggregates `grads` (the same layout as init's params) and returns the update: what to
  // subtract from the parameters to hold the job's new ones (a float32 NumPy array, or a list of
  // them shaped like grads, views of one array); with `sparse`, (keys, update, params).
  py::object PushPull(py::object grads, bool sparse, std::optional<double> loss, py::object out,
                      py::object params_out) {
    Arrays a = Borrow(grads, "grads");
    const auto buffers = Buffers(a);
    const double l = loss.value_or(std::nan(""));
    const Borrowed dense_update = DenseOut(out, "out", sparse, buffers);
    const Borrowed dense_params = DenseOut(params_out, "params_out", sparse, buffers);
    if (dense_update.data != nullptr && dense_update.data == dense_params.data) {
      throw py::value_error("push_pull: out and params_out are the same array");
    }
    if (sparse) {
      client::SparseUpdate u;
      Call([&] { u = live().PushPullSparse(buffers, l, dense_update.data, dense_params.data); });
      if (u.all && (dense_update.data != nullptr || dense_params.data != nullptr)) {
        return py::make_tuple(AllKeys(), out, params_out);  // None for the one not given
      }
      // The arrays own the library's vectors (no copy). A dense method's step changed every key:
      // its keys are one read-only array 0, 1, ..., n - 1, made once.
      py::object keys = u.all ? AllKeys() : py::object(Owned(std::move(u.keys)));
      return py::make_tuple(keys, Owned(std::move(u.update)), Owned(std::move(u.params)));
    }
    // The update comes into a zeroed array (numpy.zeros: pages the step does not touch stay
    // untouched); the library writes the keys that changed.
    if (!np_zeros_) np_zeros_ = py::module_::import("numpy").attr("zeros");
    py::array_t<float> update = np_zeros_(live().num_params(), "float32");
    float* into = update.mutable_data();
    Call([&] { live().PushPull(buffers, into, l); });
    if (!a.listed) return update;
    py::list parts;
    size_t offset = 0;
    for (size_t i = 0; i < sizes_.size(); ++i) {
      py::object part = update[py::slice(static_cast<py::ssize_t>(offset),
                                         static_cast<py::ssize_t>(offset + sizes_[i]), 1)];
      parts.append(part.attr("reshape")(py::tuple(py::cast(shapes_[i]))));
      offset += sizes_[i];
    }
    return parts;
  }

  // train.overlap: backward: starts the step's pushes on `grad` (one flat tensor) while the
  // backward pass writes it; False where the job does not overlap.
  bool BeginStep(py::object grad) {
    Arrays a = Borrow(grad, "grad");
    if (a.listed) {
      throw py::value_error("begin_step: grad is one flat tensor of all the model's elements");
    }
    const auto buffers = Buffers(a);
    bool begun = false;
    Call([&] { begun = live().BeginStep(buffers[0]); });
    return begun;
  }

  void GradientReady(size_t key_begin) {
    Call([&] { live().GradientReady(key_begin); });
  }

  // push_pull's out or params_out: none, or a writable float32 host array of the model's size
  // that shares no memory with the gradients (the library reads them during the step).
  Borrowed DenseOut(py::handle obj, const std::string& name, bool sparse,
                    const std::vector<client::Buffer>& grads) {
    if (obj.is_none()) return {};
    if (!sparse) {
      throw py::value_error("push_pull: " + name + " is for sparse=True (a dense step's result)");
    }
    if (py::hasattr(obj, "flags") && !obj.attr("flags").attr("writeable").cast<bool>()) {
      throw py::value_error("push_pull: " + name + " is read-only");
    }
    Borrowed b = Borrowed::From(obj, name);
    if (b.size != live().num_params() || b.device != client::kHost) {
      throw py::value_error("push_pull: " + name + " has " + std::to_string(b.size) + " elements" +
                            (b.device != client::kHost ? " on a GPU" : "") +
                            "; it takes the model's " + std::to_string(live().num_params()) +
                            " in host memory");
    }
    const auto begin = reinterpret_cast<uintptr_t>(b.data);
    const uintptr_t end = begin + b.size * sizeof(float);
    for (const client::Buffer& g : grads) {
      const auto g_begin = reinterpret_cast<uintptr_t>(g.data);
      if (begin < g_begin + g.size * sizeof(float) && g_begin < end) {
        throw py::value_error("push_pull: " + name + " shares memory with grads");
      }
    }
    return b;
  }

  // A dense step's keys: one read-only array 0, 1, ..., n - 1, made once.
  py::object AllKeys() {
    if (!all_keys_) {
      std::vector<int64_t> k(live().num_params());
      std::iota(k.begin(), k.end(), int64_t{0});
      py::array_t<int64_t> a = Owned(std::move(k));
      a.attr("setflags")(py::arg("write") = false);
      all_keys_ = a;
    }
    return all_keys_;
  }

  // The job's parameters as this worker holds them (a copy, float32).
  py::array_t<float> Params() {
    std::span<const float> p;
    try {
      p = live().params();
    } catch (const client::Error& e) {
      Raise(e);
    }
    return py::array_t<float>(static_cast<py::ssize_t>(p.size()), p.data());
  }

  // What this worker holds back (its residual), for tests and diagnostics.
  py::array_t<float> Residual() {
    std::vector<float> r;
    try {
      r = live().residual();
    } catch (const client::Error& e) {
      Raise(e);
    }
    return py::array_t<float>(static_cast<py::ssize_t>(r.size()), r.data());
  }

  void SetEpoch(uint32_t epoch) { live().SetEpoch(epoch); }
  void SetDensityScale(double scale) {
    Call([&] { live().SetDensityScale(scale); });
  }
  // (index, count) of the epoch that begins after `step` steps (client::Worker::data_split).
  std::pair<int, int> DataSplit(uint64_t step) const {
    client::Worker::DataSplit split;
    Call([&] { split = live().data_split(step); });
    return {split.index, split.count};
  }
  void ReportEvaluation(double test_accuracy) {
    Call([&] { live().ReportEvaluation(test_accuracy); });
  }

  // client::Worker::AllreduceValues, their mean (op "mean") or sums ("sum"), as float64.
  py::array_t<double> AllreduceValues(
      py::array_t<double, py::array::c_style | py::array::forcecast> values,
      const std::string& op) {
    if (op != "mean" && op != "sum") {
      throw py::value_error("allreduce_values: op '" + op + "'; 'mean' or 'sum'");
    }
    const std::span<const double> in(values.data(), static_cast<size_t>(values.size()));
    std::vector<double> sums;
    uint32_t contributors = 0;
    Call([&] { sums = live().AllreduceValues(in, &contributors); });
    py::array_t<double> out(static_cast<py::ssize_t>(sums.size()));
    for (size_t i = 0; i < sums.size(); ++i) {
      out.mutable_data()[i] = op == "mean" ? sums[i] / contributors : sums[i];
    }
    return out;
  }

  // ssp / async: waits until every worker pushed as many steps as this one; the job's parameters
  // then (a copy). bsp, allreduce: the parameters at once.
  py::array_t<float> Synchronize() {
    py::array_t<float> out(static_cast<py::ssize_t>(live().num_params()));
    std::span<float> params(out.mutable_data(), live().num_params());
    Call([&] { live().Synchronize(params); });
    return out;
  }

  void SetTrainedModel(py::object params) {
    const auto host = HostFloats(params, "set_trained_model: params");
    std::span<const float> p(host.data(), static_cast<size_t>(host.size()));
    Call([&] { live().SetTrainedModel(p); });
  }

  void SetModelBuffers(py::dict buffers) {
    std::vector<client::Worker::ModelBuffer> kept;
    for (auto [key, value] : buffers) {
      client::Worker::ModelBuffer b;
      b.name = py::str(key);
      const auto host =
          HostFloats(py::reinterpret_borrow<py::object>(value), "set_model_buffers: " + b.name);
      for (py::ssize_t d = 0; d < host.ndim(); ++d) b.shape.push_back(host.shape(d));
      b.values.assign(host.data(), host.data() + host.size());
      kept.push_back(std::move(b));
    }
    Call([&] { live().SetModelBuffers(std::move(kept)); });
  }

  void SetCheckpointState(py::bytes state, py::object model) {
    WithStateAndModel(state, model, "set_checkpoint_state",
                      [&](auto s, auto p) { live().SetCheckpointState(s, p); });
  }

  py::bytes CheckpointState() const {
    const auto& s = live().checkpoint_state();
    return py::bytes(reinterpret_cast<const char*>(s.data()), s.size());
  }

  void SendHandoff(py::bytes state, py::object model) {
    WithStateAndModel(state, model, "send_handoff",
                      [&](auto s, auto p) { live().SendHandoff(s, p); });
  }

  // {"from": rank, "state": bytes, "model": float32 array or None, "missing": why nothing came}.
  py::dict ReceiveHandoff() {
    client::Worker::Handoff h;
    Call([&] { h = live().ReceiveHandoff(); });
    py::dict d;
    d["from"] = h.from;
    d["state"] = py::bytes(reinterpret_cast<const char*>(h.state.data()), h.state.size());
    if (h.model.empty()) {
      d["model"] = py::none();
    } else {
      d["model"] = Owned(std::move(h.model));
    }
    d["missing"] = h.missing;
    return d;
  }

  void Finish(double test_accuracy, double train_loss, double samples_per_s, double train_s) {
    Call([&] { live().Finish(test_accuracy, train_loss, samples_per_s, train_s); });
  }

  py::dict LastStep() const {
    const client::StepCounters c = live().last_step();
    py::dict d;
    d["bytes_sent"] = c.bytes_sent;
    d["bytes_received"] = c.bytes_received;
    d["selected"] = c.selected;
    d["applied"] = c.applied;
    d["encode_ms"] = c.encode_ms;
    d["comm_ms"] = c.comm_ms;
    return d;
  }

  // Every key of the resolved config with its value as `--get` prints it ("train.lr": "0.05").
  py::dict Config() const {
    py::dict d;
    for (const auto& [key, value] : live().config()) d[py::str(key)] = value;
    return d;
  }

  const client::Worker& worker() const { return live(); }
  // Frees the client library's worker: one that did not finish leaves the job. Every call after
  // it raises ValueError; closing again does nothing.
  void Close() { worker_.reset(); }
  std::string aggregation() const { return live().allreduce() ? "allreduce" : "ps"; }

 private:
  // The worker; ValueError once closed.
  client::Worker& live() {
    if (!worker_)
      throw py::value_error("sparseps.Worker: closed (close(), or the end of its with block)");
    return *worker_;
  }
  const client::Worker& live() const { return const_cast<Worker*>(this)->live(); }

  std::optional<client::Worker> worker_;
  bool listed_ = false;
  std::vector<size_t> sizes_;
  std::vector<std::vector<py::ssize_t>> shapes_;
  py::object np_zeros_;  // numpy.zeros, looked up once
  py::object all_keys_;  // push_pull(sparse=True)'s keys after a dense step: 0..n-1, read-only
};

}  // namespace
}  // namespace sparseps

// sparseps.Worker.push_pull's docstring.
constexpr const char* kPushPullDoc = R"doc(
Aggregates grads (laid out as init's params, or one flat tensor of all of them) with the job's
encoding or collective, and returns the update: subtract it from the parameters to hold the job's
new ones (params -= update). A float32 NumPy array, or a list of arrays shaped like grads (views
of one array). A single tensor is read in place; a list is gathered into one buffer first.
With sparse=True it returns (keys, update, params) instead: the flat keys whose parameters changed
(int64, increasing; every key after a dense update, then one read-only array shared by every such
step), the update there and the new parameters there, without a dense array. out and params_out
(optional, with sparse=True: writable float32 arrays or CPU tensors of the model's size, kept from
step to step): a step that changes every key (a dense method: ring, Gloo, PowerSGD) writes its
update into out and its new parameters into params_out and returns (keys, out, params_out), None
for the one not given, making no array of the model's size; a sparse step leaves them untouched.
loss (optional, a
float): the step's training loss, for the live metrics (metrics.port: sparseps_worker_loss).
Raises ValueError for a gradient with NaN or Inf (nothing is sent; the job goes on), TimeoutError
naming a missing peer, sparseps.RolledBack when a lost server was replaced and the job went back to
its newest checkpoint: `step` and params() are then the checkpoint's, and the loop goes on from there.)doc";

constexpr char kBeginStepDoc[] = R"doc(
train.overlap: backward (ps mode; CPU tensors, or CUDA tensors where the encoding has a device
compressor): starts this step's aggregation before the gradient is whole. grad: the one flat
float32 tensor of all the model's elements that the backward pass is writing and that this step's
push_pull(grad, sparse=True) gets; each server key range of it is compressed and pushed, on a
thread of the library's own, once gradient_ready has reported it.
Returns False and starts nothing where the job does not overlap (push_pull then does the whole
step). sparseps.torch.DistributedOptimizer(overlap=True) calls it from gradient hooks.)doc";

// The Worker's calls and facts about resuming: its position (step), how it joined, and the
// loop's own state in its checkpoints.
void DefineResumeCalls(py::class_<sparseps::Worker>& worker) {
  using sparseps::Worker;
  worker
      .def("set_checkpoint_state", &Worker::SetCheckpointState, py::arg("state"),
           py::arg("model") = py::none(), R"doc(
Right after the push_pull that returned with checkpoint_due True (and the loop's optimizer step):
completes that checkpoint with the loop's own state, `state` (bytes in a format of the loop's;
sparseps.torch.DistributedOptimizer's is NumPy's .npz), kept in this worker's checkpoint file,
and on worker 0 `model` (num_params elements: a float32 array, or a torch.Tensor on any device;
None: the job's parameters) as the checkpoint's model file, with the buffers set_model_buffers set
last beside it (set them first for this step's). A job resumed from it, or rolled back to it,
gives the bytes back as checkpoint_state. Without this call the checkpoint is written at the next
push_pull as it was taken. Raises sparseps.Error
when no checkpoint waits, ValueError for a model of another size.)doc")
      .def_property_readonly("checkpoint_state", &Worker::CheckpointState,
                             "The loop's own state (set_checkpoint_state's bytes) in the "
                             "checkpoint resumed from (after init) or rolled back to (after "
                             "RolledBack); b'' when it holds none")
      .def_property_readonly(
          "step", [](const Worker& w) { return w.worker().step(); },
          "Steps (push_pull calls) done, from the checkpoint's on a resumed job, from the "
          "join iteration on a replacement")
      .def_property_readonly(
          "resumed", [](const Worker& w) { return w.worker().resumed(); },
          "True when the job resumed from a checkpoint (after init)")
      .def_property_readonly(
          "rejoined", [](const Worker& w) { return w.worker().rejoined(); },
          "True for a replacement (node.rejoin, --rejoin) let into the running job (after init): "
          "step is the iteration it pushes from; the loop goes on from there")
      .def_property_readonly(
          "checkpoint_due", [](const Worker& w) { return w.worker().checkpoint_due(); },
          "True when the last push_pull ended an iteration of which every node "
          "writes a checkpoint (hand your own optimizer state to set_checkpoint_state then)")
      .def("send_handoff", &Worker::SendHandoff, py::arg("state"), py::arg("model") = py::none(),
           R"doc(
On the donor (handoff_due True: a replacement joined at the last push_pull's iteration), before
the next push_pull: hands the replacement the loop's own state, `state` (bytes in a format of the
loop's), and `model` (num_params elements: a float32 array, or a torch.Tensor on any device; None:
the job's parameters are the model), through the scheduler. The next push_pull tells the
replacement that none comes when the loop sends nothing. Raises sparseps.Error when no hand-over is
due, ValueError for a model of another size or a hand-over over 16 float32 a parameter and
256 MiB.)doc")
      .def("receive_handoff", &Worker::ReceiveHandoff, R"doc(
On a replacement (handoff_expected True: after its first push_pull), before the next: waits
(cluster.barrier_timeout_s) for the donor's hand-over and returns {"from": its rank, "state":
bytes, "model": a float32 array or None, "missing": why nothing came ("" when it did; the
donor's loop may hand over b"" and None)}. Raises sparseps.Error when none is expected,
TimeoutError naming the donor, sparseps.RolledBack as push_pull.)doc")
      .def_property_readonly(
          "handoff_due", [](const Worker& w) { return w.worker().handoff_due(); },
          "True on the donor after the push_pull of the iteration a replacement joined at: hand "
          "the loop's state to send_handoff before the next push_pull")
      .def_property_readonly(
          "handoff_expected", [](const Worker& w) { return w.worker().handoff_expected(); },
          "True on a replacement after its first push_pull, until receive_handoff or the next "
          "push_pull: the donor's model and state are coming");
}

// The membership as a loop sees it: who is live, which data share is this worker's, who leads;
// and the numbers its live workers share (allreduce_values).
void DefineMembershipFacts(py::class_<sparseps::Worker>& worker) {
  using sparseps::Worker;
  worker
      .def_property_readonly(
          "live_workers", [](const Worker& w) { return w.worker().live_workers(); },
          "sorted ranks of the workers still in the job: a worker lost under "
          "cluster.on_worker_failure: continue is gone from it (data_split says "
          "how to share the data among them from which epoch on)")
      .def("data_split", &Worker::DataSplit, py::arg("step"),
           "(index, count): this worker's share of the training data in the epoch that begins "
           "after `step` steps: shard `index` of `count`, the live workers of the newest "
           "membership change before that step (a worker lost under "
           "cluster.on_worker_failure: continue, or a replacement joined), as sparseps-worker "
           "re-splits. Every worker gets the same count at the same step; call it at each "
           "epoch's start and take (samples // count) // batch steps. sparseps.Error before "
           "init")
      .def_property_readonly(
          "is_leader", [](const Worker& w) { return w.worker().is_leader(); },
          "true on the lowest live rank: worker 0, or the one that took over "
          "evaluating and writing the model after worker 0 was lost")
      .def("allreduce_values", &Worker::AllreduceValues, py::arg("values"), py::arg("op") = "mean",
           "The mean (op='mean') or the sum (op='sum') over the live workers of `values` (1 to "
           "4096 numbers: a list, a NumPy array, a CPU tensor), element by element, as a float64 "
           "array, the same on every worker (as Horovod's allreduce of a metric). Every live "
           "worker calls it at the same point of its loop with as many numbers (the n-th call "
           "after the same step); through the scheduler, not the gradients' path. ValueError "
           "for no or too many numbers; sparseps.RolledBack, as from push_pull, when a server "
           "lost meanwhile sent the job back to a checkpoint.");
}

// sparseps.Error (a RuntimeError) and its kinds, which Raise uses.
void DefineErrors(py::module_& m) {
  static py::exception<std::runtime_error> error(m, "Error", PyExc_RuntimeError);
  sparseps::g_error = error.ptr();
  // A server was replaced: back at the checkpoint (step, params()); the loop goes on from there.
  static py::exception<std::runtime_error> rolled_back(m, "RolledBack", error.ptr());
  sparseps::g_rolled_back = rolled_back.ptr();
  // This worker is out of the job (cut off from the scheduler, or removed by it); the job may go
  // on without it: a loop exits with code 3, as the daemons do, so that launch.sh lets it go.
  static py::exception<std::runtime_error> lost(m, "Lost", error.ptr());
  sparseps::g_lost = lost.ptr();
  // A replacement came as or after the job ended (init): nothing to join, nothing failed.
  // sparseps.JobEnded (python/sparseps/_job_ended.py), a SystemExit with code 0, shared with
  // sparseps.capi: uncaught, the loop exits with code 0, as the daemons do.
  py::object job_ended = py::module_::import("sparseps._job_ended").attr("JobEnded");
  sparseps::g_job_ended = job_ended.release().ptr();  // a reference kept for the process's life
}

PYBIND11_MODULE(_sparseps, m) {
  using sparseps::Worker;
  m.doc() = "sparseps: sparse, compressed gradient aggregation (parameter server or allreduce)";
  DefineErrors(m);
  m.attr("cuda") = sparseps::client::CudaBuild();  // CUDA tensors are compressed on the device
  py::class_<Worker> worker(m, "Worker", R"doc(
One worker of a sparseps job, driven by a Python training loop.

Worker(config, rank=None, overrides=())
  config: path of the job's YAML config (proto/config.proto; "" for the defaults). The scheduler's
  address comes from it or from SPARSEPS_SCHEDULER=host:port; overrides are "key=value" strings
  as --set takes them; rank (or SPARSEPS_RANK, else RANK as torchrun sets it) requests this worker's rank.
)doc");
  worker
      .def(py::init<const std::string&, std::optional<int>, const std::vector<std::string>&>(),
           py::arg("config"), py::arg("rank") = py::none(),
           py::arg("overrides") = std::vector<std::string>())
      .def("init", &Worker::Init, py::arg("params"), py::arg("names") = py::none(), R"doc(
Joins the job (registers with the scheduler and waits for every node) with the size of params (a
float32 tensor or array, or a list of them), and makes the job's starting parameters worker 0's:
they are written into params in place on every worker. names (one per tensor) name the tensors of
the model file (model.safetensors; default param0, param1, ...). When the job resumes from a
checkpoint (--resume), params get the checkpoint's parameters instead, and `step` the steps done
then: the loop goes on from there (its own optimizer state it restores itself). A replacement
worker (node.rejoin=true, with the lost worker's rank) gets the job's parameters at the iteration
it joins at and `step` that iteration (`rejoined` is True): it goes on from there too.)doc")
      .def("push_pull", &Worker::PushPull, py::arg("grads"), py::arg("sparse") = false,
           py::arg("loss") = py::none(), py::arg("out") = py::none(),
           py::arg("params_out") = py::none(), kPushPullDoc)
      .def("begin_step", &Worker::BeginStep, py::arg("grad"), kBeginStepDoc)
      .def("gradient_ready", &Worker::GradientReady, py::arg("key_begin"),
           "After begin_step: grad[key_begin:] is final for this step (every key from key_begin "
           "on; CUDA: the kernels that wrote it have completed). Thread-safe; does nothing "
           "without begin_step.")
      .def("params", &Worker::Params, "The job's parameters as this worker holds them (a copy).")
      .def("residual", &Worker::Residual,
           "What this worker holds back for later steps (its residual; a copy).")
      .def("synchronize", &Worker::Synchronize, R"doc(
train.consistency ssp / async: waits until every worker has pushed as many steps as this one and
returns the job's parameters then, with no staleness (a flat float32 NumPy array, a copy): call it
before the final evaluation and before saving the model. bsp and allreduce: the parameters at once.
Raises TimeoutError naming a missing peer.)doc")
      .def("set_trained_model", &Worker::SetTrainedModel, py::arg("params"), R"doc(
The parameters worker 0 saves as the trained model at finish (run.dir/model.safetensors) instead of
the job's: for a model an optimizer of its own trained from the aggregate (num_params elements,
copied: a float32 array, or a torch.Tensor on any device). Raises ValueError on another size.)doc")
      .def("set_model_buffers", &Worker::SetModelBuffers, py::arg("buffers"), R"doc(
The model's buffers (a dict of name -> float array or torch.Tensor on any device, such as the
buffers of a module's state_dict: BatchNorm's running statistics) that worker 0 writes beside the
parameters into the trained model file at finish and into a checkpoint's model file at
set_checkpoint_state, replacing earlier ones ({}: none). Raises ValueError for a name of one of
the model's layers, or for something that is not an array or tensor.)doc")
      .def("close", &Worker::Close,
           "Frees the worker: one that did not finish leaves the job (under "
           "cluster.on_worker_failure: continue the others go on without it). Every call after "
           "it raises ValueError; closing again does nothing. `with sparseps.Worker(...) as w:` "
           "closes it at the block's end.")
      .def("report_evaluation", &Worker::ReportEvaluation, py::arg("test_accuracy"),
           "The test accuracy (a fraction in [0, 1]) of an evaluation the loop ran: the live "
           "metrics' sparseps_worker_test_accuracy gauge (metrics.port) and finish()'s default. "
           "ValueError outside [0, 1].")
      .def("set_density_scale", &Worker::SetDensityScale, py::arg("scale"),
           "Scales this worker's top-k k (ps mode, encoding topk) from the next push: scale "
           "times the epoch's, at most every key; 1: the config's; 1 / density sends "
           "everything held back. Other encodings and allreduce ignore it. ValueError unless "
           "positive and finite.")
      .def("set_epoch", &Worker::SetEpoch, py::arg("epoch"),
           "Sets the epoch (0-based) for the density warm-up (compression.warmup_epochs).")
      .def("finish", &Worker::Finish, py::arg("test_accuracy") = -1.0, py::arg("train_loss") = 0.0,
           py::arg("samples_per_s") = 0.0, py::arg("train_s") = 0.0,
           R"doc(
Tells the scheduler this worker is done and waits until every worker is; the scheduler then
writes summary.json (run.dir) with these statistics: test_accuracy (a fraction; -1: the last
report_evaluation's, or not evaluated here), train_loss (the last epoch's mean), samples_per_s (this worker's), train_s (seconds).
In BSP the others have cluster.barrier_timeout_s to finish too (a leader's final evaluation
counts); then the job ends with an error naming who did not.)doc")
      .def_property_readonly("last_step", &Worker::LastStep,
                             "What the last push_pull did: bytes, entries selected and applied, "
                             "encode and communication milliseconds.")
      .def_property_readonly("config", &Worker::Config,
                             "Every key of the job's resolved config: {'train.lr': '0.05', ...} "
                             "(values as `sparseps-worker --get` prints them; Worker.get parses)")
      .def_property_readonly("rank", [](const Worker& w) { return w.worker().rank(); })
      .def_property_readonly("num_workers",
                             [](const Worker& w) { return w.worker().num_workers(); })
      .def_property_readonly("num_params", [](const Worker& w) { return w.worker().num_params(); })
      .def_property_readonly(
          "lr", [](const Worker& w) { return w.worker().lr(); }, "train.lr of the job")
      .def_property_readonly("aggregation", &Worker::aggregation, "'ps' or 'allreduce'")
      .def_property_readonly("bytes_sent", [](const Worker& w) { return w.worker().bytes_sent(); })
      .def_property_readonly("bytes_received",
                             [](const Worker& w) { return w.worker().bytes_received(); });
  DefineResumeCalls(worker);
  DefineMembershipFacts(worker);
}
