// Authentication and encryption of every ZeroMQ connection: ZeroMQ's CURVE mechanism (RFC 26,
// CurveZMQ) with a ZAP handler (RFC 27) that accepts only authorized public keys.
//
// One CurveContext per zmq::context_t (a daemon has one): it owns the node's keypair, the
// authorized keys and the ZAP handler thread, and registers itself so that BindRouter and
// ConnectDealer (transport/van.h) make CURVE servers and clients on that context. Without one the
// sockets use ZeroMQ's NULL mechanism, as before.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <zmq.hpp>

#include "common/status.h"
#include "proto/config.pb.h"

namespace sparseps {

// A CURVE keypair in Z85 text (40 characters each).
struct CurveKeypair {
  std::string public_key;
  std::string secret_key;
};

// A fresh keypair (zmq_curve_keypair). Errors: Unimplemented when libzmq was built without CURVE.
Result<CurveKeypair> GenerateCurveKeypair();

// Writes DIR/public.key (mode 0644) and DIR/secret.key (mode 0600, created so; never readable by
// others in between), creating DIR (0700) when missing. Refuses (AlreadyExists) to overwrite an
// existing secret.key. Errors: IoError naming the path.
Status WriteCurveKeypair(const std::string& dir, const CurveKeypair& keys);

// Reads DIR/public.key and DIR/secret.key. Errors: InvalidArgument naming the file when one is
// missing, is not a 40-character Z85 key, or secret.key can be read by group or others.
Result<CurveKeypair> ReadCurveKeypair(const std::string& dir);

// Reads one Z85 public key from `file` (surrounding whitespace ignored).
Result<std::string> ReadCurvePublicKey(const std::string& file);

// Every *.key file in `dir` that holds one Z85 public key. Errors: InvalidArgument naming the
// directory when it cannot be read, or a file that is not a key.
Result<std::set<std::string>> ReadAuthorizedKeys(const std::string& dir);

// The node's CURVE identity on one ZeroMQ context, and that context's ZAP handler: a thread with
// a REP socket on inproc://zeromq.zap.01 that answers each CURVE handshake: 200 with the client's
// Z85 key as the User-Id (RecvMessage puts it in Message::peer_key) when the key is authorized,
// 400 otherwise. An unknown key makes it read authorized_keys_dir again when the directory changed
// since it was read (a key file added) or a second after the last read (a file edited in place),
// so that a key added for a replacement node counts at its first knock, without a restart, while a
// stranger knocking over and over costs a stat; a refused key is logged once (its first refusal)
// and counted.
//
// Thread-safety: the accessors are safe from any thread. Destroy before the context (the handler's
// socket belongs to it).
class CurveContext {
 public:
  // Reads the keys named by `security` (curve must be on) and starts the ZAP handler on `context`.
  // Errors: InvalidArgument naming the missing or bad file; Unimplemented without CURVE support.
  static Result<std::unique_ptr<CurveContext>> Start(zmq::context_t& context,
                                                     const proto::SecurityConfig& security);
  ~CurveContext();
  CurveContext(const CurveContext&) = delete;
  CurveContext& operator=(const CurveContext&) = delete;

  const CurveKeypair& keys() const { return keys_; }
  const std::string& scheduler_public_key() const { return scheduler_key_; }
  // The folder of this node's keypair (security.key_dir).
  const std::string& key_dir() const { return security_.key_dir(); }
  // Handshakes refused so far (unknown keys and malformed ZAP requests).
  uint64_t refused() const { return refused_.load(); }
  uint64_t accepted() const { return accepted_.load(); }

  // Makes `socket` a CURVE server with this node's secret key (before bind).
  void MakeServer(zmq::socket_t& socket) const;
  // Makes `socket` a CURVE client of the server whose public key is `server_key` (before connect).
  void MakeClient(zmq::socket_t& socket, const std::string& server_key) const;

  // The CurveContext registered for `context`, or null (no CURVE on it).
  static const CurveContext* For(const zmq::context_t& context);

 private:
  CurveContext(zmq::context_t& context, const proto::SecurityConfig& security, CurveKeypair keys,
               std::string scheduler_key, std::set<std::string> authorized);
  void Serve(zmq::socket_t socket);
  bool Authorized(const std::string& key);

  zmq::context_t& context_;
  const proto::SecurityConfig security_;
  const CurveKeypair keys_;
  const std::string scheduler_key_;
  std::mutex mu_;
  std::set<std::string> authorized_;                   // guarded by mu_
  std::map<std::string, uint64_t> refusals_;           // key -> count, guarded by mu_
  std::chrono::steady_clock::time_point last_reload_;  // guarded by mu_
  std::filesystem::file_time_type dir_mtime_;  // authorized_keys_dir's at the last read; mu_
  std::atomic<uint64_t> refused_{0};
  std::atomic<uint64_t> accepted_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// A daemon's CurveContext on `context` when config.security.curve is on; null when it is off.
// Errors: CurveContext::Start's.
Result<std::unique_ptr<CurveContext>> StartCurveIfOn(zmq::context_t& context,
                                                     const proto::JobConfig& config);

// The host to bind on: node.bind_host when set, else `advertised`.
std::string BindHost(const proto::JobConfig& config, const std::string& advertised);

}  // namespace sparseps
