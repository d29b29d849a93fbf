// Moving bytes that will not be read again soon. A normal store first reads the destination
// line into the cache (read-for-ownership); for outputs far larger than the cache that read
// is wasted and costs as much bandwidth as the write itself.
#pragma once

#include <cstddef>

namespace keras_ring {

// memcpy with non-temporal stores (x86-64; plain memcpy elsewhere). The destination leaves
// the cache: use it only for large outputs. Stores are fenced before returning.
void StreamCopy(void* dst, const void* src, size_t bytes);

// StreamCopy without the fence, for many small pieces in a row; call StreamFence() before
// the data is handed to anyone.
void StreamCopyUnfenced(void* dst, const void* src, size_t bytes);
void StreamFence();

}  // namespace keras_ring
