#include "shm_transport.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/statvfs.h>
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

constexpr uint64_t kRegionMagic = 0x6b72696e6773686dull;  // "kringshm"
constexpr size_t kAlign = 64;                              // messages start on a cache line
constexpr int kSleepSliceMs = 10;                          // liveness checks while asleep
const char kNamePrefix[] = "keras_ring.";

struct alignas(64) Counter {
  std::atomic<uint64_t> value{0};
};

// A byte ring from one sender to the region's owner.
struct Channel {
  Counter written;   // advanced by the sender
  Counter consumed;  // advanced by the owner
};

uint64_t AlignUp(uint64_t v) { return (v + kAlign - 1) & ~(kAlign - 1); }

long Futex(std::atomic<uint32_t>* addr, int op, uint32_t val, const timespec* ts) {
  // Not FUTEX_PRIVATE: the word lives in memory shared between processes.
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, ts, nullptr, 0);
}

std::string RegionName(uint64_t token, int rank, int pid) {
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
  char error[440];  // the whole of an error that says what to do (a full /dev/shm's)
};

}  // namespace

struct ShmTransport::Region {
  uint64_t magic;
  int32_t rank;
  int32_t size;
  uint64_t channel_bytes;
  uint64_t header_bytes;
  alignas(64) std::atomic<uint32_t> aborted;  // set (release) after the cause below
  int32_t cause_code;    // why: kCancelled for a clean shutdown
  int32_t cause_peer;    // the rank to blame
  char cause_message[kCauseMessageBytes];
  alignas(64) std::atomic<uint32_t> doorbell;  // bumped by anyone who made progress for us
  alignas(64) std::atomic<uint32_t> sleepers;  // >0 while the owner sleeps on the doorbell

