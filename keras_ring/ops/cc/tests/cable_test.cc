// A cable pulled between two hosts in the middle of a collective: every rank's error must
// blame a rank on the far side of the cable, also a rank that got through that collective
// and then waits, in the next one, on a same-host peer that did not. Real host transports
// (TCP across the "hosts", shm within) under runtimes; the cable is a test-only decorator
// that swallows the traffic and the abort notices crossing it, as a dead link does.
#include <algorithm>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../core/runtime.h"
#include "test_harness.h"
#include "test_util.h"

namespace kr_test {
namespace {

using namespace keras_ring;  // NOLINT: test-local

// Which pairs of ranks the cable still connects. Cut pairs lose every byte and notice.
class Cable {
 public:
  explicit Cable(std::vector<int> hosts) : hosts_(std::move(hosts)) {}
  void CutPair(int a, int b) {
    std::lock_guard<std::mutex> lock(mu_);
    pairs_.push_back({std::min(a, b), std::max(a, b)});
  }
  void Pull() {
    std::lock_guard<std::mutex> lock(mu_);
    pulled_ = true;
  }
  bool Cut(int a, int b) const {
    if (At(hosts_, a) == At(hosts_, b)) return false;
    std::lock_guard<std::mutex> lock(mu_);
    const std::vector<int> pair{std::min(a, b), std::max(a, b)};
    return pulled_ || std::find(pairs_.begin(), pairs_.end(), pair) != pairs_.end();
  }

 private:
  const std::vector<int> hosts_;
  mutable std::mutex mu_;
  std::vector<std::vector<int>> pairs_;
  bool pulled_ = false;
};

// A rank's transport seen through the cable: sends across a cut vanish, receives across one
// wait until their deadline (or this rank's abort), and notices across one never arrive.
class ThroughCable : public Transport {
 public:
  ThroughCable(std::unique_ptr<Transport> inner, std::shared_ptr<Cable> cable)
      : inner_(std::move(inner)), cable_(std::move(cable)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const char* name() const override { return "cable"; }

  Status Send(int peer, const void* data, size_t bytes, Deadline deadline) override {
    return Cut(peer) ? Status::OK() : inner_->Send(peer, data, bytes, deadline);
  }
  Status Recv(int peer, void* data, size_t bytes, Deadline deadline) override {
    return Cut(peer) ? Silence(peer, deadline) : inner_->Recv(peer, data, bytes, deadline);
  }
  Status SendRecv(int to, const void* send_data, size_t send_bytes, int from, void* recv_data,
                  size_t recv_bytes, Deadline deadline) override {
    if (!Cut(to) && !Cut(from)) {
      return inner_->SendRecv(to, send_data, send_bytes, from, recv_data, recv_bytes, deadline);
    }
    KR_RETURN_IF_ERROR(Send(to, send_data, send_bytes, deadline));
    return Recv(from, recv_data, recv_bytes, deadline);
  }
  Status PollPeerFailure() override {
    if (abort_.aborted()) return Status::OK();
    for (int peer = 0; peer < size(); ++peer) {
      Status s = PeerNotice(peer);
      if (!s.ok()) return s;
    }
    return Status::OK();
  }
  Status PeerNotice(int peer) override {
    return peer == rank() || Cut(peer) ? Status::OK() : inner_->PeerNotice(peer);
  }
  void AbortWith(const Status& cause) override {
    abort_.Set(cause);
    inner_->AbortWith(cause);
  }

 private:
  bool Cut(int peer) const { return peer >= 0 && cable_->Cut(rank(), peer); }
  Status Silence(int peer, Deadline deadline) const {
    while (!deadline.expired()) {
      if (abort_.aborted()) return abort_.WaitError();
      std::this_thread::sleep_for(std::chrono::milliseconds(5));  // a dead link: nothing
    }
    return Status(Code::kDeadlineExceeded, "timed out waiting for rank " + std::to_string(peer),
                  peer);
  }

  std::unique_ptr<Transport> inner_;
  std::shared_ptr<Cable> cable_;
  AbortState abort_;
};

// Threads meeting at a point: Arrive returns once `n` have arrived.
class Meeting {
 public:
  explicit Meeting(int n) : n_(n) {}
  void Arrive(const std::function<void()>& last_does = nullptr) {
    std::unique_lock<std::mutex> lock(mu_);
    if (++arrived_ == n_) {
      if (last_does) last_does();
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [this] { return arrived_ >= n_; });
  }

 private:
  const int n_;
  int arrived_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
};

Request OneFloat(const std::string& name, float* value) {
  Request r;
  r.kind = Kind::kAllreduce;
  r.name = name;
  r.tensors.push_back(Tensor(DataType::kFloat32, {1}, value, value));
  return r;
}

TEST(Cable_APulledCableIsBlamedAcrossIt_EvenByARankAheadOfItsPeer) {
  const std::vector<int> hosts{0, 0, 1, 1};
  auto cable = std::make_shared<Cable>(hosts);
  auto inner = ConnectHostWorld(hosts, Mix(41));
  std::vector<std::unique_ptr<Runtime>> runtimes;
  for (int r = 0; r < 4; ++r) {
    RuntimeOptions options;
    options.rank = r;
    options.size = 4;
    options.timeout_seconds = 4;  // waits end after 4 s + depth x 1 s
    options.stall_warning_seconds = 0;
    options.failure_exit_seconds = 0;  // never end this test process
    runtimes.push_back(std::make_unique<Runtime>(
        options, std::make_unique<ThroughCable>(std::move(At(inner, r)), cable)));
  }
  // 'a' runs on an intact cable. Then the link between ranks 0 and 2 dies first: in 'b',
  // ranks 1 and 3 finish their last round with each other, 0 and 2 wait for each other. The
  // rest of the cable goes before 1 and 3 start 'c', whose first round is with 0 and 2: a
  // rank that only waits there must not be blamed.
  Meeting a_done(4);
  Meeting b_done_by_1_and_3(2);
  std::vector<Status> failures(4);
  std::vector<double> seconds(4);
  std::vector<std::thread> threads;
  for (int r = 0; r < 4; ++r) {
    threads.emplace_back([&, r] {
      Runtime& rt = *At(runtimes, r);
      float value = 1.0f;
      CHECK_OK(rt.Run(OneFloat("a", &value)));
      a_done.Arrive([&] { cable->CutPair(0, 2); });
      const auto start = Clock::now();
      Status s = rt.Run(OneFloat("b", &value));
      if (s.ok()) {
        b_done_by_1_and_3.Arrive([&] { cable->Pull(); });
        s = rt.Run(OneFloat("c", &value));
      }
      At(failures, r) = s;
      At(seconds, r) = SecondsSince(start);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 4; ++r) {
    const Status& s = At(failures, r);
    CHECK(!s.ok()) << "rank " << r << " did not fail";
    const int blamed = s.peer();
    CHECK(blamed >= 0 && At(hosts, blamed) != At(hosts, r))
        << "rank " << r << " blamed rank " << blamed << " on its own side: " << s.message();
    CHECK(At(seconds, r) < 30) << "rank " << r << " took " << At(seconds, r) << " s";
  }
  // The ranks that got through 'b' say why their same-host peer did not answer in 'c'.
  CHECK_CONTAINS(At(failures, 1).message(), "rank 0 was still waiting in allreduce 'b'");
  CHECK_CONTAINS(At(failures, 3).message(), "rank 2 was still waiting in allreduce 'b'");
}

}  // namespace
}  // namespace kr_test
