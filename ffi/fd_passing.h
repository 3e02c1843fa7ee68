// File-descriptor exchange between the processes of one job on one host (multicast handles and POSIX-fd
// memory handles are fds, which only a Unix-domain socket can carry: SCM_RIGHTS).
//
// Security: the sockets live in a per-job directory created with mkdtemp (mode 0700, owned by us, under
// $XDG_RUNTIME_DIR, else $TMPDIR, else /tmp), so another user cannot even reach them; on top of that every
// accepted connection's SO_PEERCRED must show our uid and, once the job's pids are known, a pid of the
// job (the one of the rank the message claims to come from). Every call is bounded by a timeout.
// Pure host code: unit-tested on CPU.
#pragma once
#include <sys/types.h>

#include <string>
#include <vector>

#include "multicast_group.h"

namespace pk::fdpass {

// Creates the job directory (0700) and returns its path. Throws std::runtime_error on failure.
std::string create_job_dir();
// Throws unless `path` is a directory (not a link) owned by our effective uid with mode 0700, so a
// process joining the job never uses a directory another user could have prepared or can enter.
void check_job_dir(const std::string& path);

struct PeerCredentials {
  pid_t pid;
  uid_t uid;
};

// Why a connecting peer is rejected, "" when it is accepted: its uid must be `my_uid`; when `job_pids`
// is not empty its pid must be one of them.
std::string check_peer(const PeerCredentials& peer, uid_t my_uid, const std::vector<pid_t>& job_pids);

struct Message {
  int sender = -1;      // the rank the peer sent from (its pid checked against job_pids[sender] when known)
  int fd = -1;          // the received fd (owned by the caller), -1 when none came
  std::string payload;  // up to kMaxPayload bytes
};

constexpr size_t kMaxPayload = 1 << 16;

// The socket of one rank: listens on <dir>/rank-<rank>.sock; one message per connection.
class Endpoint {
 public:
  // `job_pids[r]`: pid of rank r when known (else empty: then only the uid is checked).
  Endpoint(const std::string& dir, int rank, std::vector<pid_t> job_pids = {});
  ~Endpoint();
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  // Sends `payload` and, when fd >= 0, a duplicate of `fd` (the caller keeps its own) to rank `peer`;
  // waits up to timeout_ms for the peer to listen. Throws on timeout or error.
  void send(int peer, int fd, const std::string& payload, int timeout_ms);
  // The next message from an accepted peer; connections failing the credential check are closed and
  // counted, and the wait goes on until timeout_ms, then throws naming the rejections.
  Message receive(int timeout_ms);

  void set_job_pids(std::vector<pid_t> pids) { job_pids_ = std::move(pids); }
  int rejected() const { return rejected_; }
  const std::string& path() const { return path_; }
  int rank() const { return rank_; }

 private:
  std::string socket_path(int rank) const;

  std::string dir_;
  std::string path_;
  int rank_;
  int listen_fd_ = -1;
  std::vector<pid_t> job_pids_;
  int rejected_ = 0;
  std::string last_rejection_;
};

// MulticastTransport over endpoints: rank 0 is the root and the hub (others talk only to it).
class SocketTransport final : public MulticastTransport {
 public:
  SocketTransport(Endpoint& endpoint, int num_ranks, int timeout_ms);
  bool all_agree(bool mine) override;
  int share_fd(int fd) override;
  void barrier() override { all_agree(true); }

 private:
  std::string tag(const char* kind) const;
  Message expect(const char* kind);

  Endpoint& ep_;
  int num_ranks_;
  int timeout_ms_;
  int step_ = 0;  // lockstep counter: a message from another step is a protocol error
};

}  // namespace pk::fdpass
