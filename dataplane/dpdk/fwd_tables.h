/* SPDX-License-Identifier: Apache-2.0
 *
 * fwd_tables.h - the DPDK forwarder's tables and how they change.
 *
 * One immutable struct fwd_tables is current at a time. Workers read it
 * without a lock: they load the pointer once per burst and announce a
 * quiescent state (rte_rcu_qsbr) between bursts. A change (one protocol
 * operation) copies the current version in hugepage memory, edits the copy,
 * publishes it with one atomic store, waits until every worker has passed a
 * quiescent state, and only then frees the old version and any ring it no
 * longer shares. A packet therefore sees either the old tables or the new
 * ones, whole, never a half-written ring.
 *
 * Rings are shared between versions until one is rewritten (copy on write),
 * so a backend or VIP change copies 64 KB, not every ring.
 */
#ifndef HPCLB_FWD_TABLES_H
#define HPCLB_FWD_TABLES_H

#include <pthread.h>
#include <stdbool.h>
#include <string.h>
#include <rte_rcu_qsbr.h>

#include "fwd_conn.h"
#include "lb_proto.h"

/* Open-addressed VIP index: twice LB_MAX_VIPS, so a probe sequence is short. */
#define FWD_VIP_INDEX_SIZE (2 * LB_MAX_VIPS)

struct fwd_vip_slot {
	struct lb_vip_key key;
	__u32 vip_id;
	__u8 mode;      /* enum lb_vip_mode */
	__u8 used;
	__u8 nat_flags; /* LB_VIP_F_* */
	__u8 pad;
	__be16 nat_port; /* NAT mode's backend port, network order (0 = the VIP's port) */
	__u16 pad2;
};

struct fwd_tables {
	struct lb_config config;
	/* Set by the first set_config. Until then a restarted forwarder knows no
	 * VIP, and passing VIP traffic to the kernel (which may hold the VIP
	 * addresses) would get live connections reset: it drops TCP/UDP instead. */
	bool configured;
	struct fwd_vip_slot vip_index[FWD_VIP_INDEX_SIZE];
	struct lb_vip_key vip_keys[LB_MAX_VIPS]; /* by vip_id, for rebuilding the index */
	__u8 vip_modes[LB_MAX_VIPS];
	__u8 vip_nat_flags[LB_MAX_VIPS];
	__be16 vip_nat_ports[LB_MAX_VIPS];
	bool vip_used[LB_MAX_VIPS];
	/* A NAT VIP of either family is configured: with a non-empty connection
	 * table, what makes NAT mode "active" (lb_conn.h; XDP's nat_active), the
	 * condition under which IPv6 frames for no VIP and ICMPv6 errors are
	 * looked at by NAT at all. */
	bool has_nat_vip;
	/* The entry set_vip was given, by vip_id: tunnel mode's lb_encap_prepare
	 * reads its tunnel fields. Apart from the index on purpose: a slot stays
	 * 32 bytes (two a cache line), so the IPv4 lookup touches what it did. */
	struct lb_vip_entry vip_entries[LB_MAX_VIPS];
	__u32 arp_addrs[LB_MAX_VIPS]; /* distinct IPv4 VIP addresses the forwarder answers ARP for */
	__u32 n_arp_addrs;
	/* Distinct IPv6 VIP addresses the forwarder answers Neighbor
	 * Solicitations for (fwd_packet.c), as arp_addrs for ARP. */
	union lb_addr ndp_addrs[LB_MAX_VIPS];
	__u32 n_ndp_addrs;
	/* NAT mode's settings (set_nat): the SNAT pools (whose addresses ARP,
	 * for IPv4, and neighbour discovery, for IPv6, are answered for too), the
	 * port range, the down policy, the timeouts the
	 * workers' sweep applies. A swap like any other change: a packet sees
	 * one configuration whole. */
	struct lb_nat_config nat;
	struct lb_backend backends[LB_MAX_BACKENDS];
	__u32 *rings[LB_MAX_VIPS]; /* ring_size slots each, NULL while the VIP has none */
};

/* The writer side. Only the main lcore calls the ops; telemetry readers take
 * `lock` to read `current` (they are not RCU readers). */
struct fwd_table_store {
	struct fwd_tables *current; /* published with __atomic_store_n(RELEASE) */
	struct rte_rcu_qsbr *qsbr;  /* one thread id per worker */
	int socket_id;              /* NUMA node the tables are allocated on */
	pthread_mutex_t lock;
	__u64 swaps;                /* versions published, for stats and tests */
};

/* Counters of one worker, summed by the main lcore on demand. Plain adds:
 * only the owning worker writes them, the reader tolerates a torn view. */
struct fwd_counters {
	struct lb_counter global[LB_STAT_MAX];
	struct lb_counter vips[LB_MAX_VIPS];
	struct lb_counter backends[LB_MAX_BACKENDS];
	struct fwd_conn_figures conns; /* this worker's part of the connection figures (both
					* families' tables: the protocol reports their sums) */
} __attribute__((aligned(64)));

struct fwd_context {
	struct fwd_table_store store;
	struct fwd_counters **counters; /* one per worker */
	unsigned int nworkers;
	struct fwd_conn_table *conns;   /* NAT connections, shared by the workers (fwd_conn.h) */
	struct fwd_conn6_table *conns6; /* IPv6 NAT connections, the same way */
};

