/* SPDX-License-Identifier: Apache-2.0
 *
 * conn_selftest.c - the DPDK forwarder's NAT connection table
 * (dataplane/dpdk/fwd_conn.c) on a real rte_hash: the capacity is exact, a
 * full table evicts the oldest embryonic connection through the FIFO (at most
 * LB_CONN_EVICT_TRIES keys looked at), never an established one, the idle
 * sweep removes by state timeout, SNAT ports are probed in order, the figures
 * add up, and with several workers removed entries are reused only after a
 * quiescent state. The IPv6 table (fwd_conn6_*, the same code instantiated
 * for 40-byte keys) keeps the same rules: its tests are at the end, beside
 * the figures summed over both tables. Run by
 * tests/unit/test_dpdk_conn_table.py under a small EAL (--no-huge).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <rte_byteorder.h>
#include <rte_eal.h>
#include <rte_malloc.h>

#include "fwd_conn.h"

#include "selftest.h"

#define VIP 0x0a01a8c6u     /* network order, any value */
#define BACKEND 0x0b0012c6u
#define SNAT_ADDR 0x640012c6u
#define S 1000000000ull     /* one second in ns */

static struct fwd_conn_figures fig;

/* The IPv6 table's helpers (with its tests, at the end). */
static enum fwd_conn_open_status open6(struct fwd_conn6_table *ct, __u32 i, __u8 state,
				       __u64 now, bool *evicted);
static struct fwd_conn6_slot *find6(struct fwd_conn6_table *ct, __u32 i);

static struct lb_flow_key_v4 okey(__u32 i)
{
	struct lb_flow_key_v4 k;

	memset(&k, 0, sizeof(k));
	k.saddr = rte_cpu_to_be_32(0x0a000000u + i);
	k.daddr = VIP;
	k.sport = rte_cpu_to_be_16((__u16)(10000 + i));
	k.dport = rte_cpu_to_be_16(80);
	k.proto = LB_IPPROTO_TCP;
	return k;
}

static struct fwd_conn_req req(const struct fwd_conn_table *ct, __u32 i, __u8 state, __u64 now)
{
	struct fwd_conn_req r;

	memset(&r, 0, sizeof(r));
	r.orig = okey(i);
	r.orig_sig = fwd_conn_sig(ct, &r.orig);
	r.backend_addr = BACKEND;
	r.backend_port = rte_cpu_to_be_16(8080);
	r.hash = 1000 + i;
	r.tmpl.backend_id = 7;
	r.tmpl.vip_id = 3;
	r.tmpl.state = state;
	r.tmpl.client_port = 1;
	r.now_ns = now;
	return r;
}

static enum fwd_conn_open_status open_conn(struct fwd_conn_table *ct, __u32 i, __u8 state,
					   __u64 now, bool *evicted)
{
	struct fwd_conn_req r = req(ct, i, state, now);
	struct fwd_conn_slot *o;
	bool ev;

	return fwd_conn_open(ct, &fig, &r, &o, evicted ? evicted : &ev);
}

static struct fwd_conn_slot *find(struct fwd_conn_table *ct, __u32 i)
{
	struct lb_flow_key_v4 k = okey(i);

	return fwd_conn_lookup(ct, &k, fwd_conn_sig(ct, &k));
}

/* SYN, SYN+ACK, ACK through the table's own update. */
static void establish(struct fwd_conn_table *ct, __u32 i)
{
	struct fwd_conn_slot *o = find(ct, i);

	CHECK(o != NULL, "connection %u to establish is missing", i);
	if (!o)
		return;
	fwd_conn_update(ct, &fig, o, LB_CONN_REPLY, LB_IPPROTO_TCP, LB_TCP_SYN | LB_TCP_ACK, 1);
	fwd_conn_update(ct, &fig, o, LB_CONN_ORIG, LB_IPPROTO_TCP, LB_TCP_ACK, 1);
	CHECK(fwd_conn_state(o) == LB_CONN_ESTABLISHED, "connection %u state %u", i,
	      fwd_conn_state(o));
}

static struct lb_conn_stats stats(const struct fwd_conn_table *ct)
{
	const struct fwd_conn_figures *figs[1] = { &fig };
	struct lb_conn_stats s;

	fwd_conn_read(ct, NULL, figs, 1, &s);
	return s;
}

