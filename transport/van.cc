#include "transport/van.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstring>
#include <mutex>
#include <stdexcept>

#include "security/security.h"

namespace sparseps {
namespace {
std::atomic<bool> g_stop{false};
extern "C" void OnStopSignal(int) { g_stop.store(true); }
}  // namespace

std::string Endpoint(const std::string& host, uint32_t port) {
  return "tcp://" + host + ":" + std::to_string(port);
}

Result<BoundRouter> BindRouter(zmq::context_t& context, const std::string& host, uint32_t port,
                               int64_t max_frame_bytes, RoutingIdReuse reuse) {
  BoundRouter out{zmq::socket_t(context, zmq::socket_type::router), 0};
  const std::string ep = port == 0 ? "tcp://" + host + ":*" : Endpoint(host, port);
  try {
    out.socket.set(zmq::sockopt::router_mandatory, 1);
    out.socket.set(zmq::sockopt::router_handover, reuse == RoutingIdReuse::kHandOver ? 1 : 0);
    out.socket.set(zmq::sockopt::sndhwm, kSocketHwm);
    out.socket.set(zmq::sockopt::rcvhwm, kSocketHwm);
    out.socket.set(zmq::sockopt::maxmsgsize, max_frame_bytes);
    out.socket.set(zmq::sockopt::linger, 2000);
    if (const CurveContext* curve = CurveContext::For(context)) curve->MakeServer(out.socket);
    out.socket.bind(ep);
    const std::string bound = out.socket.get(zmq::sockopt::last_endpoint);
    out.port = static_cast<uint32_t>(std::stoul(bound.substr(bound.rfind(':') + 1)));
  } catch (const std::exception& e) {
    return Status::IoError("cannot bind " + ep + ": " + e.what());
  }
  return out;
}

Result<PortReservation> PortReservation::Reserve(const std::string& host, uint32_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  const bool any = host.empty() || host == "*" || host == "0.0.0.0";
  if (any || getaddrinfo(host.c_str(), service.c_str(), &hints, &found) != 0) {
    found = nullptr;  // an interface name, or every address: reserve on all of them
    if (getaddrinfo(nullptr, service.c_str(), &hints, &found) != 0) found = nullptr;
  }
  std::string why = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);  // as ZeroMQ's listener
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) == 0) {
      freeaddrinfo(found);
      const uint16_t p = bound.ss_family == AF_INET6
                             ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                             : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
      return PortReservation(fd, p);
    }
    why = std::strerror(errno);
    ::close(fd);
  }
  if (found != nullptr) freeaddrinfo(found);
  return Status::IoError("cannot reserve port " + service + " on " + host + ": " + why);
}

PortReservation& PortReservation::operator=(PortReservation&& o) noexcept {
  if (this != &o) {
    Release();
    fd_ = o.fd_;
    port_ = o.port_;
    o.fd_ = -1;
  }
  return *this;
}

void PortReservation::Release() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

zmq::socket_t ConnectDealer(zmq::context_t& context, const std::string& host, uint32_t port,
                            const std::string& routing_id, const std::string& server_key,
                            int64_t max_frame_bytes,
                            const std::function<void(zmq::socket_t&)>& before_connect) {
  zmq::socket_t s(context, zmq::socket_type::dealer);
  s.set(zmq::sockopt::routing_id, routing_id);
  s.set(zmq::sockopt::sndhwm, kSocketHwm);
  s.set(zmq::sockopt::rcvhwm, kSocketHwm);
  s.set(zmq::sockopt::maxmsgsize, max_frame_bytes);
  s.set(zmq::sockopt::linger, 2000);
  s.set(zmq::sockopt::sndtimeo, kDealerSendTimeoutMs);
  if (const CurveContext* curve = CurveContext::For(context)) {
    if (server_key.empty()) {
      throw std::invalid_argument("CURVE is on but no server key was given for " +
                                  Endpoint(host, port));
    }
    curve->MakeClient(s, server_key);
  }
  if (before_connect) before_connect(s);
  s.connect(Endpoint(host, port));
  return s;
}

