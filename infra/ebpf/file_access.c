/* File-access events of audited allocations (spec: Telemetry Architecture, audit mode:
 * "All file access events ... with user identity"; Sensitive Workloads, Audit Trail:
 * "Data access: every file open/read/write (from eBPF audit telemetry)").
 *
 * Loaded on its own (not concatenated with lattice.h and the metric programs) by the
 * node agent's lattice_agent.telemetry.fileaudit, only while an allocation on the node
 * is in audit mode. Every open of a file by a task of an audited allocation becomes one
 * event in the ring buffer `file_events`: time, tgid, tid, uid, comm, path, the open
 * flags and the syscall's result (an fd, or -errno: refused opens are audited too).
 * The access mode in the flags (read, write, read-write) stands for what the process
 * may then do with the file; reads and writes themselves are not traced (sys_enter_read
 * and _write fire on every I/O syscall of the node, a cost audit mode does not need).
 *
 * Filter, in the kernel: `audited` maps a thread id to the allocation's slot (the agent
 * seeds the allocation's processes; children and threads are added at fork, so nothing
 * escapes by forking between two agent passes); allocations in a cgroup v2 scope are
 * also matched by cgroup id (`audited_cgroups`). A task of no audited allocation costs
 * one hash lookup per open (two for a thread, three with v2 scopes).
 *
 * Only tracepoint arguments and helpers, never kernel structs (see README.md): the node
 * may compile against another kernel's headers.
 */

#define FA_PATH_MAX 256
#define FA_NO_SLOT 0xffffffffU

struct file_event {
    u64 time_ns;       /* bpf_ktime_get_boot_ns(): the agent converts to wall time */
    u32 tgid;          /* the process */
    u32 tid;           /* the thread that opened */
    u32 uid;           /* the task's real uid */
    u32 slot;          /* the audited allocation (the agent's slot number) */
    s64 flags;         /* open(2) flags */
    s64 result;        /* fd >= 0, else -errno */
    char comm[16];
    char path[FA_PATH_MAX]; /* as the process named it (relative paths stay relative) */
};

/* an open between its entry and its exit, by pid_tgid */
struct pending_open {
    u64 filename;      /* user pointer */
    s64 flags;
    u32 slot;
    u32 pad;
};

/* tid -> slot. LRU: an entry sched_process_exit missed ages out instead of filling it */
BPF_TABLE("lru_hash", u32, u32, audited, 65536);
/* cgroup v2 id (the inode number of the scope directory) -> slot */
BPF_HASH(audited_cgroups, u64, u32, 256);
/* [0]: how many entries audited_cgroups has (0 on v1 nodes: no helper call, no lookup) */
BPF_ARRAY(fa_config, u32, 1);
BPF_HASH(pending_opens, u64, struct pending_open, 16384);
/* 4 MiB: some 14,000 events between two agent polls before the kernel drops (counted) */
BPF_RINGBUF_OUTPUT(file_events, 1 << 10);
/* [0]: events the ring buffer had no room for */
BPF_PERCPU_ARRAY(fa_lost, u64, 1);

static __always_inline u32 fa_slot(void)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id, tgid = id >> 32;
    u32 *slot = audited.lookup(&tid);
    if (slot)
        return *slot;
    if (tgid != tid) {
        slot = audited.lookup(&tgid);
        if (slot)
            return *slot;
    }
    u32 zero = 0;
    u32 *n = fa_config.lookup(&zero);
    if (n && *n) {
        u64 cg = bpf_get_current_cgroup_id();
        slot = audited_cgroups.lookup(&cg);
        if (slot)
            return *slot;
    }
    return FA_NO_SLOT;
}

static __always_inline int fa_enter(const char *filename, s64 flags)
{
    u32 slot = fa_slot();
    if (slot == FA_NO_SLOT)
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    struct pending_open p = {.filename = (u64)filename, .flags = flags, .slot = slot};
    pending_opens.update(&id, &p);
    return 0;
}

static __always_inline int fa_exit(s64 ret)
{
    u64 id = bpf_get_current_pid_tgid();
    struct pending_open *p = pending_opens.lookup(&id);
    if (!p)
        return 0;
    struct file_event *e = file_events.ringbuf_reserve(sizeof(struct file_event));
    if (!e) {
        u32 zero = 0;
        u64 *lost = fa_lost.lookup(&zero);
        if (lost)
            (*lost)++;
        pending_opens.delete(&id);
        return 0;
    }
    e->time_ns = bpf_ktime_get_boot_ns();
    e->tgid = id >> 32;
    e->tid = (u32)id;
    e->uid = (u32)bpf_get_current_uid_gid();
    e->slot = p->slot;
    e->flags = p->flags;
    e->result = ret;
    bpf_get_current_comm(&e->comm, sizeof(e->comm));
    if (bpf_probe_read_user_str(&e->path, sizeof(e->path), (const void *)p->filename) < 0)
        e->path[0] = 0;
    pending_opens.delete(&id);
    file_events.ringbuf_submit(e, 0);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_openat)
{
    return fa_enter(args->filename, args->flags);
}

TRACEPOINT_PROBE(syscalls, sys_exit_openat)
{
    return fa_exit(args->ret);
}

#ifdef LATTICE_FA_OPEN /* open(2): x86_64 has it, arm64 does not (the agent checks) */
TRACEPOINT_PROBE(syscalls, sys_enter_open)
{
    return fa_enter(args->filename, args->flags);
}

TRACEPOINT_PROBE(syscalls, sys_exit_open)
{
    return fa_exit(args->ret);
}
#endif

#ifdef LATTICE_FA_OPENAT2 /* openat2(2): the flags are the first u64 of struct open_how */
TRACEPOINT_PROBE(syscalls, sys_enter_openat2)
{
    u64 flags = 0;
    bpf_probe_read_user(&flags, sizeof(flags), (const void *)args->how);
    return fa_enter(args->filename, (s64)flags);
}

TRACEPOINT_PROBE(syscalls, sys_exit_openat2)
{
    return fa_exit(args->ret);
}
#endif

/* Children and threads belong to their parent's allocation from birth. */
TRACEPOINT_PROBE(sched, sched_process_fork)
{
    u32 slot = fa_slot();
    if (slot != FA_NO_SLOT) {
        u32 child = args->child_pid;
        audited.update(&child, &slot);
    }
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    audited.delete(&tid);
    return 0;
}