static void test_capacity_and_entries(void)
{
	struct fwd_conn_table ct;
	struct fwd_conn_slot *o, *r;
	struct lb_flow_key_v4 rk;
	struct lb_conn_stats s;
	int rc;

	memset(&fig, 0, sizeof(fig));
	/* The smallest table holds exactly two connections. */
	rc = fwd_conn_init(&ct, "conn_min", LB_CONN_TABLE_MIN, 1, NULL, SOCKET_ID_ANY);
	CHECK(rc == 0, "init min: %d", rc);
	CHECK(open_conn(&ct, 1, LB_CONN_ESTABLISHED, 0, NULL) == FWD_CONN_OPENED, "conn 1");
	CHECK(open_conn(&ct, 2, LB_CONN_ESTABLISHED, 0, NULL) == FWD_CONN_OPENED, "conn 2");
	CHECK(open_conn(&ct, 3, LB_CONN_ESTABLISHED, 0, NULL) == FWD_CONN_FULL,
	      "a third connection in a 4-entry table");
	CHECK(fwd_conn_count(&ct) == 4, "count %u", fwd_conn_count(&ct));

	/* Both entries: the reply key names the original, and back. */
	o = find(&ct, 1);
	CHECK(o && o->c.dir == LB_CONN_ORIG && o->c.backend_id == 7 && o->c.vip_id == 3,
	      "original entry");
	if (o) {
		lb_conn_reply_key(&rk, BACKEND, rte_cpu_to_be_16(8080), okey(1).saddr,
				  okey(1).sport, LB_IPPROTO_TCP);
		CHECK(!memcmp(&o->c.peer, &rk, sizeof(rk)), "the original's peer is the reply key");
		r = fwd_conn_lookup(&ct, &rk, fwd_conn_sig(&ct, &rk));
		CHECK(r && r->c.dir == LB_CONN_REPLY && fwd_conn_orig(&ct, r) == o,
		      "the reply entry leads to the original");
		CHECK(r && !memcmp(&r->c.peer, &o->key, sizeof(rk)), "the reply's peer");
	}
	s = stats(&ct);
	CHECK(s.capacity == 4 && s.entries == 4 && s.by_state[LB_CONN_ESTABLISHED] == 2,
	      "figures: capacity %llu entries %llu established %llu",
	      (unsigned long long)s.capacity, (unsigned long long)s.entries,
	      (unsigned long long)s.by_state[LB_CONN_ESTABLISHED]);
	/* Closing frees exactly two entries. */
	fwd_conn_close(&ct, &fig, find(&ct, 1));
	CHECK(!find(&ct, 1) && fwd_conn_count(&ct) == 2, "close");
	CHECK(open_conn(&ct, 3, LB_CONN_ESTABLISHED, 0, NULL) == FWD_CONN_OPENED,
	      "room after a close");
	fwd_conn_free(&ct);

	CHECK(fwd_conn_init(&ct, "conn_odd", 6 + 1, 1, NULL, SOCKET_ID_ANY) == -EINVAL,
	      "an odd size is refused");
	CHECK(fwd_conn_init(&ct, "conn_two", 2, 1, NULL, SOCKET_ID_ANY) == -EINVAL,
	      "a size below LB_CONN_TABLE_MIN is refused");

	/* A larger table fills to its capacity exactly: no cuckoo failure. */
	memset(&fig, 0, sizeof(fig));
	rc = fwd_conn_init(&ct, "conn_big", 4096, 1, NULL, SOCKET_ID_ANY);
	CHECK(rc == 0, "init big: %d", rc);
	for (__u32 i = 0; i < 2048; i++)
		CHECK(open_conn(&ct, 100 + i, LB_CONN_ESTABLISHED, 0, NULL) == FWD_CONN_OPENED,
		      "conn %u of 2048", i);
	CHECK(open_conn(&ct, 99999, LB_CONN_SYN_SENT, 0, NULL) == FWD_CONN_FULL,
	      "established connections are never evicted");
	CHECK(fwd_conn_count(&ct) == 4096, "count %u", fwd_conn_count(&ct));
	for (__u32 i = 0; i < 2048; i++)
		CHECK(find(&ct, 100 + i) != NULL, "conn %u lost", i);
	s = stats(&ct);
	CHECK(s.by_state[LB_CONN_ESTABLISHED] == 2048, "%llu established",
	      (unsigned long long)s.by_state[LB_CONN_ESTABLISHED]);
	fwd_conn_free(&ct);
}

