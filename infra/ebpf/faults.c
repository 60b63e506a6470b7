/* User page faults per allocation (minor and major: every fault taken in user mode).
 *
 * exceptions:page_fault_user exists on x86 only; elsewhere the agent attaches
 * on_fault_perf to the software perf event PERF_COUNT_SW_PAGE_FAULTS (period 1), which
 * fires in the faulting task's context as well. */
#include "lattice.h"

#ifdef LATTICE_FAULT_TRACEPOINT
TRACEPOINT_PROBE(exceptions, page_fault_user)
{
    struct alloc_stats *s = stats_of(current_alloc(1));
    if (s)
        s->faults++;
    return 0;
}
#else
int on_fault_perf(struct bpf_perf_event_data *ctx)
{
    struct alloc_stats *s = stats_of(current_alloc(1));
    if (s)
        s->faults++;
    return 0;
}
#endif
