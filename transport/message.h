// Message framing: a protobuf Header frame plus raw little-endian payload frames.
//
// Sending moves payload buffers into ZeroMQ without copying. Receiving validates the header
// against the frames (count, sizes, element types) before anything looks at a payload; typed
// access to a frame (FrameAs) checks the element type and size again.
//
// Thread-safety: a Message is a value owned by one thread at a time; sockets are not shared.
#pragma once

#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "common/status.h"
#include "proto/messages.pb.h"

namespace sparseps {

// Limits that bound what a hostile peer can make us allocate or parse.
inline constexpr size_t kMaxHeaderBytes = 1 << 20;  // 1 MiB
inline constexpr size_t kMaxPayloadFrames = 16;
// The numbers one member gives a summing barrier (proto::Barrier::values): Worker::AllreduceValues.
inline constexpr size_t kMaxBarrierValues = 4096;

struct Message {
  Message() = default;
  Message(Message&&) noexcept = default;
  Message& operator=(Message&&) noexcept = default;
  Message(const Message&) = delete;
  Message& operator=(const Message&) = delete;

  proto::Header header;
  std::vector<zmq::message_t> frames;  // payload frames, described in order by header.frames()
  // Received with security.curve on: the sender's CURVE public key (Z85) that the ZAP handler
  // authorized (ZeroMQ's User-Id property). Empty otherwise.
  std::string peer_key;

  // Typed read-only view of payload frame i. Errors (ProtocolError) when i is out of range, the
  // declared element type is not `type`, or the size is not a multiple of sizeof(T). A frame whose
  // storage is not aligned for T is copied once into aligned storage owned by this Message.
  template <typename T>
  Result<std::span<const T>> FrameAs(size_t i, proto::ElemType type) const;

  // Total bytes on the wire: header plus payload frames (what byte counters add).
  size_t WireBytes() const;

 private:
  mutable std::deque<std::vector<uint64_t>> aligned_copies_;
};

// Size in bytes of one element of `type`; 0 for ELEM_UNSPECIFIED or unknown values.
size_t ElemSize(proto::ElemType type);

// Appends a payload frame that takes ownership of `data` (no copy) and records its type and size.
template <typename T>
void AddFrame(Message* msg, proto::ElemType type, std::vector<T>&& data) {
  auto* owned = new std::vector<T>(std::move(data));
  const size_t bytes = owned->size() * sizeof(T);
  msg->frames.emplace_back(
      owned->data(), bytes, [](void*, void* hint) { delete static_cast<std::vector<T>*>(hint); },
      owned);
  auto* info = msg->header.add_frames();
  info->set_type(type);
  info->set_bytes(bytes);
}

// Appends a payload frame that takes ownership of data[0, n) (no copy): for a payload written in
// place, without the zeroing that a std::vector of n elements costs first.
template <typename T>
void AddFrame(Message* msg, proto::ElemType type, std::unique_ptr<T[]> data, size_t n) {
  T* owned = data.release();
  const size_t bytes = n * sizeof(T);
  msg->frames.emplace_back(
      owned, bytes, [](void* p, void*) { delete[] static_cast<T*>(p); }, nullptr);
  auto* info = msg->header.add_frames();
  info->set_type(type);
  info->set_bytes(bytes);
}

// Appends a payload frame holding a copy of data[0, n).
template <typename T>
void AddFrameCopy(Message* msg, proto::ElemType type, const T* data, size_t n) {
  msg->frames.emplace_back(data, n * sizeof(T));
  auto* info = msg->header.add_frames();
  info->set_type(type);
  info->set_bytes(n * sizeof(T));
}

// Sends msg on `socket` (header frame first). For a ROUTER socket pass the peer's routing id.
// Payload frames are moved out of msg. On success adds the bytes sent to *bytes (if not null).
// Errors: NotFound when a ROUTER_MANDATORY socket has no connection for the routing id (the peer
// is gone), IoError when the peer's queue is full (a ROUTER never blocks on one peer) or ZeroMQ
// refuses otherwise.
Status SendMessage(zmq::socket_t& socket, Message& msg, const std::string* routing_id = nullptr,
                   uint64_t* bytes = nullptr);

// Receives one multipart message that is ready on `socket` (call after poll said readable; does
// not block otherwise). For a ROUTER socket (`router` true), the first part is the peer's routing
// id, stored in *routing_id. Adds all bytes received to *bytes. Errors: ProtocolError when the
// header does not parse, or the frames do not match the header's count, types or sizes (the
// routing id is still filled so the caller can answer ERROR); IoError when nothing was ready.
Result<Message> RecvMessage(zmq::socket_t& socket, bool router, std::string* routing_id,
                            uint64_t* bytes);

// Checks that msg's payload frames match its header: count, known element types, byte sizes
// equal to the declared ones and multiples of the element size.
Status ValidateFrames(const Message& msg);

// Human-readable name of a command, for logs and errors.
std::string CommandName(proto::Command command);
std::string RoleName(proto::Role role);

// Bytes on one socket (or a client's sockets) by message type, each direction, for the live
// metrics' bytes by type. Add the bytes SendMessage / RecvMessage counted for one message under
// its command; a message that did not parse goes under COMMAND_UNSPECIFIED ("malformed").
// Thread-compatible.
class TrafficByCommand {
 public:
  // One message type's totals: type is the command's name in lower case ("push", "pull_reply").
  struct Row {
    std::string type;
    uint64_t sent = 0;      // bytes
    uint64_t received = 0;  // bytes
  };
  void Sent(proto::Command command, uint64_t bytes) { Add(command).sent += bytes; }
  void Received(proto::Command command, uint64_t bytes) { Add(command).received += bytes; }
  // Every type that had traffic, in the order first seen.
  const std::vector<Row>& rows() const { return rows_; }

 private:
  Row& Add(proto::Command command);
  std::vector<Row> rows_;
  std::vector<proto::Command> commands_;  // rows_[i]'s command
};

template <typename T>
Result<std::span<const T>> Message::FrameAs(size_t i, proto::ElemType type) const {
  if (i >= frames.size() || static_cast<int>(i) >= header.frames_size()) {
    return Status::ProtocolError("payload frame " + std::to_string(i) + " missing (message has " +
                                 std::to_string(frames.size()) + ")");
  }
  if (header.frames(static_cast<int>(i)).type() != type) {
    return Status::ProtocolError("payload frame " + std::to_string(i) + " has element type " +
                                 proto::ElemType_Name(header.frames(static_cast<int>(i)).type()) +
                                 ", expected " + proto::ElemType_Name(type));
  }
  const zmq::message_t& f = frames[i];
  if (f.size() % sizeof(T) != 0) {
    return Status::ProtocolError("payload frame " + std::to_string(i) + " has " +
                                 std::to_string(f.size()) + " bytes, not a multiple of " +
                                 std::to_string(sizeof(T)));
  }
  const size_t n = f.size() / sizeof(T);
  if (n == 0) return std::span<const T>();
  const void* data = f.data();
  if (reinterpret_cast<uintptr_t>(data) % alignof(T) != 0) {
    auto& copy = aligned_copies_.emplace_back((f.size() + 7) / 8);
    std::memcpy(copy.data(), data, f.size());
    data = copy.data();
  }
  return std::span<const T>(static_cast<const T*>(data), n);
}

}  // namespace sparseps
