#include "fd_passing.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>

namespace pk::fdpass {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x504b4644;  // "PKFD"

struct Header {
  uint32_t magic;
  int32_t sender;
  uint32_t payload_bytes;
  uint32_t has_fd;
};

[[noreturn]] void fail(const std::string& what) {
  throw std::runtime_error("pk_jax fd passing: " + what);
}

[[noreturn]] void fail_errno(const std::string& what) { fail(what + ": " + std::strerror(errno)); }

struct Fd {
  int fd = -1;
  explicit Fd(int f = -1) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int release() {
    const int f = fd;
    fd = -1;
    return f;
  }
};

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left < 0 ? 0 : int(left);
}

sockaddr_un address(const std::string& path) {
  sockaddr_un a = {};
  a.sun_family = AF_UNIX;
  if (path.size() >= sizeof(a.sun_path))
    fail("socket path too long (" + std::to_string(path.size()) + " bytes, limit " +
         std::to_string(sizeof(a.sun_path) - 1) + "): " + path +
         "; point XDG_RUNTIME_DIR or TMPDIR at a shorter directory");
  std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
  return a;
}

void set_timeouts(int fd, int ms) {
  ms = std::max(ms, 1);
  timeval tv{ms / 1000, (ms % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

// Reads exactly n bytes (the socket's SO_RCVTIMEO bounds each read).
void read_exactly(int fd, char* buf, size_t n) {
  while (n > 0) {
    const ssize_t r = ::recv(fd, buf, n, 0);
    if (r == 0) fail("peer closed the connection mid-message");
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) fail("a peer stalled mid-message past the timeout");
      fail_errno("recv");
    }
    buf += r;
    n -= size_t(r);
  }
}

}  // namespace

std::string create_job_dir() {
  const char* base = std::getenv("XDG_RUNTIME_DIR");
  if (base == nullptr || *base == '\0') base = std::getenv("TMPDIR");
  if (base == nullptr || *base == '\0') base = "/tmp";
  std::string templ = std::string(base) + "/pk_jax-XXXXXX";
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr) fail_errno("mkdtemp in " + std::string(base));
  const std::string path(buf.data());
  // mkdtemp makes it 0700; say so explicitly in case of an unusual umask or platform.
  if (::chmod(path.c_str(), 0700) != 0) fail_errno("chmod 0700 " + path);
  check_job_dir(path);
  return path;
}

void check_job_dir(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) fail_errno("job directory " + path);
  if (!S_ISDIR(st.st_mode)) fail("job directory " + path + " is not a directory (or is a symbolic link)");
  if (st.st_uid != ::geteuid())
    fail("job directory " + path + " belongs to uid " + std::to_string(st.st_uid) + ", not to us (uid " +
         std::to_string(::geteuid()) + ")");
  if ((st.st_mode & 07777) != 0700) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", unsigned(st.st_mode & 07777));
    fail("job directory " + path + " has mode " + mode + "; it must be 0700 so no other user can reach the sockets");
  }
}

std::string check_peer(const PeerCredentials& peer, uid_t my_uid, const std::vector<pid_t>& job_pids) {
  if (peer.uid != my_uid)
    return "peer pid " + std::to_string(peer.pid) + " runs as uid " + std::to_string(peer.uid) + ", not ours (" +
           std::to_string(my_uid) + ")";
  if (!job_pids.empty() && std::find(job_pids.begin(), job_pids.end(), peer.pid) == job_pids.end())
    return "peer pid " + std::to_string(peer.pid) + " is not a process of this job";
  return "";
}

Endpoint::Endpoint(const std::string& dir, int rank, std::vector<pid_t> job_pids)
    : dir_(dir), rank_(rank), job_pids_(std::move(job_pids)) {
  if (rank < 0) fail("rank must be >= 0, got " + std::to_string(rank));
  check_job_dir(dir_);
  path_ = socket_path(rank);
  const sockaddr_un a = address(path_);
  Fd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (s.fd < 0) fail_errno("socket");
  if (::bind(s.fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) != 0) fail_errno("bind " + path_);
  ::chmod(path_.c_str(), 0600);
  if (::listen(s.fd, 64) != 0) {
    ::unlink(path_.c_str());
    fail_errno("listen " + path_);
  }
  listen_fd_ = s.release();
}

