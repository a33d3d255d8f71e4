#include "transport/message.h"

#include <cctype>
#include <iterator>

namespace sparseps {

size_t ElemSize(proto::ElemType type) {
  switch (type) {
    case proto::U8:
      return 1;
    case proto::F16:
      return 2;
    case proto::U32:
    case proto::F32:
      return 4;
    default:
      return 0;
  }
}

size_t Message::WireBytes() const {
  size_t total = header.ByteSizeLong();
  for (const auto& f : frames) total += f.size();
  return total;
}

std::string CommandName(proto::Command command) {
  const std::string& name = proto::Command_Name(command);
  return name.empty() ? "command#" + std::to_string(static_cast<int>(command)) : name;
}

TrafficByCommand::Row& TrafficByCommand::Add(proto::Command command) {
  // A handful of types per socket: a linear search beats a map.
  for (size_t i = 0; i < commands_.size(); ++i) {
    if (commands_[i] == command) return rows_[i];
  }
  std::string type = command == proto::COMMAND_UNSPECIFIED ? "malformed" : CommandName(command);
  for (char& c : type) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  commands_.push_back(command);
  rows_.push_back({std::move(type), 0, 0});
  return rows_.back();
}

std::string RoleName(proto::Role role) {
  switch (role) {
    case proto::SCHEDULER:
      return "scheduler";
    case proto::SERVER:
      return "server";
    case proto::WORKER:
      return "worker";
    default:
      return "node";
  }
}

Status ValidateFrames(const Message& msg) {
  const auto& h = msg.header;
  if (static_cast<size_t>(h.frames_size()) != msg.frames.size()) {
    return Status::ProtocolError("header declares " + std::to_string(h.frames_size()) +
                                 " payload frames, message has " +
                                 std::to_string(msg.frames.size()));
  }
  for (int i = 0; i < h.frames_size(); ++i) {
    const size_t elem = ElemSize(h.frames(i).type());
    if (elem == 0) {
      return Status::ProtocolError("payload frame " + std::to_string(i) +
                                   " has an unknown element type " +
                                   std::to_string(static_cast<int>(h.frames(i).type())));
    }
    const size_t actual = msg.frames[static_cast<size_t>(i)].size();
    if (h.frames(i).bytes() != actual) {
      return Status::ProtocolError("payload frame " + std::to_string(i) + " declares " +
                                   std::to_string(h.frames(i).bytes()) + " bytes, carries " +
                                   std::to_string(actual));
    }
    if (actual % elem != 0) {
      return Status::ProtocolError("payload frame " + std::to_string(i) + " has " +
                                   std::to_string(actual) + " bytes, not a multiple of " +
                                   std::to_string(elem));
    }
  }
  return Status::OK();
}

Status SendMessage(zmq::socket_t& socket, Message& msg, const std::string* routing_id,
                   uint64_t* bytes) {
  std::string header = msg.header.SerializeAsString();
  uint64_t total = header.size();
  try {
    if (routing_id != nullptr) {
      // A ROUTER with ROUTER_MANDATORY would block on a peer with kSocketHwm messages queued (one
      // that does not read its replies): the reply is refused instead, so that no peer can stall
      // a daemon. The check is made at the first frame; the rest of the message then goes through.
      if (!socket.send(zmq::buffer(*routing_id),
                       zmq::send_flags::sndmore | zmq::send_flags::dontwait)) {
        return Status::IoError("the peer's queue is full (it does not read what it is sent)");
      }
    }
    const bool more = !msg.frames.empty();
    if (!socket.send(zmq::buffer(header),
                     more ? zmq::send_flags::sndmore : zmq::send_flags::none)) {
      // A socket with a send timeout (ZMQ_SNDTIMEO) that ran out: no connection took it.
      return Status::IoError(
          "send " + CommandName(msg.header.command()) +
          " found no connection to the peer that takes it (with security.curve: did the peer "
          "refuse this node's key? its log names each refused key; or the peer reads nothing)");
    }
    for (size_t i = 0; i < msg.frames.size(); ++i) {
      total += msg.frames[i].size();
      const bool last = i + 1 == msg.frames.size();
      if (!socket.send(msg.frames[i], last ? zmq::send_flags::none : zmq::send_flags::sndmore)) {
        return Status::IoError("send would block (payload)");
      }
    }
  } catch (const zmq::error_t& e) {
    if (e.num() == EHOSTUNREACH) {
      // A ROUTER (mandatory routing) with no connection for that routing id: the peer is gone.
      return Status::NotFound(std::string("send ") + CommandName(msg.header.command()) +
                              " failed: the peer's connection is gone (" + e.what() + ")");
    }
    return Status::IoError(std::string("send ") + CommandName(msg.header.command()) +
                           " failed: " + e.what());
  }
  msg.frames.clear();
  if (bytes != nullptr) *bytes += total;
  return Status::OK();
}

Result<Message> RecvMessage(zmq::socket_t& socket, bool router, std::string* routing_id,
                            uint64_t* bytes) {
  // Parts are received one at a time so that a message with more parts than any legitimate one is
  // drained without keeping the surplus (each part is bounded by the socket's ZMQ_MAXMSGSIZE).
  const size_t max_parts = kMaxPayloadFrames + 2;  // routing id, header, payload frames
  std::vector<zmq::message_t> parts;
  size_t received = 0;
  try {
    for (;;) {
      zmq::message_t part;
      if (!socket.recv(part, received == 0 ? zmq::recv_flags::dontwait : zmq::recv_flags::none)) {
        return Status::IoError("no message ready");
      }
      ++received;
      if (bytes != nullptr && (!router || received > 1)) *bytes += part.size();
      const bool more = part.more();
      if (parts.size() < max_parts) parts.push_back(std::move(part));
      if (!more) break;
    }
  } catch (const zmq::error_t& e) {
    return Status::IoError(std::string("receive failed: ") + e.what());
  }
  size_t first = 0;
  if (router) {
    if (parts.empty()) return Status::ProtocolError("empty message");
    if (routing_id != nullptr) *routing_id = parts[0].to_string();
    first = 1;
  }
  if (received <= first) return Status::ProtocolError("message has no header frame");
  if (received - first - 1 > kMaxPayloadFrames) {
    return Status::ProtocolError("message has " + std::to_string(received - first - 1) +
                                 " payload frames; at most " + std::to_string(kMaxPayloadFrames) +
                                 " are allowed");
  }
  const zmq::message_t& head = parts[first];
  if (head.size() > kMaxHeaderBytes) {
    return Status::ProtocolError("header frame of " + std::to_string(head.size()) +
                                 " bytes exceeds the limit of " + std::to_string(kMaxHeaderBytes));
  }
  Message msg;
  if (!msg.header.ParseFromArray(head.data(), static_cast<int>(head.size()))) {
    return Status::ProtocolError("header frame (" + std::to_string(head.size()) +
                                 " bytes) is not a valid Header");
  }
  // With CURVE the ZAP handler's User-Id is the sender's public key (security/security.h).
  if (const char* user = zmq_msg_gets(parts[first].handle(), "User-Id"); user != nullptr) {
    msg.peer_key = user;
  }
  for (size_t i = first + 1; i < parts.size(); ++i) msg.frames.push_back(std::move(parts[i]));
  SPARSEPS_RETURN_IF_ERROR(ValidateFrames(msg));
  return msg;
}

}  // namespace sparseps
