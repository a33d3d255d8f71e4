#include "transport/control_client.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <utility>

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
      control_routing_id_(MakeRoutingId(role, "ctl")),
      monitor_(ZMQ_EVENT_CONNECTED | ZMQ_EVENT_CONNECT_RETRIED | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH),
      socket_(
          ConnectDealer(context, config.cluster().scheduler_host(),
                        config.cluster().scheduler_port() == 0
                            ? 1  // placeholder; Register() refuses port 0 with a clear error
                            : config.cluster().scheduler_port(),
                        control_routing_id_, SchedulerKey(context), kControlMaxFrameBytes,
                        [this](zmq::socket_t& s) { monitored_ = monitor_.Attach(context_, s); })) {
  if (!monitored_) {
    spdlog::warn(
        "no monitor on the control socket ({}): a connection to the scheduler made "
        "again is noticed at this node's next message",
        zmq_strerror(zmq_errno()));
  }
}

ControlClient::~ControlClient() {
  StopHeartbeats();
  if (monitor_.active()) zmq_socket_monitor(socket_.handle(), nullptr, 0);
}

void ControlClient::ReadConnectionEvents() {
  uint16_t id;
  uint32_t value;
  while (monitor_.Next(&id, &value)) {
    if (id == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH && key_refused_.ok()) {
      // ZeroMQ drops a connection whose handshake the peer refused and does not make it again:
      // every later send would wait for a connection that never comes. This node ends at once.
      key_refused_ = CurveKeyRefused(context_, "the scheduler at " + scheduler_endpoint(), value);
    } else if (id == ZMQ_EVENT_CONNECTED) {
      // The first connection carries the registration and the membership; one made after them
      // is one made again.
      if (has_membership_ && !shutdown_) reconnected_ = true;
      refused_since_.reset();
    } else if (id == ZMQ_EVENT_CONNECT_RETRIED && !refused_since_) {
      refused_since_ = Clock::now();
    }
  }
}

void ControlClient::CheckReconnected() {
  ReadConnectionEvents();
  if (!std::exchange(reconnected_, false) || !has_membership_ || shutdown_) return;
  ++reconnections_;
  spdlog::info("the connection to the scheduler at {} was made again", scheduler_endpoint());
  Message hello;
  hello.header.set_command(proto::HEARTBEAT);
  if (Status s = Send(hello); !s.ok()) spdlog::warn("heartbeat not sent: {}", s.message());
  // As first sent (stamped by Send): a server's answer names by its epoch the change it answers.
  auto again = [&](const proto::Header& h) {
    Message m;
    m.header = h;
    Status s = SendMessage(socket_, m);
    if (!s.ok()) spdlog::warn("{} not sent again: {}", CommandName(h.command()), s.message());
  };
  for (const proto::Header& report : reports_) again(report);
  if (answer_) again(*answer_);
  if (!reports_.empty() || answer_) {
    spdlog::info("sent the scheduler again {} report(s) of checkpoint {}{}", reports_.size(),
                 reports_.empty() ? std::string("-") : std::to_string(reports_.front().iteration()),
                 answer_ ? " and this node's " + CommandName(answer_->command()) : std::string());
  }
}

std::string ControlClient::scheduler_endpoint() const {
  return Endpoint(config_.cluster().scheduler_host(), config_.cluster().scheduler_port());
}