static void test_fifo_eviction(void)
{
	struct fwd_conn_table ct;
	bool ev;
	int rc;

	memset(&fig, 0, sizeof(fig));
	rc = fwd_conn_init(&ct, "conn_fifo", 8, 1, NULL, SOCKET_ID_ANY);
	CHECK(rc == 0, "init: %d", rc);
	for (__u32 i = 1; i <= 4; i++)
		CHECK(open_conn(&ct, i, LB_CONN_SYN_SENT, 0, &ev) == FWD_CONN_OPENED && !ev,
		      "SYN %u", i);
	/* Full: the oldest embryonic one (1) goes. */
	CHECK(open_conn(&ct, 5, LB_CONN_SYN_SENT, 0, &ev) == FWD_CONN_OPENED && ev,
	      "SYN 5 evicts");
	CHECK(!find(&ct, 1) && find(&ct, 2) && find(&ct, 5), "1 evicted, 2 and 5 kept");
	CHECK(fwd_conn_count(&ct) == 8, "count %u", fwd_conn_count(&ct));
	/* Established ones are skipped (and leave the FIFO): 2, 3 established,
	 * 4 is the oldest still embryonic. */
	establish(&ct, 2);
	establish(&ct, 3);
	CHECK(open_conn(&ct, 6, LB_CONN_SYN_SENT, 0, &ev) == FWD_CONN_OPENED && ev, "SYN 6");
	CHECK(find(&ct, 2) && find(&ct, 3) && !find(&ct, 4) && find(&ct, 5) && find(&ct, 6),
	      "4 evicted, 2 and 3 kept");
	/* A connection opened established (mid-stream) never enters the FIFO;
	 * nor does an eviction take more than LB_CONN_EVICT_TRIES keys. FIFO
	 * now: 5, 6. */
	establish(&ct, 5);
	establish(&ct, 6);
	CHECK(open_conn(&ct, 7, LB_CONN_SYN_SENT, 0, &ev) == FWD_CONN_FULL,
	      "nothing embryonic: refused");
	CHECK(fwd_conn_count(&ct) == 8, "count %u", fwd_conn_count(&ct));
	fwd_conn_free(&ct);

	/* Exactly LB_CONN_EVICT_TRIES keys per attempt: four established
	 * connections ahead of an embryonic one hide it once. */
	memset(&fig, 0, sizeof(fig));
	rc = fwd_conn_init(&ct, "conn_tries", 12, 1, NULL, SOCKET_ID_ANY);
	CHECK(rc == 0, "init: %d", rc);
	for (__u32 i = 1; i <= 6; i++)
		CHECK(open_conn(&ct, i, LB_CONN_SYN_SENT, 0, NULL) == FWD_CONN_OPENED, "SYN %u", i);
	for (__u32 i = 1; i <= LB_CONN_EVICT_TRIES; i++)
		establish(&ct, i);
	CHECK(open_conn(&ct, 7, LB_CONN_SYN_SENT, 0, &ev) == FWD_CONN_FULL,
	      "the embryonic ones lie past the tries");
	CHECK(open_conn(&ct, 8, LB_CONN_SYN_SENT, 0, &ev) == FWD_CONN_OPENED && ev,
	      "the next attempt reaches them");
	CHECK(!find(&ct, 5) && find(&ct, 6) && find(&ct, 8), "5, the oldest embryonic, evicted");
	/* A UDP connection without a reply is embryonic too. */
	fwd_conn_free(&ct);
}

static void test_expiry_by_state(void)
{
	struct fwd_conn_table ct;
	struct fwd_conn_sweep sw;
	__u32 timeouts[LB_CONN_STATES] = LB_CONN_TIMEOUTS_DEFAULT;
	struct lb_conn_stats s;
	unsigned int n;
	int rc;

	memset(&fig, 0, sizeof(fig));
	rc = fwd_conn_init(&ct, "conn_expiry", 64, 1, NULL, SOCKET_ID_ANY);
	CHECK(rc == 0, "init: %d", rc);
	fwd_conn_sweep_init(&ct, &sw, 0, 1);
	timeouts[LB_CONN_SYN_SENT] = 5;
	timeouts[LB_CONN_ESTABLISHED] = 100;
	timeouts[LB_CONN_UDP_UNREPLIED] = 2;
	for (__u32 i = 1; i <= 4; i++)
		CHECK(open_conn(&ct, i, LB_CONN_SYN_SENT, 10 * S, NULL) == FWD_CONN_OPENED, "%u", i);
	for (__u32 i = 5; i <= 8; i++)
		CHECK(open_conn(&ct, i, LB_CONN_ESTABLISHED, 10 * S, NULL) == FWD_CONN_OPENED,
		      "%u", i);
	CHECK(open_conn(&ct, 9, LB_CONN_UDP_UNREPLIED, 10 * S, NULL) == FWD_CONN_OPENED, "9");
	/* Not idle long enough: nothing goes. */
	n = fwd_conn_expire(&ct, &fig, &sw, timeouts, 14 * S, ct.nslots);
	CHECK(n == 1 && !find(&ct, 9), "at 4 s only the UDP one expired (%u)", n);
	/* A packet keeps a connection alive: last_seen is either direction's. */
	fwd_conn_update(&ct, &fig, find(&ct, 1), LB_CONN_REPLY, LB_IPPROTO_TCP, LB_TCP_ACK, 14 * S);
	n = fwd_conn_expire(&ct, &fig, &sw, timeouts, 16 * S, ct.nslots);
	CHECK(n == 3, "at 6 s the 3 silent SYN_SENT expired (%u)", n);
	CHECK(find(&ct, 1) && !find(&ct, 2) && find(&ct, 5), "which ones");
	/* A slice looks at `budget` slots only. */
	n = fwd_conn_expire(&ct, &fig, &sw, timeouts, 200 * S, 0);
	CHECK(n == 0, "an empty slice removed %u", n);
	n = fwd_conn_expire(&ct, &fig, &sw, timeouts, 200 * S, ct.nslots);
	CHECK(n == 5 && fwd_conn_count(&ct) == 0, "all idle at 190 s: %u, %u left", n,
	      fwd_conn_count(&ct));
	s = stats(&ct);
	CHECK(s.expired == 9 && s.entries == 0, "expired %llu", (unsigned long long)s.expired);
	for (__u32 st = 0; st < LB_CONN_STATES; st++)
		CHECK(s.by_state[st] == 0, "state %u: %llu left", st,
		      (unsigned long long)s.by_state[st]);
	fwd_conn_free(&ct);
}

