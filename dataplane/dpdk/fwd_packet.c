/* SPDX-License-Identifier: Apache-2.0 */
#include <string.h>
#include <rte_arp.h>
#include <rte_byteorder.h>
#include <rte_ether.h>

#include "fwd_packet.h"
#include "lb_conn.h"
#include "lb_hash.h"
#include "lb_parse.h"
#include "lb_rewrite.h"

static inline void count(struct lb_counter *c, __u64 bytes)
{
	c->packets += 1;
	c->bytes += bytes;
}

static inline enum fwd_verdict stat(struct fwd_packet_ctx *c, enum lb_stat which, __u32 len,
				    enum fwd_verdict v)
{
	count(&c->counters->global[which], len);
	return v;
}

static inline const struct lb_backend *backend_in(const struct fwd_tables *t, __u32 id,
						  __u8 state)
{
	if (id >= LB_MAX_BACKENDS || t->backends[id].state != state)
		return NULL;
	return &t->backends[id];
}

/* First up backend among the probe slots of the flow whose hash is hash, or
 * LB_NO_BACKEND. */
static __u32 pick_backend(const struct fwd_tables *t, __u32 vip_id, __u64 hash)
{
	const __u32 *ring = t->rings[vip_id];
	__u32 ring_size = t->config.ring_size;

	if (!ring || ring_size < 3)
		return LB_NO_BACKEND;
	for (__u32 n = 0; n < LB_RING_PROBES; n++) {
		__u32 id = ring[lb_probe_slot(hash, ring_size, n)];

		if (id != LB_NO_BACKEND && backend_in(t, id, LB_BACKEND_UP))
			return id;
	}
	return LB_NO_BACKEND;
}

/* An ARP request for a VIP or SNAT pool address becomes its reply, in place,
 * on whichever port it came: a backend on an egress port resolves the pool
 * address its replies go to. */
static enum fwd_verdict arp(struct fwd_packet_ctx *c, __u8 *frame, __u32 len)
{
	struct rte_ether_hdr *eth = (struct rte_ether_hdr *)frame;
	struct rte_arp_hdr *a = (struct rte_arp_hdr *)(eth + 1);
	const __u8 *mac = c->port_macs[c->in_port];
	__u32 vip;

	if (len < sizeof(*eth) + sizeof(*a) || a->arp_hardware != RTE_BE16(RTE_ARP_HRD_ETHER) ||
	    a->arp_protocol != RTE_BE16(RTE_ETHER_TYPE_IPV4) || a->arp_hlen != 6 ||
	    a->arp_plen != 4 || a->arp_opcode != RTE_BE16(RTE_ARP_OP_REQUEST) ||
	    (!fwd_is_vip_addr(c->tables, a->arp_data.arp_tip) &&
	     !fwd_is_snat_addr(c->tables, a->arp_data.arp_tip)))
		return stat(c, LB_STAT_PASS_NOT_IPV4, len, FWD_TO_KERNEL);
	vip = a->arp_data.arp_tip;
	a->arp_opcode = RTE_BE16(RTE_ARP_OP_REPLY);
	a->arp_data.arp_tha = a->arp_data.arp_sha;
	a->arp_data.arp_tip = a->arp_data.arp_sip;
	memcpy(&a->arp_data.arp_sha, mac, 6);
	a->arp_data.arp_sip = vip;
	memcpy(&eth->dst_addr, &a->arp_data.arp_tha, 6);
	memcpy(&eth->src_addr, mac, 6);
	return stat(c, LB_STAT_ARP_REPLY, len, FWD_REPLY);
}

/* The flow key from a parse that said LB_PARSE_OK on an untagged IPv4 frame:
 * the one place the key is built. Every byte is written (the address's other
 * 12 bytes and the pad are 0): the key is hashed and looked up as raw bytes. */
static inline void flow_key_v4(struct lb_flow_key *flow, const struct lb_parsed *p)
{
	memset(flow, 0, sizeof(*flow));
	flow->saddr.v4 = p->src.v4;
	flow->daddr.v4 = p->dst.v4;
	flow->sport = p->sport;
	flow->dport = p->dport;
	flow->proto = p->proto;
	flow->family = LB_FAMILY_V4;
}

