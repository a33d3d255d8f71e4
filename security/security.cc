#include "security/security.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>
#include <zmq_addon.hpp>

namespace sparseps {
namespace {

constexpr size_t kZ85KeyChars = 40;
constexpr const char* kZapEndpoint = "inproc://zeromq.zap.01";

std::mutex g_registry_mu;
std::map<const void*, const CurveContext*> g_registry;  // context handle -> its CurveContext

bool IsZ85Key(const std::string& s) {
  if (s.size() != kZ85KeyChars) return false;
  uint8_t raw[32];
  return zmq_z85_decode(raw, s.c_str()) != nullptr;
}

std::string Trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

Result<std::string> ReadKeyFile(const std::string& file) {
  std::ifstream in(file);
  if (!in) return Status::InvalidArgument("cannot read CURVE key file " + file);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string key = Trim(ss.str());
  if (!IsZ85Key(key)) {
    return Status::InvalidArgument("CURVE key file " + file +
                                   " does not hold one 40-character Z85 key (make keys with "
                                   "sparseps-keygen DIR)");
  }
  return key;
}

}  // namespace

Result<CurveKeypair> GenerateCurveKeypair() {
  if (!zmq_has("curve")) {
    return Status::FailedPrecondition("this libzmq was built without CURVE (libsodium)");
  }
  char pub[kZ85KeyChars + 1];
  char sec[kZ85KeyChars + 1];
  if (zmq_curve_keypair(pub, sec) != 0) {
    return Status::Internal(std::string("zmq_curve_keypair: ") + zmq_strerror(zmq_errno()));
  }
  return CurveKeypair{pub, sec};
}

Status WriteCurveKeypair(const std::string& dir, const CurveKeypair& keys) {
  std::error_code ec;
  if (!std::filesystem::exists(dir)) {
    std::filesystem::create_directories(dir, ec);
    if (ec) return Status::IoError("cannot create " + dir + ": " + ec.message());
    std::filesystem::permissions(dir, std::filesystem::perms::owner_all, ec);
  }
  const std::string secret = dir + "/secret.key";
  const int fd = open(secret.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    if (errno == EEXIST) {
      return Status::FailedPrecondition(secret +
                                        " exists; remove it first to make a new keypair (the old "
                                        "public key then no longer works)");
    }
    return Status::IoError("cannot create " + secret + ": " + std::strerror(errno));
  }
  const std::string text = keys.secret_key + "\n";
  const bool ok = write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  close(fd);
  if (!ok) return Status::IoError("cannot write " + secret);
  const std::string pub = dir + "/public.key";
  std::ofstream out(pub, std::ios::trunc);
  out << keys.public_key << "\n";
  if (!out.flush()) return Status::IoError("cannot write " + pub);
  return Status::OK();
}

Result<std::string> ReadCurvePublicKey(const std::string& file) { return ReadKeyFile(file); }

Result<CurveKeypair> ReadCurveKeypair(const std::string& dir) {
  if (dir.empty()) {
    return Status::InvalidArgument(
        "security.curve is on but security.key_dir is empty: make a keypair with sparseps-keygen "
        "DIR and set security.key_dir=DIR");
  }
  const std::string secret = dir + "/secret.key";
  struct stat st {};
  if (stat(secret.c_str(), &st) != 0) {
    return Status::InvalidArgument("security.key_dir: " + secret +
                                   " is missing (make a keypair with sparseps-keygen " + dir + ")");
  }
  if ((st.st_mode & (S_IRWXG | S_IRWXO)) != 0) {
    return Status::InvalidArgument("security.key_dir: " + secret +
                                   " can be read by group or others; chmod 600 it");
  }
  CurveKeypair keys;
  auto secret_key = ReadKeyFile(secret);
  if (!secret_key.ok()) return secret_key.status();
  auto public_key = ReadKeyFile(dir + "/public.key");
  if (!public_key.ok()) return public_key.status();
  keys.secret_key = *secret_key;
  keys.public_key = *public_key;
  return keys;
}

Result<std::set<std::string>> ReadAuthorizedKeys(const std::string& dir) {
  if (dir.empty()) {
    return Status::InvalidArgument(
        "security.curve is on but security.authorized_keys_dir is empty: put every node's "
        "public.key there (as NAME.key) and set it");
  }
  std::set<std::string> keys;
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec);
  if (ec) {
    return Status::InvalidArgument("security.authorized_keys_dir " + dir +
                                   " cannot be read: " + ec.message());
  }
  for (const auto& entry : it) {
    if (!entry.is_regular_file() || entry.path().extension() != ".key") continue;
    auto key = ReadKeyFile(entry.path().string());
    if (!key.ok()) return key.status();
    keys.insert(std::move(*key));
  }
  return keys;
}

