// The timeline's recording switch and marks (KerasRingTimelineMark records through them).
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
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

size_t LineCount(const std::string& text) {
  return static_cast<size_t>(std::count(text.begin(), text.end(), '\n'));
}

std::string ReadFile(FILE* f) {
  std::string text;
  rewind(f);
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, n);
  return text;
}

TEST(Timeline_SpillsHeldEventsToItsFileAndKeepsTheRest) {
  Timeline timeline(true);
  FILE* f = tmpfile();
  CHECK(f != nullptr);
  CHECK(timeline.SpillTo(fileno(f), 4) == 0);
  for (int i = 0; i < 10; ++i) timeline.Mark("m" + std::to_string(i));
  CHECK(timeline.SpillTo(-1, 4) == 0);
  fflush(f);
  const std::string spilled = ReadFile(f);
  const std::string held = timeline.Drain();
  CHECK(LineCount(spilled) == 8 && LineCount(held) == 2) << spilled << "|" << held;
  CHECK(Fields(spilled.substr(0, spilled.find('\n')))[1] == "m0") << spilled;
  CHECK(Fields(held.substr(0, held.find('\n')))[1] == "m8") << held;
  fclose(f);
}

TEST(Timeline_AFailedSpillKeepsItsEventsAndSaysWhy) {
  Timeline timeline(true);
  const int read_only = open("/dev/null", O_RDONLY);
  CHECK(read_only >= 0);
  CHECK(timeline.SpillTo(read_only, 2) == 0);
  for (int i = 0; i < 5; ++i) timeline.Mark("m" + std::to_string(i));
  CHECK(timeline.SpillTo(-1, 2) == EBADF);  // the write failed; spilling stopped there
  CHECK(timeline.SpillTo(-1, 2) == 0);      // told once
  const std::string held = timeline.Drain();
  CHECK(LineCount(held) == 5) << held;  // none lost, in order
  CHECK(Fields(held.substr(0, held.find('\n')))[1] == "m0") << held;
  close(read_only);
}

}  // namespace
}  // namespace kr_test
