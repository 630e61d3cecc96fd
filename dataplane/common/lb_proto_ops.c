/* SPDX-License-Identifier: Apache-2.0
 *
 * lb_proto_ops.c - the table-protocol server (version 2): what each op does
 * to the tables. See PROTOCOL.md for the ops and lb_proto.h for the contract
 * with the data planes; the wire format is lb_proto_codec.c's.
 *
 * Every request goes through three stages:
 *   1. decoding and the checks a field allows on its own (the codec);
 *   2. the checks against the shadow tables (is the VIP configured, is the
 *      id free), interleaved with 1 in a fixed order per op, which decides
 *      the error a request with several faults gets; all new values are
 *      staged in scratch buffers;
 *   3. the data plane's ops, then the shadow update. If an op fails, the
 *      previous contents are written back with the same ops.
 * Stages 1 and 2 change nothing, so a rejected request leaves no trace.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>

#include "lb_proto_codec.h"

struct lb_proto_server {
	const struct lb_dataplane_ops *ops;
	void *ctx;
	struct lb_proto_info info;
	struct lb_proto_state st;
	__u32 *scratch_ring; /* ring_size slots: staged set_ring, swapped in */
	/* Staging for set_backends, indexed by position in the request. */
	__u32 ids[LB_MAX_BACKENDS];
	struct lb_backend new_b[LB_MAX_BACKENDS];
	struct lb_backend old_b[LB_MAX_BACKENDS];
	/* Counters for stats, filled by ops->read_stats and ops->read_port_stats. */
	struct lb_counter c_global[LB_STAT_MAX];
	struct lb_counter c_vips[LB_MAX_VIPS];
	struct lb_counter c_backends[LB_MAX_BACKENDS];
	struct lb_port_stats c_ports[LB_MAX_PORTS];
	bool c_ports_ok[LB_MAX_PORTS];
	struct lb_conn_stats c_conns; /* filled by ops->read_conns */
	char err[LB_CODEC_ERR_LEN]; /* the last request's error: lb_proto_outcome */
};

/* One request being applied. */
struct call {
	struct lb_proto_server *srv;
	struct lb_codec_req *r;
	int changed; /* the tables were modified */
};

/* ---- checks against the shadow tables ----------------------------------- */

/* vip_id of a configured VIP. */
static int get_vip_id(struct call *c, __u32 *vip_id)
{
	uint64_t v;

	if (lb_codec_uint(c->r, "vip_id", 0, LB_MAX_VIPS - 1, &v))
		return -1;
	if (!c->srv->st.vips[v].used)
		return lb_codec_fail(c->r, "field 'vip_id': VIP %llu is not configured",
				     (unsigned long long)v);
	*vip_id = (__u32)v;
	return 0;
}

static int find_vip(const struct lb_proto_server *srv, const struct lb_vip_key *key)
{
	for (int i = 0; i < LB_MAX_VIPS; i++)
		if (srv->st.vips[i].used && memcmp(&srv->st.vips[i].key, key, sizeof(*key)) == 0)
			return i;
	return -1;
}

/* The first configured VIP of family whose connections take a SNAT address
 * (from that family's pool), or -1. */
static int find_snat_vip(const struct lb_proto_state *st, __u8 family)
{
	for (int i = 0; i < LB_MAX_VIPS; i++)
		if (st->vips[i].used && (st->vips[i].nat_flags & LB_VIP_F_SNAT) &&
		    st->vips[i].key.family == family)
			return i;
	return -1;
}

/* The SNAT pool's size for the VIPs of family. */
static __u32 pool_size(const struct lb_nat_config *nat, __u8 family)
{
	return family == LB_FAMILY_V6 ? nat->snat_naddrs6 : nat->snat_naddrs;
}

/* Whether the data plane serves NAT mode (lb_proto.h: set_nat). */
static bool has_nat(const struct lb_proto_server *srv)
{
	return srv->ops->set_nat != NULL;
}

/* Whether it serves NAT mode for IPv6 VIPs too (lb_proto_info.nat6, which
 * means nothing without NAT mode itself). */
static bool has_nat6(const struct lb_proto_server *srv)
{
	return has_nat(srv) && srv->info.nat6;
}

