// The worker's key-value client of the parameter servers (ps-lite's KVWorker, BSP flavour).
//
// One DEALER socket per server. Every wait has a deadline (cluster.request_timeout_s) and an
// error names the server; a FATAL from the scheduler ends any wait at once. Every request carries
// an id that its reply echoes; one without a reply after cluster.retry_interval_s (a message lost
// with a broken connection) is sent again with the same id, as is one a server refused as not yet
// ready (ERROR with retryable), until the deadline. The servers answer repeats as the first
// (server/shard_server.h); a reply to a request answered already is dropped and counted. A server
// answers the repeat of a pull it holds with what the pull waits for (ERROR with held: "the push
// of iteration 3 from worker 1"), which the deadline's error then names.
//
// The core is ps-lite's: Push and Pull send one range's request and return a ticket, Wait(tickets)
// receives until those requests are answered (pulls applied). Every other call (PushPull, its two
// halves, range by range, the sketch's two rounds, the initial and final pulls) is a composition
// of these.
//
// Thread-safety: used by one thread.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <span>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "common/key_range.h"
#include "common/status.h"
#include "transport/control_client.h"
#include "transport/message.h"
#include "transport/van.h"

namespace sparseps {

// How a PsClient waits and sends, derived from the job config in one place (PsClientOptionsFor).
struct PsClientOptions {
  // Seconds a wait for a server's reply may take before it fails naming the server
  // (cluster.request_timeout_s).
  double request_timeout_s = 60.0;
  // The pulls of an iteration leave only once every server acknowledged this worker's push (the
  // servers add a push at its pull: server/shard_server.h); otherwise push and pull leave
  // together. cluster.on_worker_failure: continue sets it.
  bool commit_after_ack = false;
  // Seconds before a request without a reply is sent again (cluster.retry_interval_s; 0: never).
  double retry_interval_s = 0.0;
  // At most this many pushes unacknowledged at once (cluster.push_window; 0: all at once):
  // PushPull and SketchTwoRounds' exact values send the rest in key order as acks come.
  size_t push_window = 0;
};

// The options of config.cluster.
PsClientOptions PsClientOptionsFor(const proto::JobConfig& config);

class PsClient {
 public:
  // Connects to every server in the membership. `control` is polled during waits.
  PsClient(zmq::context_t& context, const proto::Membership& membership, int worker_rank,
           ControlClient* control, const PsClientOptions& options);

  // The key ranges, sorted (one per server).
  const std::vector<KeyRange>& ranges() const { return ranges_; }

  // A request in flight: its id, which its reply echoes.
  using Ticket = uint64_t;

  // Sends range r's push (one Message as a Compressor makes it; command and iteration set here,
  // and the checkpoint request of RequestCheckpoint) and returns its ticket; the PUSH_ACK is
  // taken by a later Wait. Errors: Unavailable once the job paused (nothing sent), IoError.
  Result<Ticket> Push(size_t r, int64_t iteration, Message& push);
  // Sends range r's PULL of `iteration` (the server answers once it applied the iteration) and
  // returns its ticket; a Wait applies the reply into its params. Errors as Push's.
  Result<Ticket> Pull(size_t r, int64_t iteration);
  // Receives until every one of `tickets` is answered, applying pull replies into params (any
  // other reply that comes meanwhile is taken too). Errors as PushPull's; the deadline names the
  // first server a ticket waits for.
  Status Wait(std::span<const Ticket> tickets, int64_t iteration, float* params);

  // Sends the initial parameters (num_params floats) to their servers and waits for the acks.
  // Done by one worker (rank 0) before the others pull.
  Status Init(const float* params);

  // Pulls every range densely once the servers are initialised (version 0) into params.
  Status PullInitial(float* params) { return PullDense(0, params); }

  // Pulls every range densely at version `version` (once the servers applied that many
  // iterations) into params: a replacement worker's start (--rejoin).
  Status PullDense(int64_t version, float* params);

  // train.consistency ssp / async: pulls every range once every worker has pushed `iteration`
  // (this worker's last pushed iteration), i.e. with no staleness: the end of training.
  // Errors as PushPull's.
  Status PullBarrier(int64_t iteration, float* params);

  // Pushes pushes[r] (one Message per range, as a Compressor makes them) for `iteration`, then
  // pulls the result of that iteration into params: the changed entries, or the dense range.
  // Errors: ProtocolError when a server rejects a push or replies wrongly (the server's reason
  // included), DeadlineExceeded naming the server, Aborted on FATAL, Unavailable once an epoch
  // newer than the client's paused the job for a lost server or rolled it back (every wait ends
  // then, and nothing more is sent: the job rolls back).
  Status PushPull(int64_t iteration, std::vector<Message>& pushes, float* params);

