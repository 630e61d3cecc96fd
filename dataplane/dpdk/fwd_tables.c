/* SPDX-License-Identifier: Apache-2.0 */
#include <errno.h>
#include <string.h>
#include <rte_malloc.h>

#include "fwd_tables.h"

static struct fwd_tables *clone_tables(const struct fwd_table_store *s)
{
	struct fwd_tables *t = rte_malloc_socket("hpclb_tables", sizeof(*t),
						 RTE_CACHE_LINE_SIZE, s->socket_id);

	if (t)
		memcpy(t, s->current, sizeof(*t));
	return t;
}

/* Publishes next, waits until no worker can still see the old version, then
 * frees it and the rings it held that next no longer shares. A worker passes
 * a quiescent state after every burst, so this waits for one burst at most. */
static void publish(struct fwd_table_store *s, struct fwd_tables *next)
{
	struct fwd_tables *old = s->current;

	pthread_mutex_lock(&s->lock);
	__atomic_store_n(&s->current, next, __ATOMIC_RELEASE);
	s->swaps++;
	pthread_mutex_unlock(&s->lock);
	rte_rcu_qsbr_synchronize(s->qsbr, RTE_QSBR_THRID_INVALID);
	for (__u32 v = 0; v < LB_MAX_VIPS; v++)
		if (old->rings[v] && old->rings[v] != next->rings[v])
			rte_free(old->rings[v]);
	rte_free(old);
}

/* Recreates the lookup index and the ARP and NDP address lists from vip_keys. */
static void rebuild_vip_index(struct fwd_tables *t)
{
	memset(t->vip_index, 0, sizeof(t->vip_index));
	memset(t->ndp_addrs, 0, sizeof(t->ndp_addrs));
	t->n_arp_addrs = 0;
	t->n_ndp_addrs = 0;
	t->has_nat_vip = false;
	for (__u32 v = 0; v < LB_MAX_VIPS; v++) {
		const struct lb_vip_key *k = &t->vip_keys[v];
		__u32 h = fwd_vip_index_hash(k);
		bool seen = false;

		if (!t->vip_used[v])
			continue;
		t->has_nat_vip = t->has_nat_vip || t->vip_modes[v] == LB_MODE_NAT;
		/* 64 keys in 128 slots: a free slot is always found. */
		for (__u32 n = 0; n < FWD_VIP_INDEX_SIZE; n++) {
			struct fwd_vip_slot *slot = &t->vip_index[(h + n) % FWD_VIP_INDEX_SIZE];

			if (slot->used)
				continue;
			slot->key = *k;
			slot->vip_id = v;
			slot->mode = t->vip_modes[v];
			slot->nat_flags = t->vip_nat_flags[v];
			slot->nat_port = t->vip_nat_ports[v];
			slot->used = 1;
			break;
		}
		/* ARP for an IPv4 VIP, neighbour discovery for an IPv6 one:
		 * each address once, however many ports it serves. */
		if (k->family == LB_FAMILY_V6) {
			for (__u32 i = 0; i < t->n_ndp_addrs; i++)
				seen = seen || !memcmp(&t->ndp_addrs[i], &k->addr, sizeof(k->addr));
			if (!seen)
				t->ndp_addrs[t->n_ndp_addrs++] = k->addr;
			continue;
		}
		if (k->family != LB_FAMILY_V4)
			continue;
		for (__u32 i = 0; i < t->n_arp_addrs; i++)
			seen = seen || t->arp_addrs[i] == k->addr.v4;
		if (!seen)
			t->arp_addrs[t->n_arp_addrs++] = k->addr.v4;
	}
}

static int op_set_config(void *ctx, const struct lb_config *cfg)
{
	struct fwd_context *c = ctx;
	struct fwd_tables *next;

	if (cfg->ring_size != c->store.current->config.ring_size)
		return -EINVAL; /* fixed at start: every ring has this many slots */
	next = clone_tables(&c->store);
	if (!next)
		return -ENOMEM;
	next->config = *cfg;
	next->configured = true;
	publish(&c->store, next);
	return 0;
}

