/* SPDX-License-Identifier: Apache-2.0
 *
 * proto_selftest.c - the protocol server (lb_proto_codec.c, lb_proto_ops.c)
 * alone, against a fake data plane that keeps its own copy of the tables and
 * can be told to fail. Built and run by tests/unit/test_protocol_server.py
 * (with ASan/UBSan), no root needed.
 *
 * Checks: after every request the fake data plane holds exactly what the
 * server's shadow says (so dump/get_ring never lie); a failing op is reported
 * and rolled back; random and mutated messages always get a well-formed
 * reply and never change anything they should not.
 *
 * NAT mode (set_nat, read_conns, set_vip's mode 1 and snat): every field's
 * bounds, the SNAT rule both ways, dump's round trip, stats' "conns", the
 * rollback, lb_proto_server_restore's checks, and a second server whose data
 * plane has no NAT hooks. NAT mode for IPv6: proto_selftest_nat6.c,
 * included below; the fuzz runs with nat6 on.
 */
#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>

#include "lb_proto.h"

#define RS 251 /* a small prime ring keeps the fuzz fast */

static struct {
	struct lb_config cfg;
	struct lb_vip_key keys[LB_MAX_VIPS];
	struct lb_vip_entry entries[LB_MAX_VIPS];
	int used[LB_MAX_VIPS];
	struct lb_backend b[LB_MAX_BACKENDS];
	__u32 ring[LB_MAX_VIPS][RS];
	struct lb_nat_config nat;
	int nat_calls;  /* set_nat calls, rollbacks included */
	int conns_fail; /* read_conns fails */
	int fail_at;    /* >0: the n-th next call fails (half applied)... */
	int fail_count; /* ...and so do this many - 1 after it */
} dp;

static int n_ok, n_rejected; /* so the fuzz shows it reached both outcomes */
static bool mirror_nat6; /* the server under test has info.nat6 (IPv6 NAT VIPs allowed) */

#include "selftest.h"

static int should_fail(void)
{
	if (dp.fail_at > 1) {
		dp.fail_at--;
		return 0;
	}
	if (dp.fail_at == 1 && dp.fail_count > 0) {
		if (--dp.fail_count == 0)
			dp.fail_at = 0;
		return 1;
	}
	return 0;
}

static void fail_calls(int at, int count)
{
	dp.fail_at = at;
	dp.fail_count = count;
}

static int f_set_config(void *c, const struct lb_config *cfg)
{
	(void)c;
	if (should_fail())
		return -EIO;
	dp.cfg = *cfg;
	return 0;
}

static int find_key(const struct lb_vip_key *k)
{
	for (int i = 0; i < LB_MAX_VIPS; i++)
		if (dp.used[i] && !memcmp(&dp.keys[i], k, sizeof(*k)))
			return i;
	return -1;
}

static int f_set_vip(void *c, const struct lb_vip_key *k, const struct lb_vip_entry *e)
{
	int cur = find_key(k);

	(void)c;
	if (should_fail())
		return -EIO;
	if (cur >= 0)
		dp.used[cur] = 0;
	dp.used[e->vip_id] = 1;
	dp.keys[e->vip_id] = *k;
	dp.entries[e->vip_id] = *e;
	return 0;
}

static int f_del_vip(void *c, const struct lb_vip_key *k)
{
	int cur = find_key(k);

	(void)c;
	if (should_fail())
		return -EIO;
	if (cur >= 0)
		dp.used[cur] = 0;
	return 0;
}

static int f_set_backends(void *c, const __u32 *ids, const struct lb_backend *b, size_t n)
{
	int fail = should_fail();

	(void)c;
	for (size_t i = 0; i < (fail ? n / 2 : n); i++)
		dp.b[ids[i]] = b[i];
	return fail ? -EIO : 0;
}

static int f_write_ring(void *c, __u32 vip, const __u32 *slots)
{
	int fail = should_fail();

	(void)c;
	memcpy(dp.ring[vip], slots, (fail ? RS / 2 : RS) * sizeof(__u32));
	return fail ? -EIO : 0;
}

static int f_patch_ring(void *c, __u32 vip, const struct lb_ring_patch *p, size_t n)
{
	int fail = should_fail();

	(void)c;
	for (size_t i = 0; i < (fail ? n / 2 : n); i++)
		dp.ring[vip][p[i].slot] = p[i].backend;
	return fail ? -EIO : 0;
}

static int f_read_stats(void *c, struct lb_counter *g, struct lb_counter *v, struct lb_counter *b)
{
	(void)c;
	g[0].packets = 1;
	v[0].packets = 2;
	b[0].packets = 3;
	return 0;
}

/* Port 0 reads; any other port's driver fails (the reply shows an empty map). */
static int f_read_port_stats(void *c, __u32 port, struct lb_port_stats *out)
{
	(void)c;
	if (port != 0)
		return -EIO;
	out->rx_packets = 4;
	out->rx_crc_errors = 5;
	return 0;
}

/* Half applied on failure: the pool changes, the rest does not. */
static int f_set_nat(void *c, const struct lb_nat_config *nat)
{
	int fail = should_fail();

	(void)c;
	dp.nat_calls++;
	if (fail) {
		memcpy(dp.nat.snat_addrs, nat->snat_addrs, sizeof(dp.nat.snat_addrs));
		return -EIO;
	}
	dp.nat = *nat;
	return 0;
}

static int f_read_conns(void *c, struct lb_conn_stats *out)
{
	(void)c;
	if (dp.conns_fail)
		return -EIO;
	out->capacity = 4096;
	out->entries = 10;
	for (int s = 0; s < LB_CONN_STATES; s++)
		out->by_state[s] = (__u64)s + 1;
	out->snat_ports_in_use = 3;
	out->expired = 1ull << 40;
	return 0;
}

static const struct lb_dataplane_ops ops = {
	f_set_config, f_set_vip, f_del_vip, f_set_backends, f_write_ring, f_patch_ring, f_read_stats,
	f_read_port_stats, f_set_nat, f_read_conns,
};

/* A data plane without NAT mode: no set_nat, no read_conns. */
static const struct lb_dataplane_ops ops_nonat = {
	f_set_config, f_set_vip, f_del_vip, f_set_backends, f_write_ring, f_patch_ring, f_read_stats,
	f_read_port_stats, NULL, NULL,
};

/* The fake data plane and the server's shadow agree. */
static void check_mirror(const struct lb_proto_server *srv, const char *when)
{
	const struct lb_proto_state *st = lb_proto_server_state(srv);

	CHECK(!memcmp(&st->config, &dp.cfg, sizeof(dp.cfg)), "config differs after %s", when);
	for (int i = 0; i < LB_MAX_VIPS; i++) {
		CHECK(st->vips[i].used == (dp.used[i] != 0), "vip %d used differs after %s", i, when);
		if (st->vips[i].used) {
			CHECK(!memcmp(&st->vips[i].key, &dp.keys[i], sizeof(dp.keys[i])),
			      "vip %d key differs after %s", i, when);
			CHECK(st->vips[i].nat_flags == dp.entries[i].nat_flags &&
			      !dp.entries[i].pad[0] && !dp.entries[i].pad[1] && !dp.entries[i].pad[2],
			      "vip %d nat_flags differ after %s", i, when);
			/* The SNAT rule holds whatever the requests were. */
			CHECK(!(st->vips[i].nat_flags & LB_VIP_F_SNAT) ||
			      (st->vips[i].mode == LB_MODE_NAT &&
			       (st->vips[i].key.family == LB_FAMILY_V6 ? st->nat.snat_naddrs6 :
				st->nat.snat_naddrs) > 0),
			      "vip %d: SNAT without a NAT mode or a pool of its family after %s",
			      i, when);
			CHECK(st->vips[i].mode != LB_MODE_NAT || mirror_nat6 ||
			      st->vips[i].key.family == LB_FAMILY_V4,
			      "vip %d: an IPv6 NAT VIP after %s", i, when);
			CHECK(st->vips[i].mode == dp.entries[i].mode &&
			      st->vips[i].nat_port == dp.entries[i].nat_port &&
			      st->vips[i].tunnel_family == dp.entries[i].tunnel_family &&
			      !memcmp(&st->vips[i].tunnel_src, &dp.entries[i].tunnel_src,
				      sizeof(dp.entries[i].tunnel_src)) &&
			      dp.entries[i].vip_id == (__u32)i,
			      "vip %d entry differs after %s", i, when);
			{
				struct lb_vip_entry e;

				lb_proto_vip_entry(&st->vips[i], (__u32)i, &e);
				CHECK(!memcmp(&e, &dp.entries[i], sizeof(e)),
				      "vip %d: the whole entry differs after %s", i, when);
			}
			/* The tunnel rules hold whatever the requests were. */
			CHECK(st->vips[i].mode == LB_MODE_TUNNEL ?
			      st->vips[i].tunnel_family && !st->vips[i].nat_port &&
			      st->vips[i].tunnel_encap <= LB_ENCAP_GUE &&
			      (st->vips[i].tunnel_encap == LB_ENCAP_GUE) ==
			      (st->vips[i].gue_port != 0) &&
			      st->vips[i].tunnel_src_bits <= LB_TUNNEL_SRC_BITS_MAX &&
			      !(st->vips[i].key.family == LB_FAMILY_V6 &&
				st->vips[i].tunnel_family == LB_FAMILY_V4) :
			      !st->vips[i].tunnel_encap && !st->vips[i].gue_port &&
			      !st->vips[i].tunnel_src_bits,
			      "vip %d: tunnel fields break the rules after %s", i, when);
			CHECK(dp.keys[i].family == LB_FAMILY_V6 ||
			      (dp.keys[i].family == LB_FAMILY_V4 && !dp.keys[i].addr.v6w[1] &&
			       !dp.keys[i].addr.v6w[2] && !dp.keys[i].addr.v6w[3]),
			      "vip %d key: family %u or IPv4 tail not 0 after %s", i,
			      dp.keys[i].family, when);
			CHECK(!memcmp(st->rings[i], dp.ring[i], sizeof(dp.ring[i])),
			      "ring %d differs after %s", i, when);
		} else {
			for (int s = 0; s < RS; s++)
				CHECK(dp.ring[i][s] == LB_NO_BACKEND, "free ring %d slot %d set", i, s);
		}
	}
	CHECK(!memcmp(st->backends, dp.b, sizeof(dp.b)), "backends differ after %s", when);
	CHECK(!memcmp(&st->nat, &dp.nat, sizeof(dp.nat)), "NAT config differs after %s", when);
}

/* Sends one request; returns ok, and checks the reply is a well-formed map. */
static int send_req(struct lb_proto_server *srv, const void *buf, size_t len, char *err,
		    size_t errlen)
{
	msgpack_sbuffer reply;
	msgpack_unpacked up;
	size_t off = 0;
	int ok = -1;

	msgpack_sbuffer_init(&reply);
	msgpack_unpacked_init(&up);
	lb_proto_handle(srv, buf, len, &reply, NULL);
	if (msgpack_unpack_next(&up, reply.data, reply.size, &off) == MSGPACK_UNPACK_SUCCESS &&
	    off == reply.size && up.data.type == MSGPACK_OBJECT_MAP) {
		const msgpack_object_map *m = &up.data.via.map;

		for (uint32_t i = 0; i < m->size; i++) {
			const msgpack_object *k = &m->ptr[i].key, *v = &m->ptr[i].val;

			if (k->via.str.size == 2 && !memcmp(k->via.str.ptr, "ok", 2))
				ok = v->type == MSGPACK_OBJECT_BOOLEAN ? v->via.boolean : -1;
			if (err && k->via.str.size == 5 && !memcmp(k->via.str.ptr, "error", 5))
				snprintf(err, errlen, "%.*s", (int)v->via.str.size, v->via.str.ptr);
		}
	}
	CHECK(ok >= 0, "reply is not a well-formed map");
	if (ok == 1)
		n_ok++;
	else
		n_rejected++;
	msgpack_unpacked_destroy(&up);
	msgpack_sbuffer_destroy(&reply);
	return ok == 1;
}

/* A small msgpack writer for building requests. */
struct w {
	msgpack_sbuffer sb;
	msgpack_packer pk;
};

static void w_init(struct w *w, const char *op, int nfields)
{
	msgpack_sbuffer_init(&w->sb);
	msgpack_packer_init(&w->pk, &w->sb, msgpack_sbuffer_write);
	msgpack_pack_map(&w->pk, 2 + nfields);
	msgpack_pack_str_with_body(&w->pk, "v", 1);
	msgpack_pack_uint8(&w->pk, LB_PROTOCOL_VERSION);
	msgpack_pack_str_with_body(&w->pk, "op", 2);
	msgpack_pack_str_with_body(&w->pk, op, strlen(op));
}

static void w_key(struct w *w, const char *k)
{
	msgpack_pack_str_with_body(&w->pk, k, strlen(k));
}

static void w_uint(struct w *w, const char *k, uint64_t v)
{
	w_key(w, k);
	msgpack_pack_uint64(&w->pk, v);
}

