// Per-collective phase times for KERAS_RING_TIMELINE (a Chrome trace written by Python).
// Times are microseconds of the monotonic clock, which all processes of a host share.
#pragma once

#include <atomic>
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

// Besides collectives it records marks: events with seq 0 and all four times equal, points of
// the program (say, a gradient computed: KerasRingTimelineMark) on the collectives' clock.
class Timeline {
 public:
  explicit Timeline(bool recording = false) : recording_(recording) {}
  static int64_t NowMicros(Clock::time_point t = Clock::now());
  // Recording can start and stop while collectives run (keras_ring.timeline.record).
  bool recording() const { return recording_.load(std::memory_order_relaxed); }
  void SetRecording(bool on) { recording_.store(on, std::memory_order_relaxed); }
  void Record(TimelineEvent event);
  void Mark(const std::string& label);  // now, if recording
  // Returns the recorded events as tab-separated lines and forgets them.
  std::string Drain();
  // From `max_events` events held, Record appends them to `fd` as Drain's lines and forgets
  // them, so a run's whole trace (KERAS_RING_TIMELINE) is not held in memory; fd -1 stops
  // that, after a write in progress. Returns the errno of a write that failed since the last
  // call (0 if none): spilling stopped there, and the events stayed held.
  int SpillTo(int fd, size_t max_events);

 private:
  void Spill();

  std::atomic<bool> recording_;
  std::mutex mu_;
  std::vector<TimelineEvent> events_;
  // Held while events are written to spill_fd_ (lock order: spill_mu_, then mu_), so the
  // lines of two writers never interleave; Record's caller waits only when it spills itself.
  std::mutex spill_mu_;
  int spill_fd_ = -1;        // guarded by mu_ (read) and spill_mu_ + mu_ (written)
  size_t spill_at_ = 0;      // events held that start a spill (mu_)
  int spill_error_ = 0;      // errno of a failed write (spill_mu_)
};

}  // namespace keras_ring
