/* SPDX-License-Identifier: Apache-2.0
 *
 * proto_selftest_nat6.c - NAT mode for IPv6 in the protocol server: part of
 * proto_selftest.c (included by it, for its fake data plane and request
 * helpers), kept apart so that neither file grows past reading.
 *
 * Checks: set_nat's snat_addrs of both families (the IPv6 unicast rule, the
 * duplicates and the per-family count, errors naming the wire's entry, the
 * IPv4 pool's faults before the IPv6 one's), dump's IPv4-then-IPv6 order and
 * its round trip, set_vip mode 1 with a 16-byte VIP on a plane with "nat6",
 * the SNAT rule per family both ways, and lb_proto_server_restore's IPv6
 * cases on planes with and without nat6.
 */

/* An IPv6 address fd00::<a>:<b> (unicast, a ULA). */
static void ip6_ula(__u8 *out, __u8 a, __u8 b)
{
	memset(out, 0, 16);
	out[0] = 0xfd;
	out[13] = a;
	out[15] = b;
}

static void pack_ip6(struct w *w, const __u8 *a)
{
	msgpack_pack_bin_with_body(&w->pk, a, 16);
}

/* The i-th malformed IPv6 set_nat (on a plane with nat6) into w; returns
 * what its error must say, NULL past the last. */
static const char *bad_nat6(struct w *w, int i)
{
	static const __u8 notuni[7][16] = {
		{ 0 },                                                     /* :: */
		{ [15] = 1 },                                              /* ::1 */
		{ 0xff, 0x02, [15] = 1 },                                  /* ff02::1 */
		{ 0xfe, 0x80, [15] = 1 },                                  /* fe80::1 */
		{ 0xfe, 0xbf, [15] = 1 },                                  /* febf::1 */
		{ [10] = 0xff, [11] = 0xff, [12] = 192, [14] = 2, [15] = 1 }, /* ::ffff:192.0.2.1 */
		{ 0xff, [15] = 5 },                                        /* ff00::5 */
	};
	static const char *const needles[7] = {
		"field 'snat_addrs[2]': :: is not a unicast address (::, ::1, ff00::/8, "
		"fe80::/10 and ::ffff:0:0/96 are refused)",
		"field 'snat_addrs[2]': ::1 is not a unicast address",
		"field 'snat_addrs[2]': ff02::1 is not a unicast address",
		"field 'snat_addrs[2]': fe80::1 is not a unicast address",
		"field 'snat_addrs[2]': febf::1 is not a unicast address",
		"field 'snat_addrs[2]': ::ffff:192.0.2.1 is not a unicast address",
		"field 'snat_addrs[2]': ff00::5 is not a unicast address",
	};
	__u8 a[16], b[16];

	ip6_ula(a, 0, 0xa);
	ip6_ula(b, 0, 0xb);
	switch (i) {
	case 0: case 1: case 2: case 3: case 4: case 5: case 6:
		/* [IPv6, IPv4, bad IPv6]: the wire's index, not the pool's. */
		w_init(w, "set_nat", 1);
		w_key(w, "snat_addrs");
		msgpack_pack_array(&w->pk, 3);
		pack_ip6(w, a);
		pack_ip4(w, 192, 0, 2, 1);
		pack_ip6(w, notuni[i]);
		return needles[i];
	case 7:
		w_init(w, "set_nat", 1);
		w_key(w, "snat_addrs");
		msgpack_pack_array(&w->pk, 4);
		pack_ip6(w, a);
		pack_ip4(w, 192, 0, 2, 1);
		pack_ip6(w, b);
		pack_ip6(w, a);
		return "field 'snat_addrs[3]': fd00::a appears twice (also snat_addrs[0])";
	case 8: /* an IPv4 duplicate across an IPv6 entry */
		w_init(w, "set_nat", 1);
		w_key(w, "snat_addrs");
		msgpack_pack_array(&w->pk, 3);
		pack_ip4(w, 192, 0, 2, 1);
		pack_ip6(w, a);
		pack_ip4(w, 192, 0, 2, 1);
		return "field 'snat_addrs[2]': 192.0.2.1 appears twice (also snat_addrs[0])";
	case 9: /* the IPv4 pool's faults first, wherever they lie */
		w_init(w, "set_nat", 1);
		w_key(w, "snat_addrs");
		msgpack_pack_array(&w->pk, 2);
		pack_ip6(w, notuni[1]);
		pack_ip4(w, 127, 0, 0, 1);
		return "field 'snat_addrs[1]': 127.0.0.1 is not a unicast address";
	case 10: case 11: { /* 17 (20) IPv6 and 3 IPv4: the count, not the 17th */
		int n6 = i == 10 ? 17 : 20;

		w_init(w, "set_nat", 1);
		w_key(w, "snat_addrs");
		msgpack_pack_array(&w->pk, (uint32_t)n6 + 3);
		for (int k = 0; k < n6; k++) {
			ip6_ula(a, 1, (__u8)(k + 1));
			pack_ip6(w, a);
			if (k < 3)
				pack_ip4(w, 192, 0, 2, (__u8)(k + 1));
		}
		return i == 10 ?
		       "field 'snat_addrs' has 17 IPv6 entries, at most 16 of each family allowed" :
		       "field 'snat_addrs' has 20 IPv6 entries, at most 16 of each family allowed";
	}
	case 12: /* a type fault comes before the count */
		w_init(w, "set_nat", 1);
		w_key(w, "snat_addrs");
		msgpack_pack_array(&w->pk, 18);
		for (int k = 0; k < 17; k++) {
			ip6_ula(a, 2, (__u8)(k + 1));
			pack_ip6(w, a);
		}
		w_str(w, "fd00::1");
		return "field 'snat_addrs[17]' must be bin, got str";
	default:
		return NULL;
	}
}