  // PushPull in two halves (train.overlap: delay): StartPushPull sends the pushes of `iteration`
  // and its pulls (with commit_after_ack, once every push is acknowledged) and returns; AwaitPull
  // then waits for the replies and applies them into params. In between, the replies wait in the
  // sockets and params is free for the model to read (ZeroMQ's I/O thread receives them
  // meanwhile). A reply that comes while StartPushPull waits for acks (push_window) is applied at
  // once. Errors as PushPull's; after one, the iteration is void.
  Status StartPushPull(int64_t iteration, std::vector<Message>& pushes, float* params);
  Status AwaitPull(int64_t iteration, float* params);

  // PushPull range by range (train.overlap: backward), for pushes made while the gradient is
  // still computed: BeginPushes, then PushRange once for every range r (in any order; the pull of
  // r leaves with it unless commit_after_ack), then FinishPushes, which waits for every ack and
  // reply and applies the pulls into params. Errors as PushPull's; after one, the iteration is
  // void (start again with BeginPushes only after the job rolled back).
  void BeginPushes();
  Status PushRange(int64_t iteration, size_t r, Message& push);
  Status FinishPushes(int64_t iteration, float* params);

  // Between PushRange calls: takes the acks and replies that have come, without waiting, and
  // applies the pulls among them into params (a range's reply comes once every worker pushed it,
  // BSP, so early ranges are applied while later ones are still computed). Errors as
  // FinishPushes's (a server's rejection, a malformed reply).
  Status Drain(float* params);

  // When range r's last PUSH_ACK and PULL_REPLY came (the pull reply once applied), for the
  // per-step trace (metrics.trace_steps).
  Clock::time_point acked_at(size_t r) const { return peers_[r].acked_at; }
  Clock::time_point replied_at(size_t r) const { return peers_[r].replied_at; }

  // Called for every pull reply with the range's first key and the keys (relative to it) whose
  // value changes: the reply's keys when sparse, the keys whose value differs when dense; before
  // the new values are written, so the old ones can still be read. delta[j] = new - old value at
  // keys[j] for a sparse reply (the updates applied since the version this worker held); empty
  // for a dense one. The sketch compressor resets its residual there (Compressor::OnChanged).
  using ChangedCallback = std::function<void(uint64_t key_begin, std::span<const uint32_t> keys,
                                             std::span<const float> delta)>;
  void set_changed_callback(ChangedCallback cb) { on_changed_ = std::move(cb); }

  // The sketch encoding's second round (compression.sketch.second_round) for `iteration`: pushes
  // the sketches (one per range), asks every server for its candidate keys, lets `exact` fill the
  // phase-1 push of range r with the worker's exact values at those keys, pushes them and pulls.
  // await = false (train.overlap: delay): returns once the pulls are sent, as StartPushPull; then
  // AwaitPull.
  using ExactPush =
      std::function<Status(size_t range, std::span<const uint32_t> candidates, Message* push)>;
  Status SketchTwoRounds(int64_t iteration, std::vector<Message>& sketches, const ExactPush& exact,
                         float* params, bool await = true);

  // Asks (worker 0, checkpoint.every_s) for a checkpoint after the next iteration pushed: its
  // pushes carry the request, and the servers answer every worker's pull of that iteration with
  // it.
  void RequestCheckpoint() { request_checkpoint_ = true; }
  // True when a pull reply of the last PushPull / SketchTwoRounds said that a checkpoint is taken
  // after that iteration.
  bool checkpoint_after_last() const { return checkpoint_after_last_; }

  // Requests sent again (no reply within retry_interval_s, or refused as not ready), and replies
  // dropped because their request was answered already.
  uint64_t resent_requests() const { return resent_; }
  uint64_t duplicate_replies() const { return duplicate_replies_; }

  uint64_t bytes_sent() const { return bytes_sent_; }
  uint64_t bytes_received() const { return bytes_received_; }
  // The same bytes by message type (push, pull, pull_reply, ...).
  const TrafficByCommand& traffic() const { return traffic_; }
  // The last PushPull / SketchTwoRounds, in seconds: push, from sending the pushes to the last
  // server's PUSH_ACK; pull, from sending the pulls to the last server's PULL_REPLY applied
  // (which includes waiting for the slowest worker's push: BSP).
  double last_push_s() const { return last_push_s_; }
  double last_pull_s() const { return last_pull_s_; }
  // Parameter version (applied iterations) held for range r.
  int64_t version(size_t r) const { return peers_[r].version; }

