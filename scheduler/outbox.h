// The scheduler's sends to its nodes, held while a node's connection is gone for a moment.
//
// Thread-safety: used by the one thread that runs the scheduler daemon.
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "common/clock.h"
#include "common/status.h"
#include "transport/van.h"

namespace sparseps {

// Sends the scheduler's messages on its ROUTER socket (ROUTER_MANDATORY). A send to a node of the
// job whose connection is gone (NotFound: its TCP connection broke and its ZeroMQ is making it
// again, or its process died) is not dropped: the message is held, with every later one to that
// node behind it, and sent again in order at each Retry until it goes through, the node leaves
// the job or the message waited hold_s. So a BARRIER_RELEASE, a MEMBERSHIP or the SHUTDOWN sent
// while a node's connection was made again still reaches it. HEARTBEATs are not held (the next
// one follows within a heartbeat interval), nor messages to peers that are not nodes of the job.
class Outbox {
 public:
  // What became of a message that did not go through at once.
  struct Event {
    enum Kind {
      kHeld,     // the first message held for `to`: its connection was found gone
      kGone,     // not sent, `to`'s connection is gone: a HEARTBEAT, or `to` is not held
      kDropped,  // not sent: another error (the peer's queue is full)
      kExpired,  // held hold_s, or `to` is no longer held: not sent (one event for a node's all)
    } kind;
    std::string to;
    std::string what;  // the command (kHeld; kExpired: "N messages from <command> on") or the error
  };

  // `holds(to)`: whether messages to routing id `to` are held (a node of the job). hold_s:
  // seconds a message is held at most.
  Outbox(std::function<bool(const std::string&)> holds, double hold_s);

  // Sends each message of *out in order (and clears *out); one to a node with messages held goes
  // behind them. Appends to *events what did not go through.
  void Send(zmq::socket_t& socket, std::vector<Outgoing>* out, Clock::time_point now,
            std::vector<Event>* events);
  // Sends the held messages again, each node's in order up to its first that fails still; drops
  // those held hold_s or longer and those of nodes `holds` no longer holds (kExpired).
  void Retry(zmq::socket_t& socket, Clock::time_point now, std::vector<Event>* events);

  // Messages held now, over all nodes.
  size_t held() const;

 private:
  struct Held {
    Outgoing o;
    Clock::time_point since;
  };
  // Sends the front of `queue` while it goes through; false when one failed with NotFound.
  bool Drain(zmq::socket_t& socket, std::deque<Held>& queue, std::vector<Event>* events);

  std::function<bool(const std::string&)> holds_;
  double hold_s_;
  std::map<std::string, std::deque<Held>> held_;  // by routing id; no empty queues
};

}  // namespace sparseps
