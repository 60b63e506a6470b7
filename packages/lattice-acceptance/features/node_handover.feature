Feature: The next job in line takes a node the moment the job before it ends
  When a node is busy and work waits, the scheduler queues the job that will follow on
  it (its reservation) as the node's next allocation. The commit that ends the running
  job hands the node to that next job at once, without a scheduling round trip, and the
  scheduler then queues the one after it. A hand-over checks everything an assignment
  does; what cannot follow (a cancelled job) leaves the node to the next cycle.

  Each scenario runs on its own real cluster with one node.

  Scenario: Jobs waiting for a single node follow one another without a scheduling round trip
    Given a Lattice cluster with 1 node running a job until released
    And two jobs that run until released waiting behind it
    When the running job is released
    Then the first waiting job runs on the node
    And the node shows the second waiting job as its next allocation
    When the first waiting job is released
    Then the second waiting job runs on the node, started by the commit that ended the first

  Scenario: A cancelled next job does not take the node
    Given a Lattice cluster with 1 node running a job until released
    And two jobs that run until released waiting behind it
    When the running job is released
    And the first waiting job runs on the node
    And the node's next allocation is cancelled
    And the first waiting job is released
    Then the cancelled job never ran
    And the node is free

  Scenario: Queueing a node's next job sends its agent nothing new
    Given a Lattice cluster with 1 node running a job until released
    And two jobs that run until released waiting behind it
    When the running job is released
    Then the first waiting job runs on the node
    And the node shows the second waiting job as its next allocation
    And the server has sent the node's agent four desired states: an idle node, the first job, the node idle again, the job that took it
    And the server's metrics count the queued next job as a change that left the agent's work as it was

  Scenario: A job submitted while the node is busy is weighed at the next hand-over, not only at the periodic cycle
    Given a Lattice cluster with 1 node whose scheduler cycles by itself only once a minute, running a job until released
    And two jobs that run until released waiting behind it
    When the running job is released
    Then the first waiting job runs on the node
    And the node shows the second waiting job as its next allocation
    When a job of a higher preemption class that runs until released is submitted
    And the first waiting job is released
    Then the second waiting job runs on the node, started by the commit that ended the first
    And the node shows the higher-class job as its next allocation well before the periodic cycle
