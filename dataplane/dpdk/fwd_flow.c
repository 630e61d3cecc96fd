/* SPDX-License-Identifier: Apache-2.0 */
#include <errno.h>
#include <string.h>
#include <sys/random.h>
#include <rte_malloc.h>

#include "fwd_flow.h"
#include "lb_hash.h"

#define EVICT_SAMPLE 8        /* used entries looked at to choose a victim */
#define EVICT_MAX_WALK 1024   /* positions walked at most to find them */

/* rte_hash's key compare (0: equal): fwd_flow_key_eq, fwd_flow.h says why. */
static int fwd_flow_key_cmp(const void *a, const void *b, size_t len)
{
	(void)len; /* always sizeof(struct lb_flow_key) */
	return !fwd_flow_key_eq(a, b);
}

int fwd_flow_init(struct fwd_flow_table *ft, const char *name, __u32 capacity,
		  __u64 timeout_tsc, int socket_id)
{
	struct rte_hash_parameters p = {
		.name = name,
		.entries = capacity,
		.key_len = sizeof(struct lb_flow_key),
		.socket_id = socket_id,
		.extra_flag = RTE_HASH_EXTRA_FLAGS_EXT_TABLE,
	};

	memset(ft, 0, sizeof(*ft));
	if (capacity < 8)
		return -EINVAL;
	if (getrandom(ft->sig_key, sizeof(ft->sig_key), 0) != sizeof(ft->sig_key))
		return -EIO;
	{
		__u64 k0, k1;

		memcpy(&k0, ft->sig_key, 8);
		memcpy(&k1, ft->sig_key + 8, 8);
		ft->sip_v[0] = k0 ^ 0x736f6d6570736575ULL;
		ft->sip_v[1] = k1 ^ 0x646f72616e646f6dULL;
		ft->sip_v[2] = k0 ^ 0x6c7967656e657261ULL;
		ft->sip_v[3] = k1 ^ 0x7465646279746573ULL;
	}
	ft->h = rte_hash_create(&p);
	if (ft->h)
		rte_hash_set_cmp_func(ft->h, fwd_flow_key_cmp);
	ft->slots = rte_zmalloc_socket(name, (size_t)capacity * sizeof(*ft->slots),
				       RTE_CACHE_LINE_SIZE, socket_id);
	if (!ft->h || !ft->slots) {
		fwd_flow_free(ft);
		return -ENOMEM;
	}
	ft->capacity = capacity;
	ft->timeout_tsc = timeout_tsc;
	return 0;
}

void fwd_flow_free(struct fwd_flow_table *ft)
{
	rte_hash_free(ft->h);
	rte_free(ft->slots);
	ft->h = NULL;
	ft->slots = NULL;
}

static int remove_at(struct fwd_flow_table *ft, __u32 pos)
{
	struct fwd_flow_slot *s = &ft->slots[pos];

	if (rte_hash_del_key_with_hash(ft->h, &s->key, fwd_flow_sig(ft, &s->key)) < 0)
		return -ENOENT;
	s->used = false;
	return 0;
}

unsigned int fwd_flow_expire(struct fwd_flow_table *ft, __u64 now, unsigned int budget)
{
	unsigned int removed = 0;

	for (unsigned int n = 0; n < budget; n++) {
		__u32 pos = ft->sweep_next;
		const struct fwd_flow_slot *s = &ft->slots[pos];

		ft->sweep_next = pos + 1 < ft->capacity ? pos + 1 : 0;
		if (s->used && now - s->last_seen > ft->timeout_tsc && remove_at(ft, pos) == 0)
			removed++;
	}
	return removed;
}

/* Removes the least recently seen of the next EVICT_SAMPLE used entries. */
static int evict_one(struct fwd_flow_table *ft)
{
	__u64 oldest = UINT64_MAX;
	__u32 victim = 0, seen = 0;

	for (__u32 n = 0; n < EVICT_MAX_WALK && seen < EVICT_SAMPLE; n++) {
		__u32 pos = ft->sweep_next;
		const struct fwd_flow_slot *s = &ft->slots[pos];

		ft->sweep_next = pos + 1 < ft->capacity ? pos + 1 : 0;
		if (!s->used)
			continue;
		seen++;
		if (s->last_seen <= oldest) {
			oldest = s->last_seen;
			victim = pos;
		}
	}
	if (!seen)
		return -ENOSPC;
	return remove_at(ft, victim);
}

int fwd_flow_pin(struct fwd_flow_table *ft, const struct lb_flow_key *k, hash_sig_t sig,
		 const struct lb_flow_entry *e, __u64 now)
{
	int32_t pos = rte_hash_add_key_with_hash(ft->h, k, sig);
	int evicted = 0;

	if (pos == -ENOSPC) {
		/* Full (the extendable buckets make this mean every position is
		 * taken): idle entries first, then the oldest of a sample. */
		if (!fwd_flow_expire(ft, now, EVICT_MAX_WALK)) {
			if (evict_one(ft) == 0)
				evicted = 1;
		}
		pos = rte_hash_add_key_with_hash(ft->h, k, sig);
	}
	if (pos < 0 || (__u32)pos >= ft->capacity) {
		ft->pin_failures++;
		return pos < 0 ? pos : -ERANGE;
	}
	ft->slots[pos].e = *e;
	ft->slots[pos].key = *k;
	ft->slots[pos].last_seen = now;
	ft->slots[pos].used = true;
	return evicted;
}

__u32 fwd_flow_count(const struct fwd_flow_table *ft)
{
	int32_t n = rte_hash_count(ft->h);

	return n > 0 ? (__u32)n : 0;
}

void fwd_flow_reset(struct fwd_flow_table *ft)
{
	rte_hash_reset(ft->h);
	for (__u32 pos = 0; pos < ft->capacity; pos++)
		ft->slots[pos].used = false;
	ft->sweep_next = 0;
}