static void test_snat_ports(void)
{
	struct fwd_conn_table ct;
	struct fwd_conn_slot *o;
	struct fwd_conn_req r;
	struct lb_conn_stats s;
	bool ev;
	int rc;

	memset(&fig, 0, sizeof(fig));
	rc = fwd_conn_init(&ct, "conn_snat", 64, 1, NULL, SOCKET_ID_ANY);
	CHECK(rc == 0, "init: %d", rc);
	/* Nine connections whose hash points at the same first candidate: the
	 * first LB_SNAT_PROBES take consecutive ports, the ninth finds none. */
	for (__u32 i = 0; i <= LB_SNAT_PROBES; i++) {
		enum fwd_conn_open_status st;

		r = req(&ct, i, LB_CONN_SYN_SENT, 0);
		r.snat = true;
		r.snat_addr = SNAT_ADDR;
		r.port_min = 40000;
		r.port_max = 40009;
		r.hash = 5; /* candidates 40005, 40006, ... 40009, 40000, ... */
		st = fwd_conn_open(&ct, &fig, &r, &o, &ev);
		if (i < LB_SNAT_PROBES) {
			__u16 want = (__u16)(40000 + (5 + i) % 10);

			CHECK(st == FWD_CONN_OPENED && o &&
			      o->c.peer.dport == rte_cpu_to_be_16(want) &&
			      o->c.peer.daddr == SNAT_ADDR && (o->c.flags & LB_CONN_F_SNAT),
			      "SNAT conn %u: status %d port %u", i, st,
			      o ? rte_be_to_cpu_16(o->c.peer.dport) : 0);
		} else {
			CHECK(st == FWD_CONN_NO_REPLY_KEY, "ninth: status %d", st);
		}
	}
	s = stats(&ct);
	CHECK(s.snat_ports_in_use == LB_SNAT_PROBES, "snat in use %llu",
	      (unsigned long long)s.snat_ports_in_use);
	fwd_conn_close(&ct, &fig, find(&ct, 0));
	CHECK(stats(&ct).snat_ports_in_use == LB_SNAT_PROBES - 1, "a close gives the port back");
	/* Without SNAT, a reply key another connection holds is refused. */
	r = req(&ct, 50, LB_CONN_SYN_SENT, 0);
	CHECK(fwd_conn_open(&ct, &fig, &r, &o, &ev) == FWD_CONN_OPENED, "conn 50");
	r.orig.daddr ^= 0x01000000u; /* the same client pair, another VIP, same backend */
	r.orig_sig = fwd_conn_sig(&ct, &r.orig);
	CHECK(fwd_conn_open(&ct, &fig, &r, &o, &ev) == FWD_CONN_NO_REPLY_KEY, "clash refused");
	fwd_conn_free(&ct);
}

/* Several workers: removed entries wait for every reader's quiescent state,
 * the capacity stays exact meanwhile. */
