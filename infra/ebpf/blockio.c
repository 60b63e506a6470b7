/* Block I/O latency per allocation: request issue (to the driver) -> completion, as
 * biolatency measures it, in log2 buckets.
 *
 * Completion runs in interrupt context (the task there is unrelated), and issue often
 * runs in a kworker or whichever task unplugs the queue. The only moment the submitting
 * task is current is block_bio_queue, so the owner is noted there by sector and carried
 * to the request at issue. Keys: the sector alone for the bio (block_bio_queue reports a
 * partition's device number, the request the whole disk's; the sector is the disk's in
 * both), device + sector for requests in flight. Writeback of dirty pages by the
 * kernel's flusher threads is nobody's: it is not counted. */
#include "lattice.h"

struct rq_key {
    u32 dev;
    u32 pad;
    u64 sector;
};

struct rq_start {
    u64 ts;
    u32 slot;
    u32 pad;
};

/* LRU: bios merged into a request under another sector never reach issue under theirs */
BPF_TABLE("lru_hash", u64, u32, bio_owner, 16384);
BPF_TABLE("lru_hash", struct rq_key, struct rq_start, in_flight, 16384);

TRACEPOINT_PROBE(block, block_bio_queue)
{
    u32 slot = current_alloc(1);
    if (slot != NO_ALLOC) {
        u64 sector = args->sector;
        bio_owner.update(&sector, &slot);
    }
    return 0;
}

TRACEPOINT_PROBE(block, block_rq_issue)
{
    u64 sector = args->sector;
    u32 slot = NO_ALLOC;
    u32 *owner = bio_owner.lookup(&sector);
    if (owner) {
        slot = *owner;
        bio_owner.delete(&sector);
    } else {
        slot = current_alloc(1);
    }
    if (slot == NO_ALLOC)
        return 0;
    struct rq_key key = {.dev = args->dev, .sector = sector};
    struct rq_start start = {.ts = bpf_ktime_get_ns(), .slot = slot};
    in_flight.update(&key, &start);
    return 0;
}

TRACEPOINT_PROBE(block, block_rq_complete)
{
    struct rq_key key = {.dev = args->dev, .sector = args->sector};
    struct rq_start *start = in_flight.lookup(&key);
    if (!start)
        return 0;
    u64 now = bpf_ktime_get_ns();
    u64 took = now > start->ts ? now - start->ts : 0;
    struct alloc_stats *s = stats_of(start->slot);
    if (s)
        s->io_hist[slot_of(took)]++;
    in_flight.delete(&key);
    return 0;
}