static void w_bin(struct w *w, const char *k, const void *p, size_t n)
{
	w_key(w, k);
	msgpack_pack_bin_with_body(&w->pk, p, n);
}

/* A set_vip request's five fields for TCP port 80 (vip_id, addr, port, proto,
 * mode), leaving room for `extra` more fields after them. */
static void w_set_vip(struct w *w, int extra, uint64_t vip_id, const void *addr, size_t addr_len,
		      uint64_t mode)
{
	w_init(w, "set_vip", 5 + extra);
	w_uint(w, "vip_id", vip_id);
	w_bin(w, "addr", addr, addr_len);
	w_uint(w, "port", 80);
	w_uint(w, "proto", 6);
	w_uint(w, "mode", mode);
}

static int run(struct lb_proto_server *srv, struct w *w, char *err, size_t errlen)
{
	int ok = send_req(srv, w->sb.data, w->sb.size, err, errlen);

	msgpack_sbuffer_destroy(&w->sb);
	return ok;
}

/* A VIP address: 10.0.0.<last> (alen 4) or fd00::<last> (alen 16). */
static void vip_addr(__u8 *addr, size_t alen, __u8 last)
{
	memset(addr, 0, 16);
	if (alen == 16) {
		addr[0] = 0xfd;
	} else {
		addr[0] = 10;
	}
	addr[alen - 1] = last;
}

static void req_vip_af(struct w *w, __u32 id, __u8 last, __u16 port, size_t alen)
{
	__u8 addr[16];

	vip_addr(addr, alen, last);
	w_init(w, "set_vip", 5);
	w_uint(w, "vip_id", id);
	w_bin(w, "addr", addr, alen);
	w_uint(w, "port", port);
	w_uint(w, "proto", 6);
	w_uint(w, "mode", 0);
}

static void req_vip(struct w *w, __u32 id, __u8 last, __u16 port)
{
	req_vip_af(w, id, last, port, 4);
}

static void req_backends_af(struct w *w, __u32 first, __u32 n, __u8 state, size_t alen)
{
	__u8 addr[16] = { 10, 1, 0, 0 }, mac[6] = { 2, 0, 0, 0, 0, 0 };

	if (alen == 16)
		addr[0] = 0xfd;

	w_init(w, "set_backends", 1);
	w_key(w, "backends");
	msgpack_pack_array(&w->pk, n);
	for (__u32 i = 0; i < n; i++) {
		addr[alen - 1] = (__u8)(first + i);
		mac[5] = (__u8)(first + i);
		msgpack_pack_map(&w->pk, 5);
		w_uint(w, "id", first + i);
		w_bin(w, "addr", addr, alen);
		w_bin(w, "mac", mac, 6);
		w_uint(w, "state", state);
		w_uint(w, "port", 0);
	}
}

static void req_backends(struct w *w, __u32 first, __u32 n, __u8 state)
{
	req_backends_af(w, first, n, state, 4);
}

static void req_ring(struct w *w, __u32 vip, __u32 seed)
{
	__u8 slots[RS * 4];

	for (__u32 s = 0; s < RS; s++) {
		__u32 v = (s * 7 + seed) % 17 == 0 ? LB_NO_BACKEND : (s + seed) % 16;

		memcpy(slots + s * 4, &v, 4); /* little-endian host */
	}
	w_init(w, "set_ring", 2);
	w_uint(w, "vip_id", vip);
	w_bin(w, "slots", slots, sizeof(slots));
}

static void req_patch(struct w *w, __u32 vip, __u32 n, __u32 seed)
{
	__u32 p[2 * 64];

	for (__u32 i = 0; i < n && i < 64; i++) {
		p[2 * i] = (seed + i * 31) % RS;
		p[2 * i + 1] = (seed + i) % 16;
	}
	w_init(w, "patch_ring", 2);
	w_uint(w, "vip_id", vip);
	w_bin(w, "patch", p, (size_t)n * 8);
}

static void test_failures(struct lb_proto_server *srv)
{
	__u8 addr[4] = { 10, 0, 0, 3 };
	char err[512];
	struct w w;

	/* set_ring: the write fails half-way, the restore succeeds. */
	req_ring(&w, 3, 99);
	fail_calls(1, 1);
	CHECK(!run(srv, &w, err, sizeof(err)), "set_ring should fail");
	CHECK(strstr(err, "data plane failed to apply set_ring") &&
	      strstr(err, "previous contents restored"), "error: %s", err);
	check_mirror(srv, "failed set_ring");

	/* patch_ring and set_backends likewise. */
	req_patch(&w, 3, 10, 5);
	fail_calls(1, 1);
	CHECK(!run(srv, &w, err, sizeof(err)), "patch_ring should fail");
	check_mirror(srv, "failed patch_ring");
	req_backends(&w, 0, 8, 2);
	fail_calls(1, 1);
	CHECK(!run(srv, &w, err, sizeof(err)), "set_backends should fail");
	check_mirror(srv, "failed set_backends");

	/* del_vip: the ring reset works, the VIP removal fails; both undone. */
	w_init(&w, "del_vip", 3);
	w_bin(&w, "addr", addr, 4);
	w_uint(&w, "port", 80);
	w_uint(&w, "proto", 6);
	fail_calls(2, 1);
	CHECK(!run(srv, &w, err, sizeof(err)), "del_vip should fail");
	CHECK(strstr(err, "data plane failed to apply del_vip"), "error: %s", err);
	check_mirror(srv, "failed del_vip");

	/* The restore fails too: reported as such; a full set_ring resyncs. */
	req_ring(&w, 3, 98);
	fail_calls(1, 2);
	CHECK(!run(srv, &w, err, sizeof(err)), "set_ring should fail");
	CHECK(strstr(err, "failed too"), "error: %s", err);
	req_ring(&w, 3, 97);
	CHECK(run(srv, &w, err, sizeof(err)), "set_ring: %s", err);
	check_mirror(srv, "resync");
}

/* A multicast destination MAC is refused, like the configuration refuses it,
 * and nothing of the request is applied; all zeros (a backend whose MAC is
 * not known, down) is taken. */
static void test_backend_macs(struct lb_proto_server *srv)
{
	static const __u8 macs[][6] = {
		{ 0x02, 0, 0, 0, 0, 0x30 }, { 0x01, 0x00, 0x5e, 0, 0, 0xfb },
		{ 0xff, 0xff, 0xff, 0xff, 0xff, 0xff }, { 0x33, 0x33, 0, 0, 0, 1 },
	};
	__u8 addr[4] = { 10, 1, 0, 30 }, zero[6] = { 0 };
	char err[512];
	struct w w;

	for (size_t bad = 1; bad < sizeof(macs) / sizeof(macs[0]); bad++) {
		w_init(&w, "set_backends", 1);
		w_key(&w, "backends");
		msgpack_pack_array(&w.pk, 2);
		for (size_t i = 0; i < 2; i++) {
			msgpack_pack_map(&w.pk, 5);
			w_uint(&w, "id", 30 + i);
			w_bin(&w, "addr", addr, 4);
			w_bin(&w, "mac", macs[i ? bad : 0], 6);
			w_uint(&w, "state", 0);
			w_uint(&w, "port", 0);
		}
		CHECK(!run(srv, &w, err, sizeof(err)), "multicast MAC %zu accepted", bad);
		CHECK(strstr(err, "field 'backends[1].mac' must be a unicast address"),
		      "error: %s", err);
		CHECK(dp.b[30].state == LB_BACKEND_UNUSED, "backends[0] applied anyway");
		check_mirror(srv, "multicast MAC");
	}
	w_init(&w, "set_backends", 1);
	w_key(&w, "backends");
	msgpack_pack_array(&w.pk, 1);
	msgpack_pack_map(&w.pk, 5);
	w_uint(&w, "id", 30);
	w_bin(&w, "addr", addr, 4);
	w_bin(&w, "mac", zero, 6);
	w_uint(&w, "state", LB_BACKEND_DOWN);
	w_uint(&w, "port", 0);
	CHECK(run(srv, &w, err, sizeof(err)), "all-zero MAC: %s", err);
	CHECK(dp.b[30].state == LB_BACKEND_DOWN, "all-zero MAC not applied");
	check_mirror(srv, "all-zero MAC");
}

/* Protocol 2's addresses: bin 4 or 16 picks the family, another length is
 * refused naming the field; the NAT and tunnel fields are decoded, checked
 * and stored (dump reports them) even though only DSR is served. */
static void test_families(struct lb_proto_server *srv)
{
	const struct lb_proto_state *st = lb_proto_server_state(srv);
	__u8 addr6[16], addr5[5] = { 10, 0, 0, 9, 9 }, src6[16];
	char err[512];
	struct w w;

	/* An IPv6 VIP with the same last byte and port as IPv4 VIP 3: another key. */
	req_vip_af(&w, 40, 3, 80, 16);
	CHECK(run(srv, &w, err, sizeof(err)), "IPv6 set_vip: %s", err);
	CHECK(st->vips[40].used && st->vips[40].key.family == LB_FAMILY_V6 &&
	      st->vips[40].key.addr.v6[0] == 0xfd && st->vips[40].key.addr.v6[15] == 3,
	      "IPv6 VIP not stored");
	CHECK(st->vips[3].used && st->vips[3].key.family == LB_FAMILY_V4,
	      "IPv4 VIP 3 disturbed");
	check_mirror(srv, "IPv6 set_vip");

	/* A wrong length names the field. */
	w_set_vip(&w, 0, 41, addr5, sizeof(addr5), 0);
	CHECK(!run(srv, &w, err, sizeof(err)), "5-byte addr accepted");
	CHECK(strstr(err, "field 'addr' must be bin of 4 (IPv4) or 16 (IPv6) bytes, got 5"),
	      "error: %s", err);
	CHECK(!st->vips[41].used, "5-byte addr applied");

	/* nat_port and tunnel_src: stored with a DSR VIP (re-set: same key, id). */
	vip_addr(addr6, 16, 3);
	vip_addr(src6, 16, 0x99);
	w_set_vip(&w, 2, 40, addr6, 16, 0);
	w_uint(&w, "nat_port", 8080);
	w_bin(&w, "tunnel_src", src6, 16);
	CHECK(run(srv, &w, err, sizeof(err)), "set_vip with nat_port/tunnel_src: %s", err);
	CHECK(st->vips[40].nat_port == (__u16)((8080 >> 8) | ((8080 & 0xff) << 8)) &&
	      st->vips[40].tunnel_family == LB_FAMILY_V6 && st->vips[40].tunnel_src.v6[15] == 0x99,
	      "nat_port/tunnel_src not stored");
	check_mirror(srv, "set_vip extras");

	/* Bad extras are refused naming the field, before the mode. */
	w_set_vip(&w, 1, 40, addr6, 16, 1);
	w_bin(&w, "tunnel_src", addr5, sizeof(addr5));
	CHECK(!run(srv, &w, err, sizeof(err)), "5-byte tunnel_src accepted");
	CHECK(strstr(err, "field 'tunnel_src' must be bin of 4 (IPv4) or 16 (IPv6) bytes, got 5"),
	      "error: %s", err);
	w_set_vip(&w, 1, 40, addr6, 16, 0);
	w_uint(&w, "nat_port", 65536);
	CHECK(!run(srv, &w, err, sizeof(err)), "nat_port 65536 accepted");
	CHECK(strstr(err, "field 'nat_port' out of range"), "error: %s", err);
	/* NAT mode: its fields are valid, an IPv6 NAT VIP is not. */
	w_set_vip(&w, 1, 40, addr6, 16, 1);
	w_uint(&w, "nat_port", 8081);
	CHECK(!run(srv, &w, err, sizeof(err)), "IPv6 mode 1 accepted");
	CHECK(strstr(err, "field 'mode': NAT mode (1) is IPv4 only"), "error: %s", err);
	CHECK(st->vips[40].nat_port == (__u16)((8080 >> 8) | ((8080 & 0xff) << 8)),
	      "refused request changed nat_port");
	check_mirror(srv, "refused extras");

	/* IPv6 backends next to IPv4 ones. */
	req_backends_af(&w, 40, 4, 0, 16);
	CHECK(run(srv, &w, err, sizeof(err)), "IPv6 set_backends: %s", err);
	CHECK(st->backends[41].family == LB_FAMILY_V6 && st->backends[41].addr.v6[15] == 41 &&
	      st->backends[0].family == LB_FAMILY_V4 && st->backends[0].addr.v6w[1] == 0,
	      "IPv6 backends not stored");
	check_mirror(srv, "IPv6 set_backends");

	/* del_vip by the IPv6 key. */
	w_init(&w, "del_vip", 3);
	w_bin(&w, "addr", addr6, 16);
	w_uint(&w, "port", 80);
	w_uint(&w, "proto", 6);
	CHECK(run(srv, &w, err, sizeof(err)), "IPv6 del_vip: %s", err);
	CHECK(!st->vips[40].used && st->vips[3].used, "IPv6 del_vip removed the wrong VIP");
	check_mirror(srv, "IPv6 del_vip");
}