static void test_shared_reuse(void)
{
	struct fwd_conn_table ct;
	struct rte_rcu_qsbr *v;
	struct fwd_conn_slot *o;
	size_t sz = rte_rcu_qsbr_get_memsize(2);
	__u32 free_before;
	bool ev;
	int rc;

	memset(&fig, 0, sizeof(fig));
	v = rte_zmalloc("conn_qsbr", sz, RTE_CACHE_LINE_SIZE);
	CHECK(v && rte_rcu_qsbr_init(v, 2) == 0, "qsbr");
	if (!v)
		return;
	/* This thread is worker 0; worker 1 is offline (as when asleep). */
	rte_rcu_qsbr_thread_register(v, 0);
	rte_rcu_qsbr_thread_online(v, 0);
	CHECK(fwd_conn_init(&ct, "conn_shared", 4, 2, NULL, SOCKET_ID_ANY) == -EINVAL,
	      "several workers need the QSBR variable");
	rc = fwd_conn_init(&ct, "conn_shared", 4, 2, v, SOCKET_ID_ANY);
	CHECK(rc == 0 && ct.shared && ct.nslots == 4 + 2 * FWD_CONN_HEADROOM, "init: %d", rc);
	CHECK(open_conn(&ct, 1, LB_CONN_SYN_SENT, 0, NULL) == FWD_CONN_OPENED, "1");
	CHECK(open_conn(&ct, 2, LB_CONN_SYN_SENT, 0, NULL) == FWD_CONN_OPENED, "2");
	free_before = ct.nfree;
	CHECK(open_conn(&ct, 3, LB_CONN_SYN_SENT, 0, &ev) == FWD_CONN_OPENED && ev, "3 evicts");
	CHECK(fwd_conn_count(&ct) == 4 && !find(&ct, 1), "exact capacity, 1 gone");
	CHECK(ct.retired_len == 2 && ct.nfree == free_before - 2,
	      "1's entries wait (retired %u, free %u of %u)", ct.retired_len, ct.nfree,
	      free_before);
	/* Still no quiescent state: nothing is reused. */
	CHECK(open_conn(&ct, 4, LB_CONN_SYN_SENT, 0, &ev) == FWD_CONN_OPENED && ev, "4 evicts");
	CHECK(ct.retired_len == 4, "retired %u", ct.retired_len);
	rte_rcu_qsbr_quiescent(v, 0);
	o = find(&ct, 3);
	CHECK(o != NULL, "3 is there");
	CHECK(open_conn(&ct, 5, LB_CONN_SYN_SENT, 0, &ev) == FWD_CONN_OPENED && ev, "5 evicts");
	CHECK(ct.retired_len == 2, "after a quiescent state the first four are reused (%u)",
	      ct.retired_len);
	/* The state word's compare-and-swap path. */
	o = find(&ct, 5);
	if (o) {
		fwd_conn_update(&ct, &fig, o, LB_CONN_REPLY, LB_IPPROTO_TCP,
				LB_TCP_SYN | LB_TCP_ACK, 1);
		CHECK(fwd_conn_state(o) == LB_CONN_SYN_RECV, "shared update: %u",
		      fwd_conn_state(o));
	}
	CHECK(stats(&ct).by_state[LB_CONN_SYN_SENT] == 1 &&
	      stats(&ct).by_state[LB_CONN_SYN_RECV] == 1, "figures after evictions");
	fwd_conn_free(&ct);
	{
		/* The IPv6 table, shared the same way. */
		struct fwd_conn6_table ct6;

		rc = fwd_conn6_init(&ct6, "conn6_shared", 4, 2, v, SOCKET_ID_ANY);
		CHECK(rc == 0 && ct6.shared, "IPv6 shared init: %d", rc);
		CHECK(open6(&ct6, 1, LB_CONN_SYN_SENT, 0, NULL) == FWD_CONN_OPENED &&
		      open6(&ct6, 2, LB_CONN_SYN_SENT, 0, NULL) == FWD_CONN_OPENED &&
		      open6(&ct6, 3, LB_CONN_SYN_SENT, 0, &ev) == FWD_CONN_OPENED && ev,
		      "IPv6 shared: 3 evicts 1");
		CHECK(ct6.retired_len == 2 && !find6(&ct6, 1) && find6(&ct6, 3),
		      "IPv6 shared: 1's entries wait (%u)", ct6.retired_len);
		rte_rcu_qsbr_quiescent(v, 0);
		CHECK(open6(&ct6, 4, LB_CONN_SYN_SENT, 0, &ev) == FWD_CONN_OPENED && ev &&
		      ct6.retired_len == 2, "IPv6 shared: reused after a quiescent state (%u)",
		      ct6.retired_len);
		fwd_conn6_free(&ct6);
	}
	rte_rcu_qsbr_thread_offline(v, 0);
	rte_rcu_qsbr_thread_unregister(v, 0);
	rte_free(v);
}