/* The VIP key of an IPv4 flow, every byte written as in flow_key_v4. */
static inline void vip_key_v4(struct lb_vip_key *vkey, const struct lb_flow_key *flow)
{
	memset(vkey, 0, sizeof(*vkey));
	vkey->addr.v4 = flow->daddr.v4;
	vkey->port = flow->dport;
	vkey->proto = flow->proto;
	vkey->family = LB_FAMILY_V4;
}

/* ---- NAT mode (lb_conn.h) ------------------------------------------------
 * Followed step by step; the comments name the step. Counting order: the
 * conn_* or nat_icmp counter first, the fwd_* (or drop_*) one last, so that
 * whoever waits for the verdict counter sees the whole packet counted. The
 * entry points are kept out of line: fwd_packet's DSR path compiles as it did
 * without them (perf/packet_cost.py). */

static inline void conn_key_v4(struct lb_flow_key_v4 *k, const struct lb_parsed *p)
{
	k->saddr = p->src.v4;
	k->daddr = p->dst.v4;
	k->sport = p->sport;
	k->dport = p->dport;
	k->proto = p->proto;
	k->pad[0] = 0;
	k->pad[1] = 0;
	k->pad[2] = 0;
}

/* The backend of a connection, if it may still carry it (up or draining). */
static inline const struct lb_backend *conn_backend(const struct fwd_tables *t, __u32 id)
{
	const struct lb_backend *b = backend_in(t, id, LB_BACKEND_UP);

	return b ? b : backend_in(t, id, LB_BACKEND_DRAINING);
}

/* Sends a translated frame to dst_mac out of port: fwd_tx when that is the
 * port it came in on, else fwd_redirect; the VIP's and the backend's
 * counters as in DSR mode. */
static enum fwd_verdict nat_out(struct fwd_packet_ctx *c, __u8 *frame, __u32 len,
				const __u8 *dst_mac, __u32 port, const struct lb_conn *e,
				__u32 *out_port)
{
	if (port >= c->nports)
		return stat(c, LB_STAT_DROP_TX_ERROR, len, FWD_DROP);
	if (lb_rewrite_macs(frame, frame + len, dst_mac, c->port_macs[port]))
		return stat(c, LB_STAT_DROP_MALFORMED, len, FWD_DROP); /* cannot happen: parsed */
	stat(c, port == c->in_port ? LB_STAT_FWD_TX : LB_STAT_FWD_REDIRECT, len, FWD_OUT);
	if (e->vip_id < LB_MAX_VIPS)
		count(&c->counters->vips[e->vip_id], len);
	if (e->backend_id < LB_MAX_BACKENDS)
		count(&c->counters->backends[e->backend_id], len);
	*out_port = port;
	return FWD_OUT;
}

/* Original direction to backend be: translated as the entry says, out of the
 * backend's port (0: the one it came in on). */
static enum fwd_verdict nat_to_backend(struct fwd_packet_ctx *c, __u8 *frame, __u32 len,
				       const struct lb_parsed *p, const struct lb_flow_key_v4 *key,
				       const struct fwd_conn_slot *o, const struct lb_backend *be,
				       __u32 *out_port)
{
	if (lb_conn_translate(frame, frame + len, p, key, &o->c.peer) != LB_NAT_OK)
		return stat(c, LB_STAT_DROP_MALFORMED, len, FWD_DROP); /* cannot happen: parsed */
	return nat_out(c, frame, len, be->mac, be->port ? be->port : c->in_port, &o->c, out_port);
}

/* Step 2: a packet matching the reply entry r. The state lives in the
 * original entry; the client's MAC and port are in both. */
static __attribute__((noinline)) enum fwd_verdict nat_reply(struct fwd_packet_ctx *c, __u8 *frame, __u32 len,
				  const struct lb_parsed *p, const struct lb_flow_key_v4 *key,
				  const struct fwd_conn_slot *r, __u8 tcp_flags, __u32 *out_port)
{
	struct fwd_conn_slot *o = fwd_conn_orig(c->conns, (struct fwd_conn_slot *)r);

	/* Removed by another worker a moment ago: as if not found. */
	if (!o || !fwd_conn_update(c->conns, &c->counters->conns, o, LB_CONN_REPLY, p->proto,
				   tcp_flags, c->now_ns))
		return stat(c, LB_STAT_PASS_NOT_VIP, len, FWD_TO_KERNEL);
	stat(c, LB_STAT_CONN_REPLY, len, FWD_DROP);
	if (lb_conn_translate(frame, frame + len, p, key, &r->c.peer) != LB_NAT_OK)
		return stat(c, LB_STAT_DROP_MALFORMED, len, FWD_DROP); /* cannot happen: parsed */
	return nat_out(c, frame, len, r->c.client_mac, r->c.client_port, &r->c, out_port);
}