/* Whether it serves tunnel mode (lb_proto_info.tunnel). */
static bool has_tunnel(const struct lb_proto_server *srv)
{
	return srv->info.tunnel;
}

/* The modes a data plane serves, for the "mode not supported" error. */
static const char *modes_served(const struct lb_proto_server *srv)
{
	if (has_nat(srv) && has_tunnel(srv))
		return "0 (dsr), 1 (nat) and 2 (tunnel) are";
	if (has_nat(srv))
		return "0 (dsr) and 1 (nat) are";
	if (has_tunnel(srv))
		return "0 (dsr) and 2 (tunnel) are";
	return "0 (dsr) is";
}

void lb_proto_vip_entry(const struct lb_proto_vip *v, __u32 vip_id, struct lb_vip_entry *e)
{
	memset(e, 0, sizeof(*e));
	e->vip_id = vip_id;
	e->mode = v->mode;
	e->tunnel_family = v->tunnel_family;
	e->nat_port = v->nat_port;
	e->tunnel_src = v->tunnel_src;
	e->nat_flags = v->nat_flags;
	e->tunnel_encap = v->tunnel_encap;
	e->gue_port = v->gue_port;
	e->tunnel_src_bits = v->tunnel_src_bits;
}

void lb_proto_vip_from_entry(const struct lb_vip_entry *e, struct lb_proto_vip *v)
{
	v->mode = e->mode;
	v->tunnel_family = e->tunnel_family;
	v->nat_port = e->nat_port;
	v->tunnel_src = e->tunnel_src;
	v->nat_flags = e->nat_flags;
	v->tunnel_encap = e->tunnel_encap;
	v->gue_port = e->gue_port;
	v->tunnel_src_bits = e->tunnel_src_bits;
}

/* set_vip's rules across fields, in PROTOCOL.md's order, once every field
 * passed its own checks; e holds the decoded extras. */
static int vip_mode_rules(struct call *c, const struct lb_vip_key *key, uint64_t mode,
			  const struct lb_vip_entry *e, const struct lb_codec_tunnel_given *given,
			  bool snat)
{
	struct lb_proto_server *srv = c->srv;
	struct lb_codec_req *r = c->r;

	if ((mode == LB_MODE_NAT && !has_nat(srv)) || (mode == LB_MODE_TUNNEL && !has_tunnel(srv)))
		return lb_codec_fail(r, "mode not supported by this data plane: field 'mode' is "
				     "%llu, only %s implemented", (unsigned long long)mode,
				     modes_served(srv));
	if (mode == LB_MODE_NAT && key->family != LB_FAMILY_V4 && !has_nat6(srv))
		return lb_codec_fail(r, "field 'mode': NAT mode (1) is IPv4 only, this VIP's "
				     "'addr' is IPv6");
	if (mode != LB_MODE_TUNNEL && (given->tunnel_encap || given->gue_port ||
				       given->tunnel_src_bits))
		return lb_codec_fail(r, "field '%s': only a tunnel VIP (mode 2) takes it, field "
				     "'mode' is %llu",
				     given->tunnel_encap ? "tunnel_encap" :
				     given->gue_port ? "gue_port" : "tunnel_src_bits",
				     (unsigned long long)mode);
	if (mode == LB_MODE_TUNNEL) {
		if (given->gue_port && e->tunnel_encap != LB_ENCAP_GUE)
			return lb_codec_fail(r, "field 'gue_port': only GUE (tunnel_encap 1) has a "
					     "UDP port, tunnel_encap is 0 (ipip)");
		if (!e->tunnel_family)
			return lb_codec_fail(r, "field 'tunnel_src': tunnel mode (2) needs an outer "
					     "source address");
		/* lb_encap.h: the IPv4 path MTU cannot carry IPv6's 1280 plus 20. */
		if (key->family == LB_FAMILY_V6 && e->tunnel_family != LB_FAMILY_V6)
			return lb_codec_fail(r, "field 'tunnel_src': an IPv6 VIP is tunnelled in "
					     "IPv6 only (IPv6 inside IPv4 is not carried), "
					     "'tunnel_src' is IPv4");
		if (e->nat_port)
			return lb_codec_fail(r, "field 'nat_port': only a NAT VIP (mode 1) takes "
					     "a backend port, field 'mode' is 2");
	}
	if (snat && mode != LB_MODE_NAT)
		return lb_codec_fail(r, "field 'snat': only a NAT VIP (mode 1) takes SNAT, "
				     "field 'mode' is %llu", (unsigned long long)mode);
	/* Each family's VIPs take their SNAT address from their own pool. */
	if (snat && pool_size(&srv->st.nat, key->family) == 0)
		return lb_codec_fail(r, "field 'snat': no %sSNAT pool configured (set_nat)",
				     key->family == LB_FAMILY_V6 ? "IPv6 " : "");
	return 0;
}

