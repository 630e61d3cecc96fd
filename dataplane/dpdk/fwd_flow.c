/* SPDX-License-Identifier: Apache-2.0 */
#include <errno.h>
#include <string.h>
#include <sys/random.h>
#include <rte_malloc.h>

#include "fwd_flow.h"
#include "lb_hash.h"

#define EVICT_SAMPLE 8       /* entries looked at to choose a victim */
#define FULL_EXPIRE_BUDGET 64 /* entries walked to free room before evicting */

static hash_sig_t flow_sig(const struct fwd_flow_table *ft, const struct lb_flow_key *k)
{
	return (hash_sig_t)lb_flow_hash(ft->sig_key, k);
}

int fwd_flow_init(struct fwd_flow_table *ft, const char *name, __u32 capacity,
		  __u64 timeout_tsc, int socket_id)
{
	struct rte_hash_parameters p = {
		.name = name,
		.entries = capacity,
		.key_len = sizeof(struct lb_flow_key),
		.socket_id = socket_id,
	};

	memset(ft, 0, sizeof(*ft));
	if (capacity < 8)
		return -EINVAL;
	if (getrandom(ft->sig_key, sizeof(ft->sig_key), 0) != sizeof(ft->sig_key))
		return -EIO;
	ft->h = rte_hash_create(&p);
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

struct fwd_flow_slot *fwd_flow_lookup(struct fwd_flow_table *ft, const struct lb_flow_key *k,
				      __u64 now)
{
	int32_t pos = rte_hash_lookup_with_hash(ft->h, k, flow_sig(ft, k));

	if (pos < 0 || (__u32)pos >= ft->capacity)
		return NULL;
	ft->slots[pos].last_seen = now;
	return &ft->slots[pos];
}

unsigned int fwd_flow_expire(struct fwd_flow_table *ft, __u64 now, unsigned int budget)
{
	unsigned int removed = 0;
	const void *key;
	void *data;

	for (unsigned int n = 0; n < budget; n++) {
		int32_t pos = rte_hash_iterate(ft->h, &key, &data, &ft->sweep_next);

		if (pos == -ENOENT) {
			ft->sweep_next = 0; /* wrapped: start over next time */
			break;
		}
		if (pos < 0 || (__u32)pos >= ft->capacity)
			break;
		if (now - ft->slots[pos].last_seen > ft->timeout_tsc &&
		    rte_hash_del_key(ft->h, key) >= 0)
			removed++;
	}
	return removed;
}

/* Removes the least recently seen of the next EVICT_SAMPLE entries. */
static int evict_one(struct fwd_flow_table *ft)
{
	struct lb_flow_key victim;
	__u64 oldest = UINT64_MAX;
	bool found = false;
	const void *key;
	void *data;

	for (unsigned int n = 0; n < 2 * EVICT_SAMPLE && !(found && n >= EVICT_SAMPLE); n++) {
		int32_t pos = rte_hash_iterate(ft->h, &key, &data, &ft->sweep_next);

		if (pos == -ENOENT) {
			ft->sweep_next = 0;
			continue;
		}
		if (pos < 0 || (__u32)pos >= ft->capacity)
			break;
		if (ft->slots[pos].last_seen <= oldest) {
			oldest = ft->slots[pos].last_seen;
			memcpy(&victim, key, sizeof(victim));
			found = true;
		}
	}
	if (!found)
		return -ENOSPC;
	return rte_hash_del_key(ft->h, &victim) >= 0 ? 0 : -ENOSPC;
}

int fwd_flow_pin(struct fwd_flow_table *ft, const struct lb_flow_key *k,
		 const struct lb_flow_entry *e, __u64 now)
{
	hash_sig_t sig = flow_sig(ft, k);
	int32_t pos = rte_hash_add_key_with_hash(ft->h, k, sig);
	int evicted = 0;

	if (pos == -ENOSPC) {
		/* A full table (or a full cuckoo path): expired entries first. */
		if (!fwd_flow_expire(ft, now, FULL_EXPIRE_BUDGET)) {
			if (evict_one(ft))
				return -ENOSPC;
			evicted = 1;
		}
		pos = rte_hash_add_key_with_hash(ft->h, k, sig);
	}
	if (pos < 0 || (__u32)pos >= ft->capacity)
		return pos < 0 ? pos : -ERANGE;
	ft->slots[pos].e = *e;
	ft->slots[pos].last_seen = now;
	return evicted;
}
