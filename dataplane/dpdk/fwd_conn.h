/* SPDX-License-Identifier: Apache-2.0
 *
 * fwd_conn.h - the DPDK forwarder's NAT connection tables (lb_tables.h "NAT
 * mode: the connection table", rules in lb_conn.h), one per family:
 *   IPv4  struct fwd_conn_table,  struct lb_flow_key_v4 -> struct lb_conn
 *   IPv6  struct fwd_conn6_table, struct lb_flow_key (family 6) -> struct lb_conn6
 * two entries per connection, at most `capacity` entries each. Both are one
 * code, written once in fwd_conn_family.h (types, inline lookups) and
 * fwd_conn_family.c.h (operations), instantiated twice by key type: the
 * IPv4 instance is the code the forwarder had before IPv6 NAT, name for name
 * (fwd_conn_*), the IPv6 one the same with fwd_conn6_* names.
 *
 * One table per family for the whole forwarder, not one per worker. Every
 * worker polls its own queue of every port, and RSS (or af_packet/af_xdp's steering)
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
 * read_conns; the live entry count is the table's own. The two families'
 * tables count into the same per-worker figures: the protocol reports the
 * sums over both (nat6 spec 1), and one worker's transitions in either table
 * are still written by that worker alone.
 */
#ifndef HPCLB_FWD_CONN_H
#define HPCLB_FWD_CONN_H

#include <stdbool.h>
#include <stddef.h>
#include <string.h>
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

/* What one worker did to the tables (both families): signed deltas, summed
 * over the workers by read_conns (a connection opened by one worker and
 * closed by another is +1 in one, -1 in the other). */
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

/* A worker's share of a table's idle sweep: slots [lo, hi), next one to look at. */
struct fwd_conn_sweep {
	__u32 lo, hi, next;
};

enum fwd_conn_open_status {
	FWD_CONN_OPENED = 0,
	FWD_CONN_EXISTS,     /* another worker opened it meanwhile: *out is that entry */
	FWD_CONN_NO_REPLY_KEY, /* no free SNAT port among the probes (or, without SNAT,
				* the reply key belongs to another connection) */
	FWD_CONN_FULL,       /* no room and nothing embryonic to evict */
};

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

/* ---- the per-family parts ----------------------------------------------
 * fwd_conn_family.h is read once per family with these names defined:
 *   FC(x)          the family's name for x: fwd_conn_x, fwd_conn6_x
 *   FC_KEY         its key type, FC_ENTRY its entry type (the contract's)
 *   FC_ADDR        an address of the family (__be32, union lb_addr)
 *   FC_KEY_HASH    the key's SipHash (the IPv4 flow hash; the 40-byte one)
 *   FC_SLOT_SIZE   one slot's bytes: a whole number of cache lines
 *   FC_REPLY_KEY   lb_conn.h's reply key builder, addresses by value
 *   FC_ADDR_ZERO   whether an FC_ADDR is the unspecified address
 * fwd_conn.c defines the same for fwd_conn_family.c.h. */
#define FC_CAT_(a, b) a##b
#define FC_CAT(a, b) FC_CAT_(a, b)

/* IPv6's reply key builder with the IPv4 one's calling convention (addresses
 * by value), so that the shared code calls either the same way. */
static inline void fwd_conn6_reply_key(struct lb_flow_key *reply, union lb_addr backend_addr,
				       __be16 backend_port, union lb_addr client_addr,
				       __be16 client_port, __u8 proto)
{
	lb_conn6_reply_key(reply, &backend_addr, backend_port, &client_addr, client_port, proto);
}

static inline bool fwd_conn6_addr_zero(const union lb_addr *a)
{
	return !(a->v6w[0] | a->v6w[1] | a->v6w[2] | a->v6w[3]);
}

#define FC(x) FC_CAT(fwd_conn_, x)
#define FC_KEY struct lb_flow_key_v4
#define FC_ENTRY struct lb_conn
#define FC_ADDR __be32
#define FC_KEY_HASH lb_flow_hash_v4_key
#define FC_SLOT_SIZE 64 /* one cache line per entry */
#define FC_REPLY_KEY lb_conn_reply_key
#define FC_ADDR_ZERO(a) ((a) == 0)
#include "fwd_conn_family.h"

#define FC(x) FC_CAT(fwd_conn6_, x)
#define FC_KEY struct lb_flow_key
#define FC_ENTRY struct lb_conn6
#define FC_ADDR union lb_addr
#define FC_KEY_HASH lb_flow_hash_v6
#define FC_SLOT_SIZE 128 /* the 64-byte entry and its 40-byte key: two lines */
#define FC_REPLY_KEY fwd_conn6_reply_key
#define FC_ADDR_ZERO(a) fwd_conn6_addr_zero(&(a))
#include "fwd_conn_family.h"

/* The figures of the whole NAT state from the workers' (n of them): the sums
 * over both tables (either may be NULL) of capacity, entries, by_state,
 * snat_ports_in_use, expired. A sum that a race makes negative for a moment
 * reads as 0. */
void fwd_conn_read(const struct fwd_conn_table *ct, const struct fwd_conn6_table *ct6,
		   const struct fwd_conn_figures *const *figs, unsigned int n,
		   struct lb_conn_stats *out);

#endif /* HPCLB_FWD_CONN_H */
