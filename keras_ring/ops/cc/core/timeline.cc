#include "timeline.h"

#include <sstream>

namespace keras_ring {

int64_t Timeline::NowMicros(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
}

void Timeline::Record(TimelineEvent event) {
  std::lock_guard<std::mutex> lock(mu_);
  events_.push_back(std::move(event));
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

}  // namespace keras_ring
