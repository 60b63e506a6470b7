Feature: Bad input is refused with a hint
  A submission that cannot run as written is refused at once: the error says what is
  wrong, a `Hint:` says what to do instead, and nothing is stored. This holds for the
  `lattice` CLI (flags, `#LATTICE` directives in a script, a missing command) and for
  the REST API it calls. Every step runs against a real local cluster: a quorum member,
  a scheduler and two node agents on this machine.

  Background:
    Given a running Lattice cluster with 2 nodes

  Scenario Outline: A submission with bad input is rejected with a hint and nothing is stored
    When I run lattice submit with <options> for the command "echo never"
    Then the submission is rejected with an error mentioning '<error>'
    And the error carries a "Hint:" line
    And no allocation was stored

    Examples:
      | options                          | error                                     |
      | --vcluster=no-such-vcluster      | unknown vCluster "no-such-vcluster"       |
      | --tenant=no-such-tenant          | unknown tenant "no-such-tenant"           |
      | --walltime=soon                  | invalid walltime                          |
      | --walltime=abc                   | invalid walltime                          |
      | no walltime                      | walltime is required                      |
      | --nodes=0                        | nodes must be at least 1                  |
      | --nodes=-1                       | nodes must be at least 1                  |
      | a script with #LATTICE --nodes=0 | nodes must be at least 1                  |
      | --nodes=2 --min-nodes=3          | node range                                |
      | --preemption-class=11            | preemption class must be between 0 and 10 |

  Scenario Outline: A submission with nothing to run is rejected with a hint
    When I run "<command line>"
    Then the submission is rejected with an error mentioning '<error>'
    And the error carries a "Hint:" line
    And no allocation was stored

    Examples:
      | command line                       | error             |
      | lattice submit --walltime=1m       | nothing to submit |
      | lattice submit --walltime=1m --    | nothing to submit |
      | lattice submit --walltime=1m -- "" | nothing to run    |

  Scenario Outline: The API rejects bad submissions with a hint and stores nothing
    When I POST an allocation to the REST API with <field> set to <value>
    Then the API answers <status> <code> with an error mentioning '<error>'
    And the error carries a hint
    And no allocation was stored

    Examples:
      | field            | value              | status | code             | error                                     |
      | nodes            | 0                  | 400    | invalid_argument | nodes must be at least 1                  |
      | nodes            | -1                 | 400    | invalid_argument | nodes must be at least 1                  |
      | walltime         | "abc"              | 400    | invalid_argument | invalid walltime                          |
      | preemption_class | 11                 | 400    | invalid_argument | preemption class must be between 0 and 10 |
      | entrypoint       | ""                 | 400    | invalid_argument | empty entrypoint                          |
      | entrypoint       | "   "              | 400    | invalid_argument | empty entrypoint                          |
      | vcluster         | "no-such-vcluster" | 404    | not_found        | unknown vCluster "no-such-vcluster"       |