Endpoint::~Endpoint() {
  if (listen_fd_ >= 0) ::close(listen_fd_);
  ::unlink(path_.c_str());
}

std::string Endpoint::socket_path(int rank) const { return dir_ + "/rank-" + std::to_string(rank) + ".sock"; }

void Endpoint::send(int peer, int fd, const std::string& payload, int timeout_ms) {
  if (payload.size() > kMaxPayload)
    fail("payload of " + std::to_string(payload.size()) + " bytes exceeds " + std::to_string(kMaxPayload));
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  const std::string target = socket_path(peer);
  const sockaddr_un a = address(target);
  // The peer may not listen yet: retry until the deadline.
  Fd s;
  for (;;) {
    Fd attempt(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (attempt.fd < 0) fail_errno("socket");
    set_timeouts(attempt.fd, std::max(remaining_ms(deadline), 1));
    if (::connect(attempt.fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) == 0) {
      s.fd = attempt.release();
      break;
    }
    const int err = errno;
    if (err != ENOENT && err != ECONNREFUSED && err != EAGAIN && err != EINTR) {
      errno = err;
      fail_errno("connect to rank " + std::to_string(peer) + " at " + target);
    }
    if (remaining_ms(deadline) == 0)
      fail("rank " + std::to_string(peer) + " did not listen at " + target + " within " + std::to_string(timeout_ms) +
           " ms");
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  Header h{kMagic, rank_, uint32_t(payload.size()), fd >= 0 ? 1u : 0u};
  iovec iov[2] = {{&h, sizeof(h)}, {const_cast<char*>(payload.data()), payload.size()}};
  msghdr msg = {};
  msg.msg_iov = iov;
  msg.msg_iovlen = payload.empty() ? 1 : 2;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  const size_t total = sizeof(h) + payload.size();
  ssize_t sent = ::sendmsg(s.fd, &msg, MSG_NOSIGNAL);
  if (sent < 0) fail_errno("sendmsg to rank " + std::to_string(peer));
  // The fd went with the first bytes; send whatever the kernel did not take in one go.
  size_t done = size_t(sent);
  while (done < total) {
    const size_t off = done;
    const char* p = off < sizeof(h) ? reinterpret_cast<const char*>(&h) + off : payload.data() + (off - sizeof(h));
    const size_t n = off < sizeof(h) ? sizeof(h) - off : total - off;
    const ssize_t r = ::send(s.fd, p, n, MSG_NOSIGNAL);
    if (r < 0) {
      if (errno == EINTR) continue;
      fail_errno("send to rank " + std::to_string(peer));
    }
    done += size_t(r);
  }
}

Message Endpoint::receive(int timeout_ms) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    pollfd p{listen_fd_, POLLIN, 0};
    const int ready = ::poll(&p, 1, remaining_ms(deadline));
    if (ready < 0 && errno != EINTR) fail_errno("poll");
    if (ready <= 0) {
      if (remaining_ms(deadline) > 0) continue;
      std::string msg = "rank " + std::to_string(rank_) + ": no message from a job peer within " +
                        std::to_string(timeout_ms) + " ms at " + path_;
      if (rejected_ > 0)
        msg += " (rejected " + std::to_string(rejected_) + " connection(s); last: " + last_rejection_ + ")";
      fail(msg);
    }
    Fd c(::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC));
    if (c.fd < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == ECONNABORTED) continue;
      fail_errno("accept");
    }
    ucred cred = {};
    socklen_t len = sizeof(cred);
    if (::getsockopt(c.fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) fail_errno("SO_PEERCRED");
    std::string why = check_peer({cred.pid, cred.uid}, ::geteuid(), job_pids_);
    if (!why.empty()) {
      ++rejected_;
      last_rejection_ = why;
      continue;  // closes the connection; a legitimate peer may still come
    }
    set_timeouts(c.fd, std::max(remaining_ms(deadline), 100));
    Header h = {};
    msghdr msg = {};
    iovec iov{&h, sizeof(h)};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t r;
    do r = ::recvmsg(c.fd, &msg, MSG_CMSG_CLOEXEC | MSG_WAITALL);
    while (r < 0 && errno == EINTR);
    if (r < 0) fail_errno("recvmsg");
    Message out;
    for (cmsghdr* cm = CMSG_FIRSTHDR(&msg); cm != nullptr; cm = CMSG_NXTHDR(&msg, cm))
      if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) std::memcpy(&out.fd, CMSG_DATA(cm), sizeof(int));
    Fd received(out.fd);
    if (msg.msg_flags & MSG_CTRUNC) fail("a control message was truncated (more fds than expected)");
    if (size_t(r) < sizeof(h)) read_exactly(c.fd, reinterpret_cast<char*>(&h) + r, sizeof(h) - size_t(r));
    if (h.magic != kMagic) fail("a connection sent something that is not a pk_jax message");
    if (h.payload_bytes > kMaxPayload)
      fail("a peer announced a payload of " + std::to_string(h.payload_bytes) + " bytes");
    if ((h.has_fd != 0) != (out.fd >= 0)) fail("a peer's message and its fd disagree");
    const bool pid_matches_rank =
        h.sender >= 0 && size_t(h.sender) < job_pids_.size() && job_pids_[h.sender] == cred.pid;
    if (!job_pids_.empty() && !pid_matches_rank) {
      ++rejected_;
      last_rejection_ = "pid " + std::to_string(cred.pid) + " claimed to be rank " + std::to_string(h.sender);
      continue;  // `received` closes the fd it sent
    }
    out.payload.resize(h.payload_bytes);
    if (h.payload_bytes > 0) read_exactly(c.fd, out.payload.data(), h.payload_bytes);
    out.sender = h.sender;
    out.fd = received.release();
    return out;
  }
}

