#include "test_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <thread>

#include "../core/reduce.h"
#include "../core/routed_transport.h"

namespace kr_test {

using keras_ring::Code;
using keras_ring::DataType;
using keras_ring::Deadline;
using keras_ring::LocalFabric;
using keras_ring::LocalTransport;
using keras_ring::ReduceOp;
using keras_ring::Status;
using keras_ring::Transport;

int ListenOnLoopback(int* port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  CHECK(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  CHECK(listen(fd, 16) == 0);
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *port = ntohs(addr.sin_port);
  return fd;
}

std::vector<std::unique_ptr<Transport>> ConnectHostWorld(const std::vector<int>& hosts,
                                                         uint64_t token) {
  std::vector<std::unique_ptr<Transport>> out;
  const std::vector<Status> status = TryConnectHostWorld(hosts, token, 30, &out);
  for (size_t r = 0; r < status.size(); ++r) CHECK_OK(status[r]) << "rank " << r;
  return out;
}

std::vector<Status> TryConnectHostWorld(const std::vector<int>& hosts, uint64_t token,
                                        double timeout_seconds,
                                        std::vector<std::unique_ptr<Transport>>* out, int moved,
                                        const keras_ring::PeerAddress& moved_to) {
  const int n = static_cast<int>(hosts.size());
  std::vector<int> listen_fds(static_cast<size_t>(n));
  std::vector<keras_ring::PeerAddress> peers(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    int port = 0;
    At(listen_fds, r) = ListenOnLoopback(&port);
    At(peers, r) = r == moved ? moved_to : keras_ring::PeerAddress{"127.0.0.1", port};
  }
  out->clear();
  out->resize(static_cast<size_t>(n));
  std::vector<Status> status(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      keras_ring::HostTransportConfig config;
      config.rank = r;
      config.size = n;
      config.listen_fd = At(listen_fds, r);
      config.peers = peers;
      config.host_index = hosts;
      config.job_token = token;
      config.timeout_seconds = timeout_seconds;
      config.shm.channel_bytes = 4096;  // every large message wraps around many times
      config.shm.spin_iterations = 0;
      At(status, r) = keras_ring::ConnectHostTransport(config, &At(*out, r));
    });
  }
  for (std::thread& t : threads) t.join();
  for (int fd : listen_fds) close(fd);
  return status;
}

void RunAll(std::vector<std::unique_ptr<Transport>>& world,
            const std::function<void(int, Transport&)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < static_cast<int>(world.size()); ++r) {
    threads.emplace_back([&, r] {
      if (At(world, r) != nullptr) fn(r, *At(world, r));
    });
  }
  for (std::thread& t : threads) t.join();
}

LocalWorld::LocalWorld(int n) : fabric_(std::make_shared<LocalFabric>(n)) {
  for (int r = 0; r < n; ++r) transports_.push_back(std::make_unique<LocalTransport>(fabric_, r));
}

void LocalWorld::Run(const std::function<void(int, Transport&)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < size(); ++r) {
    threads.emplace_back([this, r, &fn] { fn(r, transport(r)); });
  }
  for (std::thread& t : threads) t.join();
}

void LocalWorld::CheckDrained(const char* file, int line) {
  for (int to = 0; to < size(); ++to) {
    for (int from = 0; from < size(); ++from) {
      char byte;
      // An expired deadline: returns at once, with the byte if one is queued.
      const Status s = transport(to).Recv(from, &byte, 1, Deadline::After(0));
      if (s.code() != Code::kDeadlineExceeded) {
        RecordFailure(file, line, "stray bytes from rank " + std::to_string(from) +
                                      " to rank " + std::to_string(to) + " (status " +
                                      std::to_string(static_cast<int>(s.code())) + ")");
      }
    }
  }
}

namespace {
template <typename T>
T Load(const void* buf, size_t i) {
  T v;
  std::memcpy(&v, static_cast<const char*>(buf) + i * sizeof(T), sizeof(T));
  return v;
}
template <typename T>
void Store(void* buf, size_t i, T v) {
  std::memcpy(static_cast<char*>(buf) + i * sizeof(T), &v, sizeof(T));
}
}  // namespace

double GetAsDouble(DataType dtype, const void* buf, size_t i) {
  switch (dtype) {
    case DataType::kFloat16: return keras_ring::HalfToFloat(Load<uint16_t>(buf, i));
    case DataType::kBFloat16: return keras_ring::BFloat16ToFloat(Load<uint16_t>(buf, i));
    case DataType::kFloat32: return Load<float>(buf, i);
    case DataType::kFloat64: return Load<double>(buf, i);
    case DataType::kInt8: return Load<int8_t>(buf, i);
    case DataType::kUInt8: return Load<uint8_t>(buf, i);
    case DataType::kInt16: return Load<int16_t>(buf, i);
    case DataType::kUInt16: return Load<uint16_t>(buf, i);
    case DataType::kInt32: return Load<int32_t>(buf, i);
    case DataType::kInt64: return static_cast<double>(Load<int64_t>(buf, i));
    case DataType::kBool: return Load<uint8_t>(buf, i);
  }
  return 0;
}

void SetFromDouble(DataType dtype, void* buf, size_t i, double v) {
  switch (dtype) {
    case DataType::kFloat16:
      Store(buf, i, keras_ring::FloatToHalf(static_cast<float>(v)));
      break;
    case DataType::kBFloat16:
      Store(buf, i, keras_ring::FloatToBFloat16(static_cast<float>(v)));
      break;
    case DataType::kFloat32: Store(buf, i, static_cast<float>(v)); break;
    case DataType::kFloat64: Store(buf, i, v); break;
    case DataType::kInt8: Store(buf, i, static_cast<int8_t>(v)); break;
    case DataType::kUInt8: Store(buf, i, static_cast<uint8_t>(v)); break;
    case DataType::kInt16: Store(buf, i, static_cast<int16_t>(v)); break;
    case DataType::kUInt16: Store(buf, i, static_cast<uint16_t>(v)); break;
    case DataType::kInt32: Store(buf, i, static_cast<int32_t>(v)); break;
    case DataType::kInt64: Store(buf, i, static_cast<int64_t>(v)); break;
    case DataType::kBool: Store(buf, i, static_cast<uint8_t>(v != 0)); break;
  }
}

bool IsFloat(DataType dtype) {
  return dtype == DataType::kFloat16 || dtype == DataType::kBFloat16 ||
         dtype == DataType::kFloat32 || dtype == DataType::kFloat64;
}

const std::vector<DataType>& AllDataTypes() {
  static const std::vector<DataType> all = {
      DataType::kFloat16, DataType::kBFloat16, DataType::kFloat32, DataType::kFloat64,
      DataType::kInt8,    DataType::kUInt8,    DataType::kInt16,   DataType::kUInt16,
      DataType::kInt32,   DataType::kInt64};
  return all;
}

const std::vector<ReduceOp>& AllReduceOps() {
  static const std::vector<ReduceOp> all = {ReduceOp::kSum, ReduceOp::kAverage, ReduceOp::kMin,
                                            ReduceOp::kMax, ReduceOp::kProduct};
  return all;
}

keras_ring::TensorRef Tensor(keras_ring::DataType dtype, std::vector<int64_t> shape,
                             const void* in, void* out) {
  keras_ring::TensorRef t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.input = in;
  t.output = out;
  return t;
}

uint64_t Mix(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  uint64_t h = 0x9e3779b97f4a7c15ull;
  for (uint64_t v : {a, b, c, d}) {
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h ^= h >> 31;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 29;
  }
  return h;
}

}  // namespace kr_test