extern const struct lb_dataplane_ops fwd_tables_ops; /* ctx = struct fwd_context * */

/* Empty tables with configuration cfg and a QSBR variable for nworkers.
 * Returns 0 or a negative errno. */
int fwd_store_init(struct fwd_table_store *s, const struct lb_config *cfg,
		   unsigned int nworkers, int socket_id);
void fwd_store_free(struct fwd_table_store *s);

/* The worker side. */
static inline const struct fwd_tables *fwd_tables_current(const struct fwd_table_store *s)
{
	return __atomic_load_n(&s->current, __ATOMIC_ACQUIRE);
}

/* Index position of a VIP key (fwd_tables.c fills the index with the same).
 * The four address words folded first: an IPv4 key has three zero words, so
 * its position is what it was when the key held the IPv4 address alone. */
static inline __u32 fwd_vip_index_hash(const struct lb_vip_key *k)
{
	__u32 a = k->addr.v6w[0] ^ k->addr.v6w[1] ^ k->addr.v6w[2] ^ k->addr.v6w[3];

	return (a * 2654435761u) ^ ((__u32)k->port << 8) ^ k->proto ^ ((__u32)k->family << 16);
}

static inline bool fwd_vip_key_eq(const struct lb_vip_key *a, const struct lb_vip_key *b)
{
	return a->addr.v6w[0] == b->addr.v6w[0] && a->addr.v6w[1] == b->addr.v6w[1] &&
	       a->addr.v6w[2] == b->addr.v6w[2] && a->addr.v6w[3] == b->addr.v6w[3] &&
	       a->port == b->port && a->proto == b->proto && a->family == b->family;
}

/* The VIP slot of key, or NULL. */
static inline const struct fwd_vip_slot *fwd_vip_lookup(const struct fwd_tables *t,
							const struct lb_vip_key *key)
{
	__u32 h = fwd_vip_index_hash(key);

	for (__u32 n = 0; n < FWD_VIP_INDEX_SIZE; n++) {
		const struct fwd_vip_slot *s = &t->vip_index[(h + n) % FWD_VIP_INDEX_SIZE];

		if (!s->used)
			return NULL;
		if (fwd_vip_key_eq(&s->key, key))
			return s;
	}
	return NULL;
}

/* fwd_vip_lookup of an IPv4 key {daddr, dport, proto} given by value (the
 * same hash, the same probe): the fast path compares the slot's fields with
 * registers, where a key built on the stack field by field and then read back
 * in wider loads stalls on store forwarding. */
static inline const struct fwd_vip_slot *fwd_vip_lookup_v4(const struct fwd_tables *t,
							   __u32 daddr, __u16 dport, __u8 proto)
{
	__u32 h = (daddr * 2654435761u) ^ ((__u32)dport << 8) ^ proto ^
		  ((__u32)LB_FAMILY_V4 << 16);

	for (__u32 n = 0; n < FWD_VIP_INDEX_SIZE; n++) {
		const struct fwd_vip_slot *s = &t->vip_index[(h + n) % FWD_VIP_INDEX_SIZE];

		if (!s->used)
			return NULL;
		if (s->key.addr.v6w[0] == daddr && s->key.port == dport && s->key.proto == proto &&
		    s->key.family == LB_FAMILY_V4 && !s->key.addr.v6w[1] && !s->key.addr.v6w[2] &&
		    !s->key.addr.v6w[3])
			return s;
	}
	return NULL;
}

static inline bool fwd_is_vip_addr(const struct fwd_tables *t, __u32 addr)
{
	for (__u32 i = 0; i < t->n_arp_addrs && i < LB_MAX_VIPS; i++)
		if (t->arp_addrs[i] == addr)
			return true;
	return false;
}

/* An IPv6 VIP address (16 bytes, network order): its solicitations are ours. */
static inline bool fwd_is_vip6_addr(const struct fwd_tables *t, const __u8 addr[16])
{
	for (__u32 i = 0; i < t->n_ndp_addrs && i < LB_MAX_VIPS; i++)
		if (!memcmp(t->ndp_addrs[i].v6, addr, 16))
			return true;
	return false;
}

/* An address of the SNAT pool: backends' replies come back to it. */
static inline bool fwd_is_snat_addr(const struct fwd_tables *t, __u32 addr)
{
	for (__u32 i = 0; i < t->nat.snat_naddrs && i < LB_MAX_SNAT_ADDRS; i++)
		if (t->nat.snat_addrs[i] == addr)
			return true;
	return false;
}

/* An address of the IPv6 SNAT pool (16 bytes, network order): backends'
 * replies come back to it, so its Neighbor Solicitations are ours. */
static inline bool fwd_is_snat6_addr(const struct fwd_tables *t, const __u8 addr[16])
{
	for (__u32 i = 0; i < t->nat.snat_naddrs6 && i < LB_MAX_SNAT_ADDRS; i++)
		if (!memcmp(t->nat.snat_addrs6[i].v6, addr, 16))
			return true;
	return false;
}

#endif /* HPCLB_FWD_TABLES_H */
