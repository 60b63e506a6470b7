Feature: Whose allocations lattice status lists
  Like squeue with --me, `lattice status` lists the caller's own allocations;
  `--all` lists every user's (a permission of administrators, operators and read-only
  auditors), and `--user NAME` one user's. The rule is the API's, so the REST and gRPC
  interfaces list the same allocations for the same request. Every step runs against a
  real local cluster (a development cluster: every caller has the administrator role).

  Background:
    Given a running Lattice cluster with 2 nodes

  Scenario: Users see their own allocations unless they ask for more
    Given alice has submitted "alice-job" and bob has submitted "bob-job", both held until released
    When alice runs "lattice status"
    Then the listing shows "alice-job" and not "bob-job"
    When alice runs "lattice status --all"
    Then the listing shows "alice-job" and "bob-job"
    When alice runs "lattice status --user bob"
    Then the listing shows "bob-job" and not "alice-job"
    When alice runs "lattice status --all -o json"
    Then the JSON lists the allocations of alice and bob, each under its own user
