/* SPDX-License-Identifier: Apache-2.0
 *
 * fwd_conn.h - the DPDK forwarder's NAT connection table (lb_tables.h "NAT
 * mode: the connection table", rules in lb_conn.h): struct lb_flow_key_v4 ->
 * struct lb_conn, two entries per connection, at most `capacity` entries.
 *
 * One table for the whole forwarder, not one per worker. Every worker polls
 * its own queue of every port, and RSS (or af_packet/af_xdp's steering)
 * picks the queue from each frame's own tuple. That cannot bring both
 * directions of a NAT connection to one worker: a symmetric RSS key
 * makes (a,b) and (b,a) land together, but the reply of a translated
 * connection is not the request reversed (the backend answers from its own
 * address and port, to the client's or a SNAT pair), so no hash of the
 * packet's tuple can pair them. The reply must therefore find its
 * connection wherever it lands, and both directions update one state
 * machine. Per-worker tables that every worker can read would still need
 * cross-worker writes for that state, a search of every worker's table for
 * each reply, and a forwarder-wide "is this SNAT reply key free" decision
 * that no single owner can take (two workers could hand out one SNAT port).
 * One table makes each of these one operation, and the capacity exact for
 * any number of workers:
 *
 *  - Lookups take no lock (rte_hash with RTE_HASH_EXTRA_FLAGS_RW_CONCURRENCY_LF
 *    when there are several workers; the entry is the hash's data pointer,
 *    published by rte_hash after the entry was written).
 *  - Everything that adds or removes entries (a new connection, the FIFO and
 *    eviction, a reschedule, the idle sweep) runs under one spinlock, so the
 *    count, the FIFO and the SNAT port choice are exact; that is one lock per
 *    new or expired connection, never per packet.
 *  - A packet of a known connection, either direction, updates the state
 *    and fin_dirs of the original entry with one 16-bit compare-and-swap and
 *    stamps last_seen with a plain atomic store. A connection being removed
 *    has its state swapped to FWD_CONN_DEAD first, so a concurrent update
 *    loses and every transition is accounted exactly once.
 *  - A removed entry's memory (its slot and rte_hash key position) is reused
 *    only after every worker has passed a quiescent state of the table
 *    store's QSBR variable (each worker reports one per loop), so a lookup in
 *    flight never reads a recycled entry. The hash has room for capacity
 *    entries plus FWD_CONN_HEADROOM per worker awaiting reuse; the count of
 *    live entries alone decides "full".
 *  - The idle sweep is shared out: each worker looks at its own stripe of
 *    slots in its expiry slices (fwd_flow_expire's pattern).
 *
 * With one worker (nworkers == 1) there is no concurrency: no lock, plain
 * stores instead of the compare-and-swap, the rte_hash without the lock-free
 * mode (cheaper lookups) and memory reused at once.
 *
 * Per-worker figures (connections by state, SNAT ports held, expired) live in
 * struct fwd_conn_figures, written only by their worker (a transition is
 * counted by the worker that made it, as signed deltas) and summed by
 * read_conns; the live entry count is the table's own.
 */
#ifndef HPCLB_FWD_CONN_H
#define HPCLB_FWD_CONN_H

#include <stdbool.h>
#include <stddef.h>
#include <rte_hash.h>
#include <rte_rcu_qsbr.h>
#include <rte_spinlock.h>

#include "lb_conn.h"
#include "lb_hash.h"

/* The state of an original entry being removed (see above). */
#define FWD_CONN_DEAD 0xff
/* rte_hash positions per worker beyond the capacity, for removed entries
 * awaiting reuse: one worker loop removes at most 2 entries per frame (32 a
 * burst, 8 ports) plus 2 per expired connection (32 a slice); reuse waits for
 * every worker's next loop. */
#define FWD_CONN_HEADROOM 4096
#define FWD_CONN_NO_SLOT 0xffffffffu

struct fwd_conn_slot {
	struct lb_conn c;          /* the contract's entry */
	struct lb_flow_key_v4 key; /* this entry's own key (removal, the sweep) */
	__u32 peer_idx;            /* slot of the other direction's entry */
	__u8 used;                 /* written under the lock; read as a hint by the sweep */
	__u8 pad[3];
} __attribute__((aligned(64))); /* one cache line per entry */

_Static_assert(sizeof(struct fwd_conn_slot) == 64, "one cache line per entry");
/* state and fin_dirs are updated together as one naturally aligned 16-bit word. */
_Static_assert(offsetof(struct lb_conn, fin_dirs) == offsetof(struct lb_conn, state) + 1 &&
		       offsetof(struct lb_conn, state) % 2 == 0,
	       "state and fin_dirs form an aligned 16-bit word");