/* Step 1: a TCP/UDP packet to a NAT VIP. */
static __attribute__((noinline)) enum fwd_verdict nat_vip(struct fwd_packet_ctx *c, __u8 *frame, __u32 len,
				const struct lb_parsed *p, const struct fwd_vip_slot *vip,
				__u32 *out_port)
{
	const struct fwd_tables *t = c->tables;
	struct fwd_conn_table *ct = c->conns;
	struct fwd_conn_figures *fig = &c->counters->conns;
	__u8 tcp_flags = lb_tcp_flags(frame, frame + len, p);
	const struct lb_backend *be;
	struct fwd_conn_slot *e;
	struct fwd_conn_req req;
	struct lb_flow_key_v4 key;
	enum fwd_conn_open_status st;
	__u32 backend_id;
	__u64 hash;
	bool evicted;

	if (!ct) /* no table (cannot happen: the forwarder always has one) */
		return stat(c, LB_STAT_DROP_CONN_FULL, len, FWD_DROP);
	conn_key_v4(&key, p);
	req.orig_sig = fwd_conn_sig(ct, &key);
	e = fwd_conn_lookup(ct, &key, req.orig_sig);
	/* At most twice: the second time with the entry another worker opened
	 * while this one looked (fwd_conn_open's FWD_CONN_EXISTS). */
	for (__u32 round = 0; round < 2; round++) {
		if (e && e->c.dir == LB_CONN_REPLY) /* a reply to a pool address that is a VIP's */
			return nat_reply(c, frame, len, p, &key, e, tcp_flags, out_port);
		if (e) {
			be = conn_backend(t, e->c.backend_id);
			if (be) {
				fwd_conn_update(ct, fig, e, LB_CONN_ORIG, p->proto, tcp_flags,
						c->now_ns);
				stat(c, LB_STAT_CONN_HIT, len, FWD_DROP);
				return nat_to_backend(c, frame, len, p, &key, e, be, out_port);
			}
			if (t->nat.on_backend_down == LB_NAT_DOWN_DROP)
				return stat(c, LB_STAT_DROP_BACKEND_DOWN, len, FWD_DROP);
			stat(c, LB_STAT_CONN_RESCHEDULE, len, FWD_DROP);
			fwd_conn_close(ct, fig, e); /* both entries; on as a miss */
		}

		/* Miss. */
		req.tmpl.state = lb_conn_open_state(p->proto, tcp_flags);
		if (req.tmpl.state == LB_CONN_NO_STATE)
			return stat(c, LB_STAT_DROP_CONN_INVALID, len, FWD_DROP);
		hash = lb_flow_hash_v4_key(t->config.hash_key, &key);
		backend_id = pick_backend(t, vip->vip_id, hash);
		be = backend_in(t, backend_id, LB_BACKEND_UP);
		if (!be)
			return stat(c, LB_STAT_DROP_NO_BACKEND, len, FWD_DROP);
		req.orig = key;
		req.backend_addr = be->addr.v4;
		req.backend_port = vip->nat_port ? vip->nat_port : key.dport;
		req.snat = vip->nat_flags & LB_VIP_F_SNAT;
		req.snat_addr = 0;
		if (req.snat && t->nat.snat_naddrs && t->nat.snat_naddrs <= LB_MAX_SNAT_ADDRS)
			req.snat_addr =
				t->nat.snat_addrs[lb_snat_addr_index(hash, t->nat.snat_naddrs)];
		req.port_min = t->nat.snat_port_min;
		req.port_max = t->nat.snat_port_max;
		req.hash = hash;
		req.now_ns = c->now_ns;
		req.tmpl.backend_id = backend_id;
		req.tmpl.vip_id = (__u8)vip->vip_id;
		memcpy(req.tmpl.client_mac, frame + 6, 6); /* the Ethernet source: parsed */
		req.tmpl.client_port = (__u8)c->in_port;
		st = fwd_conn_open(ct, fig, &req, &e, &evicted);
		if (st == FWD_CONN_EXISTS)
			continue;
		if (st == FWD_CONN_NO_REPLY_KEY)
			return stat(c, LB_STAT_DROP_SNAT_EXHAUSTED, len, FWD_DROP);
		if (st != FWD_CONN_OPENED)
			return stat(c, LB_STAT_DROP_CONN_FULL, len, FWD_DROP);
		if (evicted)
			stat(c, LB_STAT_CONN_EVICT, len, FWD_DROP);
		stat(c, LB_STAT_CONN_NEW, len, FWD_DROP);
		return nat_to_backend(c, frame, len, p, &key, e, be, out_port);
	}
	/* Opened by another worker, then gone again: give up on this one. */
	return stat(c, LB_STAT_DROP_CONN_FULL, len, FWD_DROP);
}