/* lb_conn.h's state machine through the table (UDP, FIN, RST, reopen). */
static void test_states(void)
{
	struct fwd_conn_table ct;
	struct fwd_conn_slot *o;
	int rc;

	memset(&fig, 0, sizeof(fig));
	rc = fwd_conn_init(&ct, "conn_states", 16, 1, NULL, SOCKET_ID_ANY);
	CHECK(rc == 0, "init: %d", rc);
	open_conn(&ct, 1, LB_CONN_UDP_UNREPLIED, 0, NULL);
	o = find(&ct, 1);
	if (o) {
		fwd_conn_update(&ct, &fig, o, LB_CONN_ORIG, LB_IPPROTO_UDP, 0, 1);
		CHECK(fwd_conn_state(o) == LB_CONN_UDP_UNREPLIED, "UDP original keeps");
		fwd_conn_update(&ct, &fig, o, LB_CONN_REPLY, LB_IPPROTO_UDP, 0, 1);
		CHECK(fwd_conn_state(o) == LB_CONN_UDP_REPLIED, "UDP reply");
	}
	open_conn(&ct, 2, LB_CONN_ESTABLISHED, 0, NULL);
	o = find(&ct, 2);
	if (o) {
		fwd_conn_update(&ct, &fig, o, LB_CONN_ORIG, LB_IPPROTO_TCP, LB_TCP_FIN | LB_TCP_ACK, 1);
		CHECK(fwd_conn_state(o) == LB_CONN_FIN_WAIT && o->c.fin_dirs == 1, "FIN");
		fwd_conn_update(&ct, &fig, o, LB_CONN_REPLY, LB_IPPROTO_TCP, LB_TCP_FIN | LB_TCP_ACK, 1);
		CHECK(fwd_conn_state(o) == LB_CONN_TIME_WAIT && o->c.fin_dirs == 3, "both FIN");
		fwd_conn_update(&ct, &fig, o, LB_CONN_ORIG, LB_IPPROTO_TCP, LB_TCP_SYN, 1);
		CHECK(fwd_conn_state(o) == LB_CONN_SYN_SENT && o->c.fin_dirs == 0, "reopened");
		fwd_conn_update(&ct, &fig, o, LB_CONN_REPLY, LB_IPPROTO_TCP, LB_TCP_RST, 1);
		CHECK(fwd_conn_state(o) == LB_CONN_CLOSE, "RST");
	}
	{
		struct lb_conn_stats s = stats(&ct);

		CHECK(s.by_state[LB_CONN_UDP_REPLIED] == 1 && s.by_state[LB_CONN_CLOSE] == 1 &&
		      s.by_state[LB_CONN_ESTABLISHED] == 0 && s.entries == 4, "figures by state");
	}
	fwd_conn_free(&ct);
}

/* ---- the IPv6 table ---------------------------------------------------- */

static const __u8 vip6[16] = { 0xfd, 0, [15] = 0x10 };
static const __u8 backend6[16] = { 0xfd, 0, 0, 2, [15] = 0x01 };
static const __u8 snat6[16] = { 0xfd, 0, 0, 9, [15] = 0x01 };

static union lb_addr addr6(const __u8 *a)
{
	union lb_addr u;

	memcpy(u.v6, a, 16);
	return u;
}

static struct lb_flow_key okey6(__u32 i)
{
	struct lb_flow_key k;

	memset(&k, 0, sizeof(k));
	k.saddr.v6[0] = 0xfd;
	k.saddr.v6[3] = 7;
	k.saddr.v6[12] = (__u8)(i >> 24);
	k.saddr.v6[13] = (__u8)(i >> 16);
	k.saddr.v6[14] = (__u8)(i >> 8);
	k.saddr.v6[15] = (__u8)i;
	k.daddr = addr6(vip6);
	k.sport = rte_cpu_to_be_16((__u16)(10000 + i));
	k.dport = rte_cpu_to_be_16(80);
	k.proto = LB_IPPROTO_TCP;
	k.family = LB_FAMILY_V6;
	return k;
}

static struct fwd_conn6_req req6(const struct fwd_conn6_table *ct, __u32 i, __u8 state,
				 __u64 now)
{
	struct fwd_conn6_req r;

	memset(&r, 0, sizeof(r));
	r.orig = okey6(i);
	r.orig_sig = fwd_conn6_sig(ct, &r.orig);
	r.backend_addr = addr6(backend6);
	r.backend_port = rte_cpu_to_be_16(8080);
	r.hash = 1000 + i;
	r.tmpl.backend_id = 9;
	r.tmpl.vip_id = 4;
	r.tmpl.state = state;
	r.tmpl.client_port = 1;
	r.now_ns = now;
	return r;
}

