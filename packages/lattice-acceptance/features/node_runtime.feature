Feature: Node runtime: software environments staged before a job runs
  An allocation that asks for a software environment (a uenv SquashFS image) is first
  Staging: every node it was given fetches the image from the uenv registry into its
  node-local cache and checks its sha256 (the prologue). Only when every node is done
  does it become Running; the image is then mounted read-only at /user-environment for
  the job's processes only. A node whose prologue fails is not used again for that
  allocation: it goes back to the queue for other nodes, and after three failed tries
  it ends Failed with the cause.

  Every step runs against a real local cluster: a quorum member, a scheduler and three
  node agents on this machine, with a uenv registry in a directory.

  Background:
    Given a running Lattice cluster with 3 nodes and a uenv registry

  Scenario: A job with a uenv is staged on every node, then runs a program from the image
    Given the registry has "prgenv/1.0:v1" with a program "hello"
    When I submit a 2-node job with uenv "prgenv/1.0:v1" that runs "/user-environment/bin/hello"
    Then the job was Staging until every node reported its prologue done, then ran and completed
    And its output is "hello from /user-environment/bin"
    And every node's uenv cache holds "prgenv/1.0:v1"
    And /user-environment is not mounted on the host

  Scenario: A tampered image is refused on every node it tries, and the job fails after three tries
    Given the registry has "prgenv/1.0:tampered" whose index hash does not match the image
    When I submit a 1-node job with uenv "prgenv/1.0:tampered" that runs "/user-environment/bin/hello"
    Then the job ends Failed with a reason that starts "prologue_failed: uenv prgenv/1.0:tampered: image hash mismatch"
    And `lattice status` shows it failed its prologue 3 times, once on each node
    And no node's uenv cache holds "prgenv/1.0:tampered"
    And every node is Ready and idle again

  Scenario: One job's uenv is invisible to another job on the machine
    Given the registry has "prgenv/1.0:v1" with a program "hello"
    When I submit a 1-node job with uenv "prgenv/1.0:v1" that lists its mounts until released
    And I submit a 1-node job without a uenv that lists its mounts
    Then the job with the uenv sees /user-environment mounted read-only
    And the job without a uenv does not see /user-environment

  Scenario: An administrator warms a uenv on every node and evicts it from one
    When the administrator runs "lattice cache warm --image=prgenv/1.0:v1 --all"
    Then it reports "prgenv/1.0:v1" cached on every node
    And `lattice cache status -o json` shows "prgenv/1.0:v1" on every node
    When the administrator runs "lattice cache evict --image=prgenv/1.0:v1 --node=node-001"
    Then `lattice cache status -o json` shows "prgenv/1.0:v1" on every node but node-001
    And a user without the admin role is refused "lattice cache warm --image=prgenv/1.0:v1 --all" with a permission error and a Hint