static int op_set_vip(void *ctx, const struct lb_vip_key *key, const struct lb_vip_entry *vip)
{
	struct fwd_context *c = ctx;
	struct fwd_tables *next;

	if (vip->vip_id >= LB_MAX_VIPS)
		return -EINVAL;
	next = clone_tables(&c->store);
	if (!next)
		return -ENOMEM;
	/* A key that moves to another id leaves its old one: keys and ids are 1:1. */
	for (__u32 v = 0; v < LB_MAX_VIPS; v++)
		if (next->vip_used[v] && !memcmp(&next->vip_keys[v], key, sizeof(*key)))
			next->vip_used[v] = false;
	next->vip_keys[vip->vip_id] = *key;
	next->vip_modes[vip->vip_id] = vip->mode;
	next->vip_nat_flags[vip->vip_id] = vip->nat_flags;
	next->vip_nat_ports[vip->vip_id] = vip->nat_port;
	next->vip_entries[vip->vip_id] = *vip;
	next->vip_used[vip->vip_id] = true;
	rebuild_vip_index(next);
	publish(&c->store, next);
	return 0;
}

static int op_del_vip(void *ctx, const struct lb_vip_key *key)
{
	struct fwd_context *c = ctx;
	struct fwd_tables *next = clone_tables(&c->store);

	if (!next)
		return -ENOMEM;
	for (__u32 v = 0; v < LB_MAX_VIPS; v++) {
		if (next->vip_used[v] && !memcmp(&next->vip_keys[v], key, sizeof(*key))) {
			next->vip_used[v] = false;
			next->rings[v] = NULL; /* freed by publish once unseen */
		}
	}
	rebuild_vip_index(next);
	publish(&c->store, next);
	return 0;
}

static int op_set_backends(void *ctx, const __u32 *ids, const struct lb_backend *b, size_t n)
{
	struct fwd_context *c = ctx;
	struct fwd_tables *next = clone_tables(&c->store);

	if (!next)
		return -ENOMEM;
	for (size_t i = 0; i < n; i++) {
		if (ids[i] >= LB_MAX_BACKENDS) {
			rte_free(next);
			return -EINVAL;
		}
		next->backends[ids[i]] = b[i];
	}
	publish(&c->store, next);
	return 0;
}

/* A private copy of vip_id's ring in next (copy on write). */
static __u32 *own_ring(const struct fwd_table_store *s, struct fwd_tables *next, __u32 vip_id)
{
	size_t bytes = (size_t)next->config.ring_size * sizeof(__u32);
	__u32 *ring = rte_malloc_socket("hpclb_ring", bytes, RTE_CACHE_LINE_SIZE, s->socket_id);

	if (!ring)
		return NULL;
	if (next->rings[vip_id]) {
		memcpy(ring, next->rings[vip_id], bytes);
	} else {
		for (__u32 i = 0; i < next->config.ring_size; i++)
			ring[i] = LB_NO_BACKEND;
	}
	next->rings[vip_id] = ring;
	return ring;
}

static int op_write_ring(void *ctx, __u32 vip_id, const __u32 *slots)
{
	struct fwd_context *c = ctx;
	struct fwd_tables *next;
	__u32 *ring;

	if (vip_id >= LB_MAX_VIPS)
		return -EINVAL;
	next = clone_tables(&c->store);
	if (!next)
		return -ENOMEM;
	next->rings[vip_id] = NULL; /* no copy of the old contents needed */
	ring = own_ring(&c->store, next, vip_id);
	if (!ring) {
		rte_free(next);
		return -ENOMEM;
	}
	memcpy(ring, slots, (size_t)next->config.ring_size * sizeof(__u32));
	publish(&c->store, next);
	return 0;
}

static int op_patch_ring(void *ctx, __u32 vip_id, const struct lb_ring_patch *p, size_t n)
{
	struct fwd_context *c = ctx;
	struct fwd_tables *next;
	__u32 *ring;

	if (vip_id >= LB_MAX_VIPS)
		return -EINVAL;
	next = clone_tables(&c->store);
	if (!next)
		return -ENOMEM;
	ring = own_ring(&c->store, next, vip_id);
	if (!ring) {
		rte_free(next);
		return -ENOMEM;
	}
	for (size_t i = 0; i < n; i++) {
		if (p[i].slot >= next->config.ring_size) {
			rte_free(ring);
			rte_free(next);
			return -EINVAL;
		}
		ring[p[i].slot] = p[i].backend;
	}
	publish(&c->store, next);
	return 0;
}

