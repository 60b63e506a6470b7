Feature: Scheduling engine
  The scheduler decides which waiting allocation runs, where and when. A short job may
  use the idle nodes in front of a reservation, as long as it cannot delay the job that
  holds the reservation. A job of a higher preemption class takes nodes from jobs of a
  lower class, which go back to the queue without losing their place; a job of the same
  class waits. A job may ask for a range of nodes and start with what is free. A sensitive
  allocation claims its node for its user until that user gives it back. A waiting job
  says why it waits, and an administrator can change how the queue is ranked while the
  cluster runs.

  Every scenario starts its own small real cluster (one quorum member, a scheduler
  cycling every second and one to three node agents that run real processes here), and
  users act through the `lattice` CLI.

  Scenario: A short job backfills the gap in front of a reservation, a longer one waits
    Given a Lattice cluster with 2 nodes
    And a job "long" of class 9 with a walltime of 10m running on one node
    And a job "wide" of class 7 that needs 2 nodes waiting Pending for the busy node
    When I submit a job "short" of class 1 with a walltime of 2m
    And I submit a job "too-long" of class 1 with a walltime of 30m
    Then "short" runs at once on the free node while "wide" is still Pending
    And "short" ends Completed
    And "too-long" stays Pending next to the idle node while "wide" waits
    When I cancel "long" with lattice cancel
    Then "wide" runs on both nodes and ends Completed
    And "too-long" started only after "wide" had started, and ends Completed

  Scenario: A class-8 job preempts class-2 jobs, which are requeued and complete later
    Given a Lattice cluster with 2 nodes
    And a job of class 2 that runs for 5 seconds running on every node
    When I submit a job "urgent" of class 8 that needs 2 nodes
    Then "urgent" runs on both nodes while the class-2 jobs would still be running
    And "urgent" ends Completed
    And lattice logs of "urgent" show that it started once and finished once
    And every class-2 job was preempted once and kept its original submit time
    And every class-2 job runs again after "urgent" and ends Completed
    And lattice status of every class-2 job shows "Preempted count:" 1
    And lattice logs of every class-2 job show that it started twice and finished once

  Scenario: A job never preempts a running job of the same class
    Given a Lattice cluster with 1 node
    And a job "first" of class 5 that runs until released
    When I submit a job "second" of class 5
    Then "second" stays Pending while "first" runs
    When I release "first"
    Then "first" ends Completed and was never preempted
    And "second" ends Completed

  Scenario: A sensitive allocation claims its node until its user releases it
    Given a Lattice cluster with 2 nodes and a "sensitive" vCluster
    When alice submits a job to the sensitive vCluster with lattice submit
    Then alice's job ends Completed at preemption class 10
    And lattice nodes shows alice's node "Claimed by" alice although her job has ended
    When bob submits a job "bob-long" that runs until released
    And bob submits a job "bob-next"
    Then "bob-long" runs on the node that is not claimed
    And "bob-next" stays Pending although alice's claimed node is idle
    And alice's next sensitive job runs on her claimed node
    When alice releases her node with lattice node release
    Then lattice confirms that the node is released, Ready and unclaimed
    And lattice nodes shows nobody in "Claimed by" for the node
    And "bob-next" runs on the released node and ends Completed

  Scenario: A sensitive job's output never reaches the cluster's shared log store
    Given a Lattice cluster with 2 nodes and a "sensitive" vCluster
    When alice submits a job to the sensitive vCluster with lattice submit
    And bob submits a job "bob-plain"
    Then alice's job ends Completed at preemption class 10
    And "bob-plain" ends Completed
    And the cluster's log store holds the output of "bob-plain" and nothing of alice's job

  Scenario: Releasing a node that nobody claimed is refused with a hint
    Given a Lattice cluster with 1 node
    When I release the node with lattice node release
    Then lattice refuses with an error mentioning "is not claimed"
    And the error carries a "Hint:" line
    And the node is still Ready and unclaimed

  Scenario: The hint for releasing an unclaimed node names a command that works
    Given a Lattice cluster with 1 node
    When I release the node with lattice node release
    Then the lattice command named in the hint runs without error

  Scenario: A job for a GPU type that no node has yet waits for it when told to, and says so
    Given a Lattice cluster with 1 node
    When I submit a job with lattice submit --constraint gpu_type=H100 --wait-for-capacity
    Then the job stays Pending although the node is idle
    And lattice status of the job shows "Pending reason:" "waiting for capacity: needs 1 node, vCluster default has 0 that match"
    And lattice status of the job with --verbose shows "Pending reason:" "waiting for capacity: needs 1 node, vCluster default has 0 that match"
    And the REASON column of lattice status --verbose shows "waiting for capacity: needs 1 node, vCluster default has 0 that match" for the job

  Scenario: A job waiting for a busy node says that all suitable nodes are occupied
    Given a Lattice cluster with 1 node
    And a job "holder" of class 9 that runs until released
    When I submit a job with lattice submit
    Then the job stays Pending while "holder" runs
    And lattice status of the job with --verbose shows "Pending reason:" "all suitable nodes occupied"
    When I release "holder"
    Then the job ends Completed

  Scenario: A job over its tenant's node quota says it waits for quota headroom
    Given a Lattice cluster with 2 nodes
    And the administrator creates the tenant "capped" with at most 1 node
    And a job "capped-hold" of tenant "capped" that runs until released
    When I submit a job with lattice submit --tenant=capped
    Then the job stays Pending although a node is idle
    And lattice status of the job shows "Pending reason:" "waiting for quota headroom: tenant capped holds 1 of max_nodes 1, this allocation needs 1 more"

  Scenario: A job asking for a range of nodes starts with the nodes that are free
    Given a Lattice cluster with 3 nodes
    And a job "holder" of class 9 that runs until released
    When I submit a job with lattice submit --nodes=3 --min-nodes=1
    Then the job runs on the 2 free nodes and ends Completed

  Scenario Outline: Changing a vCluster's weights changes which waiting job starts first
    Given a Lattice cluster with 1 node
    And a job "holder" of class 9 that runs until released
    And a job "old-low" of class 2 waiting Pending
    And a second later a job "new-high" of class 8 waiting Pending
    When the administrator sets the weights of vCluster "default" to priority <priority> and wait time <wait_time>, and every other weight to 0
    Then lattice admin vcluster list shows those weights for "default"
    And lattice admin vcluster show default shows those weights
    When I release "holder"
    Then "<first>" starts before "<second>" and both end Completed

    Examples:
      | priority | wait_time | first    | second   |
      | 0        | 1         | old-low  | new-high |
      | 1        | 0         | new-high | old-low  |
