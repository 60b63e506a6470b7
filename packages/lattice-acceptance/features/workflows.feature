Feature: Workflows: dependencies between jobs and DAGs
  A job can wait for others, as with sbatch --dependency: afterok (they completed),
  afternotok (they failed or were cancelled), afterany (they ended). A waiting job stays
  Pending, out of the queue, even with nodes free; when its predecessor ends, the job
  enters the queue in the same step, or it is cancelled with a reason naming the
  predecessor if its condition can no longer hold. A DAG is such a workflow submitted
  as one YAML file with `lattice dag submit`: it is checked as a whole before anything
  is stored.

  Every step runs against a real local cluster: a quorum member, a scheduler and two
  node agents on this machine.

  Background:
    Given a running Lattice cluster with 2 nodes for workflows

  Scenario: A job submitted with --dependency=afterok waits for its predecessor to complete
    Given a job "first" that runs until released
    When I submit a job "second" with --dependency=afterok on "first"
    Then "second" stays Pending with the reason "waiting for dependencies" while a node is free
    When "first" is released
    Then "first" and "second" end Completed, in that order

  Scenario: A failed predecessor cancels its afterok successor and starts its afternotok one
    Given a job "train" that fails with exit code 3
    And a job "evaluate" submitted with --dependency=afterok on "train"
    And a job "notify" submitted with --dependency=afternotok on "train"
    When "train" is released
    Then "evaluate" ends Cancelled with the reason "dependency never satisfied: <train> failed (needed success)"
    And "notify" ends Completed

  Scenario: An sbatch script's #SBATCH --dependency line is honoured
    Given a job "producer" that runs until released
    When I submit a script with "#SBATCH --dependency=afterany:<producer>" as "consumer"
    Then "consumer" stays Pending with the reason "waiting for dependencies" while a node is free
    When "producer" is released
    Then "producer" and "consumer" end Completed, in that order

  Scenario: A dependency Lattice cannot keep is refused and nothing is stored
    When I run lattice submit with --dependency=afterok:1?afterok:2
    Then the submission is refused with "which Lattice does not support"
    And the error carries a "Hint:" line
    And no allocation was stored

  Scenario: A diamond DAG from YAML runs each stage after the ones it depends on
    When I submit with lattice dag submit a DAG "diamond" where "b" and "c" follow "a" and "d" follows "b" and "c"
    Then lattice confirms "Submitted DAG" with 4 allocations
    And lattice dag status shows "b", "c" and "d" Blocked while "a" has not ended
    And every stage ends Completed, "a" first and "d" last
    And lattice dag status shows the DAG Completed

  Scenario: A 4-stage pipeline runs its stages in order
    When I submit with lattice dag submit a pipeline "pipe" of the stages "s1", "s2", "s3" and "s4"
    Then every stage ends Completed, in the order "s1", "s2", "s3", "s4"
    And lattice dag status shows the DAG Completed

  Scenario: A failure branch of a DAG runs only when its predecessor fails
    When I submit with lattice dag submit a DAG "guarded" where "train" exits with code 2, "evaluate" follows it on success and "notify" on failure
    Then "evaluate" of the DAG ends Cancelled with the reason "dependency never satisfied: train failed (needed success)"
    And "notify" of the DAG ends Completed
    And lattice dag status shows the DAG Completed

  Scenario: A DAG with a cycle is refused with the cycle's path and nothing is stored
    When I submit with lattice dag submit a DAG whose "a" follows "c", "b" follows "a" and "c" follows "b"
    Then the submission is refused with "dependency cycle: a -> b -> c -> a"
    And no allocation was stored

  Scenario: Jobs of one user with the same name and --dependency=singleton run one at a time
    Given a job "nightly-1" named "nightly" with --dependency=singleton that runs until released
    When I submit a job "nightly-2" named "nightly" with --dependency=singleton
    Then "nightly-2" stays Pending with the reason "waiting for its singleton mutex: another job named 'nightly' runs" while a node is free
    When "nightly-1" is released
    Then "nightly-1" and "nightly-2" end Completed, in that order

  Scenario: aftercorr over two 10-task arrays starts element i after element i of the first array
    When I submit with lattice dag submit two 10-task arrays "pre" and "train" where "train" follows "pre" element by element
    Then all 20 tasks end Completed
    And every "train" element started after the "pre" element with its index ended
