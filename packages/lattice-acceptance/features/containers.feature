Feature: Containers and identities: jobs run as their user, in their image
  On a production node every process of an allocation runs as the user who submitted
  it (mapped through the node's accounts or node_agent.user_map), with a private
  scratch directory that is wiped when the allocation ends. An allocation may ask for
  an OCI image from a registry: every node pulls it in the prologue (Staging), and the
  job runs in a container with a read-only root, no new privileges and the default
  seccomp profile, inside the allocation's cgroup, with its working directory bound in.
  The image's digest is recorded on the allocation.

  Every step runs against a real local cluster: a quorum member, a scheduler and two
  node agents that run jobs as their submitting users, and a container registry on
  this machine.

  Background:
    Given a running Lattice cluster with 2 nodes that runs jobs as their users, and an image registry

  Scenario: A job in a container image runs as its user with a read-only root, and its digest is recorded
    Given the registry has the image "lattice/tools:1"
    When "tester" submits a job in the image "lattice/tools:1" that reports who it is and tries to write to /
    Then the job completes as uid 1000 and its attempt to write to / was refused
    And the file it wrote in its working directory belongs to uid 1000
    And `lattice status -o json` shows the digest the registry has for "lattice/tools:1"

  Scenario: An image that is not in the registry fails the prologue on each node, then the job fails
    When "tester" submits a job in the image "lattice/missing:1"
    Then the job ends Failed with a reason that says the image is not found in the registry
    And it was tried on both nodes

  Scenario: Each job gets a private scratch directory that is gone after the job
    When "alice" submits a job that writes to its scratch directory and shows its owner and mode
    Then the job completes as uid 1001 with a scratch directory it owns with mode 700
    And the scratch directory no longer exists

  Scenario: A job of a user with no account on the nodes fails with the reason
    When "mallory" submits a job that reports who it is
    Then the job ends Failed with a reason that says "mallory" has no account on the node