/* ---- NAT mode ------------------------------------------------------------ */

static const struct lb_config base_cfg = { .ring_size = RS };

/* A server on the fake data plane (o: with or without the NAT hooks); the
 * selftest cannot go on without one. */
static struct lb_proto_server *server_new(const struct lb_dataplane_ops *o,
					  const struct lb_proto_info *info)
{
	struct lb_proto_server *srv = lb_proto_server_new(o, NULL, info, &base_cfg);

	if (!srv)
		abort();
	return srv;
}

/* The fake data plane as a data plane starts: empty tables, NAT defaults. */
static void dp_reset(void)
{
	memset(&dp, 0, sizeof(dp));
	for (int i = 0; i < LB_MAX_BACKENDS; i++)
		dp.b[i].state = LB_BACKEND_UNUSED;
	for (int i = 0; i < LB_MAX_VIPS; i++)
		for (int s = 0; s < RS; s++)
			dp.ring[i][s] = LB_NO_BACKEND;
	dp.cfg = base_cfg;
	lb_proto_nat_defaults(&dp.nat);
}

static void w_bool(struct w *w, const char *k, bool v)
{
	w_key(w, k);
	if (v)
		msgpack_pack_true(&w->pk);
	else
		msgpack_pack_false(&w->pk);
}

static void w_str(struct w *w, const char *s)
{
	msgpack_pack_str_with_body(&w->pk, s, strlen(s));
}

static void pack_ip4(struct w *w, __u8 a, __u8 b, __u8 c, __u8 d)
{
	__u8 ip[4] = { a, b, c, d };

	msgpack_pack_bin_with_body(&w->pk, ip, 4);
}

/* A decoded reply, kept with the buffer its str and bin objects point into. */
struct rep {
	msgpack_sbuffer sb;
	msgpack_unpacked up;
	const msgpack_object *root; /* the reply map, NULL if malformed */
};

static int run_rep(struct lb_proto_server *srv, struct w *w, struct rep *rp, char *err,
		   size_t errlen)
{
	size_t off = 0;
	int ok = 0;

	msgpack_sbuffer_init(&rp->sb);
	msgpack_unpacked_init(&rp->up);
	rp->root = NULL;
	lb_proto_handle(srv, w->sb.data, w->sb.size, &rp->sb, NULL);
	msgpack_sbuffer_destroy(&w->sb);
	if (msgpack_unpack_next(&rp->up, rp->sb.data, rp->sb.size, &off) == MSGPACK_UNPACK_SUCCESS &&
	    off == rp->sb.size && rp->up.data.type == MSGPACK_OBJECT_MAP)
		rp->root = &rp->up.data;
	CHECK(rp->root, "reply is not a well-formed map");
	if (err)
		err[0] = '\0';
	for (uint32_t i = 0; rp->root && i < rp->root->via.map.size; i++) {
		const msgpack_object *k = &rp->root->via.map.ptr[i].key;
		const msgpack_object *v = &rp->root->via.map.ptr[i].val;

		if (k->via.str.size == 2 && !memcmp(k->via.str.ptr, "ok", 2))
			ok = v->type == MSGPACK_OBJECT_BOOLEAN && v->via.boolean;
		if (err && k->via.str.size == 5 && !memcmp(k->via.str.ptr, "error", 5))
			snprintf(err, errlen, "%.*s", (int)v->via.str.size, v->via.str.ptr);
	}
	return ok;
}

static void rep_free(struct rep *rp)
{
	msgpack_unpacked_destroy(&rp->up);
	msgpack_sbuffer_destroy(&rp->sb);
}

/* The value of key in map (a str-keyed map), or NULL. */
static const msgpack_object *mget(const msgpack_object *map, const char *key)
{
	if (!map || map->type != MSGPACK_OBJECT_MAP)
		return NULL;
	for (uint32_t i = 0; i < map->via.map.size; i++) {
		const msgpack_object *k = &map->via.map.ptr[i].key;

		if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == strlen(key) &&
		    !memcmp(k->via.str.ptr, key, k->via.str.size))
			return &map->via.map.ptr[i].val;
	}
	return NULL;
}

/* Whether the i-th key of map is name. */
static int key_is(const msgpack_object *map, uint32_t i, const char *name)
{
	const msgpack_object *k = &map->via.map.ptr[i].key;

	return k->type == MSGPACK_OBJECT_STR && k->via.str.size == strlen(name) &&
	       !memcmp(k->via.str.ptr, name, k->via.str.size);
}

static uint64_t uget(const msgpack_object *map, const char *key)
{
	const msgpack_object *o = mget(map, key);

	CHECK(o && o->type == MSGPACK_OBJECT_POSITIVE_INTEGER, "field '%s' is not a uint", key);
	return o && o->type == MSGPACK_OBJECT_POSITIVE_INTEGER ? o->via.u64 : ~0ull;
}

static const char *const state_names[LB_CONN_STATES] = LB_CONN_STATE_NAMES;

/* A request that must be refused with needle in its error, and change
 * nothing: no data plane call, the shadow's VIPs and NAT config as before. */
static void expect_reject(struct lb_proto_server *srv, struct w *w, const char *needle,
			  const char *what)
{
	static struct lb_proto_vip vips[LB_MAX_VIPS];
	const struct lb_proto_state *st = lb_proto_server_state(srv);
	struct lb_nat_config nat = st->nat;
	int calls = dp.nat_calls;
	char err[512] = "";

	memcpy(vips, st->vips, sizeof(vips));
	CHECK(!run(srv, w, err, sizeof(err)), "%s: accepted", what);
	CHECK(strstr(err, needle), "%s: error '%s' lacks '%s'", what, err, needle);
	CHECK(!memcmp(&nat, &st->nat, sizeof(nat)) && !memcmp(vips, st->vips, sizeof(vips)) &&
	      dp.nat_calls == calls, "%s: a refused request changed something", what);
	check_mirror(srv, what);
}

/* The i-th malformed set_nat into w; returns what its error must say, NULL
 * past the last. */
static const char *bad_nat(struct w *w, int i)
{
	static const __u8 a16[16] = { 0xfd };

	switch (i) {
	case 0:
		w_init(w, "set_nat", 1);
		w_key(w, "snat_addrs");
		w_str(w, "192.0.2.1");
		return "field 'snat_addrs' must be an array, got str";
	case 1:
		w_init(w, "set_nat", 1);
		w_key(w, "snat_addrs");
		msgpack_pack_array(&w->pk, LB_MAX_SNAT_ADDRS + 1);
		for (int k = 0; k <= LB_MAX_SNAT_ADDRS; k++)
			pack_ip4(w, 10, 9, 0, (__u8)(k + 1));
		return "field 'snat_addrs' has 17 IPv4 entries, at most 16 of each family allowed";
	case 2: /* this server has no "nat6" */
		w_init(w, "set_nat", 1);
		w_key(w, "snat_addrs");
		msgpack_pack_array(&w->pk, 2);
		pack_ip4(w, 192, 0, 2, 1);
		msgpack_pack_bin_with_body(&w->pk, a16, 16);
		return "field 'snat_addrs[1]' is IPv6: this data plane has no NAT mode for IPv6 "
		       "(no \"nat6\" capability)";
	case 3:
		w_init(w, "set_nat", 1);
		w_key(w, "snat_addrs");
		msgpack_pack_array(&w->pk, 1);
		w_str(w, "192.0.2.1");
		return "field 'snat_addrs[0]' must be bin, got str";
	case 4: case 5: case 6: case 7: case 8: case 9: {
		static const __u8 bad[6][4] = { { 0, 1, 2, 3 }, { 127, 0, 0, 1 }, { 224, 0, 0, 1 },
						{ 239, 255, 255, 250 }, { 240, 0, 0, 1 },
						{ 255, 255, 255, 255 } };
		static const char *const needles[6] = {
			"field 'snat_addrs[1]': 0.1.2.3 is not a unicast address",
			"field 'snat_addrs[1]': 127.0.0.1 is not a unicast address",
			"field 'snat_addrs[1]': 224.0.0.1 is not a unicast address",
			"field 'snat_addrs[1]': 239.255.255.250 is not a unicast address",
			"field 'snat_addrs[1]': 240.0.0.1 is not a unicast address",
			"field 'snat_addrs[1]': 255.255.255.255 is not a unicast address",
		};

		w_init(w, "set_nat", 1);
		w_key(w, "snat_addrs");
		msgpack_pack_array(&w->pk, 2);
		pack_ip4(w, 192, 0, 2, 1);
		msgpack_pack_bin_with_body(&w->pk, bad[i - 4], 4);
		return needles[i - 4];
	}
	case 10:
		w_init(w, "set_nat", 1);
		w_key(w, "snat_addrs");
		msgpack_pack_array(&w->pk, 3);
		pack_ip4(w, 192, 0, 2, 1);
		pack_ip4(w, 192, 0, 2, 2);
		pack_ip4(w, 192, 0, 2, 1);
		return "field 'snat_addrs[2]': 192.0.2.1 appears twice (also snat_addrs[0])";
	case 11:
		w_init(w, "set_nat", 1);
		w_uint(w, "snat_port_min", 0);
		return "field 'snat_port_min' out of range: 0 (allowed 1..65535)";
	case 12:
		w_init(w, "set_nat", 1);
		w_uint(w, "snat_port_min", 65536);
		return "field 'snat_port_min' out of range: 65536 (allowed 1..65535)";
	case 13:
		w_init(w, "set_nat", 1);
		w_uint(w, "snat_port_max", 0);
		return "field 'snat_port_max' out of range: 0 (allowed 1..65535)";
	case 14:
		w_init(w, "set_nat", 1);
		w_uint(w, "snat_port_max", 65536);
		return "field 'snat_port_max' out of range: 65536";
	case 15:
		w_init(w, "set_nat", 1);
		w_key(w, "snat_port_min");
		msgpack_pack_int64(&w->pk, -1);
		return "field 'snat_port_min' out of range: -1";
	case 16:
		w_init(w, "set_nat", 2);
		w_uint(w, "snat_port_min", 2000);
		w_uint(w, "snat_port_max", 1999);
		return "field 'snat_port_min': 2000 is above snat_port_max 1999";
	case 17: /* min defaults to 1024 */
		w_init(w, "set_nat", 1);
		w_uint(w, "snat_port_max", 1000);
		return "field 'snat_port_min': 1024 is above snat_port_max 1000";
	case 18:
		w_init(w, "set_nat", 1);
		w_uint(w, "on_backend_down", 2);
		return "field 'on_backend_down' out of range: 2 (allowed 0..1)";
	case 19:
		w_init(w, "set_nat", 1);
		w_bool(w, "on_backend_down", true);
		return "field 'on_backend_down' must be an unsigned integer, got bool";
	case 20:
		w_init(w, "set_nat", 1);
		w_key(w, "timeouts");
		msgpack_pack_array(&w->pk, 0);
		return "field 'timeouts' must be a map, got array";
	case 21:
		w_init(w, "set_nat", 1);
		w_key(w, "timeouts");
		msgpack_pack_map(&w->pk, 2);
		w_uint(w, "established", 60);
		w_uint(w, "establishd", 60);
		return "field 'timeouts': unknown connection state 'establishd' (known: syn_sent, "
		       "syn_recv, established, fin_wait, time_wait, close, udp_unreplied, "
		       "udp_replied)";
	case 22:
		w_init(w, "set_nat", 1);
		w_key(w, "timeouts");
		msgpack_pack_map(&w->pk, 1);
		w_uint(w, "established", 0);
		return "field 'timeouts.established' out of range: 0 (allowed 1..2147483647)";
	case 23:
		w_init(w, "set_nat", 1);
		w_key(w, "timeouts");
		msgpack_pack_map(&w->pk, 1);
		w_uint(w, "udp_replied", 2147483648u);
		return "field 'timeouts.udp_replied' out of range: 2147483648 (allowed 1..2147483647)";
	case 24:
		w_init(w, "set_nat", 1);
		w_key(w, "timeouts");
		msgpack_pack_map(&w->pk, 1);
		msgpack_pack_uint8(&w->pk, 1);
		msgpack_pack_uint8(&w->pk, 5);
		return "keys of timeouts must be str";
	case 25:
		w_init(w, "set_nat", 1);
		w_key(w, "timeouts");
		msgpack_pack_map(&w->pk, 1);
		w_key(w, "close");
		w_str(w, "10");
		return "field 'timeouts.close' must be an unsigned integer, got str";
	case 26:
		w_init(w, "set_nat", 1);
		w_key(w, "timeouts");
		msgpack_pack_map(&w->pk, 2);
		w_uint(w, "close", 5);
		w_uint(w, "close", 6);
		return "field 'timeouts.close' given twice";
	case 27:
		w_init(w, "set_nat", 2);
		w_key(w, "snat_addrs");
		msgpack_pack_array(&w->pk, 0);
		w_key(w, "snat_addrs");
		msgpack_pack_array(&w->pk, 0);
		return "field 'snat_addrs' given twice";
	case 28:
		w_init(w, "set_nat", 1);
		w_key(w, "timeouts");
		msgpack_pack_map(&w->pk, 2);
		w_uint(w, "syn_sent", 1);
		w_uint(w, "SYN_RECV", 2);
		return "unknown connection state 'SYN_RECV'";
	case 29:
		w_init(w, "set_nat", 1);
		w_uint(w, "timeouts", 30);
		return "field 'timeouts' must be a map, got unsigned integer";
	case 30:
		w_init(w, "set_nat", 1);
		w_key(w, "snat_addrs");
		msgpack_pack_array(&w->pk, 2);
		pack_ip4(w, 192, 0, 2, 1);
		msgpack_pack_bin_with_body(&w->pk, a16, 5);
		return "field 'snat_addrs[1]' must be bin of 4 (IPv4) or 16 (IPv6) bytes, got 5";
	case 31:
		w_init(w, "set_nat", 1);
		w_key(w, "snat_addrs");
		msgpack_pack_array(&w->pk, 2 * LB_MAX_SNAT_ADDRS + 1);
		for (int k = 0; k <= 2 * LB_MAX_SNAT_ADDRS; k++)
			pack_ip4(w, 10, 9, 0, (__u8)(k + 1));
		return "field 'snat_addrs' has 33 entries, at most 32 allowed (16 of each family)";
	default:
		return NULL;
	}
}