/* ---- applying, and undoing ---------------------------------------------- */

/* Writes an all-LB_NO_BACKEND ring for vip_id (through the scratch ring). */
static int write_empty_ring(struct lb_proto_server *srv, __u32 vip_id)
{
	for (__u32 i = 0; i < srv->st.config.ring_size; i++)
		srv->scratch_ring[i] = LB_NO_BACKEND;
	return srv->ops->write_ring(srv->ctx, vip_id, srv->scratch_ring);
}

/* Reports a failed op; rb is the result of the attempt to restore. */
static int fail_apply(struct call *c, const char *what, int err, int rb)
{
	if (rb == 0)
		return lb_codec_fail(c->r, "data plane failed to apply %s: %s (previous "
				     "contents restored)", what, strerror(-err));
	return lb_codec_fail(c->r, "data plane failed to apply %s: %s; restoring the previous "
			     "contents failed too (%s): dump may differ from the data plane",
			     what, strerror(-err), strerror(-rb));
}

/* ---- ops ---------------------------------------------------------------- */

static int op_hello(struct call *c)
{
	lb_codec_reply_hello(c->r, &c->srv->info, c->srv->st.config.ring_size,
			     has_nat(c->srv) ? c->srv->info.conn_table_size : 0);
	return 0;
}

static int op_set_config(struct call *c)
{
	struct lb_proto_server *srv = c->srv;
	struct lb_config cfg = srv->st.config;
	int err;

	if (lb_codec_hash_key(c->r, cfg.hash_key))
		return -1;
	err = srv->ops->set_config(srv->ctx, &cfg);
	if (err)
		return fail_apply(c, "set_config", err,
				  srv->ops->set_config(srv->ctx, &srv->st.config));
	srv->st.config = cfg;
	c->changed = 1;
	return 0;
}

