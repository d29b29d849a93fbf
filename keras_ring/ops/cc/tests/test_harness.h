// A tiny self-contained test harness: a registry of test functions and CHECK macros that
// record failures (file:line and a message) without stopping the test. Checks may be made
// from any thread; tests run one at a time, in registration order within a file.
#pragma once

#include <sstream>
#include <string>
#include <type_traits>

namespace kr_test {

using TestFn = void (*)();

struct Registrar {
  Registrar(const char* name, TestFn fn);
};

// Records one failed check of the test now running and prints it on one line.
void RecordFailure(const char* file, int line, const std::string& message);

// Failed checks recorded so far in the test now running.
int CurrentFailures();

// Formats any streamable value for failure messages (chars and bytes print as numbers).
template <typename T>
std::string Show(const T& v) {
  std::ostringstream out;
  if constexpr (sizeof(T) == 1 && std::is_integral_v<T>) {
    out << static_cast<int>(v);
  } else {
    out << v;
  }
  return out.str();
}

// Empty if a == b, else the failure message showing both values.
template <typename A, typename B>
std::string EqMessage(const A& a, const B& b, const char* expr) {
  if (a == b) return std::string();
  return std::string(expr) + " failed: " + Show(a) + " vs " + Show(b);
}

}  // namespace kr_test

#define KR_TEST_CONCAT2(a, b) a##b
#define KR_TEST_CONCAT(a, b) KR_TEST_CONCAT2(a, b)

// TEST(Name) { ...body... }
#define TEST(name)                                                            \
  static void KR_TEST_CONCAT(Test_, name)();                                  \
  static ::kr_test::Registrar KR_TEST_CONCAT(registrar_, name)(               \
      #name, &KR_TEST_CONCAT(Test_, name));                                   \
  static void KR_TEST_CONCAT(Test_, name)()

// CHECK(cond) << "extra context";  (the stream is only evaluated on failure)
#define CHECK(cond)                                                        \
  if (cond) {                                                              \
  } else                                                                   \
    ::kr_test::FailureStream(__FILE__, __LINE__, "CHECK(" #cond ") failed")

#define CHECK_EQ(a, b)                                                                 \
  if (std::string kr_m_ = ::kr_test::EqMessage((a), (b), "CHECK_EQ(" #a ", " #b ")");  \
      kr_m_.empty()) {                                                                 \
  } else                                                                               \
    ::kr_test::FailureStream(__FILE__, __LINE__, kr_m_)

// Checks a keras_ring::Status is OK, printing its code and message otherwise.
#define CHECK_OK(expr)                                                                   \
  if (const ::keras_ring::Status& kr_s_ = (expr); kr_s_.ok()) {                          \
  } else                                                                                 \
    ::kr_test::FailureStream(__FILE__, __LINE__,                                         \
                             "CHECK_OK(" #expr ") failed: code " +                       \
                                 std::to_string(static_cast<int>(kr_s_.code())) + ": " + \
                                 kr_s_.message())

// Checks that `text` (a std::string) contains `part`.
#define CHECK_CONTAINS(text, part)                                                        \
  if (const std::string& kr_t_ = (text); kr_t_.find(part) != std::string::npos) {         \
  } else                                                                                  \
    ::kr_test::FailureStream(__FILE__, __LINE__,                                          \
                             std::string("CHECK_CONTAINS failed: '") + kr_t_ +            \
                                 "' does not contain '" + (part) + "'")

namespace kr_test {

// Collects `<< context` after a failed check and records the failure when destroyed.
class FailureStream {
 public:
  FailureStream(const char* file, int line, std::string what)
      : file_(file), line_(line), what_(std::move(what)) {}
  ~FailureStream() {
    const std::string extra = extra_.str();
    RecordFailure(file_, line_, extra.empty() ? what_ : what_ + " [" + extra + "]");
  }
  FailureStream(const FailureStream&) = delete;
  FailureStream& operator=(const FailureStream&) = delete;
  template <typename T>
  FailureStream& operator<<(const T& v) {
    extra_ << Show(v);
    return *this;
  }

 private:
  const char* file_;
  int line_;
  std::string what_;
  std::ostringstream extra_;
};

}  // namespace kr_test
