Feature: Node agents
  Every node runs a node agent. It tells the quorum what its node is (its GPUs, memory
  domains and the links between them) and a conformance fingerprint of what is
  installed, and it runs the node's allocations. Work outlives its agent: a restarted
  agent takes its running allocations back. A node whose agent falls silent is Degraded
  after the heartbeat timeout and keeps its work; when it stays silent for the grace
  period as well it is Down, and its batch work is requeued on another node. A node
  that reports another fingerprint than before is recorded as drifted, and its work
  goes on.

  Every step runs against a real local cluster: a quorum member, a scheduler and two
  node agents on this machine, with a heartbeat every 0.5 s, a heartbeat timeout of 3 s
  and a grace period of 3 s.

  Background:
    Given a running Lattice cluster with 2 nodes

  Scenario: A node reports its topology and its conformance fingerprint
    When I look at a node with lattice nodes
    Then its conformance group is a fingerprint its agent computed, which is also the baseline it is expected to keep
    And its capabilities list its GPUs, GPU links, memory domains and memory interconnects
    And its memory domains come from this machine's NUMA nodes, with at least one CPU
    And the REST API holds the same fingerprint and memory domains for the node

  Scenario: A node whose agent comes back with another fingerprint is recorded as drifted while its job runs on
    Given a job that runs until I release it
    When the agent of the job's node restarts with the conformance group "cg-other"
    Then lattice nodes shows the node in conformance group "cg-other", drifted from its baseline
    And the node's state reason is "conformance_drift: expected=<baseline>, actual=cg-other"
    And the job is still Running on the node

  Scenario: A running job survives a restart of its node's agent and runs once
    Given a job that runs for 3 seconds
    When the agent of the job's node is killed with SIGKILL
    Then the job's processes live on and the job is still Running
    When the agent is started again
    Then the job ends Completed with exit code 0 on the same node, never requeued
    And the job went through Running and Completed only
    And the job ran once

  Scenario: A node whose agent stays silent goes Degraded, then Down, and its job is requeued
    Given a job that runs for 4 seconds
    When the job's node dies: its agent and the job's processes are killed
    Then the node goes Ready, Degraded, then Down, and Down no sooner than the heartbeat timeout and the grace period after
    And the job kept Running while the node was Degraded
    And the job ends Completed with exit code 0 on the other node, requeued once and with its original submit time
    And the job started on both nodes and finished on the other one
    When the agent is started again
    Then the node is Ready again and holds nothing

  Scenario: Following the output of a job whose node dies ends by saying the job went back to the queue
    Given a job that prints a line every half second until I release it
    And the other node is busy with a job that runs until I release it
    When I follow the job's output with lattice logs --follow
    And the job's node dies: its agent and the job's processes are killed
    Then the follow shows the job's lines, then ends saying the job went back to the queue, with a hint to follow it again once it runs
    And the job is Pending, waiting for a node

  Scenario: A node silent for less than the grace period comes back Ready and its job is undisturbed
    Given a job that runs for 6 seconds
    When the agent of the job's node stops answering
    Then the node goes Degraded, still holding the job, which keeps Running
    When the agent answers again
    Then the node is Ready again
    And the job ends Completed with exit code 0 on the same node, never requeued
    And the job ran once