static enum fwd_conn_open_status open6(struct fwd_conn6_table *ct, __u32 i, __u8 state,
				       __u64 now, bool *evicted)
{
	struct fwd_conn6_req r = req6(ct, i, state, now);
	struct fwd_conn6_slot *o;
	bool ev;

	return fwd_conn6_open(ct, &fig, &r, &o, evicted ? evicted : &ev);
}

static struct fwd_conn6_slot *find6(struct fwd_conn6_table *ct, __u32 i)
{
	struct lb_flow_key k = okey6(i);

	return fwd_conn6_lookup(ct, &k, fwd_conn6_sig(ct, &k));
}

/* Both entries keyed by 40 bytes, the capacity exact, the FIFO's eviction,
 * SNAT from an IPv6 pair, the sweep, and the figures of both tables summed. */
static void test_ipv6_table(void)
{
	struct fwd_conn6_table ct6;
	struct fwd_conn_table ct4;
	struct fwd_conn6_slot *o, *r;
	struct fwd_conn6_req q;
	struct fwd_conn_sweep sw;
	struct lb_flow_key rk;
	const struct fwd_conn_figures *figs[1] = { &fig };
	__u32 timeouts[LB_CONN_STATES] = LB_CONN_TIMEOUTS_DEFAULT;
	union lb_addr be = addr6(backend6), cl;
	struct lb_conn_stats s;
	bool ev;
	int rc;

	memset(&fig, 0, sizeof(fig));
	CHECK(sizeof(struct fwd_conn6_slot) == 128, "IPv6 slot: %zu bytes",
	      sizeof(struct fwd_conn6_slot));
	CHECK(fwd_conn6_init(&ct6, "conn6_odd", 7, 1, NULL, SOCKET_ID_ANY) == -EINVAL,
	      "an odd size is refused");
	rc = fwd_conn6_init(&ct6, "conn6_fifo", 8, 1, NULL, SOCKET_ID_ANY);
	CHECK(rc == 0, "init: %d", rc);
	for (__u32 i = 1; i <= 4; i++)
		CHECK(open6(&ct6, i, LB_CONN_SYN_SENT, 0, &ev) == FWD_CONN_OPENED && !ev,
		      "IPv6 SYN %u", i);
	/* The reply entry: (backend, client, 8080, cport), family 6, pad 0. */
	o = find6(&ct6, 2);
	CHECK(o && o->c.dir == LB_CONN_ORIG && o->c.backend_id == 9, "IPv6 original entry");
	if (o) {
		cl = okey6(2).saddr;
		memset(&rk, 0xee, sizeof(rk)); /* every byte written by the builder */
		lb_conn6_reply_key(&rk, &be, rte_cpu_to_be_16(8080), &cl, okey6(2).sport,
				   LB_IPPROTO_TCP);
		CHECK(!memcmp(&o->c.peer, &rk, sizeof(rk)) && rk.family == LB_FAMILY_V6 &&
		      rk.pad[0] == 0 && rk.pad[1] == 0, "the IPv6 original's peer");
		r = fwd_conn6_lookup(&ct6, &rk, fwd_conn6_sig(&ct6, &rk));
		CHECK(r && r->c.dir == LB_CONN_REPLY && fwd_conn6_orig(&ct6, r) == o &&
		      !memcmp(&r->c.peer, &o->key, sizeof(rk)), "the IPv6 reply entry");
	}
	/* Full: the oldest embryonic one goes; established ones never. */
	CHECK(open6(&ct6, 5, LB_CONN_SYN_SENT, 0, &ev) == FWD_CONN_OPENED && ev, "IPv6 evicts");
	CHECK(!find6(&ct6, 1) && find6(&ct6, 2) && fwd_conn6_count(&ct6) == 8, "1 evicted");
	for (__u32 i = 2; i <= 5; i++) {
		o = find6(&ct6, i);
		if (!o)
			continue;
		fwd_conn6_update(&ct6, &fig, o, LB_CONN_REPLY, LB_IPPROTO_TCP,
				 LB_TCP_SYN | LB_TCP_ACK, 1);
		fwd_conn6_update(&ct6, &fig, o, LB_CONN_ORIG, LB_IPPROTO_TCP, LB_TCP_ACK, 1);
	}
	CHECK(open6(&ct6, 6, LB_CONN_SYN_SENT, 0, &ev) == FWD_CONN_FULL,
	      "nothing embryonic in the IPv6 table: refused");

	/* The figures: both tables' sums (an IPv4 connection beside). */
	rc = fwd_conn_init(&ct4, "conn4_beside", 8, 1, NULL, SOCKET_ID_ANY);
	CHECK(rc == 0, "init IPv4: %d", rc);
	CHECK(open_conn(&ct4, 1, LB_CONN_SYN_SENT, 0, NULL) == FWD_CONN_OPENED, "IPv4 conn");
	fwd_conn_read(&ct4, &ct6, figs, 1, &s);
	CHECK(s.capacity == 16 && s.entries == 10 && s.by_state[LB_CONN_ESTABLISHED] == 4 &&
	      s.by_state[LB_CONN_SYN_SENT] == 1,
	      "summed figures: capacity %llu entries %llu established %llu syn_sent %llu",
	      (unsigned long long)s.capacity, (unsigned long long)s.entries,
	      (unsigned long long)s.by_state[LB_CONN_ESTABLISHED],
	      (unsigned long long)s.by_state[LB_CONN_SYN_SENT]);
	fwd_conn_read(NULL, &ct6, figs, 1, &s);
	CHECK(s.capacity == 8 && s.entries == 8, "IPv6 alone: %llu %llu",
	      (unsigned long long)s.capacity, (unsigned long long)s.entries);

	/* The sweep: the IPv6 table's own, by the same timeouts. */
	fwd_conn6_sweep_init(&ct6, &sw, 0, 1);
	timeouts[LB_CONN_ESTABLISHED] = 10;
	CHECK(fwd_conn6_expire(&ct6, &fig, &sw, timeouts, 5 * S, ct6.nslots) == 0, "not yet");
	CHECK(fwd_conn6_expire(&ct6, &fig, &sw, timeouts, 20 * S, ct6.nslots) == 4 &&
	      fwd_conn6_at_rest(&ct6), "all four expired");
	CHECK(fwd_conn_count(&ct4) == 2, "the IPv4 table is another's sweep");
	fwd_conn_read(&ct4, &ct6, figs, 1, &s);
	CHECK(s.expired == 4 && s.entries == 2 && s.by_state[LB_CONN_ESTABLISHED] == 0,
	      "figures after the sweep");
	fwd_conn_free(&ct4);
	fwd_conn6_free(&ct6);

	/* SNAT: the IPv6 pool pair, probed in order; the unspecified address
	 * (no IPv6 pool) gets no reply key. */
	memset(&fig, 0, sizeof(fig));
	rc = fwd_conn6_init(&ct6, "conn6_snat", 64, 1, NULL, SOCKET_ID_ANY);
	CHECK(rc == 0, "init: %d", rc);
	for (__u32 i = 0; i < 3; i++) {
		q = req6(&ct6, i, LB_CONN_SYN_SENT, 0);
		q.snat = true;
		q.snat_addr = addr6(snat6);
		q.port_min = 40000;
		q.port_max = 40009;
		q.hash = 5;
		CHECK(fwd_conn6_open(&ct6, &fig, &q, &o, &ev) == FWD_CONN_OPENED && o &&
		      o->c.peer.dport == rte_cpu_to_be_16((__u16)(40005 + i)) &&
		      !memcmp(o->c.peer.daddr.v6, snat6, 16) && (o->c.flags & LB_CONN_F_SNAT),
		      "IPv6 SNAT conn %u", i);
	}
	q = req6(&ct6, 10, LB_CONN_SYN_SENT, 0);
	q.snat = true;
	q.port_min = 40000;
	q.port_max = 40009;
	CHECK(fwd_conn6_open(&ct6, &fig, &q, &o, &ev) == FWD_CONN_NO_REPLY_KEY,
	      "no IPv6 pool address: no reply key");
	fwd_conn_read(NULL, &ct6, figs, 1, &s);
	CHECK(s.snat_ports_in_use == 3, "IPv6 SNAT ports %llu",
	      (unsigned long long)s.snat_ports_in_use);
	fwd_conn6_free(&ct6);
}

int main(int argc, char **argv)
{
	if (rte_eal_init(argc, argv) < 0) {
		printf("EAL init failed\n");
		return 2;
	}
	test_capacity_and_entries();
	test_fifo_eviction();
	test_expiry_by_state();
	test_snat_ports();
	test_states();
	test_shared_reuse();
	test_ipv6_table();
	rte_eal_cleanup();
	if (failures) {
		printf("conn_selftest: %d failures\n", failures);
		return 1;
	}
	printf("conn_selftest: ok\n");
	return 0;
}
