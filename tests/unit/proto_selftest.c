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
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lb_proto.h"

#define RS 251 /* a small prime ring keeps the fuzz fast */

static struct {
	struct lb_config cfg;
	struct lb_vip_key keys[LB_MAX_VIPS];
	struct lb_vip_entry entries[LB_MAX_VIPS];
	int used[LB_MAX_VIPS];
	struct lb_backend b[LB_MAX_BACKENDS];
	__u32 ring[LB_MAX_VIPS][RS];
	int fail_at;    /* >0: the n-th next call fails (half applied)... */
	int fail_count; /* ...and so do this many - 1 after it */
} dp;

static int n_ok, n_rejected; /* so the fuzz shows it reached both outcomes */

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

static const struct lb_dataplane_ops ops = {
	f_set_config, f_set_vip, f_del_vip, f_set_backends, f_write_ring, f_patch_ring, f_read_stats,
	f_read_port_stats,
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
			CHECK(st->vips[i].mode == dp.entries[i].mode &&
			      st->vips[i].nat_port == dp.entries[i].nat_port &&
			      st->vips[i].tunnel_family == dp.entries[i].tunnel_family &&
			      !memcmp(&st->vips[i].tunnel_src, &dp.entries[i].tunnel_src,
				      sizeof(dp.entries[i].tunnel_src)) &&
			      dp.entries[i].vip_id == (__u32)i,
			      "vip %d entry differs after %s", i, when);
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
	/* NAT mode: its fields are valid, the mode itself is not served yet. */
	w_set_vip(&w, 1, 40, addr6, 16, 1);
	w_uint(&w, "nat_port", 8081);
	CHECK(!run(srv, &w, err, sizeof(err)), "mode 1 accepted");
	CHECK(strstr(err, "mode not supported by this data plane"), "error: %s", err);
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

int main(void)
{
	struct lb_proto_info info = { .dataplane = "test", .attach_mode = "none", .nports = 1 };
	struct lb_config cfg = { .ring_size = RS };
	struct lb_proto_server *srv;
	char err[512];
	struct w w;
	unsigned seed = 12345;

	for (int i = 0; i < LB_MAX_BACKENDS; i++)
		dp.b[i].state = LB_BACKEND_UNUSED;
	for (int i = 0; i < LB_MAX_VIPS; i++)
		for (int s = 0; s < RS; s++)
			dp.ring[i][s] = LB_NO_BACKEND;
	dp.cfg = cfg;
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

	/* Fuzz: random requests built from valid pieces, some mangled, plus
	 * plain random bytes. After each, the mirror must still agree. */
	for (int it = 0; it < 20000; it++) {
		int kind = rand_r(&seed) % 8;

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
