#include "common.h"

#include <atomic>
#include <csignal>
#include <string>

namespace keras_ring {

size_t DataTypeSize(DataType t) {
  switch (t) {
    case DataType::kFloat16:
    case DataType::kBFloat16:
    case DataType::kInt16:
    case DataType::kUInt16:
      return 2;
    case DataType::kFloat32:
    case DataType::kInt32:
      return 4;
    case DataType::kFloat64:
    case DataType::kInt64:
      return 8;
    case DataType::kInt8:
    case DataType::kUInt8:
    case DataType::kBool:
      return 1;
  }
  return 0;
}

const char* DataTypeName(DataType t) {
  switch (t) {
    case DataType::kFloat16: return "float16";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kFloat32: return "float32";
    case DataType::kFloat64: return "float64";
    case DataType::kInt8: return "int8";
    case DataType::kUInt8: return "uint8";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
    case DataType::kBool: return "bool";
    case DataType::kInt16: return "int16";
    case DataType::kUInt16: return "uint16";
  }
  return "unknown";
}

bool IsValidDataType(int32_t t) { return t >= 0 && t < kNumDataTypes; }

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "Sum";
    case ReduceOp::kAverage: return "Average";
    case ReduceOp::kMin: return "Min";
    case ReduceOp::kMax: return "Max";
    case ReduceOp::kProduct: return "Product";
  }
  return "unknown";
}

bool IsValidReduceOp(int32_t op) { return op >= 0 && op <= 4; }

int Deadline::remaining_ms(int cap_ms) const {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(t_ - Clock::now()).count();
  if (left <= 0) return 0;
  return left > cap_ms ? cap_ms : static_cast<int>(left);
}

Status PeerGaveUp(int reporter, Code cause_code, int culprit, const std::string& cause_message) {
  if (cause_code == Code::kCancelled) {
    // The notice says how far the peer got ("rank 1 shut down after 40 collectives, the
    // last ..."): beside this rank's own collective, that shows where the two parted.
    // A plain array, not a static std::string: a runtime thread may still get here while
    // the exiting process runs its static destructors.
    static constexpr char kShutDown[] = " shut down ";
    const size_t at = cause_message.find(kShutDown);
    const std::string how_far =
        at == std::string::npos ? ""
                                : " (" + cause_message.substr(at + sizeof kShutDown - 1) + ")";
    return Status(Code::kUnavailable,
                  "rank " + std::to_string(reporter) + " has shut down" + how_far +
                      " while this rank still needs it: the ranks ran different numbers of "
                      "collectives: uneven data shards, or a rank that stopped early (on a "
                      "decision of its own, or by sys.exit; see 'When ranks run different "
                      "collectives' in keras_ring's README)",
                  reporter)
        .ReportedBy(reporter);
  }
  // Keep the original reason; drop what an earlier relay appended.
  std::string reason = cause_message.substr(0, cause_message.find(" (reported by rank"));
  return Status(cause_code,
                reason + " (reported by rank " + std::to_string(reporter) + ", which gave up)",
                culprit >= 0 ? culprit : reporter)
      .ReportedBy(reporter);
}

namespace {
std::atomic<int> g_interrupt_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "used from a signal handler");
}  // namespace

void RequestInterrupt(int signal_number) { g_interrupt_signal.store(signal_number); }

void ClearInterrupt() { g_interrupt_signal.store(0); }

int InterruptSignal() { return g_interrupt_signal.load(); }

Status InterruptStatus() {
  const int sig = InterruptSignal();
  if (sig == 0) return Status::OK();
  const char* name = sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "a signal";
  return Status(Code::kAborted, std::string("interrupted by ") + name);
}

}  // namespace keras_ring
