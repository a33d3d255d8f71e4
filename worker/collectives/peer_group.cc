#include "worker/collectives/peer_group.h"

#include <algorithm>

namespace sparseps {
namespace {

constexpr size_t kMaxQueuedPerPeer = 4096;

std::string RoutingId(const std::vector<PeerGroup::PeerAddress>& peers, size_t rank) {
  return peers[rank].routing_id.empty() ? "w" + std::to_string(rank) : peers[rank].routing_id;
}

}  // namespace

Result<std::unique_ptr<PeerGroup>> PeerGroup::Bind(zmq::context_t& context, const std::string& host,
                                                   uint32_t port, double timeout_s,
                                                   int64_t max_frame_bytes) {
  // Until Connect knows the peers' routing ids, a duplicate is ignored.
  auto bound = BindRouter(context, host, port, max_frame_bytes, RoutingIdReuse::kIgnore);
  if (!bound.ok()) return bound.status();
  return std::unique_ptr<PeerGroup>(
      new PeerGroup(context, std::move(bound->socket), bound->port, timeout_s, max_frame_bytes));
}

void PeerGroup::Connect(int rank, const std::vector<PeerAddress>& peers) {
  rank_ = rank;
  peers_ = peers;
  dealers_.clear();
  watches_.clear();
  rank_of_id_.clear();
  queued_.clear();
  queued_.resize(peers.size());
  const bool unguessable = std::all_of(peers.begin(), peers.end(),
                                       [](const PeerAddress& p) { return !p.routing_id.empty(); });
  router_.set(zmq::sockopt::router_handover, unguessable ? 1 : 0);
  for (size_t i = 0; i < peers.size(); ++i) {
    rank_of_id_[RoutingId(peers, i)] = static_cast<int>(i);
    watches_.emplace_back(PeerName(static_cast<int>(i)));
    if (static_cast<int>(i) == rank) {
      dealers_.emplace_back();
      continue;
    }
    dealers_.push_back(ConnectDealer(
        context_, peers[i].host, peers[i].port, RoutingId(peers, static_cast<size_t>(rank)),
        peers[i].public_key, max_frame_bytes_,
        [&](zmq::socket_t& s) { watches_.back().Attach(context_, s); }));
  }
}

std::string PeerGroup::PeerName(int rank) const {
  if (rank < 0 || rank >= size()) return "worker " + std::to_string(rank);
  return "worker " + std::to_string(rank) + " at " + peers_[rank].host + ":" +
         std::to_string(peers_[rank].port);
}

Status PeerGroup::Send(int dst, uint64_t tag, Message& msg) {
  if (dst < 0 || dst >= size() || dst == rank_) {
    return Status::Internal("collective send to invalid worker " + std::to_string(dst));
  }
  if (msg.header.command() == proto::COMMAND_UNSPECIFIED) {
    msg.header.set_command(proto::COLLECTIVE);
  }
  msg.header.set_sender_role(proto::WORKER);
  msg.header.set_sender_rank(rank_);
  msg.header.set_request_id(tag);
  SPARSEPS_RETURN_IF_ERROR(watches_[static_cast<size_t>(dst)].Check());
  Status s = SendMessage(dealers_[static_cast<size_t>(dst)], msg, nullptr, &bytes_sent_);
  if (!s.ok()) return Status::IoError("sending to " + PeerName(dst) + ": " + s.message());
  return Status::OK();
}

Status PeerGroup::Pump(int64_t timeout_ms) {
  for (auto& w : watches_) SPARSEPS_RETURN_IF_ERROR(w.Check());
  std::vector<zmq::socket_t*> sockets{&router_};
  if (hook_socket_ != nullptr) sockets.push_back(hook_socket_);
  auto ready = PollIn(sockets, timeout_ms);
  if ((hook_socket_ != nullptr && ready[1]) || StopRequested()) {
    if (poll_hook_) SPARSEPS_RETURN_IF_ERROR(poll_hook_());
    if (StopRequested()) return Status::Aborted("stop signal");
  }
  if (!ready[0]) return Status::OK();
  while (true) {
    std::string id;
    auto msg = RecvMessage(router_, true, &id, &bytes_received_);
    if (!msg.ok() && msg.status().code() == StatusCode::kIoError) break;
    auto it = rank_of_id_.find(id);
    if (it == rank_of_id_.end() ||
        (msg.ok() && msg->peer_key != peers_[static_cast<size_t>(it->second)].public_key)) {
      // Not a peer of this group: dropped, so that a stranger cannot end the job.
      ++rejected_;
      ++strangers_;
      stranger_log_.Warn(id,
                         it == rank_of_id_.end() ? "not a peer of this group; dropped"
                                                 : "a peer's routing id with another CURVE key; "
                                                   "dropped",
                         "collective: ");
      continue;
    }
    const std::string from = PeerName(it->second);
    if (!msg.ok()) {
      ++rejected_;
      return Status::ProtocolError("malformed collective message from " + from + ": " +
                                   msg.status().message());
    }
    const auto& h = msg->header;
    if (h.sender_rank() != it->second ||
        (h.command() != proto::COLLECTIVE && h.command() != proto::STORE_SET)) {
      ++rejected_;
      return Status::ProtocolError("unexpected " + CommandName(h.command()) + " (sender rank " +
                                   std::to_string(h.sender_rank()) + ") from " + from);
    }
    if (h.command() == proto::STORE_SET) {
      auto key = msg->FrameAs<uint8_t>(0, proto::U8);
      auto value = msg->FrameAs<uint8_t>(1, proto::U8);
      if (!key.ok() || !value.ok()) {
        ++rejected_;
        return Status::ProtocolError("malformed rendezvous message from " + from);
      }
      store_[std::string(key->begin(), key->end())] =
          std::vector<char>(value->begin(), value->end());
      continue;
    }
    auto& queue = queued_[static_cast<size_t>(it->second)];
    if (queue.count(h.request_id()) != 0 || queue.size() >= kMaxQueuedPerPeer) {
      ++rejected_;
      return Status::ProtocolError(
          from + " sent tag " + std::to_string(h.request_id()) +
          (queue.size() >= kMaxQueuedPerPeer ? " beyond the queue limit" : " twice"));
    }
    queue.emplace(h.request_id(), std::move(*msg));
  }
  return Status::OK();
}

Status PeerGroup::WaitUntil(const std::function<bool()>& done, const std::string& what) {
  const RunTimer waited;  // a stop of this process does not run the deadline out
  while (!done()) {
    const double left = timeout_s_ - waited.Seconds();
    if (left <= 0) {
      return Status::DeadlineExceeded("timed out after " + FormatSeconds(timeout_s_) +
                                      " waiting for " + what);
    }
    SPARSEPS_RETURN_IF_ERROR(Pump(std::min<int64_t>(200, static_cast<int64_t>(left * 1000) + 1)));
  }
  return Status::OK();
}

Result<Message> PeerGroup::Recv(int src, uint64_t tag) {
  if (src < 0 || src >= size() || src == rank_) {
    return Status::Internal("collective receive from invalid worker " + std::to_string(src));
  }
  auto& queue = queued_[static_cast<size_t>(src)];
  // Whatever is ready is taken first without waiting, so early messages never sit unread.
  SPARSEPS_RETURN_IF_ERROR(Pump(0));
  SPARSEPS_RETURN_IF_ERROR(
      WaitUntil([&] { return queue.count(tag) != 0; },
                "collective message " + std::to_string(tag) + " from " + PeerName(src)));
  auto node = queue.extract(tag);
  return std::move(node.mapped());
}

Status PeerGroup::StoreSet(const std::string& key, const std::vector<char>& value) {
  store_[key] = value;
  for (int p = 0; p < size(); ++p) {
    if (p == rank_) continue;
    Message m;
    m.header.set_command(proto::STORE_SET);
    AddFrameCopy(&m, proto::U8, reinterpret_cast<const uint8_t*>(key.data()), key.size());
    AddFrameCopy(&m, proto::U8, reinterpret_cast<const uint8_t*>(value.data()), value.size());
    SPARSEPS_RETURN_IF_ERROR(Send(p, 0, m));
  }
  return Status::OK();
}

Result<std::vector<char>> PeerGroup::StoreGet(const std::string& key) {
  SPARSEPS_RETURN_IF_ERROR(
      WaitUntil([&] { return store_.count(key) != 0; }, "rendezvous key '" + key + "'"));
  return store_[key];
}

}  // namespace sparseps