  Channel* channel(int sender) {
    return reinterpret_cast<Channel*>(reinterpret_cast<char*>(this) + sizeof(Region)) + sender;
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
// every rank sends and receives at once cannot deadlock on full channels. Each direction is
// a list of pieces forming one message.
struct ShmTransport::Job {
  int to = -1;
  const SendPiece* send = nullptr;
  size_t send_bytes = 0;
  size_t sent = 0;
  size_t send_index = 0;   // current piece
  size_t send_offset = 0;  // bytes of it already sent
  int from = -1;
  const RecvPiece* recv = nullptr;
  size_t recv_bytes = 0;
  size_t received = 0;
  size_t recv_index = 0;
  size_t recv_offset = 0;
  const ReduceFn* reduce = nullptr;  // null: copy
  size_t element_bytes = 1;

  // Channel state, set up by Transfer.
  uint64_t cap = 0;
  Channel* out = nullptr;  // our ring in the receiver's region
  char* out_data = nullptr;
  Region* out_owner = nullptr;
  Channel* in = nullptr;  // the sender's ring in our region
  const char* in_data = nullptr;
  Region* in_owner = nullptr;  // the sender's region (rung when we free space)
  uint64_t w = 0;               // our write position in `out`
  uint64_t c = 0;               // our read position in `in`

  bool sending() const { return sent < send_bytes; }
  bool receiving() const { return received < recv_bytes; }
  bool CanProgress() const {
    return (sending() && w - out->consumed.value.load(std::memory_order_acquire) < cap) ||
           (receiving() && in->written.value.load(std::memory_order_acquire) >= c + element_bytes);
  }
  bool TrySend();
  bool TryRecv();
};

bool ShmTransport::Job::TrySend() {
  if (!sending()) return false;
  const uint64_t consumed = out->consumed.value.load(std::memory_order_acquire);
  if (w - consumed >= cap) return false;  // full (w may run ahead by the alignment pad)
  // Fill what is free in one go, piece by piece, then publish once.
  while (sending() && w - consumed < cap) {
    const SendPiece& piece = send[send_index];
    const uint64_t pos = w & (cap - 1);
    const size_t k = static_cast<size_t>(
        std::min<uint64_t>({cap - (w - consumed), piece.bytes - send_offset, cap - pos}));
    std::memcpy(out_data + pos, static_cast<const char*>(piece.data) + send_offset, k);
    w += k;
    sent += k;
    send_offset += k;
    if (send_offset == piece.bytes) {
      ++send_index;
      send_offset = 0;
    }
  }
  out->written.value.store(w, std::memory_order_release);
  out_owner->Ring();
  return true;
}

bool ShmTransport::Job::TryRecv() {
  if (!receiving()) return false;
  const uint64_t written = in->written.value.load(std::memory_order_acquire);
  bool progressed = false;
  // Pieces hold whole elements, so only the available bytes can end mid-element.
  while (receiving() && written >= c + element_bytes) {
    const RecvPiece& piece = recv[recv_index];
    if (recv_offset == piece.bytes) {  // an empty piece
      ++recv_index;
      continue;
    }
    const uint64_t pos = c & (cap - 1);
    size_t k = static_cast<size_t>(
        std::min<uint64_t>({written - c, piece.bytes - recv_offset, cap - pos}));
    k -= k % element_bytes;  // reduce whole elements only
    if (k == 0) break;
    char* dst = static_cast<char*>(piece.dst) + recv_offset;
    if (reduce != nullptr) {
      // Straight from the shared ring into the output: no staging copy.
      (*reduce)(dst, static_cast<const char*>(piece.local) + recv_offset, in_data + pos, k);
    } else {
      std::memcpy(dst, in_data + pos, k);
    }
    c += k;
    received += k;
    recv_offset += k;
    if (recv_offset == piece.bytes) {
      ++recv_index;
      recv_offset = 0;
    }
    progressed = true;
  }
  if (!progressed) return false;
  in->consumed.value.store(c, std::memory_order_release);
  in_owner->Ring();
  return true;
}

ShmTransport::ShmTransport(int rank, int size, const ShmOptions& options)
    : rank_(rank), size_(size), options_(options), peers_(static_cast<size_t>(size)) {}

ShmTransport::~ShmTransport() {
  for (Peer& p : peers_) {
    if (p.region != nullptr && p.region != own_) munmap(p.region, region_bytes_);
  }
  if (own_ != nullptr) munmap(own_, region_bytes_);
}

void ShmTransport::RemoveStaleRegions() {
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

namespace {

// Reserves the pages of the region that will be written: the header and the channels of the
// local peers (a remote peer's channel is never touched). ftruncate reserves nothing on
// tmpfs: a full /dev/shm (Docker's default is 64 MiB) then killed the rank with SIGBUS at its
// first write to a missing page, mid-collective, with no message. An error here is told to
// every rank at start-up instead. 0, or the errno.
int Reserve(int fd, size_t header_bytes, size_t channel_bytes, const std::vector<int>& local) {
  int rc = posix_fallocate(fd, 0, static_cast<off_t>(header_bytes));
  for (size_t i = 0; rc == 0 && i < local.size(); ++i) {
    rc = posix_fallocate(fd, static_cast<off_t>(header_bytes + local[i] * channel_bytes),
                         static_cast<off_t>(channel_bytes));
  }
  return rc == EOPNOTSUPP || rc == EINVAL ? 0 : rc;  // a filesystem that cannot: as before
}

std::string NoSpaceMessage(size_t needed, size_t ranks_here) {
  const double mib = 1024.0 * 1024.0;
  struct statvfs fs {};
  char free_text[64] = "free space unknown";
  if (statvfs("/dev/shm", &fs) == 0) {
    std::snprintf(free_text, sizeof free_text, "%.1f MiB free",
                  static_cast<double>(fs.f_bavail) * static_cast<double>(fs.f_frsize) / mib);
  }
  char text[512];
  std::snprintf(text, sizeof text,
                "/dev/shm has too little free space for the shared-memory channels (each of "
                "the %zu ranks on this host needs %.1f MiB; %s): enlarge it (docker run "
                "--shm-size=1g), lower KERAS_RING_SHM_CHANNEL_BYTES (needed per other rank on "
                "the host), or set KERAS_RING_SHM=0 (TCP)",
                ranks_here, static_cast<double>(needed) / mib, free_text);
  return text;
}

}  // namespace

std::string ShmTransport::CreateOwnRegion(size_t header_bytes, const std::vector<int>& local) {
  own_name_ = RegionName(options_.job_token, rank_, getpid());
  int fd = shm_open(own_name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  void* mem = MAP_FAILED;
  int err = 0;
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(region_bytes_)) != 0) {
    err = errno;
  } else if ((err = Reserve(fd, header_bytes, options_.channel_bytes, local)) == 0) {
    mem = mmap(nullptr, region_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (mem == MAP_FAILED) err = errno;
  }
  if (fd >= 0) close(fd);
  if (mem == MAP_FAILED) {
    if (fd >= 0) shm_unlink(own_name_.c_str());
    if (err == ENOSPC) {
      return NoSpaceMessage(header_bytes + local.size() * options_.channel_bytes,
                            local.size() + 1);
    }
    return "creating shared memory " + own_name_ + " failed: " + std::strerror(err);
  }
  own_ = new (mem) Region();  // ftruncate zero-filled the rest
  own_->magic = kRegionMagic;
  own_->rank = rank_;
  own_->size = size_;
  own_->channel_bytes = options_.channel_bytes;
  own_->header_bytes = header_bytes;
  return "";
}

std::string ShmTransport::MapPeer(int peer, int pid, int liveness_fd) {
  const std::string name = RegionName(options_.job_token, peer, pid);
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  void* mem =
      fd >= 0 ? mmap(nullptr, region_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  const int err = errno;
  if (fd >= 0) close(fd);
  if (mem == MAP_FAILED) return "mapping " + name + " failed: " + std::strerror(err);
  auto* region = static_cast<Region*>(mem);
  if (region->magic != kRegionMagic || region->channel_bytes != options_.channel_bytes) {
    munmap(mem, region_bytes_);
    return name + " is not a keras_ring region of this size (KERAS_RING_SHM_CHANNEL_BYTES "
                  "must be equal on all ranks)";
  }
  peers_[static_cast<size_t>(peer)] = Peer{region, liveness_fd};
  return "";
}

Status ShmTransport::Create(Transport& control, const std::vector<int>& local,
                            const std::vector<int>& liveness_fds, const ShmOptions& options,
                            double timeout_seconds, std::unique_ptr<ShmTransport>* out) {
  const int rank = control.rank();
  const int size = control.size();
  ShmOptions tuned = options;
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  if (static_cast<long>(local.size()) + 1 > cores) {
    // Oversubscribed: a spinning rank would hold the core the peer it waits for needs.
    tuned.spin_iterations = 0;
  }
  // A graph's collective that yields while it waits cuts a wake-up per round where each rank
  // has a core (2 ranks on 2 cores: 4 KiB in a graph 48 us instead of 105). Where ranks
  // outnumber cores the waits sleep at once: a chain of collectives alone would yield faster
  // (4 ranks on 2 cores, 4 KiB: 59-65 us instead of 113-265), but in training the yielded
  // core goes to other ranks' backprop, and Keras MLP steps at 4 ranks were slower yielding
  // in 5 of 7 alternated rounds. The runtime lets a chain's collectives yield all the same
  // (Runtime::FollowsClosely): their peers are a collective behind at most.
  if (static_cast<long>(local.size()) + 1 > cores) tuned.yield_in_graphs = false;
  std::unique_ptr<ShmTransport> t(new ShmTransport(rank, size, tuned));
  const size_t header =
      (sizeof(Region) + static_cast<size_t>(size) * sizeof(Channel) + 4095) & ~size_t{4095};
  t->region_bytes_ = header + static_cast<size_t>(size) * options.channel_bytes;
  AlgoConfig cfg;
  cfg.timeout_seconds = timeout_seconds;
  std::vector<SetupReport> reports(static_cast<size_t>(size));
  // Every rank reports success or its error, so all fail alike if one cannot set up.
  auto round = [&](const std::string& error) {
    SetupReport& mine = reports[static_cast<size_t>(rank)];
    mine.pid = static_cast<int32_t>(getpid());
    mine.ok = error.empty() ? 1 : 0;
    std::snprintf(mine.error, sizeof mine.error, "%s", error.c_str());
    std::vector<size_t> sizes(static_cast<size_t>(size), sizeof(SetupReport));
    Status s = RingAllgatherv(control, cfg, reports.data(), sizes);
    for (int r = 0; s.ok() && r < size; ++r) {
      if (!reports[static_cast<size_t>(r)].ok) {
        s = Status(Code::kUnavailable,
                   "rank " + std::to_string(r) + ": " + reports[static_cast<size_t>(r)].error, r);
      }
    }
    return s;
  };

  RemoveStaleRegions();
  Status s = round(t->CreateOwnRegion(header, local));  // also tells everyone our pid
  std::string error;
  for (int peer : local) {
    if (!s.ok() || !error.empty()) break;
    error = t->MapPeer(peer, reports[static_cast<size_t>(peer)].pid,
                       liveness_fds[static_cast<size_t>(peer)]);
  }
  if (s.ok()) s = round(error);
  // Every peer has mapped this region (or the job failed): the name is no longer needed,
  // and without a name nothing can outlive the job.
  if (t->own_ != nullptr) shm_unlink(t->own_name_.c_str());
  if (!s.ok()) return s;
  *out = std::move(t);
  return Status::OK();
}

Status ShmTransport::CheckPeers(const Job& job, bool starting) const {
  if (abort_.aborted()) return abort_.WaitError();
  KR_RETURN_IF_ERROR(InterruptStatus());
  const int waited_for[2] = {job.receiving() ? job.from : -1, job.sending() ? job.to : -1};
  // A peer that shut down cleanly left its last data in our rings: only a wait that cannot
  // progress is an error. Progress is looked at after the peer's flag is read (acquire): it
  // wrote that data before its flag, which may have come after this wait last looked, so a
  // correct job's final collective met "rank 1 has shut down" on a busy machine. A peer that
  // failed must stop us even mid-collective.
  for (int peer : waited_for) {
    if (peer < 0) continue;
    const Peer& p = peers_[static_cast<size_t>(peer)];
    // The socket before the flag: a clean shutdown sets the flag before its process ends.
    const bool gone = !starting && PeerSocketClosed(p.liveness_fd);
    if (p.region->aborted.load(std::memory_order_acquire) != 0) {
      const Code code = static_cast<Code>(p.region->cause_code);
      if (code == Code::kCancelled && (starting || job.CanProgress())) continue;
      return PeerGaveUp(peer, code, p.region->cause_peer, p.region->cause_message);
    }
    if (gone) {
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
  KR_RETURN_IF_ERROR(CheckPeers(job, /*starting=*/true));
  job.cap = options_.channel_bytes;
  // Both sides start each message on a cache line (AlignUp), so element boundaries never
  // straddle the ring's wrap-around.
  if (job.sending()) {
    job.out_owner = peers_[static_cast<size_t>(job.to)].region;
    job.out = job.out_owner->channel(rank_);
    job.out_data = job.out_owner->data(rank_);
    job.w = AlignUp(job.out->written.value.load(std::memory_order_relaxed));
  }
  if (job.receiving()) {
    job.in_owner = peers_[static_cast<size_t>(job.from)].region;
    job.in = own_->channel(job.from);
    job.in_data = own_->data(job.from);
    job.c = AlignUp(job.in->consumed.value.load(std::memory_order_relaxed));
  }
  // Waiting escalates: spin (only with a core to ourselves), then, where allowed (an eager
  // call: Deadline::may_yield; a graph's collective: yield_in_graphs), yield the core for up
  // to yield_seconds, then sleep on the doorbell. Yielding hands the core straight to a
  // runnable peer without a futex wake-up: 4 ranks on 2 cores, an eager 4 KiB allreduce
  // ~150 us instead of ~400 us, with half the CPU time.
  const auto budget = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(options_.yield_seconds));
  int idle = 0;
  const bool yielding = deadline.may_yield() || options_.yield_in_graphs;
  Clock::time_point waiting_since{};
  while (job.sending() || job.receiving()) {
    const bool sent = job.TrySend();
    if (job.TryRecv() || sent) {
      waiting_since = Clock::time_point{};
      idle = 0;
    } else if (++idle < options_.spin_iterations) {
      KR_CPU_RELAX();
    } else {
      const Clock::time_point now = Clock::now();
      if (waiting_since == Clock::time_point{}) waiting_since = now;
      if (yielding && now - waiting_since < budget) {
        sched_yield();
      } else {
        KR_RETURN_IF_ERROR(Sleep(job, deadline));
      }
    }
  }
  return Status::OK();
}

Status ShmTransport::Sleep(const Job& job, Deadline deadline) {
  // Sleep on our doorbell until a peer makes progress for us, or a slice passes.
  const uint32_t seq = own_->doorbell.load(std::memory_order_seq_cst);
  own_->sleepers.fetch_add(1, std::memory_order_seq_cst);
  if (!job.CanProgress() && !abort_.aborted()) {
    timespec ts{0, kSleepSliceMs * 1000000L};
    Futex(&own_->doorbell, FUTEX_WAIT, seq, &ts);
  }
  own_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
  // The deadline is checked even when progress looks possible: a ring whose state no longer
  // allows progress (a corrupted or foreign peer) must end in an error, never spin forever.
  if (job.CanProgress() && !deadline.expired()) return Status::OK();
  KR_RETURN_IF_ERROR(CheckPeers(job, /*starting=*/false));
  if (deadline.expired()) {
    const int waited = job.receiving() ? job.from : job.to;
    return Status(Code::kDeadlineExceeded,
                  "timed out waiting for rank " + std::to_string(waited) +
                      (job.receiving() ? " to send data" : " to accept data"),
                  waited);
  }
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
  const SendPiece send{send_data, send_bytes};
  const RecvPiece recv{recv_data, nullptr, recv_bytes};
  Job job;
  job.to = to;
  job.send = &send;
  job.send_bytes = send_bytes;
  job.from = from;
  job.recv = &recv;
  job.recv_bytes = recv_bytes;
  return Transfer(job, deadline);
}

Status ShmTransport::SendFramed(int peer, const void* data, size_t bytes, size_t head,
                                Deadline deadline) {
  if (head % kAlign != 0) return Transport::SendFramed(peer, data, bytes, head, deadline);
  return Send(peer, data, bytes, deadline);
}

Status ShmTransport::SendRecvPieces(int to, const std::vector<SendPiece>& send, int from,
                                    const std::vector<RecvPiece>& recv, size_t element_bytes,
                                    const ReduceFn* reduce, Deadline deadline) {
  Job job;
  job.to = to;
  job.send = send.data();
  for (const SendPiece& p : send) job.send_bytes += p.bytes;
  job.from = from;
  job.recv = recv.data();
  for (const RecvPiece& p : recv) job.recv_bytes += p.bytes;
  job.reduce = reduce;
  job.element_bytes = element_bytes > 0 ? element_bytes : 1;
  return Transfer(job, deadline);
}

void ShmTransport::AbortWith(const Status& cause) {
  if (!abort_.Set(cause)) return;
  if (own_ == nullptr) return;
  own_->cause_code = static_cast<int32_t>(cause.code());
  own_->cause_peer = cause.peer() >= 0 ? cause.peer() : rank_;
  std::snprintf(own_->cause_message, sizeof own_->cause_message, "%s", cause.message().c_str());
  own_->aborted.store(1, std::memory_order_release);
  own_->Ring();  // wake our own worker if it sleeps
  for (Peer& p : peers_) {
    if (p.region != nullptr) p.region->Ring();  // let peers see the flag now
  }
}

}  // namespace keras_ring