static void add(struct lb_counter *sum, const struct lb_counter *c, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		sum[i].packets += c[i].packets;
		sum[i].bytes += c[i].bytes;
	}
}

static int op_read_stats(void *ctx, struct lb_counter *global, struct lb_counter *vips,
			 struct lb_counter *backends)
{
	struct fwd_context *c = ctx;

	memset(global, 0, sizeof(struct lb_counter) * LB_STAT_MAX);
	memset(vips, 0, sizeof(struct lb_counter) * LB_MAX_VIPS);
	memset(backends, 0, sizeof(struct lb_counter) * LB_MAX_BACKENDS);
	for (unsigned int w = 0; w < c->nworkers; w++) {
		const struct fwd_counters *wc = c->counters[w];

		add(global, wc->global, LB_STAT_MAX);
		add(vips, wc->vips, LB_MAX_VIPS);
		add(backends, wc->backends, LB_MAX_BACKENDS);
	}
	return 0;
}

static int op_set_nat(void *ctx, const struct lb_nat_config *nat)
{
	struct fwd_context *c = ctx;
	struct fwd_tables *next;

	/* The server validated it; the fast path still bounds its loops by
	 * LB_MAX_SNAT_ADDRS, so a bad count cannot take it past the array. */
	if (nat->snat_naddrs > LB_MAX_SNAT_ADDRS || nat->snat_naddrs6 > LB_MAX_SNAT_ADDRS)
		return -EINVAL;
	next = clone_tables(&c->store);
	if (!next)
		return -ENOMEM;
	next->nat = *nat;
	publish(&c->store, next);
	return 0;
}

/* The tables' figures, both families summed: live entries are each table's
 * own count, the rest the workers' deltas summed. */
static int op_read_conns(void *ctx, struct lb_conn_stats *out)
{
	struct fwd_context *c = ctx;
	const struct fwd_conn_figures *figs[RTE_MAX_LCORE];

	if ((!c->conns && !c->conns6) || c->nworkers > RTE_MAX_LCORE)
		return -ENODEV;
	for (unsigned int w = 0; w < c->nworkers; w++)
		figs[w] = &c->counters[w]->conns;
	fwd_conn_read(c->conns, c->conns6, figs, c->nworkers, out);
	return 0;
}

const struct lb_dataplane_ops fwd_tables_ops = {
	.set_config = op_set_config,
	.set_vip = op_set_vip,
	.del_vip = op_del_vip,
	.set_backends = op_set_backends,
	.write_ring = op_write_ring,
	.patch_ring = op_patch_ring,
	.read_stats = op_read_stats,
	.set_nat = op_set_nat,
	.read_conns = op_read_conns,
};

int fwd_store_init(struct fwd_table_store *s, const struct lb_config *cfg,
		   unsigned int nworkers, int socket_id)
{
	size_t qsz = rte_rcu_qsbr_get_memsize(nworkers);
	struct fwd_tables *t;

	memset(s, 0, sizeof(*s));
	s->socket_id = socket_id;
	pthread_mutex_init(&s->lock, NULL);
	s->qsbr = rte_zmalloc_socket("hpclb_qsbr", qsz, RTE_CACHE_LINE_SIZE, socket_id);
	t = rte_zmalloc_socket("hpclb_tables", sizeof(*t), RTE_CACHE_LINE_SIZE, socket_id);
	if (!s->qsbr || !t || rte_rcu_qsbr_init(s->qsbr, nworkers)) {
		rte_free(s->qsbr);
		rte_free(t);
		s->qsbr = NULL;
		return -ENOMEM;
	}
	t->config = *cfg;
	lb_proto_nat_defaults(&t->nat); /* the server's too until set_nat */
	for (__u32 b = 0; b < LB_MAX_BACKENDS; b++)
		t->backends[b].state = LB_BACKEND_UNUSED;
	s->current = t;
	return 0;
}

void fwd_store_free(struct fwd_table_store *s)
{
	if (s->current) {
		for (__u32 v = 0; v < LB_MAX_VIPS; v++)
			rte_free(s->current->rings[v]);
		rte_free(s->current);
		s->current = NULL;
	}
	rte_free(s->qsbr);
	s->qsbr = NULL;
	pthread_mutex_destroy(&s->lock);
}