static void test_nat6_config(struct lb_proto_server *srv)
{
	const struct lb_proto_state *st = lb_proto_server_state(srv);
	const msgpack_object *nat, *o;
	struct lb_nat_config before;
	__u8 a[16], b[16], c6[16];
	const char *needle;
	char err[512], what[64];
	struct rep rp;
	struct w w;

	for (int i = 0; (needle = bad_nat6(&w, i)) != NULL; i++) {
		snprintf(what, sizeof(what), "bad IPv6 set_nat %d", i);
		expect_reject(srv, &w, needle, what);
	}
	/* The edges of the refused ranges are unicast. */
	ip6_ula(a, 0, 0xa);
	memset(b, 0, 16);
	b[0] = 0xfe;
	b[1] = 0xc0; /* fec0::1, past fe80::/10 */
	b[15] = 1;
	memset(c6, 0, 16);
	c6[10] = 0xff; /* ::ff:0:2, not ::ffff:0:0/96 */
	c6[15] = 2;

	/* Mixed: each family's order kept, IPv4 into snat_addrs. */
	w_init(&w, "set_nat", 1);
	w_key(&w, "snat_addrs");
	msgpack_pack_array(&w.pk, 5);
	pack_ip6(&w, a);
	pack_ip4(&w, 198, 51, 100, 1);
	pack_ip6(&w, b);
	pack_ip4(&w, 198, 51, 100, 2);
	pack_ip6(&w, c6);
	CHECK(run(srv, &w, err, sizeof(err)), "mixed set_nat: %s", err);
	CHECK(st->nat.snat_naddrs == 2 && st->nat.snat_naddrs6 == 3 &&
	      !memcmp(&st->nat.snat_addrs[1], (const __u8[]){ 198, 51, 100, 2 }, 4) &&
	      !memcmp(st->nat.snat_addrs6[0].v6, a, 16) && !memcmp(st->nat.snat_addrs6[1].v6, b, 16) &&
	      !memcmp(st->nat.snat_addrs6[2].v6, c6, 16) && st->nat.snat_addrs6[3].v6w[0] == 0,
	      "mixed set_nat not stored per family");
	check_mirror(srv, "mixed set_nat");

	/* dump: IPv4 then IPv6; sent back, it changes nothing. */
	w_init(&w, "dump", 0);
	CHECK(run_rep(srv, &w, &rp, err, sizeof(err)), "dump: %s", err);
	nat = mget(rp.root, "nat");
	o = mget(nat, "snat_addrs");
	CHECK(o && o->type == MSGPACK_OBJECT_ARRAY && o->via.array.size == 5, "dump's snat_addrs");
	for (uint32_t i = 0; o && o->type == MSGPACK_OBJECT_ARRAY && i < o->via.array.size; i++)
		CHECK(o->via.array.ptr[i].type == MSGPACK_OBJECT_BIN &&
		      o->via.array.ptr[i].via.bin.size == (i < 2 ? 4u : 16u),
		      "dump's snat_addrs[%u]: not IPv4 first then IPv6", i);
	CHECK(o && o->via.array.size == 5 &&
	      !memcmp(o->via.array.ptr[0].via.bin.ptr, (const __u8[]){ 198, 51, 100, 1 }, 4) &&
	      !memcmp(o->via.array.ptr[2].via.bin.ptr, a, 16) &&
	      !memcmp(o->via.array.ptr[4].via.bin.ptr, c6, 16), "dump's snat_addrs order");
	before = st->nat;
	w_init(&w, "set_nat", nat ? (int)nat->via.map.size : 0);
	for (uint32_t i = 0; nat && i < nat->via.map.size; i++) {
		msgpack_pack_object(&w.pk, nat->via.map.ptr[i].key);
		msgpack_pack_object(&w.pk, nat->via.map.ptr[i].val);
	}
	CHECK(run(srv, &w, err, sizeof(err)), "set_nat from dump: %s", err);
	CHECK(!memcmp(&before, &st->nat, sizeof(before)), "dump -> set_nat changed the config");
	rep_free(&rp);

	/* 16 of each family at once. */
	w_init(&w, "set_nat", 1);
	w_key(&w, "snat_addrs");
	msgpack_pack_array(&w.pk, 2 * LB_MAX_SNAT_ADDRS);
	for (int k = 0; k < LB_MAX_SNAT_ADDRS; k++) {
		pack_ip4(&w, 203, 0, 113, (__u8)(k + 1));
		ip6_ula(b, 3, (__u8)(k + 1));
		pack_ip6(&w, b);
	}
	CHECK(run(srv, &w, err, sizeof(err)), "16 + 16 set_nat: %s", err);
	CHECK(st->nat.snat_naddrs == LB_MAX_SNAT_ADDRS && st->nat.snat_naddrs6 == LB_MAX_SNAT_ADDRS,
	      "16 + 16 not stored");
	check_mirror(srv, "16 + 16 set_nat");
	w_init(&w, "set_nat", 0);
	CHECK(run(srv, &w, err, sizeof(err)), "empty set_nat: %s", err);
	CHECK(st->nat.snat_naddrs6 == 0, "an empty set_nat left the IPv6 pool");
}