/* set_nat with snat_addrs = the n addresses 203.0.113.<first + i>. */
static void req_nat_pool(struct w *w, int n, int first)
{
	w_init(w, "set_nat", 1);
	w_key(w, "snat_addrs");
	msgpack_pack_array(&w->pk, (uint32_t)n);
	for (int i = 0; i < n; i++)
		pack_ip4(w, 203, 0, 113, (__u8)(first + i));
}

static void test_nat_config(struct lb_proto_server *srv)
{
	const struct lb_proto_state *st = lb_proto_server_state(srv);
	static const __u32 dflt_t[LB_CONN_STATES] = LB_CONN_TIMEOUTS_DEFAULT;
	struct lb_nat_config dflt;
	const char *needle;
	char err[512], what[64];
	struct w w;

	lb_proto_nat_defaults(&dflt);
	CHECK(dflt.snat_naddrs == 0 && dflt.snat_port_min == 1024 && dflt.snat_port_max == 65535 &&
	      dflt.on_backend_down == LB_NAT_DOWN_RESCHEDULE &&
	      !memcmp(dflt.timeouts_s, dflt_t, sizeof(dflt_t)), "lb_proto_nat_defaults");
	CHECK(!memcmp(&st->nat, &dflt, sizeof(dflt)), "a new server's NAT config is not the default");
	CHECK(dp.nat_calls == 0, "the server wrote the NAT config at start");

	for (int i = 0; (needle = bad_nat(&w, i)) != NULL; i++) {
		snprintf(what, sizeof(what), "bad set_nat %d", i);
		expect_reject(srv, &w, needle, what);
	}

	/* Every field, some timeouts: the others keep their defaults. */
	w_init(&w, "set_nat", 5);
	w_key(&w, "snat_addrs");
	msgpack_pack_array(&w.pk, 2);
	pack_ip4(&w, 198, 51, 100, 1);
	pack_ip4(&w, 198, 51, 100, 2);
	w_uint(&w, "snat_port_min", 20000);
	w_uint(&w, "snat_port_max", 20007);
	w_uint(&w, "on_backend_down", LB_NAT_DOWN_DROP);
	w_key(&w, "timeouts");
	msgpack_pack_map(&w.pk, 2);
	w_uint(&w, "established", 3600);
	w_uint(&w, "udp_unreplied", 5);
	CHECK(run(srv, &w, err, sizeof(err)), "set_nat: %s", err);
	{
		const __u8 a0[4] = { 198, 51, 100, 1 }, a1[4] = { 198, 51, 100, 2 };

		CHECK(st->nat.snat_naddrs == 2 && !memcmp(&st->nat.snat_addrs[0], a0, 4) &&
		      !memcmp(&st->nat.snat_addrs[1], a1, 4) && st->nat.snat_addrs[2] == 0 &&
		      st->nat.snat_port_min == 20000 && st->nat.snat_port_max == 20007 &&
		      st->nat.on_backend_down == LB_NAT_DOWN_DROP,
		      "set_nat fields not stored");
	}
	for (int s = 0; s < LB_CONN_STATES; s++)
		CHECK(st->nat.timeouts_s[s] ==
		      (s == LB_CONN_ESTABLISHED ? 3600u : s == LB_CONN_UDP_UNREPLIED ? 5u : dflt_t[s]),
		      "timeout of %s: %u", state_names[s], st->nat.timeouts_s[s]);
	check_mirror(srv, "set_nat");

	/* The bounds themselves are accepted. */
	w_init(&w, "set_nat", 4);
	w_key(&w, "snat_addrs");
	msgpack_pack_array(&w.pk, LB_MAX_SNAT_ADDRS);
	for (int k = 0; k < LB_MAX_SNAT_ADDRS; k++)
		pack_ip4(&w, k ? 223 : 1, 255, (__u8)k, 254);
	w_uint(&w, "snat_port_min", 65535);
	w_uint(&w, "snat_port_max", 65535);
	w_key(&w, "timeouts");
	msgpack_pack_map(&w.pk, LB_CONN_STATES);
	for (int s = 0; s < LB_CONN_STATES; s++)
		w_uint(&w, state_names[s], s % 2 ? 2147483647u : 1);
	CHECK(run(srv, &w, err, sizeof(err)), "set_nat at the bounds: %s", err);
	CHECK(st->nat.snat_naddrs == LB_MAX_SNAT_ADDRS && st->nat.snat_port_min == 65535 &&
	      st->nat.on_backend_down == LB_NAT_DOWN_RESCHEDULE &&
	      st->nat.timeouts_s[1] == 2147483647u && st->nat.timeouts_s[0] == 1,
	      "set_nat at the bounds not stored");
	check_mirror(srv, "set_nat at the bounds");
	w_init(&w, "set_nat", 2);
	w_uint(&w, "snat_port_min", 1);
	w_uint(&w, "snat_port_max", 1);
	CHECK(run(srv, &w, err, sizeof(err)), "set_nat ports 1..1: %s", err);

	/* The request is the whole configuration: no field, the defaults. */
	w_init(&w, "set_nat", 0);
	CHECK(run(srv, &w, err, sizeof(err)), "empty set_nat: %s", err);
	CHECK(!memcmp(&st->nat, &dflt, sizeof(dflt)), "an empty set_nat left something");
	check_mirror(srv, "empty set_nat");
}

static void test_snat_rule(struct lb_proto_server *srv)
{
	const struct lb_proto_state *st = lb_proto_server_state(srv);
	__u8 a4[4] = { 10, 0, 0, 60 }, a61[4] = { 10, 0, 0, 61 }, a6[16];
	char err[512];
	struct w w;
	int calls;

	vip_addr(a6, 16, 60);
	/* A NAT VIP without SNAT needs no pool. */
	w_set_vip(&w, 1, 60, a4, 4, LB_MODE_NAT);
	w_uint(&w, "nat_port", 8080);
	CHECK(run(srv, &w, err, sizeof(err)), "NAT set_vip: %s", err);
	CHECK(st->vips[60].used && st->vips[60].mode == LB_MODE_NAT && st->vips[60].nat_flags == 0 &&
	      dp.entries[60].mode == LB_MODE_NAT, "NAT VIP not stored");
	check_mirror(srv, "NAT set_vip");

	/* snat: NAT only, a pool first, a bool. */
	w_set_vip(&w, 1, 60, a4, 4, LB_MODE_NAT);
	w_bool(&w, "snat", true);
	expect_reject(srv, &w, "field 'snat': no SNAT pool configured (set_nat)", "snat, no pool");
	w_set_vip(&w, 1, 61, a61, 4, LB_MODE_DSR);
	w_bool(&w, "snat", true);
	expect_reject(srv, &w, "field 'snat': only a NAT VIP (mode 1) takes SNAT, field 'mode' is 0",
		      "snat on DSR");
	w_set_vip(&w, 1, 60, a4, 4, LB_MODE_NAT);
	w_uint(&w, "snat", 1);
	expect_reject(srv, &w, "field 'snat' must be bool, got unsigned integer", "snat not bool");
	w_set_vip(&w, 1, 61, a6, 16, LB_MODE_NAT);
	w_bool(&w, "snat", false);
	expect_reject(srv, &w, "field 'mode': NAT mode (1) is IPv4 only, this VIP's 'addr' is IPv6",
		      "IPv6 NAT VIP");
	w_set_vip(&w, 0, 61, a4, 4, LB_MODE_TUNNEL);
	expect_reject(srv, &w, "field 'tunnel_src': tunnel mode (2) needs an outer source address",
		      "tunnel VIP without tunnel_src");
	/* A field's own error comes before the SNAT rule. */
	w_set_vip(&w, 2, 60, a4, 4, LB_MODE_NAT);
	w_uint(&w, "nat_port", 70000);
	w_bool(&w, "snat", true);
	CHECK(!run(srv, &w, err, sizeof(err)) && strstr(err, "field 'nat_port' out of range"),
	      "error: %s", err);
	/* snat false is the default, and fine on a DSR VIP. */
	w_set_vip(&w, 1, 61, a61, 4, LB_MODE_DSR);
	w_bool(&w, "snat", false);
	CHECK(run(srv, &w, err, sizeof(err)), "DSR VIP snat false: %s", err);

	/* With a pool: SNAT is taken, and the pool cannot be emptied under it. */
	req_nat_pool(&w, 1, 7);
	CHECK(run(srv, &w, err, sizeof(err)), "set_nat pool: %s", err);
	w_set_vip(&w, 2, 60, a4, 4, LB_MODE_NAT);
	w_uint(&w, "nat_port", 8080);
	w_bool(&w, "snat", true);
	CHECK(run(srv, &w, err, sizeof(err)), "set_vip snat: %s", err);
	CHECK(st->vips[60].nat_flags == LB_VIP_F_SNAT && dp.entries[60].nat_flags == LB_VIP_F_SNAT &&
	      st->vips[60].nat_port == htons(8080), "snat not stored");
	check_mirror(srv, "set_vip snat");
	w_init(&w, "set_nat", 0);
	expect_reject(srv, &w, "field 'snat_addrs': VIP 60 uses SNAT, the pool cannot be emptied",
		      "set_nat emptying the pool");
	req_nat_pool(&w, 0, 0);
	expect_reject(srv, &w, "VIP 60 uses SNAT", "set_nat with snat_addrs []");
	/* Another pool, even smaller, is fine. */
	req_nat_pool(&w, 3, 20);
	CHECK(run(srv, &w, err, sizeof(err)), "set_nat new pool: %s", err);
	req_nat_pool(&w, 1, 30);
	CHECK(run(srv, &w, err, sizeof(err)), "set_nat shrunk pool: %s", err);
	/* The VIP rewritten without snat frees the pool. */
	w_set_vip(&w, 0, 60, a4, 4, LB_MODE_NAT);
	CHECK(run(srv, &w, err, sizeof(err)), "set_vip without snat: %s", err);
	CHECK(st->vips[60].nat_flags == 0 && dp.entries[60].nat_flags == 0, "snat not cleared");
	w_init(&w, "set_nat", 0);
	CHECK(run(srv, &w, err, sizeof(err)), "set_nat empty after snat cleared: %s", err);
	/* ...and so does del_vip. */
	req_nat_pool(&w, 2, 40);
	CHECK(run(srv, &w, err, sizeof(err)), "set_nat: %s", err);
	w_set_vip(&w, 1, 60, a4, 4, LB_MODE_NAT);
	w_bool(&w, "snat", true);
	CHECK(run(srv, &w, err, sizeof(err)), "set_vip snat: %s", err);
	w_init(&w, "del_vip", 3);
	w_bin(&w, "addr", a4, 4);
	w_uint(&w, "port", 80);
	w_uint(&w, "proto", 6);
	CHECK(run(srv, &w, err, sizeof(err)), "del_vip: %s", err);
	w_init(&w, "set_nat", 0);
	CHECK(run(srv, &w, err, sizeof(err)), "set_nat empty after del_vip: %s", err);
	check_mirror(srv, "SNAT rule");

	/* set_nat fails half-way: the previous configuration is written back. */
	req_nat_pool(&w, 2, 50);
	calls = dp.nat_calls;
	fail_calls(1, 1);
	CHECK(!run(srv, &w, err, sizeof(err)), "set_nat should fail");
	CHECK(strstr(err, "data plane failed to apply set_nat: ") &&
	      strstr(err, "(previous contents restored)"), "error: %s", err);
	CHECK(dp.nat_calls == calls + 2 && st->nat.snat_naddrs == 0, "set_nat not rolled back");
	check_mirror(srv, "failed set_nat");
	req_nat_pool(&w, 2, 50);
	fail_calls(1, 2);
	CHECK(!run(srv, &w, err, sizeof(err)), "set_nat should fail");
	CHECK(strstr(err, "failed too"), "error: %s", err);
	req_nat_pool(&w, 2, 50);
	CHECK(run(srv, &w, err, sizeof(err)), "set_nat resync: %s", err);
	check_mirror(srv, "set_nat resync");
	w_init(&w, "set_nat", 0);
	CHECK(run(srv, &w, err, sizeof(err)), "set_nat: %s", err);

	/* DSR VIP 61 goes again. */
	w_init(&w, "del_vip", 3);
	w_bin(&w, "addr", a61, 4);
	w_uint(&w, "port", 80);
	w_uint(&w, "proto", 6);
	CHECK(run(srv, &w, err, sizeof(err)), "del_vip: %s", err);
	check_mirror(srv, "SNAT rule end");
}

