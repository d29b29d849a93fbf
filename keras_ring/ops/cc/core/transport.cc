#include "transport.h"

namespace keras_ring {

Status Transport::SendRecvReduce(int to, const void* send_data, size_t send_bytes, int from,
                                 void* dst, const void* local, size_t recv_bytes,
                                 size_t /*element_bytes*/, const ReduceFn& reduce,
                                 Deadline deadline) {
  if (scratch_.size() < recv_bytes) scratch_.resize(recv_bytes);
  KR_RETURN_IF_ERROR(
      SendRecv(to, send_data, send_bytes, from, scratch_.data(), recv_bytes, deadline));
  if (recv_bytes > 0) reduce(dst, local, scratch_.data(), recv_bytes);
  return Status::OK();
}

}  // namespace keras_ring