static void test_nat6_vips(struct lb_proto_server *srv)
{
	const struct lb_proto_state *st = lb_proto_server_state(srv);
	__u8 v6[16], v4[4] = { 10, 0, 0, 71 }, p6[16];
	const msgpack_object *vips;
	char err[512];
	struct rep rp;
	struct w w;

	vip_addr(v6, 16, 70);
	ip6_ula(p6, 9, 9);
	/* An IPv6 NAT VIP: accepted with nat6, no pool needed without snat. */
	w_set_vip(&w, 1, 50, v6, 16, LB_MODE_NAT);
	w_uint(&w, "nat_port", 8080);
	CHECK(run(srv, &w, err, sizeof(err)), "IPv6 NAT set_vip: %s", err);
	CHECK(st->vips[50].used && st->vips[50].mode == LB_MODE_NAT &&
	      st->vips[50].key.family == LB_FAMILY_V6 && dp.entries[50].mode == LB_MODE_NAT &&
	      dp.entries[50].nat_port == htons(8080), "IPv6 NAT VIP not stored");
	check_mirror(srv, "IPv6 NAT set_vip");

	/* snat: each family's own pool. */
	req_nat_pool(&w, 1, 7); /* IPv4 only */
	CHECK(run(srv, &w, err, sizeof(err)), "set_nat: %s", err);
	w_set_vip(&w, 1, 50, v6, 16, LB_MODE_NAT);
	w_bool(&w, "snat", true);
	expect_reject(srv, &w, "field 'snat': no IPv6 SNAT pool configured (set_nat)",
		      "IPv6 snat, IPv4 pool only");
	w_init(&w, "set_nat", 1);
	w_key(&w, "snat_addrs");
	msgpack_pack_array(&w.pk, 1);
	pack_ip6(&w, p6);
	CHECK(run(srv, &w, err, sizeof(err)), "IPv6 pool: %s", err);
	w_set_vip(&w, 1, 51, v4, 4, LB_MODE_NAT);
	w_bool(&w, "snat", true);
	expect_reject(srv, &w, "field 'snat': no SNAT pool configured (set_nat)",
		      "IPv4 snat, IPv6 pool only");
	w_set_vip(&w, 1, 50, v6, 16, LB_MODE_NAT);
	w_bool(&w, "snat", true);
	CHECK(run(srv, &w, err, sizeof(err)), "IPv6 snat: %s", err);
	CHECK(st->vips[50].nat_flags == LB_VIP_F_SNAT && dp.entries[50].nat_flags == LB_VIP_F_SNAT,
	      "IPv6 snat not stored");
	check_mirror(srv, "IPv6 snat");

	/* The IPv6 pool cannot be emptied under it; the IPv4 one is free. */
	w_init(&w, "set_nat", 0);
	expect_reject(srv, &w, "field 'snat_addrs': VIP 50 uses SNAT, the IPv6 pool cannot be "
		      "emptied (set_vip it without snat, or del_vip it, first)",
		      "set_nat emptying the IPv6 pool");
	req_nat_pool(&w, 2, 1);
	expect_reject(srv, &w, "VIP 50 uses SNAT, the IPv6 pool", "set_nat IPv4 pool only");
	w_init(&w, "set_nat", 1);
	w_key(&w, "snat_addrs");
	msgpack_pack_array(&w.pk, 2);
	pack_ip4(&w, 198, 51, 100, 3);
	pack_ip6(&w, p6);
	CHECK(run(srv, &w, err, sizeof(err)), "set_nat both pools: %s", err);
	w_set_vip(&w, 1, 51, v4, 4, LB_MODE_NAT);
	w_bool(&w, "snat", true);
	CHECK(run(srv, &w, err, sizeof(err)), "IPv4 snat: %s", err);
	/* Both emptied: the IPv4 rule speaks first. */
	w_init(&w, "set_nat", 0);
	expect_reject(srv, &w, "field 'snat_addrs': VIP 51 uses SNAT, the pool cannot be emptied",
		      "set_nat emptying both pools");

	/* dump -> set_vip of the IPv6 NAT VIP is the same VIP. */
	w_init(&w, "dump", 0);
	CHECK(run_rep(srv, &w, &rp, err, sizeof(err)), "dump: %s", err);
	vips = mget(rp.root, "vips");
	check_vips_round_trip(srv, vips);
	rep_free(&rp);

	/* Without snat the IPv6 pool is free again. */
	w_set_vip(&w, 0, 50, v6, 16, LB_MODE_NAT);
	CHECK(run(srv, &w, err, sizeof(err)), "IPv6 NAT without snat: %s", err);
	req_nat_pool(&w, 1, 3);
	CHECK(run(srv, &w, err, sizeof(err)), "IPv6 pool emptied after snat cleared: %s", err);
	check_mirror(srv, "IPv6 SNAT rule");
}

