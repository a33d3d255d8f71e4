#include "worker/ps_client.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#include "common/log_limit.h"
#include "encodings/codec.h"
#include "encodings/dense.h"
#include "encodings/registry.h"

namespace sparseps {

PsClientOptions PsClientOptionsFor(const proto::JobConfig& config) {
  PsClientOptions o;
  o.request_timeout_s = config.cluster().request_timeout_s();
  o.commit_after_ack = config.cluster().on_worker_failure() == proto::CONTINUE;
  o.retry_interval_s = config.cluster().retry_interval_s();
  o.push_window = config.cluster().push_window();
  return o;
}

PsClient::PsClient(zmq::context_t& context, const proto::Membership& membership, int worker_rank,
                   ControlClient* control, const PsClientOptions& options)
    : control_(control),
      epoch_(SettledEpoch(membership)),
      worker_rank_(worker_rank),
      request_timeout_s_(options.request_timeout_s),
      commit_after_ack_(options.commit_after_ack),
      retry_interval_s_(options.retry_interval_s),
      push_window_(options.push_window) {
  // One routing id for every server (each has its own ROUTER): the one registered, which the
  // servers accept this worker's messages from, plus "/N" for the N-th client of this process: a
  // client made after a rollback must not reuse the id of the old one, whose connection a server's
  // ROUTER may still hold (it would refuse the new one).
  static std::atomic<uint64_t> incarnation{0};
  const std::string routing_id =
      (control != nullptr ? control->data_routing_id() : MakeRoutingId(proto::WORKER, "ps")) + "/" +
      std::to_string(incarnation.fetch_add(1));
  // Servers send parameters (dense, or top-k with indices), never sketch tables.
  const int64_t max_frame = JobMaxFrameBytes(proto::JobConfig(), membership.num_params());
  std::vector<proto::RangeInfo> infos(membership.ranges().begin(), membership.ranges().end());
  std::sort(infos.begin(), infos.end(),
            [](const auto& a, const auto& b) { return a.begin() < b.begin(); });
  for (const auto& r : infos) {
    const proto::NodeInfo* server = nullptr;
    for (const auto& n : membership.nodes()) {
      if (n.role() == proto::SERVER && n.rank() == r.server_rank()) server = &n;
    }
    Peer p;
    p.range = {r.begin(), r.end()};
    p.server_rank = r.server_rank();
    const std::string host = server ? server->host() : "?";
    const uint32_t port = server ? server->port() : 0;
    p.name = "server " + std::to_string(r.server_rank()) + " at " + Endpoint(host, port);
    p.watch = HandshakeWatch(p.name);
    p.socket = ConnectDealer(context, host, port, routing_id, server ? server->public_key() : "",
                             max_frame, [&](zmq::socket_t& s) { p.watch.Attach(context, s); });
    ranges_.push_back(p.range);
    peers_.push_back(std::move(p));
  }
}

Message PsClient::Request(const Peer& peer, proto::Command command, int64_t iteration) {
  Message m;
  m.header.set_command(command);
  m.header.set_iteration(iteration);
  m.header.set_key_begin(peer.range.begin);
  m.header.set_key_end(peer.range.end);
  return m;
}

namespace {

// The time `seconds` from now.
Clock::time_point Later(double seconds) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// A copy of `msg` whose frames share their buffers with msg's (ZeroMQ's reference-counted copy):
// what is sent, so that msg stays whole for a resend.
Message WireCopy(Message& msg) {
  Message wire;
  wire.header = msg.header;
  for (auto& f : msg.frames) {
    zmq::message_t copy;
    copy.copy(f);
    wire.frames.push_back(std::move(copy));
  }
  return wire;
}

}  // namespace

Status PsClient::CheckPaused(int64_t iteration) const {
  Status s = control_->CheckPausedSince(epoch_);
  if (s.ok()) return s;
  return Status::Unavailable(s.message() + ": iteration " + std::to_string(iteration) +
                             " is void until the job rolls back");
}

Status PsClient::Send(Peer& peer, Message& msg, proto::Command expected, Ticket* ticket) {
  // The membership this client was made for is void: its server may be gone, and a request to
  // its endpoint would only wait. The iteration ends here; the job rolls back.
  SPARSEPS_RETURN_IF_ERROR(CheckPaused(msg.header.iteration()));
  SPARSEPS_RETURN_IF_ERROR(peer.watch.Check());
  auto& h = msg.header;
  h.set_sender_role(proto::WORKER);
  h.set_sender_rank(worker_rank_);
  h.set_epoch(control_->membership().epoch());
  h.set_request_id(next_request_id_++);
  if (ticket != nullptr) *ticket = h.request_id();
  Pending p{expected, {}, Later(retry_interval_s_), {}};
  const uint64_t before = bytes_sent_;
  const proto::Command command = h.command();  // h goes with msg below
  if (retry_interval_s_ > 0) {
    Message wire = WireCopy(msg);
    Status s = SendMessage(peer.socket, wire, nullptr, &bytes_sent_);
    if (!s.ok()) return Status::IoError("sending to " + peer.name + ": " + s.message());
    p.request = std::move(msg);
  } else {
    // Never sent again: only the header is kept (the reply is matched by its request id).
    p.request.header = h;
    Status s = SendMessage(peer.socket, msg, nullptr, &bytes_sent_);
    if (!s.ok()) return Status::IoError("sending to " + peer.name + ": " + s.message());
  }
  traffic_.Sent(command, bytes_sent_ - before);
  peer.pending.push_back(std::move(p));
  return Status::OK();
}

Status PsClient::Resend(Peer& peer, Pending& p) {
  p.request.header.set_epoch(control_->membership().epoch());
  Message wire = WireCopy(p.request);
  ++resent_;
  spdlog::warn("no reply from {} to {} (iteration {}) yet: sending it again (request {})",
               peer.name, CommandName(p.request.header.command()), p.request.header.iteration(),
               p.request.header.request_id());
  p.resend_at = Later(retry_interval_s_);
  const uint64_t before = bytes_sent_;
  Status s = SendMessage(peer.socket, wire, nullptr, &bytes_sent_);
  if (!s.ok()) return Status::IoError("sending to " + peer.name + " again: " + s.message());
  traffic_.Sent(wire.header.command(), bytes_sent_ - before);
  return Status::OK();
}

Status PsClient::Init(const float* params) {
  for (auto& p : peers_) {
    Message m = Request(p, proto::INIT, -1);
    EncodeDense(std::vector<float>(params + p.range.begin, params + p.range.end), &m);
    SPARSEPS_RETURN_IF_ERROR(Send(p, m, proto::INIT_ACK));
  }
  return AwaitAll(-1, nullptr);
}

Status PsClient::PullDense(int64_t version, float* params) {
  for (auto& p : peers_) {
    Message m = Request(p, proto::PULL, version - 1);
    m.header.set_have_version(-1);
    SPARSEPS_RETURN_IF_ERROR(Send(p, m, proto::PULL_REPLY));
  }
  return AwaitAll(version - 1, params);
}

Status PsClient::PullBarrier(int64_t iteration, float* params) {
  for (auto& p : peers_) {
    Message m = Request(p, proto::PULL, iteration);
    m.header.set_have_version(p.version);
    m.header.set_no_staleness(true);
    SPARSEPS_RETURN_IF_ERROR(Send(p, m, proto::PULL_REPLY));
  }
  Status s = AwaitAll(iteration, params);
  if (s.code() == StatusCode::kDeadlineExceeded) {
    return Status::DeadlineExceeded(
        s.message() +
        ": the final pull of train.consistency ssp / async waits until every worker "
        "has pushed iteration " +
        std::to_string(iteration) +
        "; a worker that ran fewer steps, or stopped, never does (give every worker the same "
        "number of steps)");
  }
  return s;
}

Status PsClient::PushPull(int64_t iteration, std::vector<Message>& pushes, float* params) {
  SPARSEPS_RETURN_IF_ERROR(StartPushPull(iteration, pushes, params));
  return AwaitPull(iteration, params);
}

Status PsClient::StartPushPull(int64_t iteration, std::vector<Message>& pushes, float* params) {
  if (pushes.size() != peers_.size()) {
    return Status::Internal("PushPull needs one push per key range: got " +
                            std::to_string(pushes.size()) + " for " +
                            std::to_string(peers_.size()));
  }
  checkpoint_after_last_ = false;
  return PushThenPull(iteration, pushes, params);
}

Status PsClient::PushThenPull(int64_t iteration, std::vector<Message>& pushes, float* params) {
  BeginPushes();
  // push_window: range r leaves once at most window - 1 of the earlier ones are unacknowledged.
  const size_t window = push_window_ == 0 ? peers_.size() : push_window_;
  for (size_t r = 0; r < peers_.size(); ++r) {
    if (r >= window) SPARSEPS_RETURN_IF_ERROR(AwaitPushAcks(iteration, params, window - 1));
    SPARSEPS_RETURN_IF_ERROR(PushRange(iteration, r, pushes[r]));
  }
  return CommitPushes(iteration, params);
}

void PsClient::BeginPushes() {
  checkpoint_after_last_ = false;
  pushed_ = Clock::now();
}

Result<PsClient::Ticket> PsClient::Push(size_t r, int64_t iteration, Message& push) {
  if (r >= peers_.size()) return Status::Internal("Push: no key range " + std::to_string(r));
  push.header.set_command(proto::PUSH);
  push.header.set_iteration(iteration);
  if (request_checkpoint_) push.header.set_checkpoint(true);
  Ticket ticket = 0;
  SPARSEPS_RETURN_IF_ERROR(Send(peers_[r], push, proto::PUSH_ACK, &ticket));
  return ticket;
}

Result<PsClient::Ticket> PsClient::Pull(size_t r, int64_t iteration) {
  if (r >= peers_.size()) return Status::Internal("Pull: no key range " + std::to_string(r));
  Peer& p = peers_[r];
  Message pull = Request(p, proto::PULL, iteration);
  pull.header.set_have_version(p.version);
  Ticket ticket = 0;
  SPARSEPS_RETURN_IF_ERROR(Send(p, pull, proto::PULL_REPLY, &ticket));
  return ticket;
}

Status PsClient::Wait(std::span<const Ticket> tickets, int64_t iteration, float* params) {
  auto waits = [&](const Pending& q) {
    return std::find(tickets.begin(), tickets.end(), q.request.header.request_id()) !=
           tickets.end();
  };
  return AwaitUntil(
      iteration, params,
      [&] {
        return std::none_of(peers_.begin(), peers_.end(), [&](const Peer& p) {
          return std::any_of(p.pending.begin(), p.pending.end(), waits);
        });
      },
      waits);
}

Status PsClient::PushRange(int64_t iteration, size_t r, Message& push) {
  auto pushed = Push(r, iteration, push);
  if (!pushed.ok()) return pushed.status();
  if (!commit_after_ack_) return Pull(r, iteration).status();
  return Status::OK();
}

Status PsClient::FinishPushes(int64_t iteration, float* params) {
  SPARSEPS_RETURN_IF_ERROR(CommitPushes(iteration, params));
  return AwaitPull(iteration, params);
}

Status PsClient::CommitPushes(int64_t iteration, float* params) {
  request_checkpoint_ = false;
  pulled_ = pushed_;
  if (commit_after_ack_) {
    // Every server holds this worker's push: the pulls commit it.
    SPARSEPS_RETURN_IF_ERROR(AwaitAll(iteration, params));
    pulled_ = Clock::now();
    for (size_t r = 0; r < peers_.size(); ++r) {
      SPARSEPS_RETURN_IF_ERROR(Pull(r, iteration).status());
    }
  }
  return Status::OK();
}

Status PsClient::AwaitPull(int64_t iteration, float* params) {
  SPARSEPS_RETURN_IF_ERROR(AwaitAll(iteration, params));
  last_push_s_ = std::chrono::duration<double>(push_acked_ - pushed_).count();
  last_pull_s_ = std::chrono::duration<double>(pull_replied_ - pulled_).count();
  return Status::OK();
}

Status PsClient::SketchTwoRounds(int64_t iteration, std::vector<Message>& sketches,
                                 const ExactPush& exact, float* params, bool await) {
  if (sketches.size() != peers_.size()) {
    return Status::Internal("SketchTwoRounds needs one sketch per key range");
  }
  checkpoint_after_last_ = false;
  for (size_t r = 0; r < peers_.size(); ++r) {
    sketches[r].header.set_phase(0);
    SPARSEPS_RETURN_IF_ERROR(Push(r, iteration, sketches[r]).status());
  }
  // The candidate requests commit the sketches: with commit_after_ack, once all are acknowledged.
  if (commit_after_ack_) SPARSEPS_RETURN_IF_ERROR(AwaitAll(iteration, params));
  for (auto& p : peers_) {
    Message ask = Request(p, proto::PULL_CANDIDATES, iteration);
    SPARSEPS_RETURN_IF_ERROR(Send(p, ask, proto::CANDIDATES));
  }
  SPARSEPS_RETURN_IF_ERROR(AwaitAll(iteration, params));
  std::vector<Message> pushes(peers_.size());
  for (size_t r = 0; r < peers_.size(); ++r) {
    Peer& p = peers_[r];
    pushes[r] = Request(p, proto::PUSH, iteration);
    SPARSEPS_RETURN_IF_ERROR(exact(r, p.candidates, &pushes[r]));
    pushes[r].header.set_phase(1);
  }
  SPARSEPS_RETURN_IF_ERROR(PushThenPull(iteration, pushes, params));
  return await ? AwaitPull(iteration, params) : Status::OK();
}

Status PsClient::ApplyPullReply(Peer& peer, const Message& msg, float* params) {
  const Codec* codec = FindCodec(msg.header.encoding());
  if (codec == nullptr)
    return Status::ProtocolError(peer.name + " replied with an unknown encoding");
  DecodedPayload p;
  Status s = codec->Decode(msg, peer.range.size(), &p);
  if (!s.ok())
    return Status::ProtocolError("bad PULL_REPLY from " + peer.name + ": " + s.message());
  // A sparse reply holds the changes since the version its have_version names (none when
  // nothing changed since: ssp's barrier pull).
  if (!p.is_dense() && (msg.header.have_version() != peer.version || peer.version < 0 ||
                        msg.header.version() < peer.version)) {
    return Status::ProtocolError(peer.name + " sent a sparse delta from version " +
                                 std::to_string(msg.header.have_version()) + " to " +
                                 std::to_string(msg.header.version()) + " but we hold " +
                                 std::to_string(peer.version));
  }
  if (p.is_sketch()) {
    return Status::ProtocolError(peer.name + " replied with a sketch; pulls are dense or topk");
  }
  float* base = params + peer.range.begin;
  if (p.is_dense()) {
    if (on_changed_) {
      changed_.clear();
      for (size_t i = 0; i < p.dense.size(); ++i) {
        if (base[i] != p.dense[i]) changed_.push_back(static_cast<uint32_t>(i));
      }
      on_changed_(peer.range.begin, changed_, {});
    }
    std::copy(p.dense.begin(), p.dense.end(), base);
  } else {
    if (on_changed_) {
      delta_.resize(p.indices.size());
      for (size_t j = 0; j < p.indices.size(); ++j) delta_[j] = p.values[j] - base[p.indices[j]];
      on_changed_(peer.range.begin, p.indices, delta_);
    }
    for (size_t j = 0; j < p.indices.size(); ++j) base[p.indices[j]] = p.values[j];
  }
  peer.version = msg.header.version();
  return Status::OK();
}

Status PsClient::AwaitAll(int64_t iteration, float* params) {
  return AwaitUntil(
      iteration, params,
      [&] {
        return std::all_of(peers_.begin(), peers_.end(),
                           [](const Peer& p) { return p.pending.empty(); });
      },
      [](const Pending&) { return true; });
}

Status PsClient::AwaitPushAcks(int64_t iteration, float* params, size_t at_most) {
  auto is_push = [](const Pending& q) { return q.expected == proto::PUSH_ACK; };
  return AwaitUntil(
      iteration, params,
      [&] {
        size_t unacked = 0;
        for (const auto& p : peers_) {
          unacked +=
              static_cast<size_t>(std::count_if(p.pending.begin(), p.pending.end(), is_push));
        }
        return unacked <= at_most;
      },
      is_push);
}

Status PsClient::AwaitUntil(int64_t iteration, float* params, const std::function<bool()>& done,
                            const std::function<bool(const Pending&)>& waits) {
  const RunTimer waited;  // a stop of this process does not run the deadline out
  std::vector<zmq::socket_t*> sockets;
  for (auto& p : peers_) sockets.push_back(&p.socket);
  sockets.push_back(&control_->socket());
  while (true) {
    if (done()) return Status::OK();
    // Every round, not only when the scheduler wrote: Poll also notices a scheduler gone silent.
    SPARSEPS_RETURN_IF_ERROR(control_->Poll());
    // A pause or a rollback since this client connected, whether or not the newest epoch still
    // says so (both may come in one Poll): what it waits for is void, and nothing goes again to a
    // lost server's old endpoint.
    SPARSEPS_RETURN_IF_ERROR(CheckPaused(iteration));
    for (auto& p : peers_) SPARSEPS_RETURN_IF_ERROR(p.watch.Check());
    const Peer* waiting = nullptr;
    const Pending* what = nullptr;
    for (const auto& p : peers_) {
      auto it = std::find_if(p.pending.begin(), p.pending.end(), waits);
      if (it != p.pending.end()) {
        waiting = &p;
        what = &*it;
        break;
      }
    }
    if (waiting == nullptr) return Status::Internal("waiting for a reply that no request expects");
    const double left = request_timeout_s_ - waited.Seconds();
    if (left <= 0) {
      return Status::DeadlineExceeded(
          "timed out after " + FormatSeconds(request_timeout_s_) + " waiting for " +
          CommandName(what->expected) + " (iteration " + std::to_string(iteration) + ") from " +
          waiting->name + (what->held_for.empty() ? "" : "; it waits for " + what->held_for));
    }
    if (retry_interval_s_ > 0) {
      const auto now = Clock::now();
      for (auto& p : peers_) {
        for (auto& q : p.pending) {
          if (now >= q.resend_at) SPARSEPS_RETURN_IF_ERROR(Resend(p, q));
        }
      }
    }
    const double ask_within = std::min(5.0, request_timeout_s_ / 4);  // seconds
    if (left <= ask_within) {
      for (auto& p : peers_) {
        for (auto& q : p.pending) {
          const bool pull = q.expected == proto::PULL_REPLY || q.expected == proto::CANDIDATES;
          if (pull && !q.asked && q.held_for.empty()) {
            q.asked = true;  // a pull is its header alone, kept also without repeats
            SPARSEPS_RETURN_IF_ERROR(Resend(p, q));
          }
        }
      }
    }
    const double until = left > ask_within ? left - ask_within : left;  // the next turn
    auto ready = PollIn(sockets, std::min<int64_t>(200, static_cast<int64_t>(until * 1000) + 1));
    for (size_t i = 0; i < peers_.size(); ++i) {
      if (ready[i]) SPARSEPS_RETURN_IF_ERROR(ReceiveFrom(peers_[i], params));
    }
  }
}

Status PsClient::ReceiveFrom(Peer& p, float* params) {
  while (true) {
    const uint64_t before = bytes_received_;
    auto msg = RecvMessage(p.socket, false, nullptr, &bytes_received_);
    if (!msg.ok() && msg.status().code() == StatusCode::kIoError) break;
    traffic_.Received(msg.ok() ? msg->header.command() : proto::COMMAND_UNSPECIFIED,
                      bytes_received_ - before);
    if (!msg.ok()) {
      return Status::ProtocolError("malformed reply from " + p.name + ": " +
                                   msg.status().message());
    }
    const auto& h = msg->header;
    // A reply from a newer membership epoch (a worker left the job): this worker learns of it
    // before it goes on, so every worker re-splits the data at the same epoch.
    if (control_->has_membership() && h.epoch() > control_->membership().epoch()) {
      SPARSEPS_RETURN_IF_ERROR(control_->WaitForEpoch(h.epoch()));
    }
    // The request this answers; none when it was answered already (a reply to a resend).
    auto it = std::find_if(p.pending.begin(), p.pending.end(), [&](const Pending& q) {
      return q.request.header.request_id() == h.request_id();
    });
    if (it == p.pending.end() && h.request_id() > 0 && h.request_id() < next_request_id_) {
      ++duplicate_replies_;
      continue;
    }
    if (h.command() == proto::ERROR) {
      if (h.held() && it != p.pending.end()) {
        // Not refused: the server holds the request (answering a repeat) and says for what; it
        // is sent again at the usual interval.
        it->held_for = Printable(h.error(), 400);
        continue;
      }
      if (h.retryable() && it != p.pending.end() && retry_interval_s_ > 0) {
        // Not ready yet (e.g. still waiting for the membership): again after a short wait.
        it->resend_at = Later(std::min(retry_interval_s_, 0.5));
        continue;
      }
      if (h.removed()) {
        // The scheduler removed this worker (declared dead while it was stopped or slow): out of
        // the job, as the scheduler's own FATAL says when it comes first.
        return Status::Disconnected("removed from the job: " + p.name +
                                    " refused our request (iteration " +
                                    std::to_string(h.iteration()) + "): " + h.error());
      }
      return Status::ProtocolError(p.name + " rejected our request (iteration " +
                                   std::to_string(h.iteration()) + "): " + h.error());
    }
    if (it == p.pending.end()) it = p.pending.begin();  // no id: the oldest request
    if (it == p.pending.end() || h.command() != it->expected) {
      return Status::ProtocolError(
          "unexpected " + CommandName(h.command()) + " from " + p.name + " (expected " +
          (it == p.pending.end() ? std::string("nothing") : CommandName(it->expected)) + ")");
    }
    p.pending.erase(it);
    if (h.command() == proto::PUSH_ACK) push_acked_ = p.acked_at = Clock::now();
    if (h.command() == proto::PULL_REPLY) {
      if (h.checkpoint()) checkpoint_after_last_ = true;
      SPARSEPS_RETURN_IF_ERROR(ApplyPullReply(p, *msg, params));
      pull_replied_ = p.replied_at = Clock::now();
    } else if (h.command() == proto::CANDIDATES) {
      DecodedPayload c;
      Status s = FindCodec(proto::TOPK)->Decode(*msg, p.range.size(), &c);
      if (!s.ok() || h.encoding() != proto::TOPK) {
        return Status::ProtocolError("bad CANDIDATES from " + p.name + ": " + s.message());
      }
      p.candidates.assign(c.indices.begin(), c.indices.end());
    }
  }
  return Status::OK();
}

Status PsClient::Drain(float* params) {
  std::vector<zmq::socket_t*> sockets;
  for (auto& p : peers_) sockets.push_back(&p.socket);
  const auto ready = PollIn(sockets, 0);
  for (size_t i = 0; i < peers_.size(); ++i) {
    if (ready[i]) SPARSEPS_RETURN_IF_ERROR(ReceiveFrom(peers_[i], params));
  }
  return Status::OK();
}

}  // namespace sparseps