static int op_set_vip(struct call *c)
{
	struct lb_proto_server *srv = c->srv;
	struct lb_codec_req *r = c->r;
	struct lb_codec_tunnel_given given;
	struct lb_vip_key key;
	struct lb_vip_entry e;
	__u32 *ring = NULL;
	uint64_t vip_id, mode;
	bool slots, snat;
	int cur, err;

	memset(&e, 0, sizeof(e));
	/* Every field is decoded and checked on its own first, whatever the
	 * mode (nat_port and tunnel_src are also stored with a DSR VIP, as
	 * protocol 2 always did), then the rules across fields. */
	if (lb_codec_uint(r, "vip_id", 0, LB_MAX_VIPS - 1, &vip_id) ||
	    lb_codec_vip_key(r, &key) ||
	    lb_codec_uint(r, "mode", LB_MODE_DSR, LB_MODE_TUNNEL, &mode) ||
	    lb_codec_vip_extras(r, &e) ||
	    lb_codec_vip_tunnel(r, &e, &given) ||
	    lb_codec_bool(r, "snat", false, &snat))
		return -1;
	if (vip_mode_rules(c, &key, mode, &e, &given, snat))
		return -1;
	if (mode == LB_MODE_TUNNEL && e.tunnel_encap == LB_ENCAP_GUE && !e.gue_port)
		e.gue_port = htons(LB_GUE_PORT_DEFAULT);
	cur = find_vip(srv, &key);
	if (cur >= 0 && (uint64_t)cur != vip_id)
		return lb_codec_fail(r, "field 'vip_id': this addr/port/proto is already VIP %d "
				     "(del_vip it first to change its id)", cur);
	if (cur < 0 && srv->st.vips[vip_id].used)
		return lb_codec_fail(r, "field 'vip_id': %llu is already used by another VIP",
				     (unsigned long long)vip_id);
	if (lb_codec_has(r, "slots", &slots))
		return -1;
	if (slots && cur >= 0)
		return lb_codec_fail(r, "field 'slots': VIP %d exists, use set_ring or patch_ring",
				     cur);
	if (cur < 0) {
		/* A new VIP: its ring in the data plane is all LB_NO_BACKEND
		 * (initialised so, and reset by del_vip), unless 'slots' gives it
		 * one, written before the VIP goes live so that its first packet
		 * already finds a backend. */
		ring = malloc((size_t)srv->st.config.ring_size * sizeof(*ring));
		if (!ring)
			return lb_codec_fail(r, "out of memory for the ring of VIP %llu",
					     (unsigned long long)vip_id);
		for (__u32 i = 0; i < srv->st.config.ring_size; i++)
			ring[i] = LB_NO_BACKEND;
		if (slots && lb_codec_slots(r, srv->st.config.ring_size, ring)) {
			free(ring);
			return -1;
		}
	}
	if (slots) {
		err = srv->ops->write_ring(srv->ctx, (__u32)vip_id, ring);
		if (err) {
			free(ring);
			return fail_apply(c, "set_vip (ring)", err,
					  write_empty_ring(srv, (__u32)vip_id));
		}
	}
	e.vip_id = (__u32)vip_id;
	e.mode = (__u8)mode;
	e.nat_flags = snat ? LB_VIP_F_SNAT : 0;
	err = srv->ops->set_vip(srv->ctx, &key, &e);
	if (err) {
		free(ring);
		if (slots) /* the ring of a free vip_id is always empty */
			return fail_apply(c, "set_vip", err,
					  write_empty_ring(srv, (__u32)vip_id));
		/* One element update: either applied or not, nothing to undo. */
		return lb_codec_fail(r, "data plane failed to apply set_vip: %s",
				     strerror(-err));
	}
	if (ring) {
		srv->st.rings[vip_id] = ring;
		srv->st.vips[vip_id].used = true;
		srv->st.vips[vip_id].key = key;
	}
	lb_proto_vip_from_entry(&e, &srv->st.vips[vip_id]);
	c->changed = 1;
	return 0;
}

static int op_del_vip(struct call *c)
{
	struct lb_proto_server *srv = c->srv;
	struct lb_vip_key key;
	int id, err;

	if (lb_codec_vip_key(c->r, &key))
		return -1;
	id = find_vip(srv, &key);
	if (id < 0)
		return lb_codec_fail(c->r, "no VIP with this addr/port/proto");
	/* Empty the ring first, then remove the VIP: a failure of either can be
	 * undone, and the ring of a free vip_id is always empty. */
	err = write_empty_ring(srv, (__u32)id);
	if (err)
		return fail_apply(c, "del_vip (ring reset)", err,
				  srv->ops->write_ring(srv->ctx, (__u32)id, srv->st.rings[id]));
	err = srv->ops->del_vip(srv->ctx, &key);
	if (err)
		return fail_apply(c, "del_vip", err,
				  srv->ops->write_ring(srv->ctx, (__u32)id, srv->st.rings[id]));
	free(srv->st.rings[id]);
	srv->st.rings[id] = NULL;
	memset(&srv->st.vips[id], 0, sizeof(srv->st.vips[id]));
	c->changed = 1;
	return 0;
}

/* Applies n staged backends (ids/new_b/old_b are filled). */
static int apply_backends(struct call *c, size_t n, const char *what)
{
	struct lb_proto_server *srv = c->srv;
	int err;

	if (n == 0)
		return 0;
	err = srv->ops->set_backends(srv->ctx, srv->ids, srv->new_b, n);
	if (err)
		return fail_apply(c, what, err,
				  srv->ops->set_backends(srv->ctx, srv->ids, srv->old_b, n));
	for (size_t i = 0; i < n; i++)
		srv->st.backends[srv->ids[i]] = srv->new_b[i];
	c->changed = 1;
	return 0;
}