/* dump's "nat" and VIP "snat"; a set_nat built from the dump changes nothing. */
/* Each VIP of a dump (its "vips" array) sent back as set_vip: accepted, and
 * the VIP the server holds unchanged. */
static void check_vips_round_trip(struct lb_proto_server *srv, const msgpack_object *vips)
{
	const struct lb_proto_state *st = lb_proto_server_state(srv);
	char err[512];
	struct w w;

	for (uint32_t i = 0; vips && vips->type == MSGPACK_OBJECT_ARRAY && i < vips->via.array.size;
	     i++) {
		const msgpack_object *v = &vips->via.array.ptr[i];
		struct lb_proto_vip old = st->vips[uget(v, "vip_id") % LB_MAX_VIPS];

		w_init(&w, "set_vip", (int)v->via.map.size);
		for (uint32_t k = 0; k < v->via.map.size; k++) {
			msgpack_pack_object(&w.pk, v->via.map.ptr[k].key);
			msgpack_pack_object(&w.pk, v->via.map.ptr[k].val);
		}
		CHECK(run(srv, &w, err, sizeof(err)), "set_vip from dump: %s", err);
		CHECK(!memcmp(&old, &st->vips[uget(v, "vip_id") % LB_MAX_VIPS], sizeof(old)),
		      "dump -> set_vip changed VIP %llu", (unsigned long long)uget(v, "vip_id"));
	}
}

static void test_nat_dump(struct lb_proto_server *srv)
{
	const struct lb_proto_state *st = lb_proto_server_state(srv);
	__u8 a62[4] = { 10, 0, 0, 62 }, a63[4] = { 10, 0, 0, 63 };
	const msgpack_object *nat, *o, *vips;
	struct lb_nat_config before;
	char err[512];
	struct rep rp;
	struct w w;
	int nsnat = 0;

	w_init(&w, "set_nat", 5);
	w_key(&w, "snat_addrs");
	msgpack_pack_array(&w.pk, 2);
	pack_ip4(&w, 198, 51, 100, 7);
	pack_ip4(&w, 192, 0, 2, 200);
	w_uint(&w, "snat_port_min", 40000);
	w_uint(&w, "snat_port_max", 50000);
	w_uint(&w, "on_backend_down", LB_NAT_DOWN_DROP);
	w_key(&w, "timeouts");
	msgpack_pack_map(&w.pk, 1);
	w_uint(&w, "time_wait", 30);
	CHECK(run(srv, &w, err, sizeof(err)), "set_nat: %s", err);
	w_set_vip(&w, 1, 62, a62, 4, LB_MODE_NAT);
	w_bool(&w, "snat", true);
	CHECK(run(srv, &w, err, sizeof(err)), "set_vip snat: %s", err);
	w_set_vip(&w, 0, 63, a63, 4, LB_MODE_NAT);
	CHECK(run(srv, &w, err, sizeof(err)), "set_vip NAT: %s", err);

	w_init(&w, "dump", 0);
	CHECK(run_rep(srv, &w, &rp, err, sizeof(err)), "dump: %s", err);
	nat = mget(rp.root, "nat");
	CHECK(nat && nat->type == MSGPACK_OBJECT_MAP && nat->via.map.size == 5 &&
	      key_is(nat, 0, "snat_addrs") && key_is(nat, 1, "snat_port_min") &&
	      key_is(nat, 2, "snat_port_max") && key_is(nat, 3, "on_backend_down") &&
	      key_is(nat, 4, "timeouts"), "dump's nat map has the wrong keys");
	o = mget(nat, "snat_addrs");
	CHECK(o && o->type == MSGPACK_OBJECT_ARRAY && o->via.array.size == 2 &&
	      o->via.array.ptr[1].type == MSGPACK_OBJECT_BIN &&
	      o->via.array.ptr[1].via.bin.size == 4 &&
	      !memcmp(o->via.array.ptr[1].via.bin.ptr, (const __u8[]){ 192, 0, 2, 200 }, 4),
	      "dump's snat_addrs");
	CHECK(uget(nat, "snat_port_min") == 40000 && uget(nat, "snat_port_max") == 50000 &&
	      uget(nat, "on_backend_down") == LB_NAT_DOWN_DROP, "dump's NAT ports or policy");
	o = mget(nat, "timeouts");
	CHECK(o && o->type == MSGPACK_OBJECT_MAP && o->via.map.size == LB_CONN_STATES,
	      "dump's timeouts: not a map of every state");
	for (uint32_t s = 0; o && o->type == MSGPACK_OBJECT_MAP && s < o->via.map.size &&
	     s < LB_CONN_STATES; s++)
		CHECK(key_is(o, s, state_names[s]) && uget(o, state_names[s]) == st->nat.timeouts_s[s],
		      "dump's timeouts[%u]", s);
	CHECK(uget(o, "time_wait") == 30, "dump's time_wait");
	vips = mget(rp.root, "vips");
	for (uint32_t i = 0; vips && vips->type == MSGPACK_OBJECT_ARRAY && i < vips->via.array.size;
	     i++) {
		const msgpack_object *v = &vips->via.array.ptr[i], *sn = mget(v, "snat");
		uint64_t id = uget(v, "vip_id");

		CHECK(sn && sn->type == MSGPACK_OBJECT_BOOLEAN && id < LB_MAX_VIPS &&
		      sn->via.boolean == ((st->vips[id].nat_flags & LB_VIP_F_SNAT) != 0),
		      "dump's VIP %llu snat", (unsigned long long)id);
		nsnat += sn && sn->type == MSGPACK_OBJECT_BOOLEAN && sn->via.boolean;
	}
	CHECK(nsnat == 1, "dump shows %d SNAT VIPs", nsnat);

	/* Round trip: dump's nat map sent back as set_nat is the same config,
	 * a VIP's dump map sent back as set_vip the same VIP. */
	before = st->nat;
	w_init(&w, "set_nat", (int)nat->via.map.size);
	for (uint32_t i = 0; i < nat->via.map.size; i++) {
		msgpack_pack_object(&w.pk, nat->via.map.ptr[i].key);
		msgpack_pack_object(&w.pk, nat->via.map.ptr[i].val);
	}
	CHECK(run(srv, &w, err, sizeof(err)), "set_nat from dump: %s", err);
	CHECK(!memcmp(&before, &st->nat, sizeof(before)), "dump -> set_nat changed the config");
	check_vips_round_trip(srv, vips);
	rep_free(&rp);
	check_mirror(srv, "NAT dump round trip");
}

static void test_nat_stats_hello(struct lb_proto_server *srv, __u32 conn_table_size)
{
	const msgpack_object *cs, *bs;
	char err[512];
	struct rep rp;
	struct w w;

	w_init(&w, "hello", 0);
	CHECK(run_rep(srv, &w, &rp, err, sizeof(err)), "hello: %s", err);
	CHECK(uget(rp.root, "conn_table_size") == conn_table_size, "hello's conn_table_size");
	rep_free(&rp);

	w_init(&w, "stats", 0);
	CHECK(run_rep(srv, &w, &rp, err, sizeof(err)), "stats: %s", err);
	cs = mget(rp.root, "conns");
	CHECK(cs && cs->type == MSGPACK_OBJECT_MAP && cs->via.map.size == 5 &&
	      key_is(cs, 0, "capacity") && key_is(cs, 1, "entries") && key_is(cs, 2, "by_state") &&
	      key_is(cs, 3, "snat_ports_in_use") && key_is(cs, 4, "expired"),
	      "stats' conns has the wrong keys");
	CHECK(uget(cs, "capacity") == 4096 && uget(cs, "entries") == 10 &&
	      uget(cs, "snat_ports_in_use") == 3 && uget(cs, "expired") == 1ull << 40,
	      "stats' conns values");
	bs = mget(cs, "by_state");
	CHECK(bs && bs->type == MSGPACK_OBJECT_MAP && bs->via.map.size == LB_CONN_STATES,
	      "by_state: not every state");
	for (uint32_t s = 0; bs && bs->type == MSGPACK_OBJECT_MAP && s < bs->via.map.size &&
	     s < LB_CONN_STATES; s++)
		CHECK(key_is(bs, s, state_names[s]) && uget(bs, state_names[s]) == s + 1,
		      "by_state[%u]", s);
	rep_free(&rp);

	/* The table cannot be read: stats still answers, "conns" is empty. */
	dp.conns_fail = 1;
	w_init(&w, "stats", 0);
	CHECK(run_rep(srv, &w, &rp, err, sizeof(err)), "stats: %s", err);
	cs = mget(rp.root, "conns");
	CHECK(cs && cs->type == MSGPACK_OBJECT_MAP && cs->via.map.size == 0,
	      "failed read_conns: conns is not an empty map");
	CHECK(mget(rp.root, "counters") != NULL, "failed read_conns: no counters");
	rep_free(&rp);
	dp.conns_fail = 0;
}

/* A state to adopt: VIP 7, 10.0.0.7:80/tcp, NAT with SNAT, a pool of one. */
static struct lb_proto_state *restore_state(void)
{
	static __u32 ring[RS];
	struct lb_proto_state *st = calloc(1, sizeof(*st));
	const __u8 pool[4] = { 198, 51, 100, 9 };

	if (!st)
		abort();
	for (int s = 0; s < RS; s++)
		ring[s] = s % 3 ? LB_NO_BACKEND : (__u32)s % 16;
	st->config = base_cfg;
	for (int i = 0; i < LB_MAX_BACKENDS; i++)
		st->backends[i].state = LB_BACKEND_UNUSED;
	lb_proto_nat_defaults(&st->nat);
	memcpy(&st->nat.snat_addrs[0], pool, 4);
	st->nat.snat_naddrs = 1;
	st->vips[7].used = true;
	st->vips[7].mode = LB_MODE_NAT;
	st->vips[7].nat_flags = LB_VIP_F_SNAT;
	st->vips[7].key.addr.v4 = htonl(0x0a000007);
	st->vips[7].key.port = htons(80);
	st->vips[7].key.proto = 6;
	st->vips[7].key.family = LB_FAMILY_V4;
	st->rings[7] = ring;
	return st;
}

/* One bad state: refused with needle, the server as it was. */
static void restore_bad(struct lb_proto_server *srv, const struct lb_proto_state *bad,
			const char *needle, int i)
{
	const struct lb_proto_state *cur = lb_proto_server_state(srv);
	struct lb_nat_config nat = cur->nat;
	char why[256] = "";

	CHECK(lb_proto_server_restore(srv, bad, why, sizeof(why)) == -EINVAL,
	      "restore case %d accepted", i);
	CHECK(strstr(why, needle), "restore case %d: '%s' lacks '%s'", i, why, needle);
	CHECK(!cur->vips[7].used && !memcmp(&nat, &cur->nat, sizeof(nat)),
	      "restore case %d changed the server", i);
}

/* One mutation of the good state, refused with needle: the restore cases'
 * table rows. Uses the calling case's srv, good, bad and n. */
#define BAD_CASE(mutation, needle)                                 \
	do {                                                       \
		memcpy(bad, good, sizeof(*bad));                   \
		mutation;                                          \
		restore_bad(srv, bad, needle, n++);                \
	} while (0)