Result<std::unique_ptr<CurveContext>> CurveContext::Start(zmq::context_t& context,
                                                          const proto::SecurityConfig& security) {
  if (!zmq_has("curve")) {
    return Status::FailedPrecondition(
        "security.curve is on but this libzmq was built without CURVE (libsodium)");
  }
  auto keys = ReadCurveKeypair(security.key_dir());
  if (!keys.ok()) return keys.status();
  if (security.scheduler_public_key().empty()) {
    return Status::InvalidArgument(
        "security.curve is on but security.scheduler_public_key is empty: set it to the file "
        "holding the scheduler's public key");
  }
  auto scheduler_key = ReadCurvePublicKey(security.scheduler_public_key());
  if (!scheduler_key.ok()) return scheduler_key.status();
  auto authorized = ReadAuthorizedKeys(security.authorized_keys_dir());
  if (!authorized.ok()) return authorized.status();
  std::unique_ptr<CurveContext> ctx(new CurveContext(
      context, security, std::move(*keys), std::move(*scheduler_key), std::move(*authorized)));
  // libzmq accepts any CURVE client when no ZAP handler is bound (ZMQ_ZAP_ENFORCE_DOMAIN is a
  // draft option Debian's libzmq lacks): the handler is bound here, before any CURVE socket exists,
  // and lives until after the last one closed (the CurveContext outlives the daemon's sockets).
  zmq::socket_t zap(context, zmq::socket_type::rep);
  try {
    zap.set(zmq::sockopt::linger, 0);
    zap.bind(kZapEndpoint);
  } catch (const zmq::error_t& e) {
    return Status::Internal(std::string("cannot bind the ZAP handler: ") + e.what());
  }
  ctx->thread_ =
      std::thread([c = ctx.get(), s = std::move(zap)]() mutable { c->Serve(std::move(s)); });
  {
    std::lock_guard<std::mutex> lock(g_registry_mu);
    g_registry[context.handle()] = ctx.get();
  }
  spdlog::info("CURVE on: public key {}, {} authorized keys in {}", ctx->keys_.public_key,
               ctx->authorized_.size(), security.authorized_keys_dir());
  return ctx;
}

CurveContext::CurveContext(zmq::context_t& context, const proto::SecurityConfig& security,
                           CurveKeypair keys, std::string scheduler_key,
                           std::set<std::string> authorized)
    : context_(context),
      security_(security),
      keys_(std::move(keys)),
      scheduler_key_(std::move(scheduler_key)),
      authorized_(std::move(authorized)),
      last_reload_(std::chrono::steady_clock::now()) {
  // Read after the keys were: a key added since is read at its first knock.
  std::error_code ec;
  dir_mtime_ = std::filesystem::last_write_time(security_.authorized_keys_dir(), ec);
}

CurveContext::~CurveContext() {
  {
    std::lock_guard<std::mutex> lock(g_registry_mu);
    g_registry.erase(context_.handle());
  }
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

const CurveContext* CurveContext::For(const zmq::context_t& context) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  auto it = g_registry.find(const_cast<zmq::context_t&>(context).handle());
  return it == g_registry.end() ? nullptr : it->second;
}

void CurveContext::MakeServer(zmq::socket_t& socket) const {
  socket.set(zmq::sockopt::curve_server, 1);
  socket.set(zmq::sockopt::curve_secretkey, keys_.secret_key);
  socket.set(zmq::sockopt::zap_domain, "sparseps");
}

