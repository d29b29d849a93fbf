// The job-level half of failure handling: once this process's runtime has failed (its own
// collective failed, or a peer failed or died), the process must end soon, whether or not
// the program notices, so that the whole job ends under any launcher instead of waiting on a
// process stuck in user code, in MPI_Finalize or in interpreter teardown. PyTorch's NCCL
// watchdog tears its process down for the same reason.
#pragma once

#include <string>

namespace keras_ring {

// Ends this process (stderr message, exit code kFailureExitCode, or the program's own status
// once LeaveUnfinalizedAtExit's handler has seen it) `grace_seconds` from now
// unless it has exited by then or DisarmFailureExit() is called first. The program gets the
// grace to raise and exit on its own. A second call while armed changes nothing; a grace <= 0
// arms nothing (the program owns the failure).
void ArmFailureExit(double grace_seconds, int rank, const std::string& cause);

// Cancels a pending failure exit: the program recovered (a new runtime was started). Forgets
// a stalled peer too.
void DisarmFailureExit();

// Records that this process's runtime failed because a peer did not take part in time. Such a
// peer may be unable to run at all (stopped, stuck in the kernel), so it never ends by itself,
// and how this process leaves decides whether its launcher ends the job.
void NoteStalledPeer();
bool PeerStalled();

// Makes this process's exit() end it, with the program's own exit status, before the exit
// handlers registered earlier run: MPICH's finalizes PMI there, after which its launcher
// takes this rank for finished and waits for a stalled peer for ever, whatever the status.
// Unfinalized, the rank's end makes the launcher stop the job. The exit first waits until
// the failure grace (and a second) has passed since the stall, so a peer stuck in user code
// ends itself saying why. The failure exit's timer is replaced by one bounding the exit from
// now (a grace, and a second past that wait): it ends a teardown that hangs, with the
// program's status once exit() has begun. With `ask_launcher`, the exit first asks MPICH's
// launcher to end the job (PMI's abort, with the program's status): Hydra missed the
// unfinalized end in 2 of about 60 jobs. Call once the interpreter is finishing (the
// handler must be registered after MPICH's); later calls change nothing.
void LeaveUnfinalizedAtExit(double grace_seconds, bool ask_launcher);

// The program's own code has finished after its job failed (the interpreter is exiting): what
// is left is teardown, which can outlast the grace since the failure on a loaded machine
// (TensorFlow's took 4 s at a load of 8 on 2 cores), and ended with 70 a program that had
// handled the failure and was leaving with its own status. The exit gets a grace of its own
// from now; a timer that fires once exit() has begun ends the process with the program's
// status. Nothing where the failure exit is not armed (the job did not fail, or the grace
// is off); for a stalled peer under MPI, LeaveUnfinalizedAtExit bounds the exit instead.
void BoundExitAfterFailure(double grace_seconds);

constexpr int kFailureExitCode = 70;  // EX_SOFTWARE

}  // namespace keras_ring
