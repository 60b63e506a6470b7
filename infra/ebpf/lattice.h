/* Shared state of the Lattice telemetry programs (loaded by bcc from the node agent's
 * lattice_agent.telemetry.ebpf, which prepends this file to the .c files it compiles).
 *
 * Attribution. Every counter is kept per *allocation slot* (0..MAX_ALLOCS-1), which the
 * agent assigns to each allocation running on the node. A task belongs to a slot when
 *   - its thread id is in `tasks` (the agent seeds the allocation's processes from its
 *     cgroup scope or its process groups, and children inherit at fork), or
 *   - its thread group leader is in `tasks` (threads are found on their first event), or
 *   - its cgroup v2 id is in `cgroups` (allocations in their own v2 scope).
 * Why not cgroup ids alone: on hybrid cgroup v1 nodes, bpf_get_current_cgroup_id()
 * answers the task's cgroup in the v2 hierarchy, which holds no allocation scopes (every
 * task reads the same id), so pids are the only key that tells allocations apart.
 *
 * Only tracepoint arguments (whose layout bcc reads from tracefs at load time) and
 * helpers are used, never kernel structs: the node may run with headers of another
 * kernel version, and struct offsets from those headers would be wrong.
 */
#ifndef LATTICE_EBPF_H
#define LATTICE_EBPF_H

#define MAX_ALLOCS 256
/* log2 buckets of nanoseconds: slot 0 holds 0 ns, slot k holds [2^(k-1), 2^k) ns; the
 * last one everything from 2^38 ns (~4.6 min) up */
#define SLOTS 40
#define NO_ALLOC 0xffffffffU

struct alloc_stats {
    u64 switches;          /* context switches away from the allocation's tasks */
    u64 faults;            /* user page faults (minor and major) */
    u64 net_tx;            /* IP bytes sent on non-loopback interfaces (v2 scopes only) */
    u64 net_rx;
    u64 rq_hist[SLOTS];    /* runnable (woken or preempted) -> on CPU */
    u64 io_hist[SLOTS];    /* block request issue -> completion */
};

/* per-CPU: the hot paths (every context switch) increment without atomics or
 * cache-line bouncing; the agent sums the CPUs when it reads */
BPF_PERCPU_ARRAY(stats, struct alloc_stats, MAX_ALLOCS);
struct task_info {
    u32 slot;
    u32 pad;
    u64 runnable_since; /* ns; 0: running or sleeping. Kept here, not in a map of its
                         * own, so a wakeup costs one lookup and a store, no update */
};

/* tid -> its allocation. LRU: an entry that is never cleaned up (a task that slipped
 * past sched_process_exit) ages out instead of filling the map */
BPF_TABLE("lru_hash", u32, struct task_info, tasks, 65536);
/* cgroup v2 id (the inode number of the scope directory) -> slot */
BPF_HASH(cgroups, u64, u32, MAX_ALLOCS);
/* [0]: how many entries `cgroups` has (skips a helper call and a lookup per event on
 * v1 nodes, where it stays 0) */
BPF_ARRAY(config, u32, 1);

static __always_inline struct alloc_stats *stats_of(u32 slot)
{
    if (slot >= MAX_ALLOCS)
        return 0;
    return stats.lookup(&slot);
}

static __always_inline u32 slot_of(u64 ns)
{
    u32 s = bpf_log2l(ns);
    return s < SLOTS ? s : SLOTS - 1;
}

/* The slot of the running task when `tid` itself is not in `tasks`: through its thread
 * group leader or its cgroup. `learn`: remember the thread under its own id, so its next
 * event is one lookup. Never learn for a task on its way out: the entry would outlive it. */
static __always_inline u32 find_alloc(u32 tid, u32 tgid, int learn)
{
    struct task_info *found;
    u32 slot = NO_ALLOC;
    if (tgid != tid) {
        found = tasks.lookup(&tgid);
        if (found)
            slot = found->slot;
    }
    if (slot == NO_ALLOC) {
        u32 zero = 0;
        u32 *n = config.lookup(&zero);
        if (n && *n) {
            u64 cg = bpf_get_current_cgroup_id();
            u32 *by_cgroup = cgroups.lookup(&cg);
            if (by_cgroup)
                slot = *by_cgroup;
        }
    }
    if (slot != NO_ALLOC && learn && tid != 0) {
        struct task_info info = {.slot = slot};
        tasks.update(&tid, &info);
    }
    return slot;
}

/* The slot of the task running now (NO_ALLOC: none). */
static __always_inline u32 current_alloc(int learn)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    struct task_info *found = tasks.lookup(&tid);
    if (found)
        return found->slot;
    return find_alloc(tid, id >> 32, learn);
}

#endif /* LATTICE_EBPF_H */
