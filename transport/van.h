// The ZeroMQ transport ("van"): socket construction, polling with deadlines, and the shutdown
// flag that signals set. The key-value layer (server/, worker/) only sees Messages and sockets
// made here, so another transport could replace this file without touching it.
//
// Thread-safety: ZeroMQ sockets belong to one thread; the context is thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>
#include <zmq.hpp>

#include "common/clock.h"
#include "common/status.h"
#include "proto/config.pb.h"
#include "transport/message.h"

namespace sparseps {

// A message to send on a ROUTER socket: the peer's routing id and the message.
struct Outgoing {
  std::string to;
  Message msg;
};

// "tcp://host:port".
std::string Endpoint(const std::string& host, uint32_t port);

// Messages queued per peer and direction before ZeroMQ pushes back (ZMQ_SNDHWM / ZMQ_RCVHWM; a
// ROUTER's are per peer). BSP keeps a few messages per peer in flight, so this bounds what a
// flooding peer can queue in our memory to kSocketHwm times the largest frame.
inline constexpr int kSocketHwm = 1024;
// The largest frame any socket accepts before the job's sizes are known (ZMQ_MAXMSGSIZE): a peer
// declaring a bigger frame is disconnected by libzmq before anything is allocated. Control
// messages (header frames) are at most kMaxHeaderBytes.
inline constexpr int64_t kControlMaxFrameBytes = int64_t{2} << 20;

// What a ROUTER socket does with a connection whose routing id it still has a connection for.
enum class RoutingIdReuse {
  // The new connection takes the routing id over (ROUTER_HANDOVER): a peer whose TCP connection
  // broke is heard again at once, also before this side found the old connection gone. For
  // sockets whose peers' routing ids cannot be guessed (MakeRoutingId's random nonce).
  kHandOver,
  // The new connection is ignored (libzmq's default): for routing ids a stranger could guess (the
  // collectives' "w<rank>" in tests), which must not take a peer's place. libzmq neither routes
  // to the ignored connection nor hears from it, also once the old one is gone.
  kIgnore,
};

// A ROUTER socket bound to tcp://host:port (host "0.0.0.0" binds every interface); port 0 binds a
// free port. The socket refuses to send to unknown peers (ROUTER_MANDATORY) instead of dropping
// silently; a send to a peer with kSocketHwm messages queued fails (IoError in SendMessage). Frames
// over max_frame_bytes disconnect the peer. `reuse` says what becomes of a connection with a
// routing id the socket still has a connection for. With a CurveContext on `context`
// (security/security.h) the socket is a CURVE server. Errors: IoError naming the endpoint.
struct BoundRouter {
  zmq::socket_t socket;
  uint32_t port = 0;
};
Result<BoundRouter> BindRouter(zmq::context_t& context, const std::string& host, uint32_t port,
                               int64_t max_frame_bytes = kControlMaxFrameBytes,
                               RoutingIdReuse reuse = RoutingIdReuse::kHandOver);

// A TCP port held for a listener bound later (a server registers its data port before it knows
// the job's largest frame, which its socket needs at bind time): a socket bound to host:port
// (port 0: a free one) that does not listen, so no other process can take the port, and a peer
// connecting early is refused and retries (ZeroMQ reconnects) instead of landing on a listener
// about to close. Release() frees it right before the real bind. A host that is no address (a
// ZeroMQ interface name) reserves on every address. Errors: IoError naming host and port.
// Thread-safety: one thread.
class PortReservation {
 public:
  static Result<PortReservation> Reserve(const std::string& host, uint32_t port);
  PortReservation(PortReservation&& o) noexcept : fd_(o.fd_), port_(o.port_) { o.fd_ = -1; }
  PortReservation& operator=(PortReservation&& o) noexcept;
  PortReservation(const PortReservation&) = delete;
  PortReservation& operator=(const PortReservation&) = delete;
  ~PortReservation() { Release(); }

  uint32_t port() const { return port_; }
  void Release();