 private:
  // A request waiting for its reply; its frames share their buffers with what was sent, for a
  // resend.
  struct Pending {
    proto::Command expected;  // the reply's command
    Message request;
    Clock::time_point resend_at;
    std::string held_for;  // what the server said the request waits for (ERROR with held)
    // A pull with no reason heard near its deadline (no repeat went before it: retry_interval_s 0,
    // or not below request_timeout_s) goes again once, so that a server holding it says what for
    // (held_for) before the deadline's error names it.
    bool asked = false;
  };
  struct Peer {
    KeyRange range;
    int server_rank = 0;
    std::string name;  // "server 1 at tcp://host:port"
    zmq::socket_t socket;
    HandshakeWatch watch;  // with CURVE: tells at once that the server refused this worker's key
    int64_t version = -1;
    std::deque<Pending> pending;             // requests still to be answered, in the order sent
    std::vector<uint32_t> candidates;        // the last CANDIDATES reply (relative keys)
    Clock::time_point acked_at, replied_at;  // the last PUSH_ACK, PULL_REPLY
  };

  // Unavailable (naming the lost server and `iteration`) once an epoch newer than the one this
  // client was made for paused or rolled back the job (ControlClient::CheckPausedSince).
  Status CheckPaused(int64_t iteration) const;
  // Sends `msg` (role, rank, epoch and a new request id set here) and waits for `expected` from
  // the peer in the next AwaitAll; *ticket (when given) is the request id. Unavailable, sending
  // nothing, once the job paused.
  Status Send(Peer& peer, Message& msg, proto::Command expected, Ticket* ticket = nullptr);
  // Sends p.request again (a copy sharing its frames).
  Status Resend(Peer& peer, Pending& p);
  Message Request(const Peer& peer, proto::Command command, int64_t iteration);
  Status AwaitAll(int64_t iteration, float* params);
  // Receives until at most `at_most` of this worker's pushes are unacknowledged (push_window_),
  // with AwaitAll's deadline, retries and errors.
  Status AwaitPushAcks(int64_t iteration, float* params, size_t at_most);
  // Receives until done() holds; the deadline names the first peer that `waits` says waits.
  Status AwaitUntil(int64_t iteration, float* params, const std::function<bool()>& done,
                    const std::function<bool(const Pending&)>& waits);
  // Pushes pushes[r] to range r and sends the pulls of the iteration: once every push is
  // acknowledged (commit_after_ack), or right behind the pushes. AwaitPull waits for the replies.
  Status PushThenPull(int64_t iteration, std::vector<Message>& pushes, float* params);
  // FinishPushes's first half: with commit_after_ack, waits for every ack and sends the pulls.
  Status CommitPushes(int64_t iteration, float* params);
  Status ApplyPullReply(Peer& peer, const Message& msg, float* params);
  // Takes every message waiting on peer's socket (without blocking): acks, replies (the pulls
  // applied into params), candidates; errors for a rejection or a malformed or unexpected reply.
  Status ReceiveFrom(Peer& peer, float* params);

  ChangedCallback on_changed_;
  std::vector<uint32_t> changed_;  // a dense reply's changed keys, for on_changed_
  std::vector<float> delta_;       // a sparse reply's new - old values, for on_changed_
  ControlClient* control_;
  // The membership epoch this client acts on (its servers' endpoints): a pause or rollback after
  // it ends every wait.
  const uint64_t epoch_;
  const int worker_rank_;
  const double request_timeout_s_;
  const bool commit_after_ack_;
  const double retry_interval_s_;
  const size_t push_window_;
  uint64_t resent_ = 0;
  uint64_t duplicate_replies_ = 0;
  std::vector<KeyRange> ranges_;
  std::vector<Peer> peers_;
  uint64_t next_request_id_ = 1;
  bool request_checkpoint_ = false;
  bool checkpoint_after_last_ = false;
  uint64_t bytes_sent_ = 0;
  uint64_t bytes_received_ = 0;
  TrafficByCommand traffic_;
  // When the last PUSH_ACK and PULL_REPLY came (AwaitAll), for last_push_s / last_pull_s, and
  // when the pushes began (BeginPushes).
  Clock::time_point push_acked_, pull_replied_, pushed_, pulled_;
  double last_push_s_ = 0.0, last_pull_s_ = 0.0;
};

}  // namespace sparseps
