Feature: Autoscaling of reactive allocations
  A reactive allocation (`lattice submit --lifecycle reactive --min-nodes N --max-nodes M
  --scale-metric METRIC --scale-target T`) starts with min_nodes and the scheduler adds
  one node at a time while its metric stays at or above the target for the scale-up
  window, never past max_nodes, and removes one at a time while it stays at or below
  target x scale_down_threshold for the scale-down window, with a cooldown after every
  change. `lattice status` shows the nodes, the target, the bounds and the last decision
  with its reason.

  Every step runs against a real local cluster: a quorum member, a scheduler, three node
  agents and a VictoriaMetrics. The scenario is the load generator: it pushes the
  allocation's cpu_utilization as the agents do.

  Background:
    Given a running Lattice cluster with 3 nodes and a TSDB

  Scenario: A busy reactive service grows to its max_nodes and shrinks back when idle
    Given a reactive job "svc" scaling on cpu_utilization from 2 to 3 nodes with a 6 s cooldown
    Then "svc" runs on 2 nodes
    When the load of "svc" rises to 0.9
    Then "svc" grows to 3 nodes and no further
    And `lattice status` of "svc" says it scaled up because cpu_utilization was at or above 0.80
    When the load of "svc" falls to 0.05
    Then "svc" shrinks back to 2 nodes

  Scenario: A service that checkpoints is asked to checkpoint before a node is released
    Given a reactive job "ckpt" that checkpoints by signal, scaling from 2 to 3 nodes with a 4 s cooldown
    When the load of "ckpt" rises to 0.9
    Then "ckpt" grows to 3 nodes and no further
    When the load of "ckpt" falls to 0.05
    Then `lattice status` of "ckpt" says its newest node is released after its checkpoint
    And "ckpt" shrinks back to 2 nodes once its checkpoint is recorded