/* What one worker did to the table: signed deltas, summed over the workers
 * by read_conns (a connection opened by one worker and closed by another is
 * +1 in one, -1 in the other). */
struct fwd_conn_figures {
	__s64 by_state[LB_CONN_STATES]; /* connections, by their original entry's state */
	__s64 snat_ports;               /* connections holding a SNAT port */
	__u64 expired;                  /* connections removed by the idle sweep */
};

/* A removed entry waiting for every reader to move on. */
struct fwd_conn_retired {
	__u64 token;   /* rte_rcu_qsbr_start() after the removal */
	__s32 pos;     /* rte_hash key position */
	__u32 slot;
};

struct fwd_conn_table {
	/* Read by every lookup, written only at init: a cache line of its own,
	 * so that the writers' lock and counts below do not bounce it. */
	struct rte_hash *h;
	struct fwd_conn_slot *slots; /* nslots; a slot's index is ours, not rte_hash's */
	__u32 nslots;                /* capacity + headroom: what the hash can hold */
	__u32 capacity;              /* entries (two per connection); exact */
	bool shared;                 /* several workers: lock, atomics, deferred reuse */
	struct rte_rcu_qsbr *qsbr;   /* the table store's; NULL when not shared */
	__u8 sig_key[LB_HASH_KEY_LEN];
	__u32 *free_slots;           /* free slot indices (a stack of nfree) */
	/* Original keys of embryonic connections in creation order: a ring of
	 * `capacity` keys; a push to a full ring drops the oldest. */
	struct lb_flow_key_v4 *fifo;
	/* Removed entries in removal order (tokens ascend): nslots places, so it
	 * cannot overflow. */
	struct fwd_conn_retired *retired;

	/* The writers' state, under the lock (count and retired_len are also
	 * read without it, as hints and figures). */
	rte_spinlock_t lock __attribute__((aligned(64)));
	__u32 count;                 /* live entries */
	__u32 nfree;
	__u32 fifo_head, fifo_len;
	__u32 retired_head, retired_len;
};

/* A worker's share of the idle sweep: slots [lo, hi), next one to look at. */
struct fwd_conn_sweep {
	__u32 lo, hi, next;
};

/* What a new connection is made of (fwd_conn_open). */
struct fwd_conn_req {
	struct lb_flow_key_v4 orig; /* the original direction's key (a miss) */
	hash_sig_t orig_sig;
	__be32 backend_addr;
	__be16 backend_port;
	bool snat;                  /* take a SNAT pair: snat_addr and a port */
	__be32 snat_addr;
	__u16 port_min, port_max;   /* host order, inclusive */
	__u64 hash;                 /* the flow hash: picks the SNAT candidates */
	struct lb_conn tmpl;        /* backend_id, vip_id, state, client_mac, client_port */
	__u64 now_ns;
};

enum fwd_conn_open_status {
	FWD_CONN_OPENED = 0,
	FWD_CONN_EXISTS,     /* another worker opened it meanwhile: *out is that entry */
	FWD_CONN_NO_REPLY_KEY, /* no free SNAT port among the probes (or, without SNAT,
				* the reply key belongs to another connection) */
	FWD_CONN_FULL,       /* no room and nothing embryonic to evict */
};

/* capacity entries (even, LB_CONN_TABLE_MIN..MAX) for nworkers workers;
 * qsbr is the table store's (ignored with one worker). name must be unique in
 * the process. 0 or a negative errno. */
int fwd_conn_init(struct fwd_conn_table *ct, const char *name, __u32 capacity,
		  unsigned int nworkers, struct rte_rcu_qsbr *qsbr, int socket_id);
void fwd_conn_free(struct fwd_conn_table *ct);

/* Worker w's part of the sweep. */
void fwd_conn_sweep_init(const struct fwd_conn_table *ct, struct fwd_conn_sweep *sw,
			 unsigned int w, unsigned int nworkers);

/* The rte_hash signature of a key: SipHash-2-4 under the table's own random
 * key (as fwd_flow.c: an outsider cannot aim keys at a bucket). */
static inline hash_sig_t fwd_conn_sig(const struct fwd_conn_table *ct,
				      const struct lb_flow_key_v4 *k)
{
	return (hash_sig_t)lb_flow_hash_v4_key(ct->sig_key, k);
}

