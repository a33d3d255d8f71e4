#include "transport/control_client.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <random>

#include "config/config.h"
#include "security/security.h"

namespace sparseps {

std::string MakeRoutingId(proto::Role role, const std::string& tag) {
  static std::atomic<uint64_t> counter{0};
  // The pid alone is not unique across hosts: in containers every daemon is pid 1, and a ROUTER
  // refuses a second peer with a routing id it already has (seen: two of five compose
  // containers never registered). A random nonce, drawn once per process, makes it so.
  static const std::string nonce = [] {
    std::random_device rd;
    char hex[17];
    std::snprintf(hex, sizeof(hex), "%08x%08x", rd(), rd());
    return std::string(hex);
  }();
  return RoleName(role) + "-" + std::to_string(getpid()) + "-" + nonce + "-" + tag + "-" +
         std::to_string(counter.fetch_add(1));
}

namespace {
std::string SchedulerKey(const zmq::context_t& context) {
  const CurveContext* curve = CurveContext::For(context);
  return curve == nullptr ? std::string() : curve->scheduler_public_key();
}
}  // namespace

ControlClient::ControlClient(zmq::context_t& context, const proto::JobConfig& config,
                             proto::Role role)
    : context_(context),
      config_(config),
      role_(role),
      heartbeat_routing_id_(MakeRoutingId(role, "hb")),
      data_routing_id_(MakeRoutingId(role, "data")),
      socket_(ConnectDealer(context, config.cluster().scheduler_host(),
                            config.cluster().scheduler_port() == 0
                                ? 1  // placeholder; Register() refuses port 0 with a clear error
                                : config.cluster().scheduler_port(),
                            MakeRoutingId(role, "ctl"), SchedulerKey(context))) {}

ControlClient::~ControlClient() { StopHeartbeats(); }

std::string ControlClient::scheduler_endpoint() const {
  return Endpoint(config_.cluster().scheduler_host(), config_.cluster().scheduler_port());
}

Status ControlClient::Send(Message& msg) {
  msg.header.set_sender_role(role_);
  msg.header.set_sender_rank(has_membership_ ? membership_.your_rank() : -1);
  msg.header.set_epoch(membership_.epoch());
  return SendMessage(socket_, msg);
}

Status ControlClient::Register(const std::string& host, uint32_t port, uint64_t num_params) {
  if (config_.cluster().scheduler_port() == 0) {
    return Status::InvalidArgument(
        "cluster.scheduler_port is 0: set it in the config, with --set cluster.scheduler_port=N, "
        "or with env SPARSEPS_SCHEDULER=host:port (the local launcher does this for you)");
  }
  Message msg;
  msg.header.set_command(proto::REGISTER);
  auto* reg = msg.header.mutable_register_();
  reg->set_role(role_);
  reg->set_host(host);
  reg->set_port(port);
  reg->set_requested_rank(config_.node().rank());
  reg->set_num_params(num_params);
  reg->set_rejoin(config_.node().rejoin());
  char hostname[256] = {0};
  gethostname(hostname, sizeof(hostname) - 1);
  reg->set_hostname(hostname);
  reg->set_pid(getpid());
  reg->set_heartbeat_routing_id(heartbeat_routing_id_);
  reg->set_data_routing_id(data_routing_id_);
  reg->set_config_text(CanonicalJobConfig(config_));
  reg->set_config_hash(ConfigHash(reg->config_text()));
  register_ = *reg;
  SPARSEPS_RETURN_IF_ERROR(Send(msg));
  registered_ = true;
  spdlog::info("registering with the scheduler at {}", scheduler_endpoint());
  return Status::OK();
}

Status ControlClient::Poll() {
  while (true) {
    if (StopRequested()) return Status::Aborted("stopped by a signal");
    if (scheduler_lost_) return Status::Disconnected(fatal_);
    if (!fatal_.empty()) return Status::Aborted("the scheduler ended the job: " + fatal_);
    auto ready = PollIn({&socket_}, 0);
    if (!ready[0]) {
      // Checked after draining: a node busy for a while finds the heartbeats queued.
      if (has_membership_ && !shutdown_ &&
          SecondsSince(last_heard_) > config_.cluster().heartbeat_timeout_s()) {
        scheduler_lost_ = true;
        fatal_ = "the scheduler at " + scheduler_endpoint() + " sent nothing for " +
                 std::to_string(SecondsSince(last_heard_)) + " s (cluster.heartbeat_timeout_s = " +
                 std::to_string(config_.cluster().heartbeat_timeout_s()) +
                 "): it is dead or unreachable";
        return Status::Disconnected(fatal_);
      }
      return Status::OK();
    }
    auto msg = RecvMessage(socket_, false, nullptr, nullptr);
    last_heard_ = Clock::now();
    if (!msg.ok()) {
      ++rejected_;
      spdlog::warn("ignoring a malformed message from the scheduler: {}", msg.status().message());
      continue;
    }
    const auto& h = msg->header;
    switch (h.command()) {
      case proto::MEMBERSHIP:
        if (has_membership_ && h.membership().epoch() <= membership_.epoch()) break;
        if (has_membership_) updates_.push_back(h);
        membership_ = h.membership();
        has_membership_ = true;
        if (membership_.has_server_lost()) {
          pause_epoch_ = membership_.epoch();
          last_loss_ = membership_.server_lost();
        }
        if (membership_.rollback()) rollback_epoch_ = membership_.epoch();
        spdlog::info("membership epoch {}: rank {}, {} nodes, {} key ranges over {} parameters",
                     membership_.epoch(), membership_.your_rank(), membership_.nodes_size(),
                     membership_.ranges_size(), membership_.num_params());
        break;
      case proto::BARRIER_RELEASE: {
        auto& released = barrier_released_[h.barrier().name()];
        released = std::max(released, h.barrier().generation() + 1);
        break;
      }
      case proto::SHUTDOWN:
        shutdown_ = true;
        break;
      case proto::HEARTBEAT:
        break;  // last_heard_ is set above
      case proto::WORKER_LOST:
      case proto::WORKER_JOIN:
        updates_.push_back(h);
        break;
      case proto::CHECKPOINTS_KEPT: {
        const auto& kept = h.checkpoints_kept().iterations();
        const bool decreasing =
            std::adjacent_find(kept.begin(), kept.end(), std::less_equal<uint64_t>()) == kept.end();
        if (kept.empty() || !decreasing) {
          ++rejected_;
          spdlog::warn(
              "ignoring CHECKPOINTS_KEPT from the scheduler: its {} iterations are not one or more "
              "newest first without repeats",
              kept.size());
          break;
        }
        if (on_checkpoints_kept_) on_checkpoints_kept_({kept.begin(), kept.end()});
        break;
      }
      case proto::FATAL:
        fatal_ = h.error().empty() ? "no reason given" : h.error();
        return Status::Aborted("the scheduler ended the job: " + fatal_);
      case proto::ERROR:
        fatal_ = "scheduler rejected our request: " + h.error();
        return Status::Aborted(fatal_);
      default:
        spdlog::warn("ignoring unexpected {} from the scheduler", CommandName(h.command()));
    }
  }
}

Status ControlClient::WaitFor(const std::function<bool()>& done, double timeout_s,
                              const std::string& what) {
  const auto start = Clock::now();
  while (true) {
    SPARSEPS_RETURN_IF_ERROR(Poll());
    if (done()) return Status::OK();
    SPARSEPS_RETURN_IF_ERROR(CheckWatched());
    if (shutdown_)
      return Status::Aborted("the scheduler shut the job down while waiting for " + what);
    const double left = timeout_s - SecondsSince(start);
    if (left <= 0) {
      return Status::DeadlineExceeded("timed out after " + std::to_string(timeout_s) +
                                      " s waiting for " + what);
    }
    PollIn({&socket_}, std::min<int64_t>(100, static_cast<int64_t>(left * 1000) + 1));
  }
}

Status ControlClient::CheckPausedSince(uint64_t epoch) const {
  if (std::max(pause_epoch_, rollback_epoch_) <= epoch) return Status::OK();
  std::string what = rollback_epoch_ > epoch
                         ? "membership epoch " + std::to_string(rollback_epoch_) +
                               " rolls the job back to the checkpoint of iteration " +
                               std::to_string(membership_.resume_iteration())
                         : "membership epoch " + std::to_string(pause_epoch_) +
                               " pauses the job for the replacement";
  const std::string who = pause_epoch_ == 0 ? std::string("a server is lost")
                                            : "server " + std::to_string(last_loss_.server_rank()) +
                                                  " is lost (" + last_loss_.reason() + ")";
  return Status::Unavailable(who + "; " + what);
}

uint64_t SettledEpoch(const proto::Membership& m) {
  return m.has_server_lost() && m.epoch() > 0 ? m.epoch() - 1 : m.epoch();
}

std::vector<proto::Header> ControlClient::TakeUpdates() {
  std::vector<proto::Header> updates;
  updates.swap(updates_);
  return updates;
}

Status ControlClient::WaitForEpoch(uint64_t epoch) {
  if (membership_.epoch() >= epoch) return Status::OK();
  return WaitFor([this, epoch] { return membership_.epoch() >= epoch; },
                 config_.cluster().barrier_timeout_s(),
                 "membership epoch " + std::to_string(epoch) + " from the scheduler at " +
                     scheduler_endpoint());
}

Status ControlClient::WaitForMembership() {
  const double total = config_.cluster().register_timeout_s() + 10.0;
  const double retry = config_.cluster().retry_interval_s();
  const std::string what = "the membership from the scheduler at " + scheduler_endpoint() +
                           " (is it running, and are all nodes started?)";
  const auto start = Clock::now();
  while (true) {
    const double left = total - SecondsSince(start);
    Status s = WaitFor([this] { return has_membership_; },
                       std::max(0.0, retry > 0 ? std::min(retry, left) : left), what);
    if (s.code() != StatusCode::kDeadlineExceeded) return s;
    if (SecondsSince(start) >= total) {
      return Status::DeadlineExceeded("timed out after " + std::to_string(total) +
                                      " s waiting for " + what);
    }
    // The registration may have been lost (a connection that broke): again, which the scheduler
    // takes as the same one.
    Message msg;
    msg.header.set_command(proto::REGISTER);
    *msg.header.mutable_register_() = register_;
    SPARSEPS_RETURN_IF_ERROR(Send(msg));
  }
}

Status ControlClient::Barrier(const std::string& name, proto::Role group) {
  const uint64_t generation = barrier_generation_[name]++;
  Message msg;
  msg.header.set_command(proto::BARRIER);
  msg.header.mutable_barrier()->set_name(name);
  msg.header.mutable_barrier()->set_generation(generation);
  msg.header.mutable_barrier()->set_group(group);
  SPARSEPS_RETURN_IF_ERROR(Send(msg));
  return WaitFor([&] { return barrier_released_[name] > generation; },
                 config_.cluster().barrier_timeout_s() + 10.0,
                 "barrier '" + name + "' generation " + std::to_string(generation));
}

void ControlClient::StartHeartbeats() {
  if (heartbeat_thread_.joinable()) return;
  heartbeat_stop_ = false;
  // The thread gets its identity by value: membership_ belongs to the calling thread.
  heartbeat_thread_ = std::thread([this, rank = membership_.your_rank(),
                                   epoch = membership_.epoch()] { HeartbeatLoop(rank, epoch); });
}

void ControlClient::StopHeartbeats() {
  {
    std::lock_guard<std::mutex> lock(heartbeat_mu_);
    heartbeat_stop_ = true;
  }
  heartbeat_cv_.notify_all();
  if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
}

void ControlClient::HeartbeatLoop(int rank, uint64_t epoch) {
  zmq::socket_t hb = ConnectDealer(context_, config_.cluster().scheduler_host(),
                                   config_.cluster().scheduler_port(), heartbeat_routing_id_,
                                   SchedulerKey(context_));
  hb.set(zmq::sockopt::linger, 0);
  const auto interval = std::chrono::duration<double>(config_.cluster().heartbeat_interval_s());
  std::unique_lock<std::mutex> lock(heartbeat_mu_);
  while (!heartbeat_stop_) {
    Message msg;
    msg.header.set_command(proto::HEARTBEAT);
    msg.header.set_sender_role(role_);
    msg.header.set_sender_rank(rank);
    msg.header.set_epoch(epoch);
    Status s = SendMessage(hb, msg);
    if (!s.ok()) spdlog::warn("heartbeat not sent: {}", s.message());
    heartbeat_cv_.wait_for(lock, interval, [this] { return heartbeat_stop_; });
  }
}

void ControlClient::ReportFailure(const Status& error) {
  if (error.ok() || !registered_ || !fatal_.empty() || shutdown_) return;
  Message msg;
  msg.header.set_command(proto::FATAL);
  msg.header.set_error(error.message());
  Status s = Send(msg);
  if (!s.ok()) {
    spdlog::warn("could not report the failure to the scheduler: {}", s.message());
    return;
  }
  socket_.set(zmq::sockopt::linger, 1000);  // let the report leave before the socket closes
}

Status ControlClient::ReportCheckpoint(uint64_t iteration, const proto::CheckpointFile& file) {
  Message msg;
  msg.header.set_command(proto::CHECKPOINT_WRITTEN);
  msg.header.set_iteration(static_cast<int64_t>(iteration));
  *msg.header.mutable_checkpoint_file() = file;
  return Send(msg);
}

Status ControlClient::SendDone(const proto::WorkerStats& stats) {
  Message msg;
  msg.header.set_command(proto::DONE);
  *msg.header.mutable_done()->mutable_stats() = stats;
  return Send(msg);
}

}  // namespace sparseps
