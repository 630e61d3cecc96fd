/* SPDX-License-Identifier: Apache-2.0
 *
 * flow_selftest.c - the DPDK forwarder's per-worker flow table
 * (dataplane/dpdk/fwd_flow.c) on a real rte_hash: pins are found again,
 * idle entries really expire, a full table evicts the oldest and keeps
 * taking new flows (never fails to pin), and every live entry stays findable.
 * Run by tests/unit/test_dpdk_flow_table.py under a small EAL (--no-huge).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <rte_eal.h>

#include "fwd_flow.h"


#include "selftest.h"

static struct lb_flow_key key(__u32 i)
{
	struct lb_flow_key k;

	memset(&k, 0, sizeof(k));
	k.saddr.v4 = i;
	k.daddr.v4 = 0x0a01a8c6;
	k.family = LB_FAMILY_V4;
	k.sport = (__u16)(i * 7);
	k.dport = 80;
	k.proto = 6;
	return k;
}

static int pin(struct fwd_flow_table *ft, __u32 i, __u64 now)
{
	struct lb_flow_key k = key(i);
	struct lb_flow_entry e = { .backend = i % 97, .vip_id = 1, .pinned_ns = now };

	return fwd_flow_pin(ft, &k, fwd_flow_sig(ft, &k), &e, now);
}

static struct fwd_flow_slot *find(struct fwd_flow_table *ft, __u32 i, __u64 now)
{
	struct lb_flow_key k = key(i);

	return fwd_flow_lookup(ft, &k, fwd_flow_sig(ft, &k), now);
}

int main(int argc, char **argv)
{
	struct fwd_flow_table ft;
	const __u32 cap = 1024;
	__u32 evicted = 0, found = 0;
	int rc;

	if (rte_eal_init(argc, argv) < 0) {
		printf("EAL init failed\n");
		return 2;
	}
	rc = fwd_flow_init(&ft, "selftest", cap, 1000 /* timeout, TSC units */, SOCKET_ID_ANY);
	CHECK(rc == 0, "init: %d", rc);

	/* Pinned flows are found, with their entry. */
	for (__u32 i = 0; i < 100; i++)
		CHECK(pin(&ft, i, 10) == 0, "pin %u", i);
	for (__u32 i = 0; i < 100; i++) {
		struct fwd_flow_slot *s = find(&ft, i, 20);

		CHECK(s && s->e.backend == i % 97, "flow %u lost", i);
	}
	CHECK(!find(&ft, 5000, 20), "a flow never pinned is found");

	/* Idle entries expire, recent ones stay. */
	for (__u32 i = 0; i < 50; i++)
		find(&ft, i, 5000); /* seen again at t=5000 */
	rc = (int)fwd_flow_expire(&ft, 5500, cap);
	CHECK(rc == 50, "expired %d of the 50 idle flows", rc);
	for (__u32 i = 0; i < 100; i++)
		CHECK((find(&ft, i, 5500) != NULL) == (i < 50), "flow %u after expiry", i);

	/* Far more flows than room, none idle long enough to expire: every pin
	 * succeeds, the oldest go first. */
	fwd_flow_free(&ft);
	rc = fwd_flow_init(&ft, "selftest2", cap, UINT64_MAX / 2, SOCKET_ID_ANY);
	CHECK(rc == 0, "init: %d", rc);
	for (__u32 i = 1000; i < 1000 + 3 * cap; i++) {
		rc = pin(&ft, i, 6000 + i);
		CHECK(rc >= 0, "pin %u failed: %d", i, rc);
		evicted += rc == 1;
	}
	CHECK(ft.pin_failures == 0, "%llu pin failures", (unsigned long long)ft.pin_failures);
	CHECK(evicted > 2 * cap - 100, "only %u evictions for %u extra flows", evicted, 2 * cap);
	for (__u32 i = 1000 + 3 * cap - 200; i < 1000 + 3 * cap; i++)
		found += find(&ft, i, 20000) != NULL;
	CHECK(found == 200, "%u of the 200 newest flows found", found);

	/* Every position the table holds is consistent with a lookup. */
	found = 0;
	for (__u32 p = 0; p < cap; p++) {
		if (!ft.slots[p].used)
			continue;
		found++;
		CHECK(fwd_flow_lookup(&ft, &ft.slots[p].key, fwd_flow_sig(&ft, &ft.slots[p].key),
				      20000) == &ft.slots[p], "slot %u not found by its key", p);
	}
	CHECK(found > cap - 32 && found <= cap, "%u used slots", found);

	fwd_flow_free(&ft);
	rte_eal_cleanup();
	if (failures) {
		printf("flow_selftest: %d failures\n", failures);
		return 1;
	}
	printf("flow_selftest: ok (%u evictions)\n", evicted);
	return 0;
}
