Feature: Allocation lifecycle
  A user submits work with the `lattice` CLI, watches it run, reads its output and
  cancels it; an operator drains a node for maintenance and gives it back. Every step
  runs against a real local cluster: a quorum member, a scheduler and two node agents
  that start real processes on this machine. (Submissions that are refused are in
  bad_input.feature.)

  Background:
    Given a running Lattice cluster with 2 nodes

  Scenario: A batch job that prints hello runs to completion
    When I submit a batch script that prints "hello"
    Then the submission is acknowledged as Pending
    And lattice status shows the job Running
    And the job ends Completed with exit code 0
    And the job went through Pending, Running and Completed, in that order
    And the job ended within 6 seconds of its submission, after running its 2 second sleep
    And lattice logs of the job show "hello" and nothing else

  Scenario: A job that outlives its walltime is killed and fails with walltime_exceeded
    When I submit a batch script with a walltime of 2 seconds that sleeps for 60 seconds
    Then the job ends Failed with reason "walltime_exceeded"
    And lattice status shows reason "walltime_exceeded"
    And the job ran for at least its walltime but was stopped well before it would have finished
    And none of the job's processes are left running
    And the job's node is free again

  Scenario: A job that ignores SIGTERM at walltime is killed after the grace period
    When I submit a batch script with a walltime of 2 seconds that ignores SIGTERM and sleeps for 60 seconds
    Then the job ends Failed with reason "walltime_exceeded"
    And lattice logs of the job contain "caught SIGTERM"
    And the job ran for at least its walltime but was stopped well before it would have finished
    And none of the job's processes are left running

  Scenario: Cancelling a running job kills it and gives its node to the next job
    Given a long job running on every node
    And another job waiting Pending because no node is free
    When I cancel the first long job with lattice cancel
    Then lattice cancel confirms "Cancelled allocation" for it
    And the cancelled job ends Cancelled
    And none of the cancelled job's processes are left running
    And the other long job is still Running
    And the waiting job starts Running on the node the cancelled job used
    And cancelling the cancelled job again is refused with a hint

  Scenario: A cancelled job's node goes to the next job only once its processes are gone
    Given a long job that traps SIGTERM running on every node
    And another job waiting Pending because no node is free
    When I cancel the first long job with lattice cancel
    Then the cancelled job ends Cancelled
    And the waiting job starts Running on the node the cancelled job used
    And the waiting job did not start while the cancelled job's processes were still running

  Scenario: Draining a node waits for its running job, then the node can be undrained
    Given a job that runs until I release it
    When the operator drains the node running it with reason "maintenance"
    Then lattice reports the node is now Draining
    And the node stays Draining while the job runs
    And a new job is placed on the other node
    And undraining the node is refused with a hint while it is Draining
    When I release the job
    Then the job ends Completed with exit code 0
    And the node becomes Drained
    When the operator undrains the node
    Then lattice reports the node is now Ready
    And a job that needs both nodes runs to completion
