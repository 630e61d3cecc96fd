/* SPDX-License-Identifier: Apache-2.0
 *
 * fwd_flow.h - one worker's flow-affinity table: lb_flow_key -> pinned backend.
 *
 * Per lcore, so it takes no lock: RSS (or af_packet/af_xdp's per-queue
 * steering) sends every packet of a flow to the same queue, hence to the same
 * worker. An rte_hash (with its extendable bucket table, so that it fills to
 * capacity instead of failing early on a full cuckoo path) holds the keys; the
 * entries live in an array indexed by the key's position. Bounded: idle
 * entries are expired by a sweep over positions, a few per loop; when the table
 * is full, the least recently seen of a small sample is evicted (counted), as
 * an LRU would.
 *
 * The rte_hash signature is SipHash-2-4 under a per-table random key, so an
 * outsider cannot aim many flows at one bucket, and re-keying the ring hash
 * (set_config) does not lose the table. Every rte_hash call therefore passes
 * the signature (the *_with_hash variants): the plain ones would hash with
 * the table's own function and never find the key.
 */
#ifndef HPCLB_FWD_FLOW_H
#define HPCLB_FWD_FLOW_H

#include <stdbool.h>
#include <rte_hash.h>

#include "lb_tables.h"

struct fwd_flow_slot {
	struct lb_flow_entry e;
	__u64 last_seen; /* TSC of the last packet */
	struct lb_flow_key key;
	bool used;
};

struct fwd_flow_table {
	struct rte_hash *h;
	struct fwd_flow_slot *slots; /* indexed by rte_hash key position */
	__u32 capacity;
	__u8 sig_key[LB_HASH_KEY_LEN];
	__u64 timeout_tsc; /* idle time after which an entry may be expired */
	__u32 sweep_next;  /* next position the expiry sweep looks at */
	__u64 pin_failures; /* flows forwarded unpinned: no room even after eviction */
};

/* capacity entries on socket_id; name must be unique in the process. */
int fwd_flow_init(struct fwd_flow_table *ft, const char *name, __u32 capacity,
		  __u64 timeout_tsc, int socket_id);
void fwd_flow_free(struct fwd_flow_table *ft);

/* The rte_hash signature of k (computed once per packet, used by both calls). */
hash_sig_t fwd_flow_sig(const struct fwd_flow_table *ft, const struct lb_flow_key *k);

/* The flow's slot, or NULL. */
struct fwd_flow_slot *fwd_flow_lookup(struct fwd_flow_table *ft, const struct lb_flow_key *k,
				      hash_sig_t sig, __u64 now);

/* Pins k to e (insert or replace). Returns 1 when a live flow had to be
 * evicted to make room, 0 otherwise, a negative errno on failure. */
int fwd_flow_pin(struct fwd_flow_table *ft, const struct lb_flow_key *k, hash_sig_t sig,
		 const struct lb_flow_entry *e, __u64 now);

/* Looks at the next `budget` positions and removes the entries idle for
 * longer than the timeout. Returns how many it removed. */
unsigned int fwd_flow_expire(struct fwd_flow_table *ft, __u64 now, unsigned int budget);

#endif /* HPCLB_FWD_FLOW_H */