Status ControlClient::Send(Message& msg) {
  // A refused key ends this node here, before its message waits for a connection that never
  // comes (the handshake may have failed before the first send: a slow start, no Poll yet).
  ReadConnectionEvents();
  SPARSEPS_RETURN_IF_ERROR(key_refused_);
  msg.header.set_sender_role(role_);
  msg.header.set_sender_rank(has_membership_ ? membership_.your_rank() : -1);
  msg.header.set_epoch(membership_.epoch());
  Status s = SendMessage(socket_, msg);
  if (!s.ok()) {
    ReadConnectionEvents();  // refused while the send waited: that is the cause to name
    SPARSEPS_RETURN_IF_ERROR(key_refused_);
  }
  return s;
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

Status ControlClient::CheckSchedulerThere() {
  const double timeout = config_.cluster().heartbeat_timeout_s();
  if (!registered_ || !register_.rejoin() || has_membership_ || shutdown_ || !refused_since_ ||
      SecondsSince(*refused_since_) <= timeout) {
    return Status::OK();
  }
  scheduler_lost_ = true;
  fatal_ = "no scheduler at " + scheduler_endpoint() + ": it refused this replacement's " +
           "connections for " + FormatSeconds(SecondsSince(*refused_since_)) +
           " (cluster.heartbeat_timeout_s = " + FormatSeconds(timeout) +
           "); a replacement (--rejoin) joins a running job: has the job ended, or did the "
           "scheduler die?";
  return Status::Disconnected(fatal_);
}

Status ControlClient::Poll() {
  CheckReconnected();
  SPARSEPS_RETURN_IF_ERROR(key_refused_);
  SPARSEPS_RETURN_IF_ERROR(CheckSchedulerThere());
  while (true) {
    if (StopRequested()) return Status::Aborted("stopped by a signal");
    if (scheduler_lost_ || removed_) return Status::Disconnected(fatal_);
    if (!fatal_.empty()) return Status::Aborted("the scheduler ended the job: " + fatal_);
    auto ready = PollIn({&socket_}, 0);
    if (!ready[0]) {
      // Checked after draining: a node busy for a while finds the heartbeats queued.
      if (has_membership_ && !shutdown_ &&
          SecondsSince(last_heard_) > config_.cluster().heartbeat_timeout_s() && Listening()) {
        scheduler_lost_ = true;
        fatal_ = "the scheduler at " + scheduler_endpoint() + " sent nothing for " +
                 FormatSeconds(SecondsSince(last_heard_)) + " (cluster.heartbeat_timeout_s = " +
                 FormatSeconds(config_.cluster().heartbeat_timeout_s()) +
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
        if (membership_.has_join()) NoteJoin(membership_);
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
        if (h.barrier().call() != 0) {  // a summing barrier's: its call's, if still awaited
          if (h.barrier().call() == summing_call_) summing_release_ = h.barrier();
          break;
        }
        auto& released = barrier_released_[h.barrier().name()];
        released = std::max(released, h.barrier().generation() + 1);
        break;
      }
      case proto::SHUTDOWN:
        shutdown_ = true;
        shutdown_reason_ = h.error();
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
      case proto::HANDOFF:
        ReceiveHandoffChunk(*msg);
        break;
      case proto::FATAL:
        fatal_ = h.error().empty() ? "no reason given" : h.error();
        if (h.removed()) {
          // Declared dead while slow or stopped: out of the job, which goes on without this node.
          removed_ = true;
          fatal_ = "removed from the job: " + fatal_;
          return Status::Disconnected(fatal_);
        }
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
  const RunTimer waited;  // a stop of this process does not run the deadline out
  while (true) {
    SPARSEPS_RETURN_IF_ERROR(Poll());
    if (done()) return Status::OK();
    SPARSEPS_RETURN_IF_ERROR(CheckWatched());
    if (shutdown_)
      return Status::Aborted("the scheduler shut the job down while waiting for " + what);
    const double left = timeout_s - waited.Seconds();
    if (left <= 0) {
      return Status::DeadlineExceeded("timed out after " + FormatSeconds(timeout_s) +
                                      " waiting for " + what);
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

uint64_t MaxHandoffBytes(uint64_t num_params) {
  constexpr uint64_t kRest = uint64_t{256} << 20;
  const uint64_t limit = std::numeric_limits<uint64_t>::max() - kRest;
  return (num_params > limit / 64 ? limit : num_params * 64) + kRest;
}

void ControlClient::NoteJoin(const proto::Membership& m) {
  const auto& j = m.join();
  if (j.worker_rank() == m.your_rank()) {
    incoming_handoff_ = IncomingHandoff();
    incoming_handoff_.from = j.donor();
    incoming_handoff_.iteration = j.iteration();
  } else if (j.donor() == m.your_rank() && j.donor() >= 0) {
    handoffs_owed_.push_back(j);
  }
}

Status ControlClient::SendHandoff(const proto::WorkerJoin& join, std::span<const float> model,
                                  std::span<const uint8_t> state) {
  const uint64_t model_bytes = model.size() * sizeof(float);
  const uint64_t total = model_bytes + state.size();
  if (total > MaxHandoffBytes(membership_.num_params())) {
    return Status::InvalidArgument("the hand-over to worker " + std::to_string(join.worker_rank()) +
                                   " is " + std::to_string(total) + " bytes, over the " +
                                   std::to_string(MaxHandoffBytes(membership_.num_params())) +
                                   " a replacement takes for this model (16 float32 a parameter "
                                   "and 256 MiB)");
  }
  const uint64_t chunks = (total + kHandoffChunkBytes - 1) / kHandoffChunkBytes;
  const auto* model_data = reinterpret_cast<const uint8_t*>(model.data());
  uint64_t chunk = 0;
  do {
    Message msg;
    msg.header.set_command(proto::HANDOFF);
    msg.header.set_iteration(join.iteration());
    auto* b = msg.header.mutable_handoff();
    b->set_to_rank(join.worker_rank());
    b->set_chunk(static_cast<uint32_t>(chunk));
    b->set_chunks(static_cast<uint32_t>(chunks));
    b->set_total_bytes(total);
    b->set_model_elements(model.size());
    if (chunks > 0) {
      // Bytes [begin, end) of the model's bytes followed by the state's.
      const uint64_t begin = chunk * kHandoffChunkBytes;
      const uint64_t end = std::min(total, begin + kHandoffChunkBytes);
      std::vector<uint8_t> bytes(end - begin);
      for (uint64_t i = begin; i < end;) {
        const bool in_model = i < model_bytes;
        const uint64_t stop = in_model ? std::min(end, model_bytes) : end;
        const uint8_t* src = in_model ? model_data + i : state.data() + (i - model_bytes);
        std::copy(src, src + (stop - i), bytes.begin() + static_cast<ptrdiff_t>(i - begin));
        i = stop;
      }
      AddFrame(&msg, proto::U8, std::move(bytes));
    }
    SPARSEPS_RETURN_IF_ERROR(Send(msg));
  } while (++chunk < chunks);
  return Status::OK();
}

void ControlClient::ReceiveHandoffChunk(const Message& msg) {
  const proto::Header& h = msg.header;
  IncomingHandoff& in = incoming_handoff_;
  if (h.iteration() == handoff_taken_) return;  // the loop took what it wanted already
  std::string why;
  if (!h.has_handoff()) {
    why = "no handoff body";
  } else if (in.from < 0 || h.iteration() != in.iteration || in.complete || !in.error.empty()) {
    why = "no hand-over of iteration " + std::to_string(h.iteration()) + " is expected";
  }
  if (!why.empty()) {
    ++rejected_;
    spdlog::warn("ignoring a HANDOFF from the scheduler: {}", why);
    return;
  }
  const proto::Handoff& b = h.handoff();
  if (!h.error().empty()) {
    in.error = h.error();  // the scheduler refused the donor's hand-over
    in.bytes = {};
    return;
  }
  const uint64_t limit = MaxHandoffBytes(membership_.num_params());
  if (in.next_chunk == 0 &&
      (b.total_bytes() > limit || b.model_elements() > b.total_bytes() / sizeof(float) ||
       (b.model_elements() != 0 && b.model_elements() != membership_.num_params()) ||
       (b.chunks() == 0) != (b.total_bytes() == 0))) {
    why = "a hand-over of " + std::to_string(b.total_bytes()) + " bytes in " +
          std::to_string(b.chunks()) + " chunks with a model of " +
          std::to_string(b.model_elements()) + " elements (the job has " +
          std::to_string(membership_.num_params()) + " parameters; at most " +
          std::to_string(limit) + " bytes)";
  } else if (in.next_chunk > 0 && (b.chunks() != in.chunks || b.total_bytes() != in.total_bytes ||
                                   b.model_elements() != in.model_elements)) {
    why = "chunk " + std::to_string(b.chunk()) + " declares another size than chunk 0";
  } else if (b.chunk() != in.next_chunk) {
    why = "chunk " + std::to_string(b.chunk()) + " where " + std::to_string(in.next_chunk) +
          " was due";
  } else if (b.chunks() > 0 &&
             (msg.frames.size() != 1 || h.frames_size() != 1 || h.frames(0).type() != proto::U8 ||
              msg.frames[0].size() > b.total_bytes() - in.bytes.size() ||
              (b.chunk() + 1 == b.chunks()) !=
                  (msg.frames[0].size() == b.total_bytes() - in.bytes.size()))) {
    why = "chunk " + std::to_string(b.chunk()) + " of " + std::to_string(b.chunks()) +
          " does not hold its share of " + std::to_string(b.total_bytes()) + " bytes";
  }
  if (!why.empty()) {
    ++rejected_;
    in.error = "a malformed hand-over from the scheduler: " + why;
    in.bytes = {};
    spdlog::warn("{}", in.error);
    return;
  }
  if (in.next_chunk == 0) {
    in.chunks = b.chunks();
    in.total_bytes = b.total_bytes();
    in.model_elements = b.model_elements();
    in.first_at = Clock::now();
    in.bytes.reserve(b.total_bytes());  // within MaxHandoffBytes, checked above
  }
  if (b.chunks() > 0) {
    const auto* data = static_cast<const uint8_t*>(msg.frames[0].data());
    in.bytes.insert(in.bytes.end(), data, data + msg.frames[0].size());
  }
  ++in.next_chunk;
  in.complete = in.next_chunk >= in.chunks;
  if (in.complete) in.complete_at = Clock::now();
}

IncomingHandoff ControlClient::TakeIncomingHandoff() {
  IncomingHandoff taken = std::move(incoming_handoff_);
  incoming_handoff_ = IncomingHandoff();
  handoff_taken_ = taken.iteration;
  return taken;
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

Status ControlClient::WaitResending(const proto::Header& request, const std::function<bool()>& done,
                                    double timeout_s, const std::string& what) {
  const double retry = config_.cluster().retry_interval_s();
  const RunTimer waited;
  int resent = 0;
  while (true) {
    const double left = timeout_s - waited.Seconds();
    Status s = WaitFor(done, std::max(0.0, retry > 0 ? std::min(retry, left) : left), what);
    if (s.code() != StatusCode::kDeadlineExceeded) return s;
    if (waited.Seconds() >= timeout_s) {
      return Status::DeadlineExceeded("timed out after " + FormatSeconds(timeout_s) +
                                      " waiting for " + what);
    }
    // The request or its answer may have been lost (a connection that broke): again, which the
    // scheduler takes as the same one. A long wait (the end of an async job) logs it once.
    spdlog::log(++resent == 1 ? spdlog::level::info : spdlog::level::debug,
                "no answer to {0} within {1} s: sending it again every {1} s",
                CommandName(request.command()), retry);
    Message msg;
    msg.header = request;
    SPARSEPS_RETURN_IF_ERROR(Send(msg));
  }
}

Status ControlClient::WaitForMembership() {
  proto::Header request;
  request.set_command(proto::REGISTER);
  *request.mutable_register_() = register_;
  return WaitResending(
      request, [this] { return has_membership_; }, config_.cluster().register_timeout_s() + 10.0,
      "the membership from the scheduler at " + scheduler_endpoint() +
          " (is it running, and are all nodes started?)");
}

Status ControlClient::Barrier(const std::string& name, proto::Role group) {
  const uint64_t generation = barrier_generation_[name]++;
  Message msg;
  msg.header.set_command(proto::BARRIER);
  msg.header.mutable_barrier()->set_name(name);
  msg.header.mutable_barrier()->set_generation(generation);
  msg.header.mutable_barrier()->set_group(group);
  const proto::Header request = msg.header;
  SPARSEPS_RETURN_IF_ERROR(Send(msg));
  return WaitResending(
      request, [&] { return barrier_released_[name] > generation; },
      config_.cluster().barrier_timeout_s() + 10.0,
      "barrier '" + name + "' generation " + std::to_string(generation));
}

Status ControlClient::SumOverBarrier(const std::string& name, uint64_t generation,
                                     proto::Role group, std::span<const double> values,
                                     std::vector<double>* sums, uint32_t* contributors) {
  if (values.empty() || values.size() > kMaxBarrierValues) {
    return Status::InvalidArgument("a summing barrier takes 1 to " +
                                   std::to_string(kMaxBarrierValues) + " numbers, not " +
                                   std::to_string(values.size()));
  }
  Message msg;
  msg.header.set_command(proto::BARRIER);
  proto::Barrier* b = msg.header.mutable_barrier();
  b->set_name(name);
  b->set_generation(generation);
  b->set_group(group);
  b->mutable_values()->Add(values.begin(), values.end());
  b->set_call(++summing_calls_);  // this node's calls differ, so a call anew is told from a repeat
  summing_call_ = b->call();
  summing_release_.reset();
  const proto::Header request = msg.header;
  Status s = Send(msg);
  if (s.ok()) {
    s = WaitResending(
        request, [&] { return summing_release_.has_value(); },
        config_.cluster().barrier_timeout_s() + 10.0,
        "barrier '" + name + "' generation " + std::to_string(generation));
  }
  summing_call_ = 0;
  if (!s.ok()) return s;
  const proto::Barrier released = *std::exchange(summing_release_, std::nullopt);
  if (static_cast<size_t>(released.values_size()) != values.size()) {
    return Status::ProtocolError("barrier '" + name + "' generation " + std::to_string(generation) +
                                 " was released with " + std::to_string(released.values_size()) +
                                 " sums for " + std::to_string(values.size()) + " numbers");
  }
  sums->assign(released.values().begin(), released.values().end());
  *contributors = released.contributors();
  return Status::OK();
}

void ControlClient::StartHeartbeats() {
  if (heartbeat_thread_.joinable()) return;
  heartbeat_stop_ = false;
  // The thread's pace tells this process's stops (its first round now: a stop within the first
  // interval is seen too), which its deadlines (RunTimer) and Listening() leave out.
  StoppedTime::OfProcess().Begin(StopGapSeconds(config_.cluster().heartbeat_interval_s()),
                                 Clock::now());
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
  if (!heartbeat_thread_.joinable()) return;
  heartbeat_thread_.join();
  StoppedTime::OfProcess().End();  // no thread: no stop is seen any longer
}

void ControlClient::HeartbeatLoop(int rank, uint64_t epoch) {
  zmq::socket_t hb = ConnectDealer(context_, config_.cluster().scheduler_host(),
                                   config_.cluster().scheduler_port(), heartbeat_routing_id_,
                                   SchedulerKey(context_));
  hb.set(zmq::sockopt::linger, 0);
  // Never blocks: with the scheduler unreachable for kSocketHwm intervals the queue is full, and a
  // heartbeat that cannot be queued is dropped; the thread keeps its pace (Listening()).
  hb.set(zmq::sockopt::sndtimeo, 0);
  const auto interval = std::chrono::duration<double>(config_.cluster().heartbeat_interval_s());
  std::unique_lock<std::mutex> lock(heartbeat_mu_);
  bool failing = false;  // warned about a heartbeat not sent, none sent since
  while (!heartbeat_stop_) {
    Message msg;
    msg.header.set_command(proto::HEARTBEAT);
    msg.header.set_sender_role(role_);
    msg.header.set_sender_rank(rank);
    msg.header.set_epoch(epoch);
    Status s = SendMessage(hb, msg);
    if (!s.ok() && !failing) spdlog::warn("heartbeat not sent: {}", s.message());
    failing = !s.ok();
    heartbeat_cv_.wait_for(lock, interval, [this] { return heartbeat_stop_; });
    StoppedTime::OfProcess().Round(Clock::now());
  }
}

bool ControlClient::Listening() const {
  const double settle_s = std::max(2 * config_.cluster().heartbeat_interval_s(), 1.0);
  return StoppedTime::OfProcess().RunningFor(
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(settle_s)),
      Clock::now());
}

void ControlClient::ReportFailure(const Status& error) {
  if (error.ok() || error.code() == StatusCode::kDisconnected || !registered_ || !fatal_.empty() ||
      shutdown_ || !key_refused_.ok()) {
    return;
  }
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
  if (!reports_.empty() && reports_.front().iteration() != msg.header.iteration()) {
    reports_.clear();
  }
  Status s = Send(msg);
  reports_.push_back(msg.header);  // stamped by Send, as SendAnswer keeps its answer
  return s;
}

Status ControlClient::SendAnswer(Message& msg) {
  Status s = Send(msg);
  answer_ = msg.header;  // stamped by Send
  return s;
}

Status ControlClient::Finish(const proto::WorkerStats& stats) {
  Message msg;
  msg.header.set_command(proto::DONE);
  *msg.header.mutable_done()->mutable_stats() = stats;
  const proto::Header request = msg.header;
  SPARSEPS_RETURN_IF_ERROR(Send(msg));
  // BSP: the end of training is a barrier, whose deadline the scheduler keeps (naming who did
  // not finish); this one comes after it. SSP and async: no deadline of its own; the scheduler's
  // silence (cluster.heartbeat_timeout_s) or its FATAL ends the wait.
  constexpr double kWhileTheSchedulerLives = 1e9;  // seconds
  const bool bsp = config_.train().consistency() == proto::BSP;
  Status s = WaitResending(
      request, [this] { return shutdown_; },
      bsp ? config_.cluster().barrier_timeout_s() + 10.0 : kWhileTheSchedulerLives,
      "SHUTDOWN from the scheduler (every worker's DONE)");
  if (s.code() != StatusCode::kDisconnected || removed_) return s;
  // This worker's part is over and its DONE went out; the scheduler fell silent before the
  // SHUTDOWN came: it ended the job and its SHUTDOWN was lost (a connection that broke as the job
  // ended), or it died. The scheduler's own exit says which; failing here too would have a
  // supervisor restart a worker of a job that ended.
  spdlog::warn(
      "{}; this worker's training is over and its DONE was sent, so it ends normally: whether the "
      "job did is the scheduler's exit status and run.dir/summary.json",
      s.message());
  return Status::OK();
}

}  // namespace sparseps
