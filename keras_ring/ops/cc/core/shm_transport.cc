#include "shm_transport.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <new>

#include "algorithms.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KR_CPU_RELAX() _mm_pause()
#else
#define KR_CPU_RELAX() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace keras_ring {
namespace {

constexpr uint64_t kSegmentMagic = 0x6b72696e6773686dull;  // "kringshm"
constexpr size_t kAlign = 64;                              // messages start on a cache line
constexpr int kSleepSliceMs = 10;                          // liveness checks while asleep
const char kNamePrefix[] = "keras_ring.";

struct alignas(64) Counter {
  std::atomic<uint64_t> value{0};
};

// A byte ring from one sender to the segment's owner.
struct Channel {
  Counter written;   // advanced by the sender
  Counter consumed;  // advanced by the owner
};

uint64_t AlignUp(uint64_t v) { return (v + kAlign - 1) & ~(kAlign - 1); }

long Futex(std::atomic<uint32_t>* addr, int op, uint32_t val, const timespec* ts) {
  // Not FUTEX_PRIVATE: the word lives in memory shared between processes.
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, ts, nullptr, 0);
}

std::string SegmentName(uint64_t token, int rank, int pid) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "/%s%016llx.%d.%d", kNamePrefix,
                static_cast<unsigned long long>(token), rank, pid);
  return buf;
}

bool PeerSocketClosed(int fd) {
  if (fd < 0) return false;
  pollfd p{fd, POLLIN | POLLRDHUP, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLHUP | POLLERR | POLLRDHUP)) return true;
  char c;
  return recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

// What every rank reports in the setup rounds.
struct SetupReport {
  int32_t pid;
  int32_t ok;
  char error[120];
};

}  // namespace

struct ShmTransport::Segment {
  uint64_t magic;
  int32_t rank;
  int32_t size;
  uint64_t channel_bytes;
  uint64_t header_bytes;
  alignas(64) std::atomic<uint32_t> aborted;
  alignas(64) std::atomic<uint32_t> doorbell;  // bumped by anyone who made progress for us
  alignas(64) std::atomic<uint32_t> sleepers;  // >0 while the owner sleeps on the doorbell

  Channel* channel(int sender) {
    return reinterpret_cast<Channel*>(reinterpret_cast<char*>(this) + sizeof(Segment)) + sender;
  }
  char* data(int sender) {
    return reinterpret_cast<char*>(this) + header_bytes +
           static_cast<size_t>(sender) * channel_bytes;
  }
  void Ring() {
    doorbell.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers.load(std::memory_order_seq_cst) != 0) {
      Futex(&doorbell, FUTEX_WAKE, INT_MAX, nullptr);
    }
  }
};

// The state of one call: both directions progress in one loop, so a ring step in which
// every rank sends and receives at once cannot deadlock on full channels.
struct ShmTransport::Job {
  int to = -1;
  const char* send = nullptr;
  size_t send_bytes = 0;
  size_t sent = 0;
  int from = -1;
  char* recv = nullptr;  // plain receive target, or
  void* dst = nullptr;   // reduce target (with local and reduce)
  const char* local = nullptr;
  const ReduceFn* reduce = nullptr;
  size_t element_bytes = 1;
  size_t recv_bytes = 0;
  size_t received = 0;
  bool send_started = false;
  bool recv_started = false;
};

ShmTransport::ShmTransport(int rank, int size, const ShmOptions& options)
    : rank_(rank), size_(size), options_(options), peers_(static_cast<size_t>(size)) {}

ShmTransport::~ShmTransport() {
  for (Peer& p : peers_) {
    if (p.segment != nullptr && p.segment != own_) munmap(p.segment, segment_bytes_);
  }
  if (own_ != nullptr) munmap(own_, segment_bytes_);
}