void CurveContext::MakeClient(zmq::socket_t& socket, const std::string& server_key) const {
  socket.set(zmq::sockopt::curve_serverkey, server_key);
  socket.set(zmq::sockopt::curve_publickey, keys_.public_key);
  socket.set(zmq::sockopt::curve_secretkey, keys_.secret_key);
}

bool CurveContext::Authorized(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  if (authorized_.count(key)) return true;
  const auto now = std::chrono::steady_clock::now();
  // Taken before the read, so that a key added while it reads changes it again.
  std::error_code ec;
  const auto mtime = std::filesystem::last_write_time(security_.authorized_keys_dir(), ec);
  if ((!ec && mtime != dir_mtime_) || now - last_reload_ >= std::chrono::seconds(1)) {
    last_reload_ = now;
    if (!ec) dir_mtime_ = mtime;
    auto reread = ReadAuthorizedKeys(security_.authorized_keys_dir());
    if (reread.ok()) {
      authorized_ = std::move(*reread);
    } else {
      spdlog::warn("re-reading the authorized keys: {}", reread.status().message());
    }
  }
  return authorized_.count(key) > 0;
}

void CurveContext::Serve(zmq::socket_t socket) {
  while (!stop_) {
    zmq::pollitem_t item{socket.handle(), 0, ZMQ_POLLIN, 0};
    try {
      zmq::poll(&item, 1, std::chrono::milliseconds(100));
    } catch (const zmq::error_t& e) {
      if (e.num() == EINTR) continue;
      if (e.num() == ETERM) return;
      throw;
    }
    if ((item.revents & ZMQ_POLLIN) == 0) continue;
    // RFC 27: version, request id, domain, address, identity, mechanism, credentials.
    std::vector<zmq::message_t> req;
    try {
      if (!zmq::recv_multipart(socket, std::back_inserter(req), zmq::recv_flags::dontwait)) {
        continue;
      }
    } catch (const zmq::error_t& e) {
      if (e.num() == ETERM) return;
      continue;
    }
    std::string status = "400";
    std::string text = "malformed ZAP request";
    std::string user;
    std::string address;
    if (req.size() >= 7 && req[0].to_string_view() == "1.0") {
      address = req[3].to_string();
      const std::string mechanism = req[5].to_string();
      if (mechanism == "CURVE" && req[6].size() == 32) {
        char z85[kZ85KeyChars + 1];
        zmq_z85_encode(z85, static_cast<const uint8_t*>(req[6].data()), 32);
        const std::string key(z85);
        if (Authorized(key)) {
          status = "200";
          text = "OK";
          user = key;
          accepted_.fetch_add(1);
        } else {
          text = "public key not authorized";
          uint64_t count;
          {
            std::lock_guard<std::mutex> lock(mu_);
            count = ++refusals_[key];
          }
          if (count == 1) {
            spdlog::warn("refused a CURVE connection from {}: public key {} is not in {}", address,
                         key, security_.authorized_keys_dir());
          }
        }
      } else {
        text = "only CURVE is accepted";
      }
    }
    if (status != "200") refused_.fetch_add(1);
    std::vector<zmq::message_t> reply;
    reply.emplace_back(std::string_view("1.0"));
    reply.emplace_back(req.size() >= 2 ? req[1].to_string() : std::string());
    reply.emplace_back(std::string_view(status));
    reply.emplace_back(std::string_view(text));
    reply.emplace_back(std::string_view(user));
    reply.emplace_back();
    try {
      zmq::send_multipart(socket, reply);
    } catch (const zmq::error_t& e) {
      if (e.num() == ETERM) return;
    }
  }
}

Result<std::unique_ptr<CurveContext>> StartCurveIfOn(zmq::context_t& context,
                                                     const proto::JobConfig& config) {
  if (!config.security().curve()) return std::unique_ptr<CurveContext>();
  return CurveContext::Start(context, config.security());
}

std::string BindHost(const proto::JobConfig& config, const std::string& advertised) {
  return config.node().bind_host().empty() ? advertised : config.node().bind_host();
}

}  // namespace sparseps
