Feature: Checkpoints on a shared file system that stops answering
  When the checkpoint root is a directory on a shared file system (NFS, Lustre), the
  node agent first writes a small probe file there before it asks a job to checkpoint
  for a preemption or a suspend. If the directory is gone (the share is unmounted) or
  the probe does not finish in a few seconds (a hung mount), the checkpoint could not be
  kept: the job is stopped without one (SIGTERM, grace, SIGKILL) and ends Failed, saying
  that checkpoint storage is unavailable, instead of waiting on a write that never
  ends. The checkpoint broker reports the same outage. Every step runs against a real
  local cluster and a real test application that counts.

  Scenario: With the checkpoint directory unmounted, a job that must stop ends Failed
    Given a Lattice cluster with 1 node that keeps checkpoints in a shared directory
    And a class-3 job "counter" submitted with "--checkpoint=signal" that counts to 100000
    When the shared checkpoint directory is unmounted
    Then the checkpoint broker reports checkpoint storage unavailable
    When the owner runs "lattice suspend" on "counter"
    Then "counter" ends Failed because checkpoint storage is unavailable and was never Suspended
    And "counter" never wrote a checkpoint
