#include "scheduler/outbox.h"

#include <utility>

#include "transport/message.h"

namespace sparseps {

Outbox::Outbox(std::function<bool(const std::string&)> holds, double hold_s)
    : holds_(std::move(holds)), hold_s_(hold_s) {}

void Outbox::Send(zmq::socket_t& socket, std::vector<Outgoing>* out, Clock::time_point now,
                  std::vector<Event>* events) {
  for (auto& o : *out) {
    const proto::Command command = o.msg.header.command();
    auto queue = held_.find(o.to);
    if (queue != held_.end()) {
      if (command != proto::HEARTBEAT) queue->second.push_back({std::move(o), now});
      continue;
    }
    Status s = SendMessage(socket, o.msg, &o.to);
    if (s.ok()) continue;
    if (s.code() != StatusCode::kNotFound) {
      events->push_back({Event::kDropped, o.to, s.message()});
    } else if (command == proto::HEARTBEAT || !holds_(o.to)) {
      events->push_back({Event::kGone, o.to, s.message()});
    } else {
      events->push_back({Event::kHeld, o.to, CommandName(command)});
      held_[o.to].push_back({std::move(o), now});  // the key is copied before o moves
    }
  }
  out->clear();
}

bool Outbox::Drain(zmq::socket_t& socket, std::deque<Held>& queue, std::vector<Event>* events) {
  while (!queue.empty()) {
    Outgoing& o = queue.front().o;
    Status s = SendMessage(socket, o.msg, &o.to);
    if (s.code() == StatusCode::kNotFound) return false;
    if (!s.ok()) events->push_back({Event::kDropped, o.to, s.message()});
    queue.pop_front();
  }
  return true;
}

void Outbox::Retry(zmq::socket_t& socket, Clock::time_point now, std::vector<Event>* events) {
  for (auto it = held_.begin(); it != held_.end();) {
    auto& queue = it->second;
    const bool keep = holds_(it->first);
    size_t expired = 0;
    std::string first;
    while (!queue.empty() && (!keep || SecondsBetween(queue.front().since, now) >= hold_s_)) {
      if (expired++ == 0) first = CommandName(queue.front().o.msg.header.command());
      queue.pop_front();
    }
    if (expired > 0) {
      events->push_back(
          {Event::kExpired, it->first,
           expired == 1 ? first : std::to_string(expired) + " messages from " + first + " on"});
    }
    if (queue.empty() || Drain(socket, queue, events)) {
      it = held_.erase(it);
    } else {
      ++it;
    }
  }
}

size_t Outbox::held() const {
  size_t n = 0;
  for (const auto& [to, queue] : held_) n += queue.size();
  return n;
}

}  // namespace sparseps