void ShmTransport::RemoveStaleSegments() {
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return;
  while (dirent* e = readdir(dir)) {
    if (std::strncmp(e->d_name, kNamePrefix, sizeof kNamePrefix - 1) != 0) continue;
    const char* dot = std::strrchr(e->d_name, '.');
    if (dot == nullptr) continue;
    const int pid = std::atoi(dot + 1);
    if (pid > 0 && kill(pid, 0) != 0 && errno == ESRCH) {
      shm_unlink((std::string("/") + e->d_name).c_str());
    }
  }
  closedir(dir);
}

Status ShmTransport::Create(Transport& control, const std::vector<int>& local,
                            const std::vector<int>& liveness_fds, const ShmOptions& options,
                            double timeout_seconds, std::unique_ptr<ShmTransport>* out) {
  const int rank = control.rank();
  const int size = control.size();
  ShmOptions tuned = options;
  if (static_cast<long>(local.size()) + 1 > sysconf(_SC_NPROCESSORS_ONLN)) {
    // Oversubscribed: a spinning rank would hold the core the peer it waits for needs.
    tuned.spin_iterations = 0;
  }
  std::unique_ptr<ShmTransport> t(new ShmTransport(rank, size, tuned));
  const size_t header =
      (sizeof(Segment) + static_cast<size_t>(size) * sizeof(Channel) + 4095) & ~size_t{4095};
  t->segment_bytes_ = header + static_cast<size_t>(size) * options.channel_bytes;
  AlgoConfig cfg;
  cfg.timeout_seconds = timeout_seconds;

  // Round 1: create this rank's segment; everyone learns who succeeded and their pids.
  SetupReport mine{static_cast<int32_t>(getpid()), 1, {}};
  RemoveStaleSegments();
  t->own_name_ = SegmentName(options.job_token, rank, mine.pid);
  int fd = shm_open(t->own_name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  void* mem = MAP_FAILED;
  if (fd >= 0 && ftruncate(fd, static_cast<off_t>(t->segment_bytes_)) == 0) {
    mem = mmap(nullptr, t->segment_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  if (mem == MAP_FAILED) {
    mine.ok = 0;
    std::snprintf(mine.error, sizeof mine.error, "creating shared memory %s failed: %s",
                  t->own_name_.c_str(), std::strerror(errno));
  } else {
    t->own_ = new (mem) Segment();
    t->own_->magic = kSegmentMagic;
    t->own_->rank = rank;
    t->own_->size = size;
    t->own_->channel_bytes = options.channel_bytes;
    t->own_->header_bytes = header;
  }
  if (fd >= 0) close(fd);
  std::vector<SetupReport> reports(static_cast<size_t>(size));
  auto round = [&](SetupReport report) {
    reports[static_cast<size_t>(rank)] = report;
    std::vector<size_t> sizes(static_cast<size_t>(size), sizeof(SetupReport));
    Status s = RingAllgatherv(control, cfg, reports.data(), sizes);
    for (int r = 0; s.ok() && r < size; ++r) {
      if (!reports[static_cast<size_t>(r)].ok) {
        s = Status(Code::kUnavailable, "rank " + std::to_string(r) + ": " +
                                           reports[static_cast<size_t>(r)].error, r);
      }
    }
    return s;
  };
  Status s = round(mine);
  std::vector<int> pids(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) pids[static_cast<size_t>(r)] = reports[static_cast<size_t>(r)].pid;

  // Round 2: map the segments of the other ranks on this host.
  SetupReport mapped{mine.pid, 1, {}};
  for (int peer : local) {
    if (!s.ok() || peer == rank) continue;
    const std::string name = SegmentName(options.job_token, peer, pids[static_cast<size_t>(peer)]);
    int pfd = shm_open(name.c_str(), O_RDWR, 0600);
    void* pmem = pfd >= 0 ? mmap(nullptr, t->segment_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED,
                                 pfd, 0)
                          : MAP_FAILED;
    if (pfd >= 0) close(pfd);
    if (pmem == MAP_FAILED || static_cast<Segment*>(pmem)->magic != kSegmentMagic ||
        static_cast<Segment*>(pmem)->channel_bytes != options.channel_bytes) {
      mapped.ok = 0;
      std::snprintf(mapped.error, sizeof mapped.error, "mapping %s failed: %s", name.c_str(),
                    std::strerror(errno));
      break;
    }
    t->peers_[static_cast<size_t>(peer)].segment = static_cast<Segment*>(pmem);
    t->peers_[static_cast<size_t>(peer)].liveness_fd = liveness_fds[static_cast<size_t>(peer)];
  }
  if (s.ok()) s = round(mapped);
  // Everyone has mapped everything it needs (or failed): the name is no longer needed.
  if (t->own_ != nullptr) shm_unlink(t->own_name_.c_str());
  if (!s.ok()) return s;
  *out = std::move(t);
  return Status::OK();
}

Status ShmTransport::CheckPeers(int to, int from, bool sending, bool receiving) const {
  if (aborted_.load()) return Status(Code::kAborted, "keras_ring runtime was aborted");
  KR_RETURN_IF_ERROR(InterruptStatus());
  const int waited_for[2] = {receiving ? from : -1, sending ? to : -1};
  for (int peer : waited_for) {
    if (peer < 0) continue;
    const Peer& p = peers_[static_cast<size_t>(peer)];
    if (p.segment->aborted.load() != 0) {
      return Status(Code::kUnavailable,
                    "rank " + std::to_string(peer) + " aborted after an error of its own", peer);
    }
    if (PeerSocketClosed(p.liveness_fd)) {
      return Status(Code::kUnavailable,
                    "lost rank " + std::to_string(peer) +
                        ": its process exited, crashed or was killed",
                    peer);
    }
  }
  return Status::OK();
}

Status ShmTransport::Transfer(Job& job, Deadline deadline) {
  // A peer that already gave up must not let this rank complete a collective it failed.
  KR_RETURN_IF_ERROR(CheckPeers(job.to, job.from, job.send_bytes > 0, job.recv_bytes > 0));
  const uint64_t cap = options_.channel_bytes;
  Channel* out_ch = job.send_bytes ? peers_[static_cast<size_t>(job.to)].segment->channel(rank_) : nullptr;
  char* out_data = job.send_bytes ? peers_[static_cast<size_t>(job.to)].segment->data(rank_) : nullptr;
  Channel* in_ch = job.recv_bytes ? own_->channel(job.from) : nullptr;
  const char* in_data = job.recv_bytes ? own_->data(job.from) : nullptr;
  uint64_t w = 0, c = 0;  // our positions in the outbound / inbound channel
  if (out_ch) w = AlignUp(out_ch->written.value.load(std::memory_order_relaxed));
  if (in_ch) c = AlignUp(in_ch->consumed.value.load(std::memory_order_relaxed));

  auto try_send = [&]() -> bool {
    if (job.sent >= job.send_bytes) return false;
    const uint64_t consumed = out_ch->consumed.value.load(std::memory_order_acquire);
    if (w - consumed >= cap) return false;  // full (w may run ahead by the alignment pad)
    const uint64_t pos = w & (cap - 1);
    const size_t k = static_cast<size_t>(
        std::min<uint64_t>({cap - (w - consumed), job.send_bytes - job.sent, cap - pos}));
    std::memcpy(out_data + pos, job.send + job.sent, k);
    w += k;
    job.sent += k;
    out_ch->written.value.store(w, std::memory_order_release);
    peers_[static_cast<size_t>(job.to)].segment->Ring();
    return true;
  };
  auto try_recv = [&]() -> bool {
    if (job.received >= job.recv_bytes) return false;
    const uint64_t written = in_ch->written.value.load(std::memory_order_acquire);
    if (written <= c) return false;  // nothing new (the sender may not have aligned yet)
    const uint64_t pos = c & (cap - 1);
    size_t k = static_cast<size_t>(
        std::min<uint64_t>({written - c, job.recv_bytes - job.received, cap - pos}));
    k -= k % job.element_bytes;  // reduce whole elements only
    if (k == 0) return false;
    if (job.reduce != nullptr) {
      (*job.reduce)(static_cast<char*>(job.dst) + job.received, job.local + job.received,
                    in_data + pos, k);  // straight from the shared ring: no staging copy
    } else {
      std::memcpy(job.recv + job.received, in_data + pos, k);
    }
    c += k;
    job.received += k;
    in_ch->consumed.value.store(c, std::memory_order_release);
    peers_[static_cast<size_t>(job.from)].segment->Ring();
    return true;
  };
  auto can_progress = [&]() {
    if (job.sent < job.send_bytes &&
        w - out_ch->consumed.value.load(std::memory_order_acquire) < cap) {
      return true;
    }
    return job.received < job.recv_bytes &&
           in_ch->written.value.load(std::memory_order_acquire) >= c + job.element_bytes;
  };

  int idle = 0;
  while (job.sent < job.send_bytes || job.received < job.recv_bytes) {
    bool progress = try_send();
    progress = try_recv() || progress;
    if (progress) {
      idle = 0;
      continue;
    }
    if (++idle < options_.spin_iterations) {
      KR_CPU_RELAX();
      continue;
    }
    // Sleep on our doorbell until a peer makes progress for us, or a slice passes.
    const uint32_t seq = own_->doorbell.load(std::memory_order_seq_cst);
    own_->sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (!can_progress() && !aborted_.load()) {
      timespec ts{0, kSleepSliceMs * 1000000L};
      Futex(&own_->doorbell, FUTEX_WAIT, seq, &ts);
    }
    own_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (can_progress()) continue;
    KR_RETURN_IF_ERROR(CheckPeers(job.to, job.from, job.sent < job.send_bytes,
                                  job.received < job.recv_bytes));
    if (deadline.expired()) {
      const bool waiting_recv = job.received < job.recv_bytes;
      const int waited = waiting_recv ? job.from : job.to;
      return Status(Code::kDeadlineExceeded,
                    "timed out waiting for rank " + std::to_string(waited) +
                        (waiting_recv ? " to send data" : " to accept data"),
                    waited);
    }
  }
  // Both sides align the next message on the channel to a cache line (AlignUp above), so
  // element boundaries never straddle the ring's wrap-around.
  return Status::OK();
}

Status ShmTransport::Send(int peer, const void* data, size_t bytes, Deadline deadline) {
  return SendRecv(peer, data, bytes, -1, nullptr, 0, deadline);
}

Status ShmTransport::Recv(int peer, void* data, size_t bytes, Deadline deadline) {
  return SendRecv(-1, nullptr, 0, peer, data, bytes, deadline);
}

Status ShmTransport::SendRecv(int to, const void* send_data, size_t send_bytes, int from,
                              void* recv_data, size_t recv_bytes, Deadline deadline) {
  Job job;
  job.to = to;
  job.send = static_cast<const char*>(send_data);
  job.send_bytes = send_bytes;
  job.from = from;
  job.recv = static_cast<char*>(recv_data);
  job.recv_bytes = recv_bytes;
  return Transfer(job, deadline);
}

Status ShmTransport::SendRecvReduce(int to, const void* send_data, size_t send_bytes, int from,
                                    void* dst, const void* local, size_t recv_bytes,
                                    size_t element_bytes, const ReduceFn& reduce,
                                    Deadline deadline) {
  Job job;
  job.to = to;
  job.send = static_cast<const char*>(send_data);
  job.send_bytes = send_bytes;
  job.from = from;
  job.dst = dst;
  job.local = static_cast<const char*>(local);
  job.reduce = &reduce;
  job.element_bytes = element_bytes > 0 ? element_bytes : 1;
  job.recv_bytes = recv_bytes;
  return Transfer(job, deadline);
}

void ShmTransport::Abort() {
  aborted_.store(true);
  if (own_ == nullptr) return;
  own_->aborted.store(1);
  own_->Ring();  // wake our own worker if it sleeps
  for (Peer& p : peers_) {
    if (p.segment != nullptr) p.segment->Ring();  // let peers see the flag now
  }
}

}  // namespace keras_ring
