/* SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
 *
 * xdp_nat6.h - NAT mode for IPv6 in the XDP program: the program
 * lb_xdp_nat6, which lb_xdp enters by tail call (lb.bpf.c's nat6_prog says
 * why a program of its own) for an IPv6 TCP/UDP frame to an IPv6 NAT VIP,
 * and, while nat_active, for one to no VIP and for ICMPv6. A part of
 * lb.bpf.c, included at its end: it uses its helpers (stat, count,
 * backend_is, pick_backend_hashed, ingress_port, nat_send, keys_v6, struct
 * nat_out) and maps (conn6_map, conn6_fifo, nat_config_map, config_map,
 * backend_map, vip_map), which the two programs share. Kept apart by
 * concern: lb.bpf.c is the frame and the IPv4 paths, this file the IPv6
 * twins.
 *
 * The rules are lb_conn.h's, which hold for IPv6 unchanged, followed step
 * for step as lb.bpf.c follows them for IPv4, with the differences the
 * contract makes (lb_tables.h "NAT mode: the connection table"):
 *   - the table is conn6_map (struct lb_flow_key, family 6, every pad byte
 *     0; entries struct lb_conn6), with its own embryonic FIFO conn6_fifo;
 *     both as large as conn_map (--conn-table-size entries each);
 *   - the flow hash is the 40-byte key's (lb_flow_hash_v6): the ring pick,
 *     the SNAT port candidates and the pool index (snat_addrs6);
 *   - a picked backend that is not IPv6 is drop_no_backend (no NAT64);
 *   - a frame whose L4 header starts beyond LB_NAT6_MAX_L4_OFF (more than
 *     256 bytes of extension headers) is the kernel's, counted
 *     pass_ext_headers: lb_nat6_rewrite refuses such a frame (its offsets
 *     must be bounded for the verifier), so it is passed before any lookup
 *     rather than found and then dropped as malformed;
 *   - ICMPv6 errors (RFC 4443 types 1-4) are what ICMP errors are for IPv4.
 * The packet rewrites are lb_nat6.h's, through lb_conn.h's lb_conn6_*.
 *
 * Stack and verifier: IPv6 NAT's structures are large (the parse 56 bytes,
 * struct lb_conn6 64, a key 40, struct lb_nat6_icmp 52; clang 14 shares few
 * stack slots between exclusive paths, and the rewrites keep copies of the
 * 16-byte addresses): on the stack they took 440 of the 512 bytes. They
 * live in a per-CPU scratch entry instead (nat6_scratch: one lookup, which
 * the verifier inlines for a per-CPU array), which also keeps the verifier
 * within its budget (lb_xdp_nat6 says how), and a new connection's two
 * entries are written from one struct lb_conn6, turned from the original
 * into the reply between the two updates (conn6_insert).
 */
#ifndef HPCLB_XDP_NAT6_H
#define HPCLB_XDP_NAT6_H

/* What the IPv6 NAT paths would otherwise keep on the stack. Per CPU: an
 * XDP program runs to completion on its CPU, so one entry per CPU is never
 * in use twice at once. */
struct nat6_scratch {
	struct lb_parsed pkt;    /* the parse, copied here (lb_xdp_nat6 says why) */
	struct lb_flow_key flow; /* the frame's key */
	struct lb_flow_key peer; /* the entry's peer: the frame leaves as it, reversed */
	struct lb_flow_key key;  /* ICMPv6: the quote reversed */
	struct lb_conn6 e;       /* a new connection's entries */
	struct lb_nat6_icmp ic;  /* ICMPv6: the parsed error */
	struct nat_out out;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct nat6_scratch);
	__uint(max_entries, 1);
} nat6_scratch SEC(".maps");

/* The 5-tuples of two IPv6 keys are equal. One test of OR-ed differences
 * rather than eleven branches: fewer states for the verifier to explore in
 * the SNAT probe loop. */
