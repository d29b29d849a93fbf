// The timeline's recording switch and marks (KerasRingTimelineMark records through them).
#include <algorithm>
#include <string>
#include <vector>

#include "../core/timeline.h"
#include "test_harness.h"

namespace kr_test {
namespace {

using keras_ring::Timeline;

std::vector<std::string> Fields(const std::string& line) {
  std::vector<std::string> out(1);
  for (char c : line) {
    if (c == '\t') {
      out.emplace_back();
    } else if (c != '\n') {
      out.back() += c;
    }
  }
  return out;
}

TEST(Timeline_MarksOnlyWhileRecording) {
  Timeline timeline;  // off, as without KERAS_RING_TIMELINE
  timeline.Mark("before");
  CHECK(timeline.Drain().empty());
  timeline.SetRecording(true);
  timeline.Mark("grad\tof layer 1");
  timeline.SetRecording(false);
  timeline.Mark("after");
  const std::string text = timeline.Drain();
  CHECK(std::count(text.begin(), text.end(), '\n') == 1) << text;
  // seq 0 (a mark), the label with its tab replaced, 0 bytes, four equal times, ok, not inlined.
  const std::vector<std::string> f = Fields(text);
  CHECK(f.size() == 9) << text;
  CHECK(f[0] == "0" && f[1] == "grad of layer 1" && f[2] == "0") << text;
  CHECK(f[3] == f[4] && f[4] == f[5] && f[5] == f[6] && std::stoll(f[3]) > 0) << text;
  CHECK(f[7] == "1" && f[8] == "0") << text;
  CHECK(timeline.Drain().empty());  // read once
}

}  // namespace
}  // namespace kr_test