/* The entry of key, or NULL. Lock-free; the entry stays readable until the
 * caller's next quiescent state. */
static inline struct fwd_conn_slot *fwd_conn_lookup(const struct fwd_conn_table *ct,
						    const struct lb_flow_key_v4 *k,
						    hash_sig_t sig)
{
	void *data;

	if (rte_hash_lookup_with_hash_data(ct->h, k, sig, &data) < 0)
		return NULL;
	return data;
}

/* Live entries (for the fast path's "is there anything to look up" and the
 * figures). */
static inline __u32 fwd_conn_count(const struct fwd_conn_table *ct)
{
	return __atomic_load_n(&ct->count, __ATOMIC_RELAXED);
}

/* Nothing for the sweep to do: no live entry, none awaiting reuse. */
static inline bool fwd_conn_at_rest(const struct fwd_conn_table *ct)
{
	return !fwd_conn_count(ct) && !__atomic_load_n(&ct->retired_len, __ATOMIC_RELAXED);
}

/* The original entry of the connection e belongs to (e itself, or its peer's
 * slot). */
static inline struct fwd_conn_slot *fwd_conn_orig(const struct fwd_conn_table *ct,
						  struct fwd_conn_slot *e)
{
	if (e->c.dir == LB_CONN_ORIG)
		return e;
	return e->peer_idx < ct->nslots ? &ct->slots[e->peer_idx] : NULL;
}

/* state and fin_dirs as one word: byte 0 (the lower address) is state. */
typedef __u16 __attribute__((may_alias)) fwd_conn_word_t;

static inline __u16 fwd_conn_word(__u8 state, __u8 fin_dirs)
{
	union {
		__u16 w;
		__u8 b[2];
	} u = { .b = { state, fin_dirs } };

	return u.w;
}

static inline __u8 fwd_conn_word_state(__u16 w)
{
	union {
		__u16 w;
		__u8 b[2];
	} u = { .w = w };

	return u.b[0];
}

static inline __u8 fwd_conn_word_fin(__u16 w)
{
	union {
		__u16 w;
		__u8 b[2];
	} u = { .w = w };

	return u.b[1];
}

/* The state of an original entry (FWD_CONN_DEAD once it is being removed). */
static inline __u8 fwd_conn_state(const struct fwd_conn_slot *o)
{
	const fwd_conn_word_t *w = (const fwd_conn_word_t *)&o->c.state;

	return fwd_conn_word_state(__atomic_load_n(w, __ATOMIC_RELAXED));
}

/* A packet in direction dir of the connection whose original entry is o:
 * stamps last_seen and moves the state (lb_conn_next_state). false when the
 * connection is being removed by another worker. */
bool fwd_conn_update(struct fwd_conn_table *ct, struct fwd_conn_figures *fig,
		     struct fwd_conn_slot *o, __u8 dir, __u8 proto, __u8 tcp_flags, __u64 now_ns);

/* Opens the connection req describes (lb_conn.h, "Miss"): picks the reply key
 * (with SNAT, the first free of LB_SNAT_PROBES candidates), makes room (the
 * oldest embryonic connection of the FIFO, *evicted = true) and inserts both
 * entries, the original first. *out: the original entry (OPENED, EXISTS). */
enum fwd_conn_open_status fwd_conn_open(struct fwd_conn_table *ct, struct fwd_conn_figures *fig,
					const struct fwd_conn_req *req,
					struct fwd_conn_slot **out, bool *evicted);

/* Removes both entries of the connection whose original entry is o (a
 * reschedule). Nothing happens if it is already gone. */
void fwd_conn_close(struct fwd_conn_table *ct, struct fwd_conn_figures *fig,
		    struct fwd_conn_slot *o);

/* Looks at the next `budget` slots of sw and removes the connections idle
 * for longer than their state's timeout (timeouts_s, by state). Returns how
 * many it removed (also added to fig->expired). Also reuses what the readers
 * have let go. */
unsigned int fwd_conn_expire(struct fwd_conn_table *ct, struct fwd_conn_figures *fig,
			     struct fwd_conn_sweep *sw, const __u32 *timeouts_s, __u64 now_ns,
			     unsigned int budget);

/* The figures of the whole table from the workers' (n of them): capacity,
 * entries, by_state, snat_ports_in_use, expired. A sum that a race makes
 * negative for a moment reads as 0. */
void fwd_conn_read(const struct fwd_conn_table *ct, const struct fwd_conn_figures *const *figs,
		   unsigned int n, struct lb_conn_stats *out);

#endif /* HPCLB_FWD_CONN_H */