static void test_nat_restore(void)
{
	struct lb_proto_info info = { .dataplane = "test", .attach_mode = "none", .nports = 1,
				      .conn_table_size = 4096 };
	struct lb_proto_server *srv = server_new(&ops, &info);
	struct lb_proto_state *good = restore_state(), *bad = restore_state();
	const struct lb_proto_state *cur;
	char why[256] = "", err[512];
	struct w w;
	int n = 0;

	cur = lb_proto_server_state(srv);
	BAD_CASE(bad->nat.snat_naddrs = 0; bad->nat.snat_addrs[0] = 0,
		 "VIP 7: nat_flags 0x1 with mode 1 and 0 SNAT addresses");
	BAD_CASE(bad->nat.snat_port_min = 0,
		 "NAT configuration: field 'snat_port_min' out of range: 0");
	BAD_CASE(bad->nat.snat_port_max = 0, "field 'snat_port_max' out of range: 0");
	BAD_CASE(bad->nat.snat_port_min = 3000; bad->nat.snat_port_max = 2999,
		 "field 'snat_port_min': 3000 is above snat_port_max 2999");
	BAD_CASE(bad->nat.snat_addrs[1] = bad->nat.snat_addrs[0]; bad->nat.snat_naddrs = 2,
		 "field 'snat_addrs[1]': 198.51.100.9 appears twice");
	BAD_CASE(bad->nat.snat_addrs[0] = htonl(0x7f000001),
		 "field 'snat_addrs[0]': 127.0.0.1 is not a unicast address");
	BAD_CASE(bad->nat.snat_addrs[5] = htonl(0x0a000001),
		 "field 'snat_addrs': entry 5 past the 1 addresses is 10.0.0.1, not 0");
	BAD_CASE(bad->nat.snat_naddrs = LB_MAX_SNAT_ADDRS + 1,
		 "field 'snat_addrs' has 17 IPv4 entries, at most 16 of each family allowed");
	BAD_CASE(bad->nat.on_backend_down = 2, "field 'on_backend_down' out of range: 2");
	BAD_CASE(bad->nat.pad[1] = 1, "pad is not 0");
	BAD_CASE(bad->nat.timeouts_s[LB_CONN_TIME_WAIT] = 0,
		 "field 'timeouts.time_wait' out of range: 0 (allowed 1..2147483647)");
	BAD_CASE(bad->nat.timeouts_s[LB_CONN_UDP_REPLIED] = 0x80000000u,
		 "field 'timeouts.udp_replied' out of range: 2147483648");
	BAD_CASE(memset(&bad->nat, 0, sizeof(bad->nat)), "NAT configuration: field 'snat_port_min'");
	BAD_CASE(bad->vips[7].nat_flags = 0x2, "VIP 7: nat_flags 0x2");
	BAD_CASE(bad->vips[7].nat_flags = 0x3, "VIP 7: nat_flags 0x3");
	BAD_CASE(bad->vips[7].mode = LB_MODE_DSR, "VIP 7: nat_flags 0x1 with mode 0");
	BAD_CASE(bad->vips[7].mode = LB_MODE_TUNNEL, "VIP 7: mode 2");
	BAD_CASE(bad->vips[7].key.family = LB_FAMILY_V6; bad->vips[7].key.addr.v6[15] = 7,
		 "VIP 7: mode 1 (family 6) not served");
	CHECK(lb_proto_server_restore(srv, good, why, sizeof(why)) == 0, "restore: %s", why);
	CHECK(cur->vips[7].used && cur->vips[7].mode == LB_MODE_NAT &&
	      cur->vips[7].nat_flags == LB_VIP_F_SNAT &&
	      !memcmp(&cur->nat, &good->nat, sizeof(good->nat)), "restore: not adopted");
	/* Adopted means validated against from now on: the SNAT rule holds. */
	w_init(&w, "set_nat", 0);
	CHECK(!run(srv, &w, err, sizeof(err)) && strstr(err, "VIP 7 uses SNAT"), "error: %s", err);
	lb_proto_server_free(srv);

	/* Without NAT mode: NAT VIPs and flags refused, st->nat ignored. */
	srv = server_new(&ops_nonat, &info);
	cur = lb_proto_server_state(srv);
	CHECK(lb_proto_server_restore(srv, good, why, sizeof(why)) == -EINVAL &&
	      strstr(why, "VIP 7: mode 1 (family 4) not served"), "non-NAT restore: %s", why);
	memcpy(bad, good, sizeof(*bad));
	bad->vips[7].mode = LB_MODE_DSR;
	CHECK(lb_proto_server_restore(srv, bad, why, sizeof(why)) == -EINVAL &&
	      strstr(why, "VIP 7: nat_flags 0x1 with mode 0 and 0 SNAT addresses"),
	      "non-NAT restore: %s", why);
	bad->vips[7].nat_flags = 0;
	memset(&bad->nat, 0xff, sizeof(bad->nat));
	CHECK(lb_proto_server_restore(srv, bad, why, sizeof(why)) == 0, "non-NAT restore: %s", why);
	{
		struct lb_nat_config dflt;

		lb_proto_nat_defaults(&dflt);
		CHECK(cur->vips[7].used && !memcmp(&cur->nat, &dflt, sizeof(dflt)),
		      "non-NAT restore took st->nat");
	}
	lb_proto_server_free(srv);
	free(good);
	free(bad);
}

/* A data plane without the NAT hooks: no NAT, whatever its info says. */
static void test_no_nat(void)
{
	struct lb_proto_info info = { .dataplane = "test", .attach_mode = "none", .nports = 1,
				      .conn_table_size = 4096 };
	struct lb_proto_server *srv;
	const msgpack_object *nat, *vips;
	__u8 a4[4] = { 10, 0, 0, 60 }, a6[16];
	char err[512];
	struct rep rp;
	struct w w;

	dp_reset();
	srv = server_new(&ops_nonat, &info);
	vip_addr(a6, 16, 60);
	w_init(&w, "hello", 0);
	CHECK(run_rep(srv, &w, &rp, err, sizeof(err)), "hello: %s", err);
	CHECK(uget(rp.root, "conn_table_size") == 0, "non-NAT hello's conn_table_size is not 0");
	rep_free(&rp);

	w_init(&w, "set_nat", 0);
	expect_reject(srv, &w, "op 'set_nat' not supported: this data plane has no NAT mode",
		      "non-NAT set_nat");
	bad_nat(&w, 11);
	expect_reject(srv, &w, "op 'set_nat' not supported", "non-NAT bad set_nat");
	w_set_vip(&w, 0, 60, a4, 4, LB_MODE_NAT);
	expect_reject(srv, &w, "mode not supported by this data plane: field 'mode' is 1, only 0 "
		      "(dsr) is implemented", "non-NAT NAT VIP");
	w_set_vip(&w, 0, 60, a6, 16, LB_MODE_NAT);
	expect_reject(srv, &w, "mode not supported by this data plane", "non-NAT IPv6 NAT VIP");
	w_set_vip(&w, 1, 60, a4, 4, LB_MODE_NAT);
	w_bool(&w, "snat", true);
	expect_reject(srv, &w, "mode not supported by this data plane", "non-NAT SNAT VIP");
	w_set_vip(&w, 1, 60, a4, 4, LB_MODE_DSR);
	w_bool(&w, "snat", true);
	expect_reject(srv, &w, "field 'snat': only a NAT VIP", "non-NAT snat on DSR");
	w_set_vip(&w, 1, 60, a4, 4, LB_MODE_DSR);
	w_bool(&w, "snat", false);
	CHECK(run(srv, &w, err, sizeof(err)), "non-NAT set_vip: %s", err);

	w_init(&w, "dump", 0);
	CHECK(run_rep(srv, &w, &rp, err, sizeof(err)), "dump: %s", err);
	nat = mget(rp.root, "nat");
	vips = mget(rp.root, "vips");
	CHECK(nat && mget(nat, "snat_addrs") && mget(nat, "snat_addrs")->via.array.size == 0 &&
	      uget(nat, "snat_port_min") == 1024 && uget(nat, "snat_port_max") == 65535 &&
	      uget(nat, "on_backend_down") == 0 &&
	      uget(mget(nat, "timeouts"), "established") == 432000, "non-NAT dump's nat");
	CHECK(vips && vips->via.array.size == 1 && mget(&vips->via.array.ptr[0], "snat") &&
	      mget(&vips->via.array.ptr[0], "snat")->type == MSGPACK_OBJECT_BOOLEAN &&
	      !mget(&vips->via.array.ptr[0], "snat")->via.boolean, "non-NAT dump's VIP snat");
	rep_free(&rp);
	w_init(&w, "stats", 0);
	CHECK(run_rep(srv, &w, &rp, err, sizeof(err)), "stats: %s", err);
	CHECK(!mget(rp.root, "conns") && mget(rp.root, "counters"), "non-NAT stats has conns");
	rep_free(&rp);
	check_mirror(srv, "non-NAT");
	lb_proto_server_free(srv);
}

/* ---- tunnel mode --------------------------------------------------------- */

/* A tunnel set_vip into w: VIP id at addr (alen bytes), mode m, and the
 * optional fields given (encap/gue/bits < 0: left out; src_len 0: no
 * tunnel_src; nat_port < 0: left out). */
static void req_tunnel_vip(struct w *w, __u32 id, const __u8 *addr, size_t alen, uint64_t m,
			   const __u8 *src, size_t src_len, int encap, int gue, int bits,
			   int nat_port)
{
	w_set_vip(w, (src_len ? 1 : 0) + (encap >= 0) + (gue >= 0) + (bits >= 0) + (nat_port >= 0),
		  id, addr, alen, m);
	if (src_len)
		w_bin(w, "tunnel_src", src, src_len);
	if (encap >= 0)
		w_uint(w, "tunnel_encap", (uint64_t)encap);
	if (gue >= 0)
		w_uint(w, "gue_port", (uint64_t)gue);
	if (bits >= 0)
		w_uint(w, "tunnel_src_bits", (uint64_t)bits);
	if (nat_port >= 0)
		w_uint(w, "nat_port", (uint64_t)nat_port);
}

/* Every VIP of a dump sent back as set_vip: nothing changes. */
static void dump_vips_round_trip(struct lb_proto_server *srv, const char *what)
{
	const struct lb_proto_state *st = lb_proto_server_state(srv);
	const msgpack_object *vips;
	char err[512];
	struct rep rp;
	struct w w;

	w_init(&w, "dump", 0);
	CHECK(run_rep(srv, &w, &rp, err, sizeof(err)), "%s: dump: %s", what, err);
	vips = mget(rp.root, "vips");
	CHECK(vips && vips->type == MSGPACK_OBJECT_ARRAY, "%s: dump has no vips", what);
	for (uint32_t i = 0; vips && vips->type == MSGPACK_OBJECT_ARRAY && i < vips->via.array.size;
	     i++) {
		const msgpack_object *v = &vips->via.array.ptr[i];
		__u32 id = (__u32)(uget(v, "vip_id") % LB_MAX_VIPS);
		struct lb_proto_vip old = st->vips[id];

		w_init(&w, "set_vip", (int)v->via.map.size);
		for (uint32_t k = 0; k < v->via.map.size; k++) {
			msgpack_pack_object(&w.pk, v->via.map.ptr[k].key);
			msgpack_pack_object(&w.pk, v->via.map.ptr[k].val);
		}
		CHECK(run(srv, &w, err, sizeof(err)), "%s: set_vip %u from dump: %s", what, id, err);
		CHECK(!memcmp(&old, &st->vips[id], sizeof(old)), "%s: dump -> set_vip changed VIP %u",
		      what, id);
	}
	rep_free(&rp);
	check_mirror(srv, what);
}

static void del_vip(struct lb_proto_server *srv, const __u8 *addr, size_t alen)
{
	char err[512];
	struct w w;

	w_init(&w, "del_vip", 3);
	w_bin(&w, "addr", addr, alen);
	w_uint(&w, "port", 80);
	w_uint(&w, "proto", 6);
	CHECK(run(srv, &w, err, sizeof(err)), "del_vip: %s", err);
}

/* set_vip's tunnel fields on a data plane with tunnel mode: each field's own
 * checks, the mode rules in PROTOCOL.md's order, what is stored, dump. */