/* A state to adopt: VIP 7, [fd00::7]:80/tcp, NAT with SNAT, an IPv6 pool of one. */
static struct lb_proto_state *restore_state6(void)
{
	struct lb_proto_state *st = restore_state();

	st->nat.snat_addrs[0] = 0;
	st->nat.snat_naddrs = 0;
	ip6_ula(st->nat.snat_addrs6[0].v6, 9, 1);
	st->nat.snat_naddrs6 = 1;
	vip_addr(st->vips[7].key.addr.v6, 16, 7);
	st->vips[7].key.family = LB_FAMILY_V6;
	return st;
}

static void test_nat6_restore(void)
{
	static const char *const caps[] = { "dsr", "nat", "nat6", NULL };
	struct lb_proto_info info = { .dataplane = "test", .attach_mode = "none", .nports = 1,
				      .conn_table_size = 4096, .capabilities = caps, .nat6 = true };
	struct lb_proto_server *srv = server_new(&ops, &info);
	struct lb_proto_state *good = restore_state6(), *bad = restore_state6();
	const struct lb_proto_state *cur;
	char why[256] = "", err[512];
	struct w w;
	int n = 100;

	cur = lb_proto_server_state(srv);
	/* An IPv4 pool does not serve an IPv6 SNAT VIP. */
	BAD_CASE(bad->nat.snat_naddrs6 = 0; memset(&bad->nat.snat_addrs6[0], 0, 16);
		 bad->nat.snat_addrs[0] = htonl(0xc6336409); bad->nat.snat_naddrs = 1,
		 "VIP 7: nat_flags 0x1 with mode 1 and 0 IPv6 SNAT addresses");
	BAD_CASE(bad->nat.snat_addrs6[0].v6[0] = 0xfe; bad->nat.snat_addrs6[0].v6[1] = 0x80,
		 "NAT configuration: field 'snat_addrs6[0]': fe80::9:1 is not a unicast address");
	BAD_CASE(bad->nat.snat_addrs6[1] = bad->nat.snat_addrs6[0]; bad->nat.snat_naddrs6 = 2,
		 "field 'snat_addrs6[1]': fd00::9:1 appears twice (also snat_addrs6[0])");
	BAD_CASE(bad->nat.snat_addrs6[3].v6[15] = 1,
		 "field 'snat_addrs6': entry 3 past the 1 addresses is ::1, not 0");
	BAD_CASE(bad->nat.snat_naddrs6 = LB_MAX_SNAT_ADDRS + 1,
		 "field 'snat_addrs' has 17 IPv6 entries, at most 16 of each family allowed");
	CHECK(lb_proto_server_restore(srv, good, why, sizeof(why)) == 0, "IPv6 restore: %s", why);
	CHECK(cur->vips[7].used && cur->vips[7].mode == LB_MODE_NAT &&
	      cur->vips[7].key.family == LB_FAMILY_V6 && cur->vips[7].nat_flags == LB_VIP_F_SNAT &&
	      !memcmp(&cur->nat, &good->nat, sizeof(good->nat)), "IPv6 restore: not adopted");
	w_init(&w, "set_nat", 0);
	CHECK(!run(srv, &w, err, sizeof(err)) && strstr(err, "VIP 7 uses SNAT, the IPv6 pool"),
	      "error: %s", err);
	lb_proto_server_free(srv);

	/* Without nat6: neither the IPv6 pool nor the IPv6 NAT VIP. */
	info.nat6 = false;
	srv = server_new(&ops, &info);
	CHECK(lb_proto_server_restore(srv, good, why, sizeof(why)) == -EINVAL &&
	      strstr(why, "NAT configuration: 1 IPv6 SNAT addresses on a data plane without NAT "
		     "mode for IPv6"), "non-nat6 restore: %s", why);
	memcpy(bad, good, sizeof(*bad));
	bad->nat.snat_naddrs6 = 0;
	memset(&bad->nat.snat_addrs6[0], 0, 16);
	bad->vips[7].nat_flags = 0;
	CHECK(lb_proto_server_restore(srv, bad, why, sizeof(why)) == -EINVAL &&
	      strstr(why, "VIP 7: mode 1 (family 6) not served"), "non-nat6 restore: %s", why);
	lb_proto_server_free(srv);
	free(good);
	free(bad);
}

