Feature: Admission, waiting and start estimates
  Lattice tells a user at once when a job can never run as asked, instead of letting it
  wait forever: more nodes than the vCluster could ever offer, a node property that no
  node has, or more nodes than the tenant may ever hold. Nothing is stored then. A user
  who knows that nodes are coming may ask to wait for capacity instead. A job that waits
  says why, with numbers, and when it is expected to start; a user can ask when a job
  would start without submitting it, and look at the whole queue of a vCluster.

  Every scenario starts its own small real cluster (one quorum member, a scheduler
  cycling every second and real node agents), and users act through the `lattice` CLI.

  Scenario Outline: A job that can never run is refused at submission and nothing is stored
    Given a Lattice cluster with 2 nodes
    And the administrator creates the tenant "capped" with at most 1 node
    When I run lattice submit <flags> and keep a list of every allocation from before
    Then lattice refuses the submission with an error saying '<error>'
    And the refusal explains itself with '<detail>'
    And lattice status --all shows the same allocations as before
    When I POST the same request to the REST API
    Then the API answers <status> <code> and again nothing is stored

    Examples:
      | flags                      | error                                                                                                      | detail                 | status | code           |
      | --nodes 8                  | allocation rejected: needs 8 nodes, vCluster "default" could offer at most 2 that match                    | --wait-for-capacity    | 422    | unsatisfiable  |
      | --constraint gpu_type=H100 | no registered node has gpu_type "H100"                                                                     | Available:             | 422    | unsatisfiable  |
      | --tenant=capped --nodes 2  | allocation rejected: tenant "capped" would exceed max_nodes quota (current: 0, requested: 2, limit: 1)     | Hint:                  | 429    | quota_exceeded |

  Scenario: A job may wait for nodes that are not there yet, and runs once they are added
    Given a Lattice cluster with 2 nodes
    When I submit a job "big" that needs 3 nodes with lattice submit --wait-for-capacity
    Then lattice accepts "big" and it stays Pending
    And lattice status of "big" says it is waiting for capacity: needs 3 nodes, vCluster default has 2 that match
    When a third node joins the cluster
    Then "big" runs on all 3 nodes and ends Completed

  Scenario: A job over its tenant's node quota says how much the tenant holds
    Given a Lattice cluster with 2 nodes
    And the administrator creates the tenant "capped" with at most 1 node
    And a job "capped-hold" of tenant "capped" that runs until released
    When I submit a job "capped-next" of tenant "capped"
    Then lattice status of "capped-next" shows the pending reason "waiting for quota headroom: tenant capped holds 1 of max_nodes 1, this allocation needs 1 more"
    When I release "capped-hold"
    Then "capped-next" ends Completed

  Scenario: When nodes are disabled under a waiting job, it says so with the numbers
    Given a Lattice cluster with 2 nodes
    And a job "hold-1" with a walltime of 2m holds one of the nodes until released
    And I have a job "pair" that needs 2 nodes waiting Pending
    When the operator disables the idle node
    Then lattice status of "pair" eventually shows the pending reason "no nodes matching constraints: needs 2 nodes, vCluster default has 1 that match (1 more down or disabled)"
    When the operator enables the node again and I release "hold-1"
    Then "pair" ends Completed

  Scenario: Asking when a job would start on an idle cluster submits nothing
    Given a Lattice cluster with 2 nodes
    When I ask lattice submit --test-only when a 1-node job would start
    Then lattice answers "Would start now on 1 node" and "Nothing was submitted."
    And no allocation was stored

  Scenario: A job waiting behind running jobs shows when it is expected to start
    Given a Lattice cluster with 2 nodes
    And jobs "hold-1" and "hold-2" with a walltime of 2m hold both nodes until released
    When I submit a job "wide" that needs 2 nodes with a walltime of 1m
    Then lattice status shows an estimated START_TIME "~HH:MM" for "wide"
    And the estimated start of "wide" is when the later holder reaches its walltime
    And lattice status of "wide" shows an "Estimated start:" line
    When I ask lattice submit --test-only when a 1-node job would start
    Then lattice answers "Would start at" and "Nothing was submitted."
    And no allocation was stored

  Scenario: A wide job starts when the jobs ahead reach their walltimes, as estimated, and a short job backfills now
    Given a Lattice cluster with 4 nodes
    And jobs "hold-1", "hold-2" and "hold-3" with walltimes of 20s, 25s and 30s run until their walltime stops them
    When I submit a job "wide" that needs 4 nodes with a walltime of 1m
    Then the estimated start of "wide" is when "hold-3" reaches its walltime, held as a reservation
    And lattice submit --test-only says a 1-node job with a walltime of 10s would start now
    When I submit the 1-node job "short" with a walltime of 10s
    Then "short" starts at once on the free node
    And "wide" starts on all 4 nodes within a few seconds of its estimated start

  Scenario: The queue view shows every user where their jobs stand
    Given a Lattice cluster with 1 node
    And jobs "hold-1" with a walltime of 2m hold the node until released
    And I have a job "mine" waiting Pending
    And bob has a job "bobs" waiting Pending
    When I look at the queue with lattice queue
    Then it says the vCluster default has 2 pending and lists "mine" with its position, score, start time, basis and reason
    And lattice queue -o json gives each entry a position, score, factor breakdown, pending reason and estimated start
    And the REST queue of vCluster default counts the same 2 pending
    And bob sees only "bobs" in lattice queue, with the same 2 pending