static int op_set_backends(struct call *c)
{
	struct lb_proto_server *srv = c->srv;
	size_t n;

	if (lb_codec_backends(c->r, srv->info.nports, srv->ids, srv->new_b, &n))
		return -1;
	for (size_t i = 0; i < n; i++)
		srv->old_b[i] = srv->st.backends[srv->ids[i]];
	return apply_backends(c, n, "set_backends");
}

static int op_set_backend_state(struct call *c)
{
	struct lb_proto_server *srv = c->srv;
	uint64_t id, state;

	if (lb_codec_uint(c->r, "id", 0, LB_MAX_BACKENDS - 1, &id) ||
	    lb_codec_uint(c->r, "state", LB_BACKEND_UP, LB_BACKEND_UNUSED, &state))
		return -1;
	if (srv->st.backends[id].state == LB_BACKEND_UNUSED)
		return lb_codec_fail(c->r, "field 'id': backend %llu is not configured "
				     "(set_backends first)", (unsigned long long)id);
	srv->ids[0] = (__u32)id;
	srv->old_b[0] = srv->st.backends[id];
	srv->new_b[0] = srv->st.backends[id];
	srv->new_b[0].state = (__u8)state;
	return apply_backends(c, 1, "set_backend_state");
}

static int op_set_ring(struct call *c)
{
	struct lb_proto_server *srv = c->srv;
	__u32 vip_id, *tmp;
	int err;

	if (get_vip_id(c, &vip_id) ||
	    lb_codec_slots(c->r, srv->st.config.ring_size, srv->scratch_ring))
		return -1;
	err = srv->ops->write_ring(srv->ctx, vip_id, srv->scratch_ring);
	if (err)
		return fail_apply(c, "set_ring", err,
				  srv->ops->write_ring(srv->ctx, vip_id, srv->st.rings[vip_id]));
	/* The staged ring becomes the shadow; the old one is the next scratch. */
	tmp = srv->st.rings[vip_id];
	srv->st.rings[vip_id] = srv->scratch_ring;
	srv->scratch_ring = tmp;
	c->changed = 1;
	return 0;
}

static int op_patch_ring(struct call *c)
{
	struct lb_proto_server *srv = c->srv;
	struct lb_ring_patch *p;
	__u32 vip_id;
	size_t n;
	int err;

	if (get_vip_id(c, &vip_id) || lb_codec_patch(c->r, srv->st.config.ring_size, &p, &n))
		return -1;
	err = srv->ops->patch_ring(srv->ctx, vip_id, p, n);
	if (err) {
		fail_apply(c, "patch_ring", err,
			   srv->ops->write_ring(srv->ctx, vip_id, srv->st.rings[vip_id]));
		free(p);
		return -1;
	}
	for (size_t i = 0; i < n; i++)
		srv->st.rings[vip_id][p[i].slot] = p[i].backend;
	c->changed = 1;
	free(p);
	return 0;
}

static int op_get_ring(struct call *c)
{
	__u32 vip_id;

	if (get_vip_id(c, &vip_id))
		return -1;
	lb_codec_reply_ring(c->r, c->srv->st.rings[vip_id], c->srv->st.config.ring_size);
	return 0;
}

/* The whole NAT configuration; fields left out take their defaults. */
static int op_set_nat(struct call *c)
{
	struct lb_proto_server *srv = c->srv;
	struct lb_nat_config nat;
	int vip, err;

	if (!has_nat(srv))
		return lb_codec_fail(c->r, "op 'set_nat' not supported: this data plane has no "
				     "NAT mode");
	if (lb_codec_nat(c->r, has_nat6(srv), &nat))
		return -1;
	/* Per family: an IPv4 pool emptied under an IPv4 SNAT VIP, then an
	 * IPv6 one under an IPv6 SNAT VIP. */
	vip = find_snat_vip(&srv->st, LB_FAMILY_V4);
	if (nat.snat_naddrs == 0 && vip >= 0)
		return lb_codec_fail(c->r, "field 'snat_addrs': VIP %d uses SNAT, the pool cannot "
				     "be emptied (set_vip it without snat, or del_vip it, first)",
				     vip);
	vip = find_snat_vip(&srv->st, LB_FAMILY_V6);
	if (nat.snat_naddrs6 == 0 && vip >= 0)
		return lb_codec_fail(c->r, "field 'snat_addrs': VIP %d uses SNAT, the IPv6 pool "
				     "cannot be emptied (set_vip it without snat, or del_vip it, "
				     "first)", vip);
	err = srv->ops->set_nat(srv->ctx, &nat);
	if (err)
		return fail_apply(c, "set_nat", err, srv->ops->set_nat(srv->ctx, &srv->st.nat));
	srv->st.nat = nat;
	c->changed = 1;
	return 0;
}

