// Basic vocabulary of the collective runtime: status, data types, reduce ops, deadlines.
// Nothing here knows about TensorFlow or MPI.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace keras_ring {

// Codes share their numbering with TensorFlow's / absl's canonical codes so the adapter
// can map them one to one.
enum class Code : int {
  kOk = 0,
  kCancelled = 1,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kInternal = 13,
  kUnavailable = 14,
};

// An error as it travels from the core to Python: a code, the rank at fault, the collective
// it happened in and why, besides the full human-readable message. Nothing downstream needs
// to parse the message to learn these.
class Status {
 public:
  Status() = default;
  Status(Code code, std::string message, int peer = -1)
      : code_(code), message_(std::move(message)), peer_(peer) {}
  static Status OK() { return Status(); }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  // The rank this error is about (the one waited for, dead, or diverging), or -1.
  int peer() const { return peer_; }
  // The collective it happened in ("allreduce 'grad'"), or empty.
  const std::string& collective() const { return collective_; }
  // Why, without the collective's prefix: the message where no collective was set.
  const std::string& reason() const { return collective_.empty() ? message_ : reason_; }
  // The rank that reported this error when it came from a peer that gave up (its abort
  // notice), or -1 when this rank saw it itself (e.g. its own wait timed out).
  int reporter() const { return reporter_; }
  Status ReportedBy(int rank) const {
    Status s = *this;
    s.reporter_ = rank;
    return s;
  }
  // This error as `collective`'s failure: the message says so in front of the reason.
  Status InCollective(const std::string& collective, const std::string& message) const {
    Status s(code_, message, peer_);
    s.collective_ = collective;
    s.reason_ = reason();
    s.reporter_ = reporter_;
    return s;
  }
  // True for errors after which the data plane can no longer be trusted.
  bool fatal() const {
    return code_ == Code::kDeadlineExceeded || code_ == Code::kUnavailable ||
           code_ == Code::kAborted || code_ == Code::kInternal;
  }

 private:
  Code code_ = Code::kOk;
  std::string message_;
  int peer_ = -1;
  std::string collective_;
  std::string reason_;
  int reporter_ = -1;
};

#define KR_RETURN_IF_ERROR(expr)        \
  do {                                  \
    ::keras_ring::Status _s = (expr);   \
    if (!_s.ok()) return _s;            \
  } while (0)

// Values are part of the C API and of the signature exchanged between ranks.
enum class DataType : int32_t {
  kFloat16 = 0,
  kBFloat16 = 1,
  kFloat32 = 2,
  kFloat64 = 3,
  kInt8 = 4,
  kUInt8 = 5,
  kInt32 = 6,
  kInt64 = 7,
  kBool = 8,
  kInt16 = 9,
  kUInt16 = 10,
};
constexpr int kNumDataTypes = 11;

size_t DataTypeSize(DataType t);
const char* DataTypeName(DataType t);
bool IsValidDataType(int32_t t);

enum class ReduceOp : int32_t {
  kSum = 0,
  kAverage = 1,
  kMin = 2,
  kMax = 3,
  kProduct = 4,
};
const char* ReduceOpName(ReduceOp op);
bool IsValidReduceOp(int32_t op);

using Clock = std::chrono::steady_clock;

// An absolute point in time after which a wait gives up, and how to wait until then. Every
// blocking call takes one.
class Deadline {
 public:
  static Deadline After(double seconds) {
    return Deadline(Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(seconds)));
  }
  explicit Deadline(Clock::time_point t) : t_(t) {}
  bool expired() const { return Clock::now() >= t_; }
  // Milliseconds left, clamped to [0, cap_ms]; for poll()-style APIs.
  int remaining_ms(int cap_ms = 1 << 30) const;
  Clock::time_point time() const { return t_; }

  // Whether a wait may yield the core to other runnable threads for a moment before it
  // sleeps. Right for an eager call, whose waiting thread is the user's own: yielding hands
  // the core to the peers it waits for. Collectives in graphs run on TensorFlow's pool
  // threads; the shared-memory transport lets them yield only where the host's ranks do not
  // outnumber its cores (ShmOptions::yield_in_graphs).
  bool may_yield() const { return may_yield_; }
  Deadline Yielding(bool yes) const {
    Deadline d = *this;
    d.may_yield_ = yes;
    return d;
  }

 private:
  Clock::time_point t_;
  bool may_yield_ = false;
};

// Room for the reason a rank that gives up leaves its peers (a notice, a shared region):
// enough for a connection error that lists the addresses tried, relayed with its reporter.
constexpr size_t kCauseMessageBytes = 1024;

// The error a rank reports when peer `reporter` gave up because of `cause` (its code and
// peer, i.e. the rank to blame, are kept; kCancelled means `reporter` shut down cleanly).
Status PeerGaveUp(int reporter, Code cause_code, int culprit, const std::string& cause_message);

// Set from a signal handler (SIGINT/SIGTERM) so blocked waits end promptly; transports
// check it in every wait slice. Async-signal-safe: a lock-free atomic store.
void RequestInterrupt(int signal_number);

// Forgets an interrupt: a new runtime starts uninterrupted (the program went on after it).
void ClearInterrupt();

// The signal that interrupted the process, or 0.
int InterruptSignal();
// A kAborted status describing the interrupt, or OK when there was none.
Status InterruptStatus();

}  // namespace keras_ring