 private:
  PortReservation(int fd, uint32_t port) : fd_(fd), port_(port) {}
  int fd_ = -1;
  uint32_t port_ = 0;
};

// How long a send on a DEALER from ConnectDealer may wait for a connection that takes it
// (ZMQ_SNDTIMEO) before it fails: ZeroMQ drops a connection whose handshake the peer refused (a
// CURVE key it does not authorize) and never makes it again, and a send would wait for it forever.
// A connection that works takes a message at once unless kSocketHwm wait for a peer that reads
// none.
inline constexpr int kDealerSendTimeoutMs = 30000;

// A DEALER socket connected to tcp://host:port with the given routing id (unique per process);
// a send fails after kDealerSendTimeoutMs without a connection that takes it. With a CurveContext
// on `context` it is a CURVE client of the server whose public key is `server_key` (Z85;
// std::invalid_argument when empty then: the caller's bug). `before_connect` (when given) is
// called with the socket just before it connects: to attach a SocketMonitor that misses nothing.
zmq::socket_t ConnectDealer(zmq::context_t& context, const std::string& host, uint32_t port,
                            const std::string& routing_id, const std::string& server_key = "",
                            int64_t max_frame_bytes = kControlMaxFrameBytes,
                            const std::function<void(zmq::socket_t&)>& before_connect = {});

// The error for a peer (e.g. "server 0 at tcp://h:p") that refused this node's CURVE key with
// ZAP status `zap_status`: InvalidArgument (a configuration error) naming the key and the file to
// authorize.
Status CurveKeyRefused(const zmq::context_t& context, const std::string& peer, uint32_t zap_status);

// A socket's monitor (zmq_socket_monitor) for the events `events` (ZMQ_EVENT_* bits), read
// without blocking. A socket has one monitor (closing the socket stops it). Thread-safety: the
// socket's thread only.
class SocketMonitor {
 public:
  SocketMonitor() = default;  // inert: Next is always false
  explicit SocketMonitor(int events) : events_(events) {}
  // Starts monitoring `socket`; before it connects, no event is missed. False, staying inert,
  // when ZeroMQ cannot start the monitor (zmq_errno says why).
  bool Attach(zmq::context_t& context, zmq::socket_t& socket);
  bool active() const { return pair_.handle() != nullptr; }
  // The next event: its number (ZMQ_EVENT_*) and value. False, without blocking, when none is
  // queued.
  bool Next(uint16_t* id, uint32_t* value);

 private:
  int events_ = 0;
  zmq::socket_t pair_;
};

// Tells at once that the peer of a client socket refused this node's CURVE key: ZeroMQ drops such
// a connection and never makes it again, so every later send on the socket would only wait for
// one (kDealerSendTimeoutMs) and every reply wait for its deadline. Monitors the socket's
// ZMQ_EVENT_HANDSHAKE_FAILED_AUTH (a socket has one monitor: not for one monitored otherwise).
// Inert without a CurveContext on the context. Thread-safety: the socket's thread only.
class HandshakeWatch {
 public:
  HandshakeWatch() = default;  // inert
  // `peer` names the other end in the error.
  explicit HandshakeWatch(std::string peer) : peer_(std::move(peer)) {}
  // Starts watching `socket` (before it connects: ConnectDealer's `before_connect`).
  void Attach(zmq::context_t& context, zmq::socket_t& socket);
  // CurveKeyRefused's error once the peer refused this node's key; OK before. Never blocks.
  Status Check();

 private:
  const zmq::context_t* context_ = nullptr;
  SocketMonitor monitor_{ZMQ_EVENT_HANDSHAKE_FAILED_AUTH};
  std::string peer_;
  Status refused_;
};

// Raises or lowers the largest frame `socket` accepts from connections made from now on.
void SetMaxFrameBytes(zmq::socket_t& socket, int64_t max_frame_bytes);

// Polls `sockets` for input for at most timeout_ms. Returns a readable flag per socket. A signal
// interrupting the poll returns all false (callers then check StopRequested()).
std::vector<bool> PollIn(const std::vector<zmq::socket_t*>& sockets, int64_t timeout_ms);

// Installs SIGINT/SIGTERM handlers that set the stop flag (once per process).
void InstallStopHandlers();
// True once SIGINT or SIGTERM arrived; every daemon loop checks it and ends with Aborted.
bool StopRequested();

// For a blocking call made from a host program that handles SIGINT itself (the Python module):
// while one of these lives, SIGINT sets the stop flag (cleared when the first one starts), so
// Ctrl-C ends the call's waits at once (Aborted) instead of at their deadline; the program's own
// handler is back when the last one ends. interrupted() tells whether SIGINT came meanwhile.
// Thread-safety: any number at once, from any threads.
class ScopedStopOnInterrupt {
 public:
  ScopedStopOnInterrupt();
  ~ScopedStopOnInterrupt();
  ScopedStopOnInterrupt(const ScopedStopOnInterrupt&) = delete;
  ScopedStopOnInterrupt& operator=(const ScopedStopOnInterrupt&) = delete;
  bool interrupted() const { return StopRequested(); }
};

}  // namespace sparseps
