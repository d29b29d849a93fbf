// The job-level half of failure handling: once this process's runtime has failed (its own
// collective failed, or a peer failed or died), the process must end soon, whether or not
// the program notices, so that the whole job ends under any launcher instead of waiting on a
// process stuck in user code, in MPI_Finalize or in interpreter teardown. PyTorch's NCCL
// watchdog tears its process down for the same reason.
#pragma once

#include <string>

namespace keras_ring {

// Ends this process (stderr message, exit code kFailureExitCode) `grace_seconds` from now
// unless it has exited by then or DisarmFailureExit() is called first. The program gets the
// grace to raise and exit on its own. A second call while armed changes nothing; a grace <= 0
// arms nothing (the program owns the failure).
void ArmFailureExit(double grace_seconds, int rank, const std::string& cause);

// Cancels a pending failure exit: the program recovered (a new runtime was started).
void DisarmFailureExit();

constexpr int kFailureExitCode = 70;  // EX_SOFTWARE

}  // namespace keras_ring
