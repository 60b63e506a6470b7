Feature: MPI launch without ssh
  `lattice launch` starts a program as ranks inside a Running allocation, the way srun
  does. Node i of the launch gets ranks [i*K, (i+1)*K) with --tasks-per-node K. The node
  agents are the MPI process manager: each serves PMI to its ranks over an inherited
  socket, and MPI_Init's barriers cross the nodes between the agents, so no ssh is ever
  needed. What the ranks print comes back as it is written; the command exits with the
  launch's status. A rank that aborts, a barrier that never completes, or an agent that
  dies ends the launch on every node, and nothing of it is left running.

  Every step runs against a real local cluster: a quorum member, a scheduler and two
  node agents on this machine, with real MPICH programs. A PMI barrier that is not
  complete after 3 s is a fence timeout.

  Background:
    Given a running Lattice cluster with 2 nodes for MPI
    And a Running allocation of 2 nodes submitted by "alice"

  Scenario: An MPI program runs as 4 ranks on 2 nodes and no ssh process ever exists
    When "alice" runs the MPI rank-sum program with lattice launch -n 4 --tasks-per-node 2 --label
    Then the launch exits with status 0
    And every rank reports size 4 and the sum of all ranks 6, prefixed with its rank
    And ranks 0 and 1 ran on one node and ranks 2 and 3 on the other
    And no ssh process existed while the launch ran

  Scenario: A rank calling MPI_Abort with 7 ends the launch with 7 on every node
    When "alice" runs the MPI program whose rank 3 calls MPI_Abort with 7, 4 ranks on 2 nodes
    Then the launch exits with status 7
    And lattice launch says it failed at rank 3 on the node of rank 3
    And no rank of the launch is still running on either node

  Scenario: A rank that never reaches MPI_Init makes the PMI fence time out
    When "alice" runs the MPI rank-sum program with rank 3 held before MPI_Init, 4 ranks on 2 nodes
    Then the launch exits with status 1 within 30 seconds
    And lattice launch says "PMI fence timeout"
    And no rank of the launch is still running on either node

  Scenario: A program that is not MPI gets its rank and the launch's size in its environment
    When "alice" runs "echo rank $LATTICE_RANK of $LATTICE_NPROCS on $LATTICE_NNODES nodes" with lattice launch --pmi none --tasks-per-node 2 --label
    Then the launch exits with status 0
    And the output is "[0] rank 0 of 4 on 2 nodes", "[1] rank 1 of 4 on 2 nodes", "[2] rank 2 of 4 on 2 nodes" and "[3] rank 3 of 4 on 2 nodes"

  Scenario: Nobody launches tasks in another user's allocation
    When "mallory" runs "touch pwned" with lattice launch in alice's allocation
    Then the launch is refused with "belongs to alice"
    And nothing was started

  Scenario: More ranks than the nodes can take at the asked tasks per node is refused
    When "alice" runs "true" with lattice launch -n 5 --tasks-per-node 2
    Then the launch is refused with "5 tasks at 2 per node need 3 nodes; the launch has 2"
    And the refusal has a hint

  Scenario: Tasks launch only in a Running allocation
    Given a Pending allocation of 3 nodes submitted by "alice" that waits for capacity
    When "alice" runs "true" with lattice launch in the Pending allocation
    Then the launch is refused with "not Running"
    And the refusal has a hint
