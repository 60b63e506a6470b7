Feature: Borrowing idle nodes between vClusters
  Every node has a home vCluster. A vCluster whose own nodes are busy borrows the idle
  nodes of another, and `lattice nodes` shows who owns a node and where it is at home.
  When the home vCluster needs its node back, the work that borrowed it is preempted,
  whatever its class, and goes back to the queue without losing its place.

  The scenario starts its own small real cluster (one quorum member, a scheduler for
  each vCluster cycling every second and node agents that run real processes here), and
  users act through the `lattice` CLI.

  Scenario: A vCluster borrows an idle node of another and gives it back when its home vCluster needs it
    Given a Lattice cluster with the vClusters "a" and "b", each the home of one node
    When I submit the jobs "b-1" and "b-2" to vCluster "b", which run until released
    Then both run, one of them on the node at home in "a"
    And lattice nodes shows that node at home in "a" and owned by "b"
    When I submit a job "a-1" of class 1 to vCluster "a"
    Then "a-1" runs on the node at home in "a" and ends Completed
    And the job of "b" that ran there was preempted once and kept its original submit time