Status CurveKeyRefused(const zmq::context_t& context, const std::string& peer,
                       uint32_t zap_status) {
  const CurveContext* curve = CurveContext::For(context);
  return Status::InvalidArgument(
      peer + " refused this node's CURVE key " +
      (curve != nullptr ? curve->keys().public_key : std::string("?")) + " (ZAP status " +
      std::to_string(zap_status) + "): put " + (curve != nullptr ? curve->key_dir() : "?") +
      "/public.key in security.authorized_keys_dir on that host and on every host of the job (a "
      "daemon reads the directory again when an unknown key knocks), then start this node again");
}

bool SocketMonitor::Attach(zmq::context_t& context, zmq::socket_t& socket) {
  static std::atomic<uint64_t> counter{0};
  const std::string endpoint = "inproc://sparseps-monitor-" + std::to_string(getpid()) + "-" +
                               std::to_string(counter.fetch_add(1));
  if (zmq_socket_monitor(socket.handle(), endpoint.c_str(), events_) != 0) return false;
  pair_ = zmq::socket_t(context, zmq::socket_type::pair);
  pair_.set(zmq::sockopt::linger, 0);
  pair_.connect(endpoint);
  return true;
}

bool SocketMonitor::Next(uint16_t* id, uint32_t* value) {
  if (!active()) return false;
  zmq::message_t event, address;
  // Each event is two frames: the event number and value, then the endpoint.
  if (!pair_.recv(event, zmq::recv_flags::dontwait)) return false;
  if (event.more()) (void)pair_.recv(address, zmq::recv_flags::dontwait);
  *id = 0;
  *value = 0;
  if (event.size() >= sizeof(*id)) std::memcpy(id, event.data(), sizeof(*id));
  if (event.size() >= sizeof(*id) + sizeof(*value)) {
    std::memcpy(value, static_cast<const char*>(event.data()) + sizeof(*id), sizeof(*value));
  }
  return true;
}

void HandshakeWatch::Attach(zmq::context_t& context, zmq::socket_t& socket) {
  context_ = &context;
  // Without CURVE no peer refuses a key; a failed start leaves the sends' timeout to end waits.
  if (CurveContext::For(context) != nullptr) (void)monitor_.Attach(context, socket);
}

Status HandshakeWatch::Check() {
  if (!refused_.ok()) return refused_;
  uint16_t id;
  uint32_t value;
  while (monitor_.Next(&id, &value)) {
    if (id == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) {
      refused_ = CurveKeyRefused(*context_, peer_, value);
      break;
    }
  }
  return refused_;
}

void SetMaxFrameBytes(zmq::socket_t& socket, int64_t max_frame_bytes) {
  socket.set(zmq::sockopt::maxmsgsize, max_frame_bytes);
}

std::vector<bool> PollIn(const std::vector<zmq::socket_t*>& sockets, int64_t timeout_ms) {
  std::vector<zmq::pollitem_t> items;
  items.reserve(sockets.size());
  for (auto* s : sockets) items.push_back({s->handle(), 0, ZMQ_POLLIN, 0});
  std::vector<bool> ready(sockets.size(), false);
  try {
    zmq::poll(items, std::chrono::milliseconds(timeout_ms < 0 ? 0 : timeout_ms));
  } catch (const zmq::error_t& e) {
    if (e.num() == EINTR) return ready;
    throw;
  }
  for (size_t i = 0; i < items.size(); ++i) ready[i] = (items[i].revents & ZMQ_POLLIN) != 0;
  return ready;
}

void InstallStopHandlers() {
  struct sigaction sa {};
  sa.sa_handler = OnStopSignal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

bool StopRequested() { return g_stop.load(); }

namespace {
std::mutex g_interrupt_mu;
int g_interrupt_scopes = 0;             // guarded by g_interrupt_mu
struct sigaction g_saved_interrupt {};  // the host's SIGINT handler while scopes live
}  // namespace

ScopedStopOnInterrupt::ScopedStopOnInterrupt() {
  std::lock_guard<std::mutex> lock(g_interrupt_mu);
  if (g_interrupt_scopes++ > 0) return;
  g_stop.store(false);
  struct sigaction sa {};
  sa.sa_handler = OnStopSignal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, &g_saved_interrupt);
}

ScopedStopOnInterrupt::~ScopedStopOnInterrupt() {
  std::lock_guard<std::mutex> lock(g_interrupt_mu);
  if (--g_interrupt_scopes > 0) return;
  sigaction(SIGINT, &g_saved_interrupt, nullptr);
}

}  // namespace sparseps
