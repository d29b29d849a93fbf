// The structure of recent errors, for Python. TensorFlow hands Python an op's error as a code
// and a message only (status payloads do not survive the trip, eagerly or in graphs), so
// every error the adapter reports is remembered here with its structure, and Python looks it
// up by its message (keras_ring_error_info) to learn the rank at fault, the collective and
// the reason without parsing text.
#pragma once

#include <string>

#include "../core/common.h"

namespace keras_ring_tf {

// Keeps `s` among the recent errors (a few dozen; the oldest are forgotten).
void RememberError(const ::keras_ring::Status& s);

// The remembered error whose message is `message`, encoded "code\nrank\ncollective\nreason"
// (rank -1: none at fault), or empty when none is remembered.
std::string DescribeError(const std::string& message);

}  // namespace keras_ring_tf