static __always_inline int same_flow6(const struct lb_flow_key *a, const struct lb_flow_key *b)
{
	__u32 d = (a->saddr.v6w[0] ^ b->saddr.v6w[0]) | (a->saddr.v6w[1] ^ b->saddr.v6w[1]) |
		  (a->saddr.v6w[2] ^ b->saddr.v6w[2]) | (a->saddr.v6w[3] ^ b->saddr.v6w[3]) |
		  (a->daddr.v6w[0] ^ b->daddr.v6w[0]) | (a->daddr.v6w[1] ^ b->daddr.v6w[1]) |
		  (a->daddr.v6w[2] ^ b->daddr.v6w[2]) | (a->daddr.v6w[3] ^ b->daddr.v6w[3]) |
		  (__u32)(a->sport ^ b->sport) | (__u32)(a->dport ^ b->dport) |
		  (__u32)(a->proto ^ b->proto);

	return d == 0;
}

/* conn_delete's twin: both entries, the peer's only while it still names
 * key. */
static __always_inline void conn6_delete(const struct lb_flow_key *key,
					 const struct lb_flow_key *peer)
{
	struct lb_conn6 *pc = bpf_map_lookup_elem(&conn6_map, peer);

	bpf_map_delete_elem(&conn6_map, key);
	if (pc && same_flow6(&pc->peer, key))
		bpf_map_delete_elem(&conn6_map, peer);
}

/* conn_evict_one's twin, on conn6_fifo and conn6_map. */
static __always_inline int conn6_evict_one(void)
{
	struct lb_flow_key key, peer;
	struct lb_conn6 *c;
	__u32 i;

	for (i = 0; i < LB_CONN_EVICT_TRIES; i++) {
		if (bpf_map_pop_elem(&conn6_fifo, &key))
			return 0; /* empty */
		c = bpf_map_lookup_elem(&conn6_map, &key);
		if (!c || c->dir != LB_CONN_ORIG || !lb_conn_embryonic(c->state))
			continue;
		peer = c->peer;
		conn6_delete(&key, &peer);
		return 1;
	}
	return 0;
}

/* Insert a new connection whose original key is key and reply key peer:
 * *e (every other field set) is written as the original entry, then turned
 * into the reply entry and written under peer; both or none. 0, or the
 * failing update's error. *e is rewritten on every call, so a retry may
 * pass it again. */
static __always_inline long conn6_insert(const struct lb_flow_key *key,
					 const struct lb_flow_key *peer, struct lb_conn6 *e)
{
	long err;

	e->peer = *peer;
	e->dir = LB_CONN_ORIG;
	err = bpf_map_update_elem(&conn6_map, key, e, BPF_ANY);
	if (err)
		return err;
	e->peer = *key;
	e->dir = LB_CONN_REPLY;
	err = bpf_map_update_elem(&conn6_map, peer, e, BPF_ANY);
	if (err)
		bpf_map_delete_elem(&conn6_map, key);
	return err;
}

/* nat_reply's twin (lb_conn.h 2.). */
static __always_inline int nat6_reply(const struct lb_conn6 *c, const struct lb_parsed *p,
				      __u8 tcp_flags, __u64 len, struct nat_out *out,
				      struct lb_flow_key *peer)
{
	struct lb_conn6 *o;

	*peer = c->peer;
	out->port = c->client_port;
	out->vip_id = c->vip_id;
	out->backend_id = c->backend_id;
	__builtin_memcpy(out->mac, c->client_mac, LB_ETH_ALEN);
	o = bpf_map_lookup_elem(&conn6_map, peer);
	if (o && o->dir == LB_CONN_ORIG) {
		o->state = lb_conn_next_state(o->state, &o->fin_dirs, LB_CONN_REPLY, p->proto,
					      tcp_flags);
		o->last_seen_ns = bpf_ktime_get_ns();
	}
	stat(LB_STAT_CONN_REPLY, len, 0);
	return NAT_FORWARD;
}

/* nat_to_vip's twin (lb_conn.h 1.): a TCP/UDP frame for an IPv6 NAT VIP.
 * The checks in lb_conn.h's order, each counted as for IPv4. */
static __always_inline int nat6_to_vip(__u32 in_port, void *data, void *data_end,
				       const struct lb_parsed *p, const struct lb_flow_key *key,
				       const struct lb_vip_entry *vip, __u64 len,
				       struct nat6_scratch *scratch)
{
	struct lb_flow_key *peer = &scratch->peer;
	struct nat_out *out = &scratch->out;
	const struct lb_eth_hdr *eth = data;
	struct lb_nat_config *nat;
	struct lb_config *cfg;
	struct lb_backend *backend;
	struct lb_conn6 *c, *e = &scratch->e;
	__u32 zero = 0, vip_id = vip->vip_id, backend_id, ring_size;
	__u8 tcp_flags = lb_tcp_flags6(data, data_end, p), open, cflags = 0;
	__be16 bport;
	__u64 hash;
	long err;

