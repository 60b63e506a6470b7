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