static int op_dump(struct call *c)
{
	lb_codec_reply_dump(c->r, &c->srv->st);
	return 0;
}

static int op_stats(struct call *c)
{
	struct lb_proto_server *srv = c->srv;
	bool conns_ok;
	int err;

	memset(srv->c_global, 0, sizeof(srv->c_global));
	memset(srv->c_vips, 0, sizeof(srv->c_vips));
	memset(srv->c_backends, 0, sizeof(srv->c_backends));
	err = srv->ops->read_stats(srv->ctx, srv->c_global, srv->c_vips, srv->c_backends);
	if (err)
		return lb_codec_fail(c->r, "data plane failed to read stats: %s", strerror(-err));
	/* A port whose counters cannot be read reports an empty map rather than
	 * failing stats. */
	for (__u32 p = 0; srv->ops->read_port_stats && p < srv->info.nports; p++) {
		memset(&srv->c_ports[p], 0, sizeof(srv->c_ports[p]));
		srv->c_ports_ok[p] = srv->ops->read_port_stats(srv->ctx, p, &srv->c_ports[p]) == 0;
	}
	/* Likewise the connection table: an empty "conns" when it cannot be read. */
	conns_ok = false;
	if (srv->ops->read_conns) {
		memset(&srv->c_conns, 0, sizeof(srv->c_conns));
		conns_ok = srv->ops->read_conns(srv->ctx, &srv->c_conns) == 0;
	}
	lb_codec_reply_stats(c->r, &srv->st, srv->c_global, srv->c_vips, srv->c_backends,
			     srv->ops->read_port_stats ? srv->c_ports : NULL, srv->c_ports_ok,
			     srv->info.nports, srv->ops->read_conns ? &srv->c_conns : NULL,
			     conns_ok);
	return 0;
}

static const struct {
	const char *name;
	int (*fn)(struct call *c);
} op_table[] = {
	{ "hello", op_hello },
	{ "set_config", op_set_config },
	{ "set_vip", op_set_vip },
	{ "del_vip", op_del_vip },
	{ "set_backends", op_set_backends },
	{ "set_backend_state", op_set_backend_state },
	{ "set_ring", op_set_ring },
	{ "patch_ring", op_patch_ring },
	{ "get_ring", op_get_ring },
	{ "dump", op_dump },
	{ "stats", op_stats },
	{ "set_nat", op_set_nat },
};

/* ---- the request -------------------------------------------------------- */

int lb_proto_handle(struct lb_proto_server *srv, const void *buf, size_t len,
		    msgpack_sbuffer *reply, struct lb_proto_outcome *outcome)
{
	struct lb_codec_req r;
	struct call c = { .srv = srv, .r = &r, .changed = 0 };
	const char *opname = "?";
	int rc;

	lb_codec_begin(&r, srv->err);
	rc = lb_codec_decode(&r, buf, len);
	if (rc == 0) {
		size_t i;

		for (i = 0; i < sizeof(op_table) / sizeof(op_table[0]); i++)
			if (lb_codec_op_is(&r, op_table[i].name))
				break;
		if (i == sizeof(op_table) / sizeof(op_table[0])) {
			rc = lb_codec_unknown_op(&r);
		} else {
			opname = op_table[i].name;
			rc = op_table[i].fn(&c);
		}
	}
	rc = lb_codec_end(&r, reply, rc);
	if (outcome) {
		outcome->op = opname;
		outcome->ok = rc == 0;
		outcome->changed = c.changed;
		outcome->error = srv->err;
	}
	return rc;
}