	cfg = bpf_map_lookup_elem(&config_map, &zero);
	nat = bpf_map_lookup_elem(&nat_config_map, &zero);
	if (!cfg || !nat || vip_id >= LB_MAX_VIPS)
		return stat(LB_STAT_DROP_NO_BACKEND, len, XDP_DROP);

	c = bpf_map_lookup_elem(&conn6_map, key);
	if (c && c->dir == LB_CONN_REPLY)
		return nat6_reply(c, p, tcp_flags, len, out, peer);
	if (c) {
		backend_id = c->backend_id;
		backend = bpf_map_lookup_elem(&backend_map, &backend_id);
		if (backend_is(backend, LB_BACKEND_UP) ||
		    backend_is(backend, LB_BACKEND_DRAINING)) {
			c->state = lb_conn_next_state(c->state, &c->fin_dirs, LB_CONN_ORIG,
						      p->proto, tcp_flags);
			c->last_seen_ns = bpf_ktime_get_ns();
			*peer = c->peer;
			out->port = backend->port ? backend->port : in_port;
			out->vip_id = vip_id;
			out->backend_id = backend_id;
			__builtin_memcpy(out->mac, backend->mac, LB_ETH_ALEN);
			stat(LB_STAT_CONN_HIT, len, 0);
			return NAT_FORWARD;
		}
		if (nat->on_backend_down == LB_NAT_DOWN_DROP)
			return stat(LB_STAT_DROP_BACKEND_DOWN, len, XDP_DROP);
		*peer = c->peer;
		conn6_delete(key, peer);
		stat(LB_STAT_CONN_RESCHEDULE, len, 0);
	}

	open = lb_conn_open_state(p->proto, tcp_flags);
	if (open == LB_CONN_NO_STATE)
		return stat(LB_STAT_DROP_CONN_INVALID, len, XDP_DROP);
	ring_size = cfg->ring_size;
	if (ring_size < 3)
		return stat(LB_STAT_DROP_NO_BACKEND, len, XDP_DROP);
	hash = lb_flow_hash_v6(cfg->hash_key, key);
	backend_id = pick_backend_hashed(ring_size, vip_id, hash);
	backend = bpf_map_lookup_elem(&backend_map, &backend_id);
	/* No NAT64: an IPv4 backend has no address of this family. */
	if (!backend || backend->family != LB_FAMILY_V6)
		return stat(LB_STAT_DROP_NO_BACKEND, len, XDP_DROP);

	/* The reply key must be free, as for IPv4 (lb.bpf.c's nat_to_vip). */
	bport = vip->nat_port ? vip->nat_port : key->dport;
	if (vip->nat_flags & LB_VIP_F_SNAT) {
		__u32 naddrs = nat->snat_naddrs6, idx, n;
		__u16 pmin = nat->snat_port_min, pmax = nat->snat_port_max;

		/* An IPv6 SNAT VIP without an IPv6 pool: the server never
		 * allows it (the spec's drop_snat_exhausted). */
		if (naddrs == 0 || naddrs > LB_MAX_SNAT_ADDRS || pmin == 0 || pmin > pmax)
			return stat(LB_STAT_DROP_SNAT_EXHAUSTED, len, XDP_DROP);
		idx = lb_snat_addr_index(hash, naddrs);
		/* Hidden from clang so that the verifier's check stays (as in
		 * nat_to_vip). */
		asm volatile("" : "+r"(idx));
		if (idx >= LB_MAX_SNAT_ADDRS)
			return stat(LB_STAT_DROP_SNAT_EXHAUSTED, len, XDP_DROP);
		for (n = 0; n < LB_SNAT_PROBES; n++) {
			__be16 sport = lb_htons(lb_snat_candidate(hash, n, pmin, pmax));

			lb_conn6_reply_key(peer, &backend->addr, bport, &nat->snat_addrs6[idx],
					   sport, p->proto);
			if (!same_flow6(peer, key) && !bpf_map_lookup_elem(&conn6_map, peer))
				break;
		}
		if (n == LB_SNAT_PROBES)
			return stat(LB_STAT_DROP_SNAT_EXHAUSTED, len, XDP_DROP);
		cflags = LB_CONN_F_SNAT;
	} else {
		lb_conn6_reply_key(peer, &backend->addr, bport, &key->saddr, key->sport, p->proto);
		if (same_flow6(peer, key) || bpf_map_lookup_elem(&conn6_map, peer))
			return stat(LB_STAT_DROP_SNAT_EXHAUSTED, len, XDP_DROP);
	}

