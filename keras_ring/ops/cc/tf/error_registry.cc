#include "error_registry.h"

#include <deque>
#include <mutex>

namespace keras_ring_tf {
namespace {

constexpr size_t kRemembered = 64;  // far more than a program sees before it reacts

std::mutex g_mu;
std::deque<::keras_ring::Status> g_errors;

}  // namespace

void RememberError(const ::keras_ring::Status& s) {
  if (s.ok()) return;
  std::lock_guard<std::mutex> lock(g_mu);
  g_errors.push_back(s);
  if (g_errors.size() > kRemembered) g_errors.pop_front();
}

std::string DescribeError(const std::string& message) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (auto it = g_errors.rbegin(); it != g_errors.rend(); ++it) {
    if (it->message() != message) continue;
    return std::to_string(static_cast<int>(it->code())) + "\n" + std::to_string(it->peer()) +
           "\n" + it->collective() + "\n" + it->reason();
  }
  return "";
}

}  // namespace keras_ring_tf