static void test_tunnel(struct lb_proto_server *srv)
{
	const struct lb_proto_state *st = lb_proto_server_state(srv);
	__u8 a4[4] = { 10, 0, 0, 50 }, a6[16], b4[4] = { 10, 0, 0, 51 }, b6[16];
	__u8 src4[4] = { 192, 0, 2, 1 }, src6[16];
	const msgpack_object *vips;
	char err[512];
	struct rep rp;
	struct w w;
	int seen = 0;

	vip_addr(a6, 16, 50);
	vip_addr(b6, 16, 51);
	vip_addr(src6, 16, 0xaa);

	/* Each field's own type and range, before any mode rule. */
	req_tunnel_vip(&w, 50, a4, 4, LB_MODE_DSR, NULL, 0, 2, -1, -1, -1);
	expect_reject(srv, &w, "field 'tunnel_encap' out of range: 2 (allowed 0..1)", "encap 2");
	w_set_vip(&w, 1, 50, a4, 4, LB_MODE_TUNNEL);
	w_key(&w, "tunnel_encap");
	w_str(&w, "gue");
	expect_reject(srv, &w, "field 'tunnel_encap' must be an unsigned integer, got str",
		      "encap str");
	req_tunnel_vip(&w, 50, a4, 4, LB_MODE_TUNNEL, src4, 4, 1, 0, -1, -1);
	expect_reject(srv, &w, "field 'gue_port' out of range: 0 (allowed 1..65535)", "gue_port 0");
	req_tunnel_vip(&w, 50, a4, 4, LB_MODE_TUNNEL, src4, 4, 1, 65536, -1, -1);
	expect_reject(srv, &w, "field 'gue_port' out of range: 65536", "gue_port 65536");
	req_tunnel_vip(&w, 50, a4, 4, LB_MODE_TUNNEL, src4, 4, 0, -1, 17, -1);
	expect_reject(srv, &w, "field 'tunnel_src_bits' out of range: 17 (allowed 0..16)", "bits 17");
	/* A field's error beats a mode rule (here: no tunnel_src). */
	req_tunnel_vip(&w, 50, a4, 4, LB_MODE_TUNNEL, NULL, 0, -1, -1, 99, -1);
	expect_reject(srv, &w, "field 'tunnel_src_bits' out of range", "bits before rules");

	/* The rules, in order. */
	req_tunnel_vip(&w, 50, a4, 4, LB_MODE_DSR, NULL, 0, 0, -1, -1, -1);
	expect_reject(srv, &w, "field 'tunnel_encap': only a tunnel VIP (mode 2) takes it, field "
		      "'mode' is 0", "encap on DSR");
	req_tunnel_vip(&w, 50, a4, 4, LB_MODE_NAT, NULL, 0, -1, 6080, -1, -1);
	expect_reject(srv, &w, "field 'gue_port': only a tunnel VIP (mode 2) takes it, field "
		      "'mode' is 1", "gue_port on NAT");
	req_tunnel_vip(&w, 50, a4, 4, LB_MODE_DSR, src4, 4, -1, -1, 0, -1);
	expect_reject(srv, &w, "field 'tunnel_src_bits': only a tunnel VIP (mode 2) takes it",
		      "bits on DSR");
	/* The IPv6 NAT rule comes first. */
	req_tunnel_vip(&w, 50, a6, 16, LB_MODE_NAT, NULL, 0, 0, -1, -1, -1);
	expect_reject(srv, &w, "field 'mode': NAT mode (1) is IPv4 only", "IPv6 NAT with encap");
	req_tunnel_vip(&w, 50, a6, 16, LB_MODE_TUNNEL, NULL, 0, -1, 6080, -1, -1);
	expect_reject(srv, &w, "field 'gue_port': only GUE (tunnel_encap 1) has a UDP port, "
		      "tunnel_encap is 0 (ipip)", "gue_port with IPIP (default)");
	req_tunnel_vip(&w, 50, a4, 4, LB_MODE_TUNNEL, src4, 4, 0, 6080, -1, -1);
	expect_reject(srv, &w, "field 'gue_port': only GUE (tunnel_encap 1)", "gue_port with IPIP");
	req_tunnel_vip(&w, 50, a6, 16, LB_MODE_TUNNEL, NULL, 0, 1, -1, 4, -1);
	expect_reject(srv, &w, "field 'tunnel_src': tunnel mode (2) needs an outer source address",
		      "no tunnel_src");
	req_tunnel_vip(&w, 50, a6, 16, LB_MODE_TUNNEL, src4, 4, 1, -1, -1, 8080);
	expect_reject(srv, &w, "field 'tunnel_src': an IPv6 VIP is tunnelled in IPv6 only (IPv6 "
		      "inside IPv4 is not carried), 'tunnel_src' is IPv4", "6 in 4");
	req_tunnel_vip(&w, 50, a4, 4, LB_MODE_TUNNEL, src4, 4, -1, -1, -1, 8080);
	expect_reject(srv, &w, "field 'nat_port': only a NAT VIP (mode 1) takes a backend port, "
		      "field 'mode' is 2", "nat_port on tunnel");
	req_tunnel_vip(&w, 50, a4, 4, LB_MODE_TUNNEL, src4, 4, -1, -1, -1, -1);
	w.sb.data[0]++; /* fixmap header: one more field, snat, follows */
	w_bool(&w, "snat", true);
	expect_reject(srv, &w, "field 'snat': only a NAT VIP (mode 1) takes SNAT, field 'mode' is 2",
		      "snat on tunnel");
	CHECK(!st->vips[50].used, "a refused tunnel VIP was stored");

	/* Accepted: IPIP over IPv4, the defaults (nat_port 0 given is fine). */
	req_tunnel_vip(&w, 50, a4, 4, LB_MODE_TUNNEL, src4, 4, -1, -1, -1, 0);
	CHECK(run(srv, &w, err, sizeof(err)), "IPIP tunnel VIP: %s", err);
	CHECK(st->vips[50].used && st->vips[50].mode == LB_MODE_TUNNEL &&
	      st->vips[50].tunnel_encap == LB_ENCAP_IPIP && st->vips[50].gue_port == 0 &&
	      st->vips[50].tunnel_src_bits == 0 && st->vips[50].tunnel_family == LB_FAMILY_V4 &&
	      st->vips[50].tunnel_src.v4 == htonl(0xc0000201) &&
	      dp.entries[50].mode == LB_MODE_TUNNEL, "IPIP tunnel VIP not stored");
	check_mirror(srv, "IPIP tunnel VIP");
	/* Rewritten as GUE over IPv6 (inner IPv4): the default port. */
	req_tunnel_vip(&w, 50, a4, 4, LB_MODE_TUNNEL, src6, 16, 1, -1, 8, -1);
	CHECK(run(srv, &w, err, sizeof(err)), "GUE 4in6 tunnel VIP: %s", err);
	CHECK(st->vips[50].tunnel_encap == LB_ENCAP_GUE &&
	      st->vips[50].gue_port == htons(LB_GUE_PORT_DEFAULT) &&
	      dp.entries[50].gue_port == htons(LB_GUE_PORT_DEFAULT) &&
	      st->vips[50].tunnel_src_bits == 8 && dp.entries[50].tunnel_src_bits == 8 &&
	      st->vips[50].tunnel_family == LB_FAMILY_V6, "GUE tunnel VIP not stored");
	/* An IPv6 VIP, GUE on a given port, every flow bit; with its ring. */
	req_tunnel_vip(&w, 51, b6, 16, LB_MODE_TUNNEL, src6, 16, 1, 5555,
		       LB_TUNNEL_SRC_BITS_MAX, -1);
	CHECK(run(srv, &w, err, sizeof(err)), "IPv6 GUE tunnel VIP: %s", err);
	CHECK(st->vips[51].gue_port == htons(5555) &&
	      st->vips[51].tunnel_src_bits == LB_TUNNEL_SRC_BITS_MAX &&
	      dp.entries[51].tunnel_encap == LB_ENCAP_GUE, "IPv6 GUE tunnel VIP not stored");
	/* An IPv4 VIP of another id, IPIP, explicitly. */
	req_tunnel_vip(&w, 52, b4, 4, LB_MODE_TUNNEL, src4, 4, 0, -1, 3, -1);
	CHECK(run(srv, &w, err, sizeof(err)), "IPIP tunnel VIP 52: %s", err);
	check_mirror(srv, "tunnel VIPs");

	/* dump: the tunnel fields with tunnel VIPs only, gue_port with GUE only. */
	w_init(&w, "dump", 0);
	CHECK(run_rep(srv, &w, &rp, err, sizeof(err)), "dump: %s", err);
	vips = mget(rp.root, "vips");
	for (uint32_t i = 0; vips && vips->type == MSGPACK_OBJECT_ARRAY && i < vips->via.array.size;
	     i++) {
		const msgpack_object *v = &vips->via.array.ptr[i];
		uint64_t id = uget(v, "vip_id");
		bool tunnel = id < LB_MAX_VIPS && st->vips[id].mode == LB_MODE_TUNNEL;

		CHECK(!mget(v, "tunnel_encap") == !tunnel && !mget(v, "tunnel_src_bits") == !tunnel,
		      "dump's VIP %llu: tunnel fields %s", (unsigned long long)id,
		      tunnel ? "missing" : "on a non-tunnel VIP");
		CHECK(!mget(v, "gue_port") ==
		      !(tunnel && st->vips[id].tunnel_encap == LB_ENCAP_GUE),
		      "dump's VIP %llu: gue_port", (unsigned long long)id);
		if (id == 50) {
			CHECK(uget(v, "tunnel_encap") == 1 && uget(v, "gue_port") == 6080 &&
			      uget(v, "tunnel_src_bits") == 8 && mget(v, "tunnel_src") &&
			      mget(v, "tunnel_src")->via.bin.size == 16, "dump's VIP 50");
			seen++;
		}
		if (id == 51) {
			CHECK(uget(v, "gue_port") == 5555 && uget(v, "tunnel_src_bits") == 16,
			      "dump's VIP 51");
			seen++;
		}
		if (id == 52) {
			CHECK(uget(v, "tunnel_encap") == 0 && uget(v, "tunnel_src_bits") == 3,
			      "dump's VIP 52");
			seen++;
		}
	}
	CHECK(seen == 3, "dump showed %d of the 3 tunnel VIPs", seen);
	rep_free(&rp);
	dump_vips_round_trip(srv, "tunnel dump round trip");

	/* Back to DSR: the tunnel fields go, tunnel_src stays as given. */
	req_tunnel_vip(&w, 50, a4, 4, LB_MODE_DSR, src4, 4, -1, -1, -1, -1);
	CHECK(run(srv, &w, err, sizeof(err)), "tunnel VIP back to DSR: %s", err);
	CHECK(st->vips[50].mode == LB_MODE_DSR && !st->vips[50].tunnel_encap &&
	      !st->vips[50].gue_port && !st->vips[50].tunnel_src_bits &&
	      st->vips[50].tunnel_family == LB_FAMILY_V4, "DSR again: tunnel fields kept");
	check_mirror(srv, "tunnel VIP back to DSR");
	del_vip(srv, a4, 4);
	del_vip(srv, b6, 16);
	del_vip(srv, b4, 4);
	check_mirror(srv, "tunnel VIPs deleted");
}

/* lb_proto_vip_entry and lb_proto_vip_from_entry: every field both ways. */
static void test_vip_entry_conversion(void)
{
	struct lb_proto_vip v, back;
	struct lb_vip_entry e;

	memset(&v, 0, sizeof(v));
	v.used = true;
	v.mode = LB_MODE_TUNNEL;
	v.tunnel_family = LB_FAMILY_V6;
	v.nat_port = htons(1);
	v.nat_flags = LB_VIP_F_SNAT;
	memset(&v.tunnel_src, 0x5a, sizeof(v.tunnel_src));
	v.tunnel_encap = LB_ENCAP_GUE;
	v.tunnel_src_bits = 12;
	v.gue_port = htons(7777);
	memset(&e, 0xff, sizeof(e));
	lb_proto_vip_entry(&v, 9, &e);
	CHECK(e.vip_id == 9 && e.mode == LB_MODE_TUNNEL && e.tunnel_family == LB_FAMILY_V6 &&
	      e.nat_port == htons(1) && e.nat_flags == LB_VIP_F_SNAT &&
	      e.tunnel_src.v6[7] == 0x5a && e.tunnel_encap == LB_ENCAP_GUE &&
	      e.gue_port == htons(7777) && e.tunnel_src_bits == 12 && !e.pad[0] && !e.pad[1] &&
	      !e.pad[2], "lb_proto_vip_entry");
	memcpy(&back, &v, sizeof(back));
	memset((char *)&back + offsetof(struct lb_proto_vip, mode), 0,
	       offsetof(struct lb_proto_vip, key) - offsetof(struct lb_proto_vip, mode));
	memset(&back.tunnel_src, 0, sizeof(back) - offsetof(struct lb_proto_vip, tunnel_src));
	lb_proto_vip_from_entry(&e, &back);
	CHECK(!memcmp(&back, &v, sizeof(v)), "lb_proto_vip_from_entry");
}