	if (LB_PAST_END(eth, sizeof(*eth), data_end))
		return stat(LB_STAT_DROP_MALFORMED, len, XDP_DROP); /* cannot happen: parsed */
	__builtin_memset(e, 0, sizeof(*e));
	e->last_seen_ns = bpf_ktime_get_ns();
	e->backend_id = backend_id;
	e->vip_id = (__u8)vip_id;
	e->state = open;
	__builtin_memcpy(e->client_mac, eth->src, LB_ETH_ALEN);
	e->client_port = (__u8)in_port;
	e->flags = cflags;
	err = conn6_insert(key, peer, e);
	if (err) {
		if ((err != -LB_E2BIG && err != -LB_ENOMEM) || !conn6_evict_one())
			return stat(LB_STAT_DROP_CONN_FULL, len, XDP_DROP);
		stat(LB_STAT_CONN_EVICT, len, 0);
		if (conn6_insert(key, peer, e))
			return stat(LB_STAT_DROP_CONN_FULL, len, XDP_DROP);
	}
	if (lb_conn_embryonic(open))
		bpf_map_push_elem(&conn6_fifo, key, BPF_EXIST);
	out->port = backend->port ? backend->port : in_port;
	out->vip_id = vip_id;
	out->backend_id = backend_id;
	__builtin_memcpy(out->mac, backend->mac, LB_ETH_ALEN);
	stat(LB_STAT_CONN_NEW, len, 0);
	return NAT_FORWARD;
}

/* nat_frame's twin: an IPv6 TCP/UDP frame (parse OK, so no fragment) for an
 * IPv6 NAT VIP (vip set) or, while NAT mode is in use, for no VIP (vip
 * NULL). key is the frame's flow key (keys_v6). */
static __always_inline int nat6_frame(const struct xdp_md *ctx, void *data, void *data_end,
				      struct nat6_scratch *s, const struct lb_vip_entry *vip,
				      __u64 len)
{
	const struct lb_parsed *p = &s->pkt;
	const struct lb_flow_key *key = &s->flow;
	struct lb_conn6 *c = NULL;
	__u32 in_port;
	int rc;

	/* The spec's bound, before any lookup: beyond it lb_nat6_rewrite
	 * would refuse the frame. */
	if (p->l4_off > LB_NAT6_MAX_L4_OFF)
		return stat(LB_STAT_PASS_EXT_HEADERS, len, XDP_PASS);
	if (!vip) {
		c = bpf_map_lookup_elem(&conn6_map, key);
		if (!c || c->dir != LB_CONN_REPLY)
			return stat(LB_STAT_PASS_NOT_VIP, len, XDP_PASS);
	}
	in_port = ingress_port(ctx);
	s->out.pad[0] = 0;
	s->out.pad[1] = 0;
	if (vip)
		rc = nat6_to_vip(in_port, data, data_end, p, key, vip, len, s);
	else
		rc = nat6_reply(c, p, lb_tcp_flags6(data, data_end, p), len, &s->out, &s->peer);
	if (rc != NAT_FORWARD)
		return rc;
	if (lb_conn6_translate(data, data_end, p, key, &s->peer) != LB_NAT_OK)
		return stat(LB_STAT_DROP_MALFORMED, len, XDP_DROP); /* cannot happen: parsed */
	return nat_send(in_port, data, data_end, &s->out, len);
}

/* nat_icmp's twin: an ICMPv6 frame while NAT mode is in use (lb_conn.h 3.);
 * p said LB_PARSE_UNSUPPORTED_L4 with proto ICMPv6. */
static __always_inline int nat6_icmp(const struct xdp_md *ctx, void *data, void *data_end,
				     struct nat6_scratch *s, __u64 len)
{
	const struct lb_parsed *p = &s->pkt;
	struct lb_backend *backend;
	struct lb_conn6 *c;
	__u32 in_port;