/* A plane with NAT mode for IPv6: its own server and fake data plane. */
static void test_nat6(void)
{
	static const char *const caps[] = { "dsr", "nat", "nat6", NULL };
	struct lb_proto_info info = { .dataplane = "test", .attach_mode = "none", .nports = 1,
				      .conn_table_size = 4096, .capabilities = caps, .nat6 = true };
	struct lb_proto_server *srv;
	const msgpack_object *cap;
	char err[512];
	struct rep rp;
	struct w w;
	bool seen = false;

	dp_reset();
	mirror_nat6 = true;
	srv = server_new(&ops, &info);
	w_init(&w, "hello", 0);
	CHECK(run_rep(srv, &w, &rp, err, sizeof(err)), "hello: %s", err);
	cap = mget(rp.root, "capabilities");
	for (uint32_t i = 0; cap && cap->type == MSGPACK_OBJECT_ARRAY && i < cap->via.array.size; i++)
		seen |= cap->via.array.ptr[i].type == MSGPACK_OBJECT_STR &&
			cap->via.array.ptr[i].via.str.size == 4 &&
			!memcmp(cap->via.array.ptr[i].via.str.ptr, "nat6", 4);
	CHECK(seen, "hello lacks the nat6 capability");
	rep_free(&rp);
	test_nat6_config(srv);
	test_nat6_vips(srv);
	lb_proto_server_free(srv);
	test_nat6_restore();
	mirror_nat6 = false;

	/* nat6 without the NAT hooks means nothing: an IPv6 NAT VIP is refused. */
	dp_reset();
	srv = server_new(&ops_nonat, &info);
	{
		__u8 v6[16];

		vip_addr(v6, 16, 70);
		w_set_vip(&w, 0, 50, v6, 16, LB_MODE_NAT);
		expect_reject(srv, &w, "mode not supported by this data plane: field 'mode' is 1",
			      "nat6 without set_nat");
	}
	lb_proto_server_free(srv);
}