/* Step 3: an ICMP error (the parse said UNSUPPORTED_L4, proto ICMP) whose
 * quote, reversed, is a connection's key: back to where that entry's peer
 * came from (the client for a reply entry, the backend for an original one). */
static __attribute__((noinline)) enum fwd_verdict nat_icmp(struct fwd_packet_ctx *c, __u8 *frame, __u32 len,
				 const struct lb_parsed *p, __u32 *out_port)
{
	const struct fwd_tables *t = c->tables;
	struct lb_nat4_icmp ic;
	struct lb_flow_key_v4 key;
	const struct fwd_conn_slot *e;
	const __u8 *mac;
	__u32 port;

	if (lb_nat4_icmp_parse(frame, frame + len, p, &ic) != LB_NAT_OK)
		return stat(c, LB_STAT_PASS_NOT_VIP, len, FWD_TO_KERNEL);
	lb_conn_icmp_key(&key, &ic);
	e = fwd_conn_lookup(c->conns, &key, fwd_conn_sig(c->conns, &key));
	if (!e)
		return stat(c, LB_STAT_PASS_NOT_VIP, len, FWD_TO_KERNEL);
	if (e->c.dir == LB_CONN_REPLY) {
		mac = e->c.client_mac;
		port = e->c.client_port;
	} else {
		const struct lb_backend *be = e->c.backend_id < LB_MAX_BACKENDS
						      ? &t->backends[e->c.backend_id]
						      : NULL;

		if (!be || be->state == LB_BACKEND_UNUSED) {
			/* Removed from the tables since: no MAC, no port. */
			stat(c, LB_STAT_NAT_ICMP, len, FWD_DROP);
			return stat(c, LB_STAT_DROP_TX_ERROR, len, FWD_DROP);
		}
		mac = be->mac;
		port = be->port ? be->port : c->in_port;
	}
	if (lb_conn_icmp_translate(frame, frame + len, &ic, &e->c.peer) != LB_NAT_OK)
		return stat(c, LB_STAT_DROP_MALFORMED, len, FWD_DROP); /* cannot happen: parsed */
	stat(c, LB_STAT_NAT_ICMP, len, FWD_DROP);
	return nat_out(c, frame, len, mac, port, &e->c, out_port);
}

enum fwd_verdict fwd_packet(struct fwd_packet_ctx *c, __u8 *frame, __u32 len, __u32 *out_port)
{
	const struct fwd_tables *t = c->tables;
	struct lb_parsed pkt;
	struct lb_flow_key flow;
	const struct fwd_vip_slot *vip;
	const struct lb_backend *backend = NULL;
	struct fwd_flow_slot *pinned;
	struct lb_vip_key vkey;
	__u32 backend_id = LB_NO_BACKEND, port;
	hash_sig_t sig;

