Feature: Preemption through checkpoints, suspend and resume
  A job that declares a checkpoint protocol (`#LATTICE --checkpoint=signal|shmem|grpc`)
  is asked to checkpoint instead of being killed when a job of a higher class needs its
  nodes: it goes Checkpointing, writes its checkpoint into the directory the agent gave
  it, and becomes Suspended with the checkpoint recorded and its nodes released; then it
  goes back to the queue with its original submit time and, when it runs again, resumes
  from that checkpoint (LATTICE_RESUME=1, LATTICE_CHECKPOINT_PATH). A job that does not
  answer is stopped (SIGTERM, grace, SIGKILL) and ends Failed, not Suspended. Its owner
  can also suspend it (`lattice suspend`) and resume it (`lattice resume`), or have it
  checkpoint now and keep running (`lattice checkpoint`). The checkpoint signal (SIGUSR1,
  which ends a process that does not catch it) goes to the processes of the job's process
  group that catch it, once one does: an application run as a child of its batch script
  checkpoints and the script runs on, and a job in which nothing catches it is never ended
  by a request (the request times out). Every step runs against a real
  local cluster and real test applications that count.

  Scenario: A counting job preempted by a class-8 job checkpoints, is Suspended and resumes from its counter
    Given a Lattice cluster with 1 node that keeps checkpoints
    And a class-3 job "counter" submitted with "--checkpoint=shmem" that counts to 160
    When I submit a job "urgent" of class 8
    Then the watch of "counter" shows Running, Checkpointing, then Suspended
    And lattice status of "counter" names its checkpoint, and the saved counter is there
    And "urgent" started only after "counter" had released its node and ends Completed
    And "counter" runs again, resumes from its saved counter and ends Completed

  Scenario: A job that ignores the checkpoint request ends Failed, not Suspended
    Given a Lattice cluster with 1 node that keeps checkpoints
    And a class-3 job "deaf" submitted with "--checkpoint=signal" that ignores checkpoint requests
    When I submit a job "urgent" of class 8
    Then "deaf" ends Failed with reason "checkpoint_timeout" and was never Suspended
    And "urgent" ends Completed

  Scenario: Its owner suspends a job and resumes it later
    Given a Lattice cluster with 1 node that keeps checkpoints
    And a class-3 job "counter" submitted with "--checkpoint=grpc" that counts to 160
    When the owner runs "lattice suspend" on "counter"
    Then "counter" becomes Suspended and stays Suspended
    When the owner runs "lattice resume" on "counter"
    Then "counter" runs again, resumes from its saved counter and ends Completed

  Scenario: Its owner has a job checkpoint now, and it keeps running
    Given a Lattice cluster with 1 node that keeps checkpoints
    And a class-3 job "counter" submitted with "--checkpoint=signal" that counts to 100000
    When the owner runs "lattice checkpoint" on "counter"
    Then lattice status of "counter" names a checkpoint while it is still Running
    And "counter" keeps counting past its saved counter

  Scenario: An application run as a child of its batch script checkpoints and the script runs on
    Given a Lattice cluster with 1 node that keeps checkpoints
    And a class-3 job "wrapped" submitted with "--checkpoint=signal" that runs its application as a child of its script
    When the owner runs "lattice checkpoint" on "wrapped"
    Then lattice status of "wrapped" names a checkpoint while it is still Running
    And "wrapped" keeps counting past its saved counter

  Scenario: A checkpoint request never ends a job in which nothing catches SIGUSR1
    Given a Lattice cluster with 1 node that keeps checkpoints
    And a class-3 job "deaf" submitted with "--checkpoint=signal" that ignores checkpoint requests
    When the owner runs "lattice checkpoint" on "deaf"
    Then the checkpoint of "deaf" times out without a signal, and it is still Running and counting
