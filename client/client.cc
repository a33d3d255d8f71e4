// The client library (include/sparseps/client.h): Worker on top of the same WorkerSession and
// Aggregator as sparseps-worker and the Python module (worker/session.h).
#include "sparseps/client.h"

#include <string>
#include <utility>

#include "common/status.h"
#include "common/tensor_layout.h"
#include "config/config.h"
#include "worker/session.h"

namespace sparseps::client {
namespace {

[[noreturn]] void Raise(const Status& s) {
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
      throw Error(ErrorCode::kInvalidArgument, s.message());
    case StatusCode::kDeadlineExceeded:
      throw Error(ErrorCode::kDeadlineExceeded, s.message());
    default:
      throw Error(ErrorCode::kFailed, s.ToString());
  }
}

void Check(const Status& s) {
  if (!s.ok()) Raise(s);
}

}  // namespace

std::string Version() { return SPARSEPS_VERSION; }

struct Worker::Impl {
  proto::JobConfig config;
  std::unique_ptr<WorkerSession> session;
  uint64_t steps = 0;
  std::vector<TensorLayout> layers;  // the model file's one tensor, "params"

  // The loop's position in a checkpoint: the steps done.
  std::function<void(StateArchive&)> LoopState() {
    return [this](StateArchive& archive) { archive.Value("step", &steps); };
  }
  Aggregator& agg() {
    if (!session) Raise(Status::FailedPrecondition("call Init(params) first"));
    return session->aggregator();
  }
};

Worker::Worker(const std::string& config_path, const std::vector<std::string>& overrides, int rank)
    : impl_(std::make_unique<Impl>()) {
  auto config = LoadOwnLoopConfig(config_path, overrides, rank, "a client-library loop");
  Check(config.status());
  impl_->config = std::move(*config);
}

Worker::~Worker() = default;
Worker::Worker(Worker&&) noexcept = default;
Worker& Worker::operator=(Worker&&) noexcept = default;

void Worker::Init(std::span<float> params) {
  Impl& m = *impl_;
  if (m.session) Raise(Status::FailedPrecondition("Init was called already"));
  if (params.empty()) Raise(Status::InvalidArgument("Init: params is empty"));
  m.layers = {{"params", {params.size()}, 0}};
  std::vector<float> initial(params.begin(), params.end());
  auto joined =
      JoinOwnLoop(m.config, initial, /*on_device=*/false, m.LoopState(), "a client-library loop");
  Check(joined.status());
  m.session = std::move(*joined);
  const auto& p = m.session->aggregator().params();
  std::copy(p.begin(), p.end(), params.begin());
}

void Worker::PushPull(std::span<float> grad, std::span<float> params) {
  Impl& m = *impl_;
  Aggregator& agg = m.agg();
  const size_t n = agg.num_params();
  if (grad.size() != n || params.size() != n) {
    Raise(Status::InvalidArgument("PushPull: grad has " + std::to_string(grad.size()) +
                                  " and params " + std::to_string(params.size()) +
                                  " elements; the job has " + std::to_string(n)));
  }
  StepStats stats;
  const Status s = agg.Step(grad.data(), /*grad_on_device=*/false, &stats);
  if (!s.ok()) {
    // A bad gradient changes nothing and the job goes on; anything else ends it.
    if (s.code() != StatusCode::kInvalidArgument) m.session->ReportFailure(s);
    Raise(s);
  }
  ++m.steps;
  Check(m.session->AfterStep(m.LoopState(), m.layers));
  const float* now = agg.host_model_params();
  std::copy(now, now + n, params.begin());
}

std::span<const float> Worker::params() const {
  const auto& p = impl_->agg().params();
  return {p.data(), p.size()};
}

void Worker::SetEpoch(uint32_t epoch) { impl_->agg().SetEpoch(epoch); }

void Worker::Synchronize(std::span<float> params) {
  Impl& m = *impl_;
  Aggregator& agg = m.agg();
  const size_t n = agg.num_params();
  if (params.size() != n) {
    Raise(Status::InvalidArgument("Synchronize: params has " + std::to_string(params.size()) +
                                  " elements; the job has " + std::to_string(n)));
  }
  const Status s = agg.Synchronize();
  if (!s.ok()) {
    m.session->ReportFailure(s);
    Raise(s);
  }
  const float* now = agg.host_model_params();
  std::copy(now, now + n, params.begin());
}

void Worker::Finish(double test_accuracy, double train_loss, double samples_per_s, double train_s) {
  Impl& m = *impl_;
  Aggregator& agg = m.agg();
  proto::WorkerStats stats;
  stats.set_steps(m.steps);
  stats.set_bytes_sent(agg.bytes_sent());
  stats.set_bytes_received(agg.bytes_received());
  stats.set_final_test_accuracy(test_accuracy);
  stats.set_final_train_loss(train_loss);
  stats.set_samples_per_s(samples_per_s);
  stats.set_wall_s(train_s);
  Status s;
  if (m.session->is_leader() && m.config.checkpoint().save_model() &&
      !m.config.run().dir().empty()) {
    s = agg.Synchronize();  // ssp / async: the saved model has every worker's every push
    if (s.ok()) s = m.session->SaveModel(m.config.run().dir() + "/model.safetensors", m.layers);
  }
  if (s.ok()) s = m.session->Finish(stats);
  m.session.reset();
  Check(s);
}

int Worker::rank() const {
  return impl_->session ? impl_->session->rank() : impl_->config.node().rank();
}
int Worker::num_workers() const { return static_cast<int>(impl_->config.cluster().num_workers()); }
bool Worker::is_leader() const { return impl_->session && impl_->session->is_leader(); }
size_t Worker::num_params() const {
  return impl_->session ? impl_->session->aggregator().num_params() : 0;
}
uint64_t Worker::step() const { return impl_->steps; }
double Worker::lr() const { return impl_->config.train().lr(); }
uint64_t Worker::bytes_sent() const {
  return impl_->session ? impl_->session->aggregator().bytes_sent() : 0;
}
uint64_t Worker::bytes_received() const {
  return impl_->session ? impl_->session->aggregator().bytes_received() : 0;
}

}  // namespace sparseps::client