	stat(c, LB_STAT_RX, len, FWD_DROP);
	/* The same one-pass parse as lb.bpf.c: the data planes balance untagged
	 * IPv4 alone, and one function says so for both. */
	switch (lb_parse_untagged_ipv4(&pkt, frame, frame + len)) {
	case LB_PARSE_OK:
		break;
	case LB_PARSE_NOT_IP:
		/* Untagged ARP is ours to answer for VIP addresses (the kernel
		 * holds none in DPDK mode); the rest, a tagged ARP included (its
		 * EtherType is the tag's), goes to the kernel. NOT_IP means the
		 * Ethernet header is whole. */
		if (((const struct rte_ether_hdr *)frame)->ether_type == RTE_BE16(RTE_ETHER_TYPE_ARP))
			return arp(c, frame, len);
		return stat(c, LB_STAT_PASS_NOT_IPV4, len, FWD_TO_KERNEL);
	case LB_PARSE_UNSUPPORTED_L4:
		/* An ICMP error may quote a NAT connection's packet. */
		if (pkt.proto == LB_IPPROTO_ICMP && c->conns && fwd_conn_count(c->conns))
			return nat_icmp(c, frame, len, &pkt, out_port);
		return stat(c, LB_STAT_PASS_NOT_VIP, len, FWD_TO_KERNEL);
	case LB_PARSE_FRAGMENT:
		return stat(c, LB_STAT_PASS_FRAGMENT, len, FWD_TO_KERNEL);
	default: /* LB_PARSE_MALFORMED (LB_PARSE_EXT_TOO_LONG is IPv6's: not here) */
		return stat(c, LB_STAT_DROP_MALFORMED, len, FWD_DROP);
	}
	flow_key_v4(&flow, &pkt);
	vip_key_v4(&vkey, &flow);
	vip = fwd_vip_lookup(t, &vkey);
	if (!vip) {
		/* A backend's reply to a NAT connection (lb_conn.h step 2):
		 * looked up only while the table holds any. */
		if (c->conns && fwd_conn_count(c->conns)) {
			struct lb_flow_key_v4 key;
			const struct fwd_conn_slot *e;

			conn_key_v4(&key, &pkt);
			e = fwd_conn_lookup(c->conns, &key, fwd_conn_sig(c->conns, &key));
			/* An original entry here is one whose VIP is gone. */
			if (e && e->c.dir == LB_CONN_REPLY)
				return nat_reply(c, frame, len, &pkt, &key, e,
						 lb_tcp_flags(frame, frame + len, &pkt), out_port);
		}
		if (!t->configured)
			return stat(c, LB_STAT_DROP_NO_BACKEND, len, FWD_DROP); /* see fwd_tables.h */
		return stat(c, LB_STAT_PASS_NOT_VIP, len, FWD_TO_KERNEL);
	}
	if (vip->mode == LB_MODE_NAT)
		return nat_vip(c, frame, len, &pkt, vip, out_port);

	sig = fwd_flow_sig(c->flows, &flow);
	pinned = fwd_flow_lookup(c->flows, &flow, sig, c->now_tsc);
	if (pinned) {
		backend_id = pinned->e.backend;
		backend = backend_in(t, backend_id, LB_BACKEND_UP);
		if (!backend)
			backend = backend_in(t, backend_id, LB_BACKEND_DRAINING);
		if (backend) {
			stat(c, LB_STAT_FLOW_HIT, len, FWD_DROP);
		} else {
			stat(c, LB_STAT_FLOW_REPIN, len, FWD_DROP);
		}
	}
	if (!backend) {
		struct lb_flow_entry fresh = { 0 };

		backend_id = pick_backend(t, vip->vip_id, lb_flow_hash(t->config.hash_key, &flow));
		backend = backend_in(t, backend_id, LB_BACKEND_UP);
		if (!backend)
			return stat(c, LB_STAT_DROP_NO_BACKEND, len, FWD_DROP);
		if (!pinned)
			stat(c, LB_STAT_FLOW_NEW, len, FWD_DROP);
		fresh.backend = backend_id;
		fresh.vip_id = vip->vip_id;
		fresh.pinned_ns = c->now_ns;
		if (pinned) {
			pinned->e = fresh;
		} else if (fwd_flow_pin(c->flows, &flow, sig, &fresh, c->now_tsc) == 1) {
			stat(c, LB_STAT_FLOW_EVICT, len, FWD_DROP);
		}
	}

	/* Port 0 means "back out of the port it came in on" (lb_tables.h). */
	port = backend->port ? backend->port : c->in_port;
	if (port >= c->nports)
		return stat(c, LB_STAT_DROP_TX_ERROR, len, FWD_DROP);
	if (lb_rewrite_macs(frame, frame + len, backend->mac, c->port_macs[port]))
		return stat(c, LB_STAT_DROP_MALFORMED, len, FWD_DROP); /* cannot happen: parsed */
	stat(c, backend->port == 0 ? LB_STAT_FWD_TX : LB_STAT_FWD_REDIRECT, len, FWD_OUT);
	count(&c->counters->vips[vip->vip_id], len);
	count(&c->counters->backends[backend_id], len);
	*out_port = port;
	return FWD_OUT;
}
