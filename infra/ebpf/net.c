/* Network bytes per allocation, for allocations in a cgroup v2 scope: cgroup_skb
 * programs attached (BPF_F_ALLOW_MULTI, beside systemd's own) to each scope's directory.
 *
 * Why cgroup_skb and not tracepoints: received packets are processed in softirq context,
 * where the current task is unrelated, and the socket that owns a packet can only be
 * reached through kernel structs (unsafe with another kernel's headers). A cgroup_skb
 * program is handed packets of the cgroup's sockets, in both directions, with
 * __sk_buff (UAPI, stable). On hybrid v1 nodes allocations have no v2 scope: nothing is
 * attached and the network series stay with the /proc collector.
 *
 * Counted: skb->len at the IP layer (headers included, link-layer framing not), every
 * interface but loopback (ifindex 1 in every network namespace). */
#include "lattice.h"

#define LOOPBACK_IFINDEX 1
/* sockets of nested cgroups under a scope: look up their ancestors too, down to here */
#define MAX_DEPTH 12

static __always_inline u32 net_slot(struct __sk_buff *skb)
{
    u64 cg = bpf_skb_cgroup_id(skb);
    u32 *slot = cgroups.lookup(&cg);
    if (slot)
        return *slot;
#pragma unroll
    for (int level = 1; level < MAX_DEPTH; level++) {
        cg = bpf_skb_ancestor_cgroup_id(skb, level);
        if (!cg)
            break;
        slot = cgroups.lookup(&cg);
        if (slot)
            return *slot;
    }
    return NO_ALLOC;
}

int net_egress(struct __sk_buff *skb)
{
    if (skb->ifindex != LOOPBACK_IFINDEX) {
        struct alloc_stats *s = stats_of(net_slot(skb));
        if (s)
            s->net_tx += skb->len;
    }
    return 1; /* allow: we only count */
}

int net_ingress(struct __sk_buff *skb)
{
    if (skb->ifindex != LOOPBACK_IFINDEX) {
        struct alloc_stats *s = stats_of(net_slot(skb));
        if (s)
            s->net_rx += skb->len;
    }
    return 1;
}
