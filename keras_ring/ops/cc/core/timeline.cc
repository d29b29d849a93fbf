#include "timeline.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <iterator>
#include <sstream>

namespace keras_ring {

int64_t Timeline::NowMicros(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
}

namespace {

std::string Lines(const std::vector<TimelineEvent>& events) {
  std::ostringstream out;
  for (const TimelineEvent& e : events) {
    std::string label = e.label;
    for (char& c : label) {
      if (c == '\t' || c == '\n') c = ' ';
    }
    out << e.seq << '\t' << label << '\t' << e.bytes << '\t' << e.submitted_us << '\t'
        << e.started_us << '\t' << e.exchanged_us << '\t' << e.done_us << '\t' << e.ok << '\t'
        << e.inlined << '\n';
  }
  return out.str();
}

// 0, or the errno of the write that failed.
int WriteAll(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return n < 0 ? errno : EIO;
    done += static_cast<size_t>(n);
  }
  return 0;
}

}  // namespace

void Timeline::Record(TimelineEvent event) {
  bool spill = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::move(event));
    spill = spill_fd_ >= 0 && events_.size() >= spill_at_;
  }
  if (spill) Spill();
}

void Timeline::Spill() {
  std::lock_guard<std::mutex> spilling(spill_mu_);
  std::vector<TimelineEvent> events;
  int fd = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (spill_fd_ < 0 || events_.size() < spill_at_) return;  // another caller spilled them
    fd = spill_fd_;
    events.swap(events_);
  }
  // Outside mu_: the collectives keep recording while the lines are written.
  const int error = WriteAll(fd, Lines(events));
  if (error == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  spill_error_ = error;
  spill_fd_ = -1;  // a line may be cut short there: the reader skips it, the events stay here
  events_.insert(events_.begin(), std::make_move_iterator(events.begin()),
                 std::make_move_iterator(events.end()));
}

int Timeline::SpillTo(int fd, size_t max_events) {
  std::lock_guard<std::mutex> spilling(spill_mu_);
  std::lock_guard<std::mutex> lock(mu_);
  spill_fd_ = fd;
  spill_at_ = std::max<size_t>(max_events, 1);
  const int error = spill_error_;
  spill_error_ = 0;
  return error;
}

void Timeline::Mark(const std::string& label) {
  if (!recording()) return;
  TimelineEvent e;
  e.label = label;
  e.submitted_us = e.started_us = e.exchanged_us = e.done_us = NowMicros();
  Record(std::move(e));
}

std::string Timeline::Drain() {
  std::vector<TimelineEvent> events;
  {
    std::lock_guard<std::mutex> lock(mu_);
    events.swap(events_);
  }
  return Lines(events);
}

}  // namespace keras_ring
