Feature: Interactive work: sessions, attach and salloc
  `lattice session` queues an interactive allocation and, once it runs, opens a shell in
  it on a real terminal; leaving the shell keeps the session until it is deleted or its
  walltime ends. `lattice attach ID` opens another terminal in a running allocation of
  yours: the remote terminal follows the local window's size, Ctrl-C reaches the remote
  foreground program, and the command's exit status comes back. `lattice salloc` is a
  session that is released when its command ends.

  Every step runs against a real local cluster: a quorum member, a scheduler and one
  node agent on this machine; the terminal is a real PTY driven by pexpect.

  Background:
    Given a running Lattice cluster with 1 node for interactive work

  Scenario: A session opens a shell in its allocation and outlives the shell
    When I start lattice session -N 1 -t 30m in a terminal
    Then a shell opens in the session's allocation
    When I leave the shell with exit 4
    Then lattice session exits with status 4 and its allocation is still Running
    And lattice session list shows the session Running
    When I delete the session with lattice session delete
    Then its allocation ends Cancelled

  Scenario: An attached terminal follows the window size and passes Ctrl-C to the remote program
    Given a running allocation of mine
    When I attach to it with lattice attach in a 24x80 terminal
    Then stty size in the remote shell says "24 80"
    When the local window becomes 40x120
    Then stty size in the remote shell says "40 120"
    When I run sleep 30 remotely and press Ctrl-C
    Then the remote shell prompt comes back within 5 seconds
    When I leave the shell with exit 3
    Then lattice attach exits with status 3

  Scenario: Nobody attaches to another user's allocation
    Given a running allocation of mine
    When "mallory" runs lattice attach on it
    Then the attach is refused with "only its owner may attach"

  Scenario: salloc runs its command in a session and releases the allocation
    When I run lattice salloc -N 1 -t 10:00 with a command printing $SLURM_JOB_ID
    Then the command printed the allocation's id
    And salloc says it relinquished the allocation and exits with the command's status
    And the allocation ends Cancelled
