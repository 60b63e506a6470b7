/* Scheduling: context switches and run-queue latency per allocation.
 *
 * A switch is counted for the task leaving the CPU (sched_switch runs in its context), so
 * the sum is the allocation's voluntary + involuntary switches, the same thing
 * /proc/<pid>/status counts. Run-queue latency is the time a task of the allocation waits
 * between becoming runnable (woken, or preempted while still runnable) and running. */
#include "lattice.h"

/* sched_switch's prev_state: 0 = still runnable (yield), TASK_REPORT_MAX (0x100 since
 * 4.14) = preempted; the low byte holds the sleeping/dead states */
#define STATE_SLEEPING_MASK 0xff
/* 'X' (EXIT_DEAD) and 'Z' (EXIT_ZOMBIE): the task's last switch */
#define STATE_EXITING_MASK 0x30

static __always_inline int on_wakeup(u32 pid)
{
    struct task_info *t = tasks.lookup(&pid);
    if (t)
        t->runnable_since = bpf_ktime_get_ns();
    return 0;
}

TRACEPOINT_PROBE(sched, sched_wakeup)
{
    return on_wakeup(args->pid);
}

TRACEPOINT_PROBE(sched, sched_wakeup_new)
{
    return on_wakeup(args->pid);
}

TRACEPOINT_PROBE(sched, sched_switch)
{
    long state = args->prev_state;
    u64 now = 0;
    /* prev is the current task */
    u64 id = bpf_get_current_pid_tgid();
    u32 prev = (u32)id;
    struct task_info *t = tasks.lookup(&prev);
    u32 slot = t ? t->slot : find_alloc(prev, id >> 32, !(state & STATE_EXITING_MASK));
    struct alloc_stats *s = stats_of(slot);
    if (s) {
        s->switches++;
        if ((state & STATE_SLEEPING_MASK) == 0) {
            /* preempted: it waits on the run queue from now on */
            if (!t)
                t = tasks.lookup(&prev);
            if (t) {
                now = bpf_ktime_get_ns();
                t->runnable_since = now;
            }
        }
    }
    u32 next = args->next_pid;
    struct task_info *n = tasks.lookup(&next);
    if (n && n->runnable_since) {
        if (!now)
            now = bpf_ktime_get_ns();
        u64 waited = now > n->runnable_since ? now - n->runnable_since : 0;
        n->runnable_since = 0;
        struct alloc_stats *ns = stats_of(n->slot);
        if (ns)
            ns->rq_hist[slot_of(waited)]++;
    }
    return 0;
}

/* Children belong to their parent's allocation from birth: nothing escapes by forking
 * between two collections, and threads need no discovery. */
TRACEPOINT_PROBE(sched, sched_process_fork)
{
    u32 slot = current_alloc(1);
    if (slot != NO_ALLOC) {
        u32 child = args->child_pid;
        struct task_info info = {.slot = slot};
        tasks.update(&child, &info);
    }
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    tasks.delete(&tid);
    return 0;
}
