// The workers' peer-to-peer transport for allreduce mode: every worker binds one ROUTER socket and
// connects one DEALER to each peer's ROUTER, so any worker can send to any other. Messages are
// the project's framed Messages (command COLLECTIVE) tagged with a 64-bit tag; a receive names its
// source and tag, and messages that arrive early (a faster peer already in the next round) wait in
// a per-source queue until asked for.
//
// Every wait has a deadline that names the missing peer; a FATAL from the scheduler (through the
// poll hook) ends a wait at once. A message from a peer that is not in the group (an unknown
// routing id or, with CURVE, another key than the peer's) is dropped and counted, so a stranger
// cannot end the job. Malformed messages from a peer of the group (bad frames, a sender rank that
// does not match its socket, a duplicate tag) are rejected, counted and reported as ProtocolError
// naming the peer; they never crash the worker.
//
// Thread-safety: used by one thread.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "common/log_limit.h"
#include "common/status.h"
#include "transport/message.h"
#include "transport/van.h"

namespace sparseps {

class PeerGroup {
 public:
  // Binds the ROUTER on host:port (0: a free port); frames over max_frame_bytes disconnect their
  // peer. Errors: IoError naming the endpoint.
  static Result<std::unique_ptr<PeerGroup>> Bind(zmq::context_t& context, const std::string& host,
                                                 uint32_t port, double timeout_s,
                                                 int64_t max_frame_bytes = kControlMaxFrameBytes);

  // The bound data port (what the worker registers with the scheduler).
  uint32_t port() const { return port_; }

  struct PeerAddress {
    std::string host;
    uint32_t port = 0;
    std::string public_key;  // CURVE (Z85); empty without CURVE
    // The routing id of the peer's connections to the others: the worker's data_routing_id from
    // the membership (random, MakeRoutingId). Empty: "w<rank>".
    std::string routing_id;
  };
  // Connects to every peer; peers[i] is worker i's address, `rank` is this worker's index in it.
  // When every peer has a routing_id, a connection with a peer's routing id takes the old one
  // over (RoutingIdReuse::kHandOver: a peer whose connection broke is heard again at once);
  // with the guessable "w<rank>" a duplicate is ignored. REQUIRES: 0 <= rank < peers.size().
  void Connect(int rank, const std::vector<PeerAddress>& peers);

  // Called about every 200 ms during waits, and at once when `socket` (if not null) is readable;
  // a non-OK status ends the wait with it. The worker passes its control client here.
  void SetPollHook(std::function<Status()> hook, zmq::socket_t* socket) {
    poll_hook_ = std::move(hook);
    hook_socket_ = socket;
  }

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(peers_.size()); }
  double timeout_s() const { return timeout_s_; }

  // Sends msg (payload frames moved out) to worker `dst` with `tag`; command, sender and tag are
  // set here. Does not block: ZeroMQ queues the message. REQUIRES: dst != rank().
  Status Send(int dst, uint64_t tag, Message& msg);

  // Waits for the message with `tag` from worker `src`. Errors: DeadlineExceeded after timeout_s
  // naming the worker and tag, ProtocolError for a malformed message from it, Aborted from the
  // poll hook.
  Result<Message> Recv(int src, uint64_t tag);

  // Gloo rendezvous store over the same sockets: Set sends (key, value) to every peer and keeps
  // it locally; Get waits until the key is known. Errors as for Recv.
  Status StoreSet(const std::string& key, const std::vector<char>& value);
  Result<std::vector<char>> StoreGet(const std::string& key);

  // "worker 3 at 10.77.0.5:41234".
  std::string PeerName(int rank) const;

  uint64_t bytes_sent() const { return bytes_sent_; }
  uint64_t bytes_received() const { return bytes_received_; }
  // Messages rejected as malformed since the start.
  uint64_t rejected() const { return rejected_; }
  // Messages dropped because their sender is not in the group (included in rejected()).
  uint64_t strangers() const { return strangers_; }

 private:
  PeerGroup(zmq::context_t& context, zmq::socket_t router, uint32_t port, double timeout_s,
            int64_t max_frame_bytes)
      : context_(context),
        router_(std::move(router)),
        port_(port),
        timeout_s_(timeout_s),
        max_frame_bytes_(max_frame_bytes) {}

  // Receives whatever is ready (waiting at most timeout_ms) into the queues. Errors:
  // ProtocolError for a malformed message, or the poll hook's status.
  Status Pump(int64_t timeout_ms);
  Status WaitUntil(const std::function<bool()>& done, const std::string& what);

  zmq::context_t& context_;
  zmq::socket_t router_;
  uint32_t port_;
  double timeout_s_;
  int64_t max_frame_bytes_;
  int rank_ = 0;
  std::vector<PeerAddress> peers_;
  std::vector<zmq::socket_t> dealers_;   // dealers_[i] connects to peer i (none for our rank)
  std::vector<HandshakeWatch> watches_;  // watches_[i]: peer i refused this worker's CURVE key
  std::map<std::string, int> rank_of_id_;
  std::vector<std::map<uint64_t, Message>> queued_;  // per source, by tag
  std::map<std::string, std::vector<char>> store_;
  std::function<Status()> poll_hook_;
  zmq::socket_t* hook_socket_ = nullptr;
  uint64_t bytes_sent_ = 0;
  uint64_t bytes_received_ = 0;
  uint64_t rejected_ = 0;
  uint64_t strangers_ = 0;
  RateLimitedLog stranger_log_{10.0};
};

}  // namespace sparseps