	if (p->l4_off > LB_NAT6_MAX_L4_OFF)
		return stat(LB_STAT_PASS_EXT_HEADERS, len, XDP_PASS);
	if (lb_nat6_icmp_parse(data, data_end, p, &s->ic) != LB_NAT_OK)
		return stat(LB_STAT_PASS_NOT_VIP, len, XDP_PASS);
	lb_conn6_icmp_key(&s->key, &s->ic);
	c = bpf_map_lookup_elem(&conn6_map, &s->key);
	if (!c)
		return stat(LB_STAT_PASS_NOT_VIP, len, XDP_PASS);
	in_port = ingress_port(ctx);
	/* The quoted packet was sent as c's peer reversed; before translation
	 * it was c's peer (s->peer: the orig of lb_conn6_icmp_translate). */
	s->peer = c->peer;
	s->out.pad[0] = 0;
	s->out.pad[1] = 0;
	s->out.vip_id = c->vip_id;
	s->out.backend_id = c->backend_id;
	if (c->dir == LB_CONN_REPLY) {
		/* About a packet sent to the backend: for the client. */
		s->out.port = c->client_port;
		__builtin_memcpy(s->out.mac, c->client_mac, LB_ETH_ALEN);
	} else {
		/* About a reply sent to the client: for the backend, unless it
		 * has left the tables. */
		backend = bpf_map_lookup_elem(&backend_map, &s->out.backend_id);
		if (!backend || backend->state == LB_BACKEND_UNUSED) {
			stat(LB_STAT_NAT_ICMP, len, 0);
			return stat(LB_STAT_DROP_TX_ERROR, len, XDP_DROP);
		}
		s->out.port = backend->port ? backend->port : in_port;
		__builtin_memcpy(s->out.mac, backend->mac, LB_ETH_ALEN);
	}
	if (lb_conn6_icmp_translate(data, data_end, &s->ic, &s->peer) != LB_NAT_OK)
		return stat(LB_STAT_DROP_MALFORMED, len, XDP_DROP); /* cannot happen: parsed */
	stat(LB_STAT_NAT_ICMP, len, 0);
	return nat_send(in_port, data, data_end, &s->out, len);
}

/* lb_xdp's tail call: the frame parsed again (a tail call keeps nothing of
 * the caller's stack; lb_xdp has counted rx), its VIP looked up again. What
 * lb_xdp sends here is an untagged IPv6 frame that parsed OK (TCP/UDP, no
 * fragment) or UNSUPPORTED_L4 with ICMPv6: anything else cannot arrive and
 * is the kernel's.
 *
 * The parse is copied into the scratch entry and used from there: the
 * verifier knows nothing of a map value's bytes, so every way through the
 * parse (each extension-header count leaves other bounds on the offsets in
 * a stack copy) reaches the NAT paths in one state. With the parse on the
 * stack each of those ways was verified through all of them again, past
 * the verifier's budget. */
SEC("xdp")
int lb_xdp_nat6(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u64 len = (__u64)(data_end - data);
	struct nat6_scratch *s;
	struct lb_parsed pkt;
	struct lb_vip_key vkey;
	struct lb_vip_entry *vip;
	enum lb_parse_verdict verdict;
	__u32 zero = 0;

	verdict = lb_parse_untagged(&pkt, data, data_end);
	s = bpf_map_lookup_elem(&nat6_scratch, &zero);
	if (!s || pkt.family != LB_FAMILY_V6)
		return stat(LB_STAT_PASS_NOT_VIP, len, XDP_PASS); /* cannot happen */
	s->pkt = pkt;
	if (verdict == LB_PARSE_UNSUPPORTED_L4 && s->pkt.proto == LB_IPPROTO_ICMPV6 && nat_active)
		return nat6_icmp(ctx, data, data_end, s, len);
	if (verdict != LB_PARSE_OK)
		return stat(LB_STAT_PASS_NOT_VIP, len, XDP_PASS); /* cannot happen */
	keys_v6(&s->flow, &vkey, &s->pkt);
	vip = bpf_map_lookup_elem(&vip_map, &vkey);
	if (vip && vip->mode != LB_MODE_NAT)
		return stat(LB_STAT_PASS_NOT_VIP, len, XDP_PASS); /* cannot happen */
	if (!vip && !nat_active)
		return stat(LB_STAT_PASS_NOT_VIP, len, XDP_PASS);
	return nat6_frame(ctx, data, data_end, s, vip, len);
}

#endif /* HPCLB_XDP_NAT6_H */
