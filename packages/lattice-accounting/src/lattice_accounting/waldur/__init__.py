"""The Waldur accounting provider (``accounting.provider: waldur``): events derived from
quorum state (events), a memory + on-disk WAL buffer (buffer), the HTTP client (client),
the push loop (pusher), the budget override for the cost function (quota) and the
wiring to the quorum's watch stream (feed). See the package README."""
