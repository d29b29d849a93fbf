// Per-collective phase times for KERAS_RING_TIMELINE (a Chrome trace written by Python).
// Times are microseconds of the monotonic clock, which all processes of a host share.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "common.h"

namespace keras_ring {

struct TimelineEvent {
  uint64_t seq = 0;
  std::string label;         // e.g. "allreduce 'grad'"
  uint64_t bytes = 0;        // this rank's payload
  int64_t submitted_us = 0;  // queued by the kernel
  int64_t started_us = 0;    // picked up by the worker: waiting for peers begins
  int64_t exchanged_us = 0;  // every rank's signature arrived: transfer/reduce begins
  int64_t done_us = 0;
  bool ok = true;
  bool inlined = false;  // completed inside the signature exchange
};

class Timeline {
 public:
  static int64_t NowMicros(Clock::time_point t = Clock::now());
  void Record(TimelineEvent event);
  // Returns the recorded events as tab-separated lines and forgets them.
  std::string Drain();

 private:
  std::mutex mu_;
  std::vector<TimelineEvent> events_;
};

}  // namespace keras_ring