SocketTransport::SocketTransport(Endpoint& endpoint, int num_ranks, int timeout_ms)
    : ep_(endpoint), num_ranks_(num_ranks), timeout_ms_(timeout_ms) {
  if (num_ranks < 1) fail("num_ranks must be >= 1, got " + std::to_string(num_ranks));
  if (endpoint.rank() >= num_ranks) fail("endpoint rank " + std::to_string(endpoint.rank()) + " >= num_ranks");
}

std::string SocketTransport::tag(const char* kind) const { return std::to_string(step_) + ":" + kind + ":"; }

Message SocketTransport::expect(const char* kind) {
  Message m = ep_.receive(timeout_ms_);
  const std::string want = tag(kind);
  if (m.payload.compare(0, want.size(), want) != 0) {
    if (m.fd >= 0) ::close(m.fd);
    fail("rank " + std::to_string(ep_.rank()) + " expected a '" + want + "' message, got '" +
         m.payload.substr(0, 40) + "' from rank " + std::to_string(m.sender));
  }
  return m;
}

bool SocketTransport::all_agree(bool mine) {
  bool all = mine;
  if (ep_.rank() == 0) {
    std::vector<bool> heard(num_ranks_, false);
    for (int i = 1; i < num_ranks_; ++i) {
      const Message m = expect("vote");
      if (m.sender <= 0 || m.sender >= num_ranks_ || heard[m.sender])
        fail("duplicate or unknown vote from rank " + std::to_string(m.sender));
      heard[m.sender] = true;
      all = all && m.payload.back() == '1';
    }
    for (int r = 1; r < num_ranks_; ++r) ep_.send(r, -1, tag("result") + (all ? "1" : "0"), timeout_ms_);
  } else {
    ep_.send(0, -1, tag("vote") + (mine ? "1" : "0"), timeout_ms_);
    all = expect("result").payload.back() == '1';
  }
  ++step_;
  return all;
}

int SocketTransport::share_fd(int fd) {
  int out = fd;
  if (ep_.rank() == 0) {
    if (fd < 0) fail("the root must share a valid fd");
    for (int r = 1; r < num_ranks_; ++r) ep_.send(r, fd, tag("fd"), timeout_ms_);
  } else {
    out = expect("fd").fd;
  }
  ++step_;
  return out;
}

}  // namespace pk::fdpass
