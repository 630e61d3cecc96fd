/* SPDX-License-Identifier: Apache-2.0 */
#include <errno.h>
#include <string.h>
#include <sys/random.h>
#include <rte_byteorder.h>
#include <rte_malloc.h>

#include "fwd_conn.h"

#define RECLAIM_BATCH 64 /* removed entries made reusable per write section, at most */
#define CONN_NS_PER_S 1000000000ull
#define HASH_MIN_ENTRIES 8 /* rte_hash's minimum (RTE_HASH_BUCKET_ENTRIES, internal) */

/* The two families' tables: one code (fwd_conn_family.c.h), the names and
 * types as fwd_conn.h gives them to fwd_conn_family.h. */
#define FC(x) FC_CAT(fwd_conn_, x)
#define FC_KEY struct lb_flow_key_v4
#define FC_ENTRY struct lb_conn
#define FC_ADDR __be32
#define FC_KEY_HASH lb_flow_hash_v4_key
#define FC_SLOT_SIZE 64
#define FC_REPLY_KEY lb_conn_reply_key
#define FC_ADDR_ZERO(a) ((a) == 0)
#include "fwd_conn_family.c.h"

#define FC(x) FC_CAT(fwd_conn6_, x)
#define FC_KEY struct lb_flow_key
#define FC_ENTRY struct lb_conn6
#define FC_ADDR union lb_addr
#define FC_KEY_HASH lb_flow_hash_v6
#define FC_SLOT_SIZE 128
#define FC_REPLY_KEY fwd_conn6_reply_key
#define FC_ADDR_ZERO(a) fwd_conn6_addr_zero(&(a))
#include "fwd_conn_family.c.h"

void fwd_conn_read(const struct fwd_conn_table *ct, const struct fwd_conn6_table *ct6,
		   const struct fwd_conn_figures *const *figs, unsigned int n,
		   struct lb_conn_stats *out)
{
	__s64 st[LB_CONN_STATES] = { 0 }, snat = 0;
	__u64 expired = 0;

	memset(out, 0, sizeof(*out));
	/* Both tables' figures are in the same per-worker struct: their sums. */
	if (ct) {
		out->capacity += ct->capacity;
		out->entries += fwd_conn_count(ct);
	}
	if (ct6) {
		out->capacity += ct6->capacity;
		out->entries += fwd_conn6_count(ct6);
	}
	for (unsigned int w = 0; w < n; w++) {
		for (__u32 s = 0; s < LB_CONN_STATES; s++)
			st[s] += figs[w]->by_state[s];
		snat += figs[w]->snat_ports;
		expired += figs[w]->expired;
	}
	for (__u32 s = 0; s < LB_CONN_STATES; s++)
		out->by_state[s] = st[s] > 0 ? (__u64)st[s] : 0;
	out->snat_ports_in_use = snat > 0 ? (__u64)snat : 0;
	out->expired = expired;
}