/* Adopting tunnel VIPs (pinned XDP maps): the rules set_vip enforces. */
static void test_tunnel_restore(void)
{
	static const char *const caps[] = { "dsr", "tunnel", NULL };
	struct lb_proto_info info = { .dataplane = "test", .attach_mode = "none", .nports = 1,
				      .conn_table_size = 4096, .capabilities = caps,
				      .tunnel = true };
	struct lb_proto_server *srv = server_new(&ops, &info);
	struct lb_proto_state *good = restore_state(), *bad = restore_state();
	const struct lb_proto_state *cur;
	char why[256] = "";
	int n = 100;

	cur = lb_proto_server_state(srv);
	/* VIP 7 becomes a GUE tunnel VIP over IPv4. */
	good->vips[7].mode = LB_MODE_TUNNEL;
	good->vips[7].nat_flags = 0;
	good->vips[7].tunnel_family = LB_FAMILY_V4;
	good->vips[7].tunnel_src.v4 = htonl(0xc0000201);
	good->vips[7].tunnel_encap = LB_ENCAP_GUE;
	good->vips[7].gue_port = htons(6080);
	good->vips[7].tunnel_src_bits = 4;
	BAD_CASE(bad->vips[7].gue_port = 0, "VIP 7: mode 2 with tunnel_src family 4, "
		 "tunnel_encap 1, gue_port 0");
	BAD_CASE(bad->vips[7].tunnel_encap = LB_ENCAP_IPIP, "tunnel_encap 0, gue_port 6080");
	BAD_CASE(bad->vips[7].tunnel_encap = 2, "tunnel_encap 2");
	BAD_CASE(bad->vips[7].tunnel_src_bits = 17, "tunnel_src_bits 17");
	BAD_CASE(bad->vips[7].tunnel_family = 0; bad->vips[7].tunnel_src.v4 = 0,
		 "tunnel_src family 0");
	BAD_CASE(bad->vips[7].nat_port = htons(80), "nat_port 80");
	BAD_CASE(bad->vips[7].key.family = LB_FAMILY_V6; bad->vips[7].key.addr.v6[15] = 7,
		 "VIP 7: mode 2 with tunnel_src family 4");
	BAD_CASE(bad->vips[7].mode = LB_MODE_DSR, "VIP 7: mode 0 with tunnel_src family 4, "
		 "tunnel_encap 1");
	BAD_CASE(bad->vips[7].mode = LB_MODE_DSR; bad->vips[7].tunnel_encap = 0;
		 bad->vips[7].gue_port = 0, "VIP 7: mode 0 with tunnel_src family 4, "
		 "tunnel_encap 0, gue_port 0, tunnel_src_bits 4");
	CHECK(lb_proto_server_restore(srv, good, why, sizeof(why)) == 0, "tunnel restore: %s", why);
	CHECK(cur->vips[7].used && !memcmp(&cur->vips[7], &good->vips[7], sizeof(good->vips[7])),
	      "tunnel restore: not adopted");
	lb_proto_server_free(srv);

	/* A plane without tunnel mode refuses to adopt a tunnel VIP. */
	info.tunnel = false;
	srv = server_new(&ops, &info);
	CHECK(lb_proto_server_restore(srv, good, why, sizeof(why)) == -EINVAL &&
	      strstr(why, "VIP 7: mode 2 (family 4) not served"), "non-tunnel restore: %s", why);
	lb_proto_server_free(srv);
	free(good);
	free(bad);
}

/* The "mode not supported" error names what the plane serves; hello carries
 * the capabilities the data plane passes. */
static void test_no_tunnel(void)
{
	static const char *const caps[] = { "dsr", "tunnel", NULL };
	struct lb_proto_info info = { .dataplane = "test", .attach_mode = "none", .nports = 1,
				      .conn_table_size = 4096 };
	__u8 a4[4] = { 10, 0, 0, 50 }, src4[4] = { 192, 0, 2, 1 };
	const msgpack_object *cap;
	struct lb_proto_server *srv;
	char err[512];
	struct rep rp;
	struct w w;

	/* NAT, no tunnel. */
	dp_reset();
	srv = server_new(&ops, &info);
	req_tunnel_vip(&w, 50, a4, 4, LB_MODE_TUNNEL, src4, 4, 1, -1, 4, -1);
	expect_reject(srv, &w, "mode not supported by this data plane: field 'mode' is 2, only 0 "
		      "(dsr) and 1 (nat) are implemented", "no-tunnel tunnel VIP");
	/* The field checks still come first. */
	req_tunnel_vip(&w, 50, a4, 4, LB_MODE_TUNNEL, src4, 4, 3, -1, -1, -1);
	expect_reject(srv, &w, "field 'tunnel_encap' out of range", "no-tunnel bad encap");
	lb_proto_server_free(srv);

	/* Neither. */
	dp_reset();
	srv = server_new(&ops_nonat, &info);
	req_tunnel_vip(&w, 50, a4, 4, LB_MODE_TUNNEL, src4, 4, -1, -1, -1, -1);
	expect_reject(srv, &w, "mode not supported by this data plane: field 'mode' is 2, only 0 "
		      "(dsr) is implemented", "bare tunnel VIP");
	lb_proto_server_free(srv);

	/* Tunnel, no NAT. */
	dp_reset();
	info.tunnel = true;
	info.capabilities = caps;
	srv = server_new(&ops_nonat, &info);
	w_set_vip(&w, 0, 50, a4, 4, LB_MODE_NAT);
	expect_reject(srv, &w, "mode not supported by this data plane: field 'mode' is 1, only 0 "
		      "(dsr) and 2 (tunnel) are implemented", "tunnel-only NAT VIP");
	req_tunnel_vip(&w, 50, a4, 4, LB_MODE_TUNNEL, src4, 4, -1, -1, -1, -1);
	CHECK(run(srv, &w, err, sizeof(err)), "tunnel-only tunnel VIP: %s", err);
	check_mirror(srv, "tunnel-only");
	w_init(&w, "hello", 0);
	CHECK(run_rep(srv, &w, &rp, err, sizeof(err)), "hello: %s", err);
	cap = mget(rp.root, "capabilities");
	CHECK(cap && cap->type == MSGPACK_OBJECT_ARRAY && cap->via.array.size == 2 &&
	      cap->via.array.ptr[1].type == MSGPACK_OBJECT_STR &&
	      cap->via.array.ptr[1].via.str.size == 6 &&
	      !memcmp(cap->via.array.ptr[1].via.str.ptr, "tunnel", 6), "hello's capabilities");
	rep_free(&rp);
	lb_proto_server_free(srv);
}

#include "proto_selftest_nat6.c"

int main(void)
{
	static const char *const caps[] = { "dsr", "nat", "tunnel", NULL };
	struct lb_proto_info info = { .dataplane = "test", .attach_mode = "none", .nports = 1,
				      .conn_table_size = 4096, .capabilities = caps,
				      .tunnel = true };
	struct lb_config cfg = base_cfg;
	struct lb_proto_server *srv;
	char err[512];
	struct w w;
	unsigned seed = 12345;

	dp_reset();
	srv = lb_proto_server_new(&ops, NULL, &info, &cfg);
	if (!srv)
		return 2;

	/* A base configuration. */
	req_vip(&w, 3, 3, 80);
	CHECK(run(srv, &w, err, sizeof(err)), "set_vip: %s", err);
	req_vip(&w, 5, 5, 53);
	CHECK(run(srv, &w, err, sizeof(err)), "set_vip: %s", err);
	req_backends(&w, 0, 16, 0);
	CHECK(run(srv, &w, err, sizeof(err)), "set_backends: %s", err);
	req_ring(&w, 3, 1);
	CHECK(run(srv, &w, err, sizeof(err)), "set_ring: %s", err);
	req_patch(&w, 3, 64, 7);
	CHECK(run(srv, &w, err, sizeof(err)), "patch_ring: %s", err);
	check_mirror(srv, "base configuration");

	test_failures(srv);
	test_backend_macs(srv);
	test_families(srv);
	test_nat_config(srv);
	test_snat_rule(srv);
	test_nat_dump(srv); /* leaves a pool, SNAT VIP 62 and NAT VIP 63 for the fuzz */
	test_nat_stats_hello(srv, info.conn_table_size);
	test_tunnel(srv);

	/* The fuzz runs with NAT mode for IPv6 (IPv6 pools and NAT VIPs). */
	info.nat6 = true;
	CHECK(lb_proto_server_set_info(srv, &info) == 0, "set_info nat6");
	mirror_nat6 = true;

	/* Fuzz: random requests built from valid pieces, some mangled, plus
	 * plain random bytes. After each, the mirror must still agree. */
	for (int it = 0; it < 20000; it++) {
		int kind = rand_r(&seed) % 10;

		switch (kind) {
		case 0:
			req_vip_af(&w, rand_r(&seed) % 70, rand_r(&seed) % 8, rand_r(&seed) % 3 + 79,
				   rand_r(&seed) % 3 ? 4 : 16);
			break;
		case 1:
			req_backends_af(&w, rand_r(&seed) % 20, rand_r(&seed) % 6, rand_r(&seed) % 5,
					rand_r(&seed) % 3 ? 4 : 16);
			break;
		case 2: req_ring(&w, rand_r(&seed) % 8, rand_r(&seed)); break;
		case 3: req_patch(&w, rand_r(&seed) % 8, rand_r(&seed) % 5, rand_r(&seed)); break;
		case 4: {
			size_t alen = rand_r(&seed) % 3 ? 4 : 16;
			__u8 addr[16];

			vip_addr(addr, alen, (__u8)(rand_r(&seed) % 8));
			w_init(&w, "del_vip", 3);
			w_bin(&w, "addr", addr, alen);
			w_uint(&w, "port", rand_r(&seed) % 3 + 79);
			w_uint(&w, "proto", 6);
			break;
		}
		case 5:
			w_init(&w, "set_backend_state", 2);
			w_uint(&w, "id", rand_r(&seed) % 24);
			w_uint(&w, "state", rand_r(&seed) % 5);
			break;
		case 6:
			w_init(&w, rand_r(&seed) % 2 ? "dump" : "stats", 0);
			break;
		case 7: { /* a pool of 0..4 from 7 addresses of both families, two not unicast */
			static const __u8 pool[4][4] = { { 198, 51, 100, 1 }, { 198, 51, 100, 2 },
							 { 203, 0, 113, 5 }, { 127, 0, 0, 1 } };
			static const __u8 pool6[3][16] = { { 0xfd, [15] = 1 }, { 0x20, 0x01, 0x0d,
							   0xb8, [15] = 2 }, { 0xfe, 0x80, [15] = 3 } };
			int n = rand_r(&seed) % 5, ports = rand_r(&seed) % 3;

			w_init(&w, "set_nat", 1 + (ports ? 2 : 0));
			w_key(&w, "snat_addrs");
			msgpack_pack_array(&w.pk, (uint32_t)n);
			for (int i = 0; i < n; i++) {
				int k = rand_r(&seed) % 7;

				if (k < 4)
					msgpack_pack_bin_with_body(&w.pk, pool[k], 4);
				else
					msgpack_pack_bin_with_body(&w.pk, pool6[k - 4], 16);
			}
			if (ports) {
				w_uint(&w, "snat_port_min", (uint64_t)(rand_r(&seed) % 3) * 30000);
				w_uint(&w, "snat_port_max", (uint64_t)(rand_r(&seed) % 3) * 30000 + 5);
			}
			break;
		}
		case 8: { /* a NAT VIP, IPv6 now and then, snat or not */
			size_t alen = rand_r(&seed) % 4 ? 4 : 16;
			__u8 addr[16];

			vip_addr(addr, alen, (__u8)(rand_r(&seed) % 8));
			if (rand_r(&seed) % 2) { /* or a tunnel VIP, any mix of its fields */
				static const __u8 src[16] = { 0xfd, [15] = 1 };
				int r = rand_r(&seed);

				req_tunnel_vip(&w, (__u32)(rand_r(&seed) % 70), addr, alen,
					       r % 5 ? LB_MODE_TUNNEL : (uint64_t)(r % 3),
					       src, (r >> 3) % 3 ? ((r >> 5) % 2 ? 4 : 16) : 0,
					       (r >> 6) % 4 - 1, (r >> 8) % 3 ? -1 : 4789,
					       (r >> 10) % 3 ? -1 : (r >> 12) % 18,
					       (r >> 17) % 4 ? -1 : (r >> 19) % 2 * 80);
				break;
			}
			w_set_vip(&w, 1, rand_r(&seed) % 70, addr, alen,
				  rand_r(&seed) % 5 ? LB_MODE_NAT : LB_MODE_DSR);
			w_bool(&w, "snat", rand_r(&seed) % 2);
			break;
		}
		default: {
			__u8 raw[64];
			size_t n = (size_t)(rand_r(&seed) % sizeof(raw)) + 1;

			for (size_t i = 0; i < n; i++)
				raw[i] = (__u8)rand_r(&seed);
			send_req(srv, raw, n, NULL, 0);
			check_mirror(srv, "random bytes");
			continue;
		}
		}
		/* Mangle a third of them: flip bytes or cut them short. */
		if (rand_r(&seed) % 3 == 0 && w.sb.size > 0) {
			if (rand_r(&seed) % 2)
				w.sb.size = (size_t)rand_r(&seed) % w.sb.size;
			else
				w.sb.data[rand_r(&seed) % w.sb.size] = (char)rand_r(&seed);
		}
		run(srv, &w, NULL, 0);
		check_mirror(srv, "fuzz request");
		if (failures > 10)
			break;
	}
	lb_proto_server_free(srv);
	mirror_nat6 = false;
	test_nat_restore();
	test_no_nat();
	test_nat6();
	test_vip_entry_conversion();
	test_tunnel_restore();
	test_no_tunnel();
	if (failures) {
		fprintf(stderr, "%d failures\n", failures);
		return 1;
	}
	CHECK(n_ok > 1000 && n_rejected > 1000, "fuzz too narrow: %d ok, %d rejected", n_ok,
	      n_rejected);
	if (failures)
		return 1;
	printf("proto_selftest: ok (%d requests applied, %d rejected)\n", n_ok, n_rejected);
	return 0;
}