/* ---- life cycle --------------------------------------------------------- */

struct lb_proto_server *lb_proto_server_new(const struct lb_dataplane_ops *ops, void *ctx,
					    const struct lb_proto_info *info,
					    const struct lb_config *cfg)
{
	struct lb_proto_server *srv;

	if (!ops || !info || !cfg || info->nports < 1 || info->nports > LB_MAX_PORTS ||
	    cfg->ring_size < 2 || cfg->ring_size > LB_RING_SIZE_MAX || !info->dataplane ||
	    !info->attach_mode)
		return NULL;
	srv = calloc(1, sizeof(*srv));
	if (!srv)
		return NULL;
	srv->scratch_ring = malloc((size_t)cfg->ring_size * sizeof(__u32));
	if (!srv->scratch_ring) {
		free(srv);
		return NULL;
	}
	srv->ops = ops;
	srv->ctx = ctx;
	srv->info = *info;
	srv->st.config = *cfg;
	for (__u32 i = 0; i < LB_MAX_BACKENDS; i++)
		srv->st.backends[i].state = LB_BACKEND_UNUSED;
	/* What the data plane starts with by itself: never written from here. */
	lb_proto_nat_defaults(&srv->st.nat);
	return srv;
}

void lb_proto_server_free(struct lb_proto_server *srv)
{
	if (!srv)
		return;
	for (int i = 0; i < LB_MAX_VIPS; i++)
		free(srv->st.rings[i]);
	free(srv->scratch_ring);
	free(srv);
}

int lb_proto_server_set_info(struct lb_proto_server *srv, const struct lb_proto_info *info)
{
	if (info->nports < 1 || info->nports > LB_MAX_PORTS || !info->dataplane ||
	    !info->attach_mode)
		return -EINVAL;
	for (__u32 i = 0; i < LB_MAX_BACKENDS; i++)
		if (srv->st.backends[i].state != LB_BACKEND_UNUSED &&
		    srv->st.backends[i].port >= info->nports)
			return -EINVAL;
	srv->info = *info;
	return 0;
}

const struct lb_proto_state *lb_proto_server_state(const struct lb_proto_server *srv)
{
	return &srv->st;
}

int lb_proto_server_restore(struct lb_proto_server *srv, const struct lb_proto_state *st,
			    char *err, size_t errlen)
{
	__u32 rs = srv->st.config.ring_size;
	__u32 *rings[LB_MAX_VIPS] = { 0 };
	char why[LB_CODEC_ERR_LEN];

	if (st->config.ring_size != rs) {
		snprintf(err, errlen, "ring_size %u, expected %u", st->config.ring_size, rs);
		return -EINVAL;
	}
	/* Without NAT mode st->nat means nothing (the plane has none to read);
	 * with it, it must be what set_nat would take. */
	if (has_nat(srv) && lb_proto_nat_check(&st->nat, why, sizeof(why))) {
		snprintf(err, errlen, "NAT configuration: %s", why);
		return -EINVAL;
	}
	/* set_nat refuses an IPv6 pool where the plane has no NAT for IPv6. */
	if (has_nat(srv) && !has_nat6(srv) && st->nat.snat_naddrs6) {
		snprintf(err, errlen, "NAT configuration: %u IPv6 SNAT addresses on a data plane "
			 "without NAT mode for IPv6", st->nat.snat_naddrs6);
		return -EINVAL;
	}
	for (__u32 i = 0; i < LB_MAX_BACKENDS; i++) {
		const struct lb_backend *b = &st->backends[i];

		if (b->state > LB_BACKEND_UNUSED ||
		    (b->state != LB_BACKEND_UNUSED &&
		     (b->port >= srv->info.nports || !lb_codec_valid_addr(&b->addr, b->family) ||
		      b->pad[0] || b->pad[1] || b->pad[2]))) {
			snprintf(err, errlen, "backend %u: state %u, port %u, family %u", i,
				 b->state, b->port, b->family);
			return -EINVAL;
		}
	}
	for (__u32 i = 0; i < LB_MAX_VIPS; i++) {
		const struct lb_proto_vip *v = &st->vips[i];

		if (!v->used)
			continue;
		for (__u32 j = 0; j < i; j++) {
			if (st->vips[j].used &&
			    memcmp(&st->vips[j].key, &v->key, sizeof(v->key)) == 0) {
				snprintf(err, errlen, "VIPs %u and %u have the same key", j, i);
				return -EINVAL;
			}
		}
		if ((v->key.proto != 6 && v->key.proto != 17) || v->key.port == 0 ||
		    !lb_codec_valid_addr(&v->key.addr, v->key.family) ||
		    (v->tunnel_family && !lb_codec_valid_addr(&v->tunnel_src, v->tunnel_family)) ||
		    !st->rings[i]) {
			snprintf(err, errlen, "VIP %u: bad key", i);
			return -EINVAL;
		}
		/* set_vip's mode rules: DSR, NAT (IPv4; IPv6 too with nat6)
		 * where the plane has it, tunnel where the plane has it. */
		if (v->mode != LB_MODE_DSR &&
		    (v->mode != LB_MODE_NAT || !has_nat(srv) ||
		     (v->key.family != LB_FAMILY_V4 && !has_nat6(srv))) &&
		    (v->mode != LB_MODE_TUNNEL || !has_tunnel(srv))) {
			snprintf(err, errlen, "VIP %u: mode %u (family %u) not served", i, v->mode,
				 v->key.family);
			return -EINVAL;
		}
		if (v->mode == LB_MODE_TUNNEL ?
		    (!v->tunnel_family || v->tunnel_encap > LB_ENCAP_GUE ||
		     (v->tunnel_encap == LB_ENCAP_GUE) != (v->gue_port != 0) ||
		     v->tunnel_src_bits > LB_TUNNEL_SRC_BITS_MAX || v->nat_port ||
		     (v->key.family == LB_FAMILY_V6 && v->tunnel_family != LB_FAMILY_V6)) :
		    (v->tunnel_encap || v->gue_port || v->tunnel_src_bits)) {
			snprintf(err, errlen, "VIP %u: mode %u with tunnel_src family %u, "
				 "tunnel_encap %u, gue_port %u, tunnel_src_bits %u, nat_port %u",
				 i, v->mode, v->tunnel_family, v->tunnel_encap, ntohs(v->gue_port),
				 v->tunnel_src_bits, ntohs(v->nat_port));
			return -EINVAL;
		}
		if ((v->nat_flags & ~LB_VIP_F_SNAT) ||
		    (v->nat_flags && (v->mode != LB_MODE_NAT ||
				      pool_size(&st->nat, v->key.family) == 0))) {
			snprintf(err, errlen, "VIP %u: nat_flags 0x%x with mode %u and %u %sSNAT "
				 "addresses", i, v->nat_flags, v->mode,
				 has_nat(srv) ? pool_size(&st->nat, v->key.family) : 0,
				 v->key.family == LB_FAMILY_V6 ? "IPv6 " : "");
			return -EINVAL;
		}
		for (__u32 s = 0; s < rs; s++) {
			if (!lb_codec_valid_backend_ref(st->rings[i][s])) {
				snprintf(err, errlen, "VIP %u: slot %u holds %u", i, s,
					 st->rings[i][s]);
				return -EINVAL;
			}
		}
	}
	/* Valid: copy the rings, then commit everything. */
	for (__u32 i = 0; i < LB_MAX_VIPS; i++) {
		if (!st->vips[i].used)
			continue;
		rings[i] = malloc((size_t)rs * sizeof(__u32));
		if (!rings[i]) {
			for (__u32 j = 0; j < i; j++)
				free(rings[j]);
			snprintf(err, errlen, "out of memory");
			return -ENOMEM;
		}
		memcpy(rings[i], st->rings[i], (size_t)rs * sizeof(__u32));
	}
	for (__u32 i = 0; i < LB_MAX_VIPS; i++) {
		free(srv->st.rings[i]);
		srv->st.rings[i] = rings[i];
		srv->st.vips[i] = st->vips[i];
	}
	srv->st.config = st->config;
	memcpy(srv->st.backends, st->backends, sizeof(srv->st.backends));
	if (has_nat(srv))
		srv->st.nat = st->nat;
	return 0;
}
