/* SPDX-License-Identifier: Apache-2.0 */
#include <string.h>
#include <rte_arp.h>
#include <rte_byteorder.h>
#include <rte_ether.h>

#include "fwd_packet.h"
#include "lb_conn.h"
#include "lb_encap.h"
#include "lb_hash.h"
#include "lb_parse.h"
#include "lb_rewrite.h"

#define LB_IPPROTO_ICMPV6 58

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
/* The flow key of an IPv4 flow, as whole words (fwd_flow.h says why). */
static inline void flow_key_v4(struct lb_flow_key *flow, const struct lb_parsed *p)
{
	fwd_flow_key_v4(flow, p->src.v4, p->dst.v4, p->sport, p->dport, p->proto);
}

/* The flow key of an IPv6 flow: all 40 bytes written (the pad too), as the
 * table hashes and compares them raw. */
static inline void flow_key_v6(struct lb_flow_key *flow, const struct lb_parsed *p)
{
	flow->saddr = p->src;
	flow->daddr = p->dst;
	flow->sport = p->sport;
	flow->dport = p->dport;
	flow->proto = p->proto;
	flow->family = LB_FAMILY_V6;
	flow->pad[0] = 0;
	flow->pad[1] = 0;
}

/* The VIP key of an IPv6 flow: 20 bytes, no padding, every one written. */
static inline void vip_key_v6(struct lb_vip_key *vkey, const struct lb_flow_key *flow)
{
	vkey->addr = flow->daddr;
	vkey->port = flow->dport;
	vkey->proto = flow->proto;
	vkey->family = LB_FAMILY_V6;
}

/* ---- IPv6 neighbour discovery (RFC 4861) -------------------------------
 * The kernel holds no VIP address in DPDK mode (as for ARP), so a Neighbor
 * Solicitation for an IPv6 VIP is answered here, in place, on the port it
 * came in on: a router or client on that link resolves the VIP to this port.
 * Everything else ICMPv6 goes to the kernel. */

#define ICMPV6_NS 135
#define ICMPV6_NA 136
#define ND_OPT_SLLA 1 /* source link-layer address */
#define ND_OPT_TLLA 2 /* target link-layer address */
#define ND_NS_LEN 24  /* type, code, checksum, reserved, target */
#define ND_NA_LEN 32  /* type, code, checksum, flags, target, one TLLA option */
#define ND_NA_S 0x40  /* Solicited, in the flags byte */
#define ND_NA_O 0x20  /* Override */
#define ND_HOP_LIMIT 255
#define ND_MAX_OPTS 64 /* options walked in a solicitation (each is 8 bytes or more) */
#define ETH_IP6_LEN (sizeof(struct lb_eth_hdr) + sizeof(struct lb_ipv6_hdr))

/* One's complement sum of n bytes as big-endian 16-bit words (RFC 1071). */
static __u32 csum_be(const __u8 *b, __u32 n, __u32 sum)
{
	__u32 i;

	for (i = 0; i + 1 < n; i += 2)
		sum += (__u32)b[i] << 8 | b[i + 1];
	if (n & 1)
		sum += (__u32)b[n - 1] << 8;
	return sum;
}

/* The ICMPv6 sum (RFC 8200 8.1): the pseudo-header (source, destination,
 * upper-layer length, next header 58) and the n-byte message at icmp,
 * folded to 16 bits. The message's checksum is right when this is 0xffff;
 * with the checksum field 0, its complement is the checksum to write. */
static __u16 icmp6_sum(const struct lb_ipv6_hdr *ip6, const __u8 *icmp, __u32 n)
{
	__u32 sum = csum_be(ip6->saddr, 16, 0);

	sum = csum_be(ip6->daddr, 16, sum);
	sum += (n >> 16) + (n & 0xffff) + LB_IPPROTO_ICMPV6;
	sum = csum_be(icmp, n, sum);
	while (sum >> 16)
		sum = (sum & 0xffff) + (sum >> 16);
	return (__u16)sum;
}

/* Whether the options of a solicitation are valid (RFC 4861 7.1.1: none of
 * length 0, each within the message) and how many source link-layer address
 * options it has. -1 when invalid. */
static int nd_opts(const __u8 *opt, __u32 n)
{
	int slla = 0;

	for (__u32 i = 0; i < ND_MAX_OPTS && n; i++) {
		__u32 olen;

		if (n < 2 || opt[1] == 0)
			return -1;
		olen = opt[1] * 8u;
		if (olen > n)
			return -1;
		slla += opt[0] == ND_OPT_SLLA;
		opt += olen;
		n -= olen;
	}
	return n ? -1 : slla; /* more than ND_MAX_OPTS: not a solicitation we answer */
}

/* A Neighbor Solicitation for an IPv6 VIP address or an address of the IPv6
 * SNAT pool (a backend resolves the pool address its replies go to, as ARP
 * for the IPv4 pool) becomes its Neighbor Advertisement (RFC 4861 4.4,
 * 7.2.4), in place: S|O, the target, a target
 * link-layer address option with the ingress port's MAC, from the target to
 * the solicitation's source. A solicitation from the unspecified address
 * (duplicate address detection) is answered to all-nodes, S clear, as 7.2.4
 * says. The parse said UNSUPPORTED_L4 with proto 58 on an untagged IPv6
 * frame: the IPv6 header and l3_len lie within the frame. Anything not a
 * valid solicitation for a VIP goes to the kernel, which owns the rest of
 * ICMPv6 and drops what is invalid. */
static __attribute__((noinline)) enum fwd_verdict ndp(struct fwd_packet_ctx *c, struct fwd_frame *f,
						      const struct lb_parsed *p)
{
	static const __u8 all_nodes[16] = { 0xff, 0x02, [15] = 0x01 };
	static const __u8 all_nodes_mac[6] = { 0x33, 0x33, 0, 0, 0, 0x01 };
	static const __u8 unspecified[16];
	struct lb_eth_hdr *eth = (struct lb_eth_hdr *)f->data;
	struct lb_ipv6_hdr *ip6 = (struct lb_ipv6_hdr *)(f->data + sizeof(*eth));
	__u8 *icmp = f->data + ETH_IP6_LEN;
	const __u8 *mac = c->port_macs[c->in_port];
	__u32 len = f->len, n;
	__u8 target[16], to[16];
	bool dad;
	int slla;

	/* The ICMPv6 header right after the IPv6 one (no extension header: the
	 * kernel judges those), a whole solicitation inside the packet, which
	 * lies inside the frame (the parse), hop limit 255 (sent on this link,
	 * not forwarded onto it), a right checksum, valid options. */
	if (ip6->nexthdr != LB_IPPROTO_ICMPV6 || p->l3_len < sizeof(*ip6) + ND_NS_LEN ||
	    ETH_IP6_LEN + ND_NS_LEN > len)
		return stat(c, LB_STAT_PASS_NOT_VIP, len, FWD_TO_KERNEL);
	n = p->l3_len - sizeof(*ip6);
	if (ip6->hop_limit != ND_HOP_LIMIT || icmp[0] != ICMPV6_NS || icmp[1] != 0 ||
	    icmp6_sum(ip6, icmp, n) != 0xffff ||
	    (!fwd_is_vip6_addr(c->tables, icmp + 8) && !fwd_is_snat6_addr(c->tables, icmp + 8)))
		return stat(c, LB_STAT_PASS_NOT_VIP, len, FWD_TO_KERNEL);
	slla = nd_opts(icmp + ND_NS_LEN, n - ND_NS_LEN);
	dad = !memcmp(ip6->saddr, unspecified, 16);
	/* From the unspecified address: no source link-layer option (7.1.1). */
	if (slla < 0 || (dad && slla))
		return stat(c, LB_STAT_PASS_NOT_VIP, len, FWD_TO_KERNEL);
	/* The advertisement is ETH_IP6_LEN + 32 bytes: more than a solicitation
	 * without options. An mbuf always has the room; a buffer without it is
	 * left to the kernel rather than answered short. */
	if (ETH_IP6_LEN + ND_NA_LEN > len + f->tailroom)
		return stat(c, LB_STAT_PASS_NOT_VIP, len, FWD_TO_KERNEL);

	memcpy(target, icmp + 8, 16);
	memcpy(to, dad ? all_nodes : ip6->saddr, 16);
	memcpy(eth->dst, dad ? all_nodes_mac : eth->src, 6);
	memcpy(eth->src, mac, 6);
	ip6->ver_tc_flow = RTE_BE32(0x60000000); /* a new packet: class and label 0 */
	ip6->payload_len = RTE_BE16(ND_NA_LEN);
	ip6->nexthdr = LB_IPPROTO_ICMPV6;
	ip6->hop_limit = ND_HOP_LIMIT;
	memcpy(ip6->saddr, target, 16);
	memcpy(ip6->daddr, to, 16);
	icmp[0] = ICMPV6_NA;
	icmp[1] = 0;
	icmp[2] = 0; /* checksum, below */
	icmp[3] = 0;
	icmp[4] = dad ? ND_NA_O : ND_NA_S | ND_NA_O; /* R clear: a host's answer */
	icmp[5] = 0;
	icmp[6] = 0;
	icmp[7] = 0;
	memcpy(icmp + 8, target, 16);
	icmp[24] = ND_OPT_TLLA;
	icmp[25] = 1; /* 8 bytes */
	memcpy(icmp + 26, mac, 6);
	n = (__u16)~icmp6_sum(ip6, icmp, ND_NA_LEN);
	icmp[2] = (__u8)(n >> 8);
	icmp[3] = (__u8)n;
	f->len = ETH_IP6_LEN + ND_NA_LEN;
	return stat(c, LB_STAT_NDP_REPLY, len, FWD_REPLY);
}

/* ---- tunnel mode (lb_encap.h) --------------------------------------------
 * DSR through a tunnel: the backend was picked and pinned as in DSR mode;
 * the outer headers go into the room before the frame. Out of line, like
 * NAT's entry points, so that the DSR path compiles as it did. */
static __attribute__((noinline)) enum fwd_verdict tunnel_out(struct fwd_packet_ctx *c, struct fwd_frame *f,
							     const struct lb_parsed *p,
							     const struct fwd_vip_slot *vip,
							     const struct lb_backend *be,
							     __u32 backend_id, __u32 port,
							     __u32 *out_port)
{
	const struct lb_vip_entry *v = &c->tables->vip_entries[vip->vip_id];
	struct lb_encap_plan plan;
	__u32 len = f->len;
	__u8 *data;

	/* lb_encap_prepare refuses IPv6 inside IPv4 and a tunnel source of
	 * another family than the backend's; the mbuf may lack the headroom
	 * (a PMD that gives little): either way nothing is sent. */
	if (lb_encap_prepare(&plan, p, v, be, lb_inner_tos(f->data, f->data + len, p)) ||
	    plan.len > f->headroom)
		return stat(c, LB_STAT_DROP_ENCAP, len, FWD_DROP);
	memcpy(plan.dst_mac, be->mac, 6);
	memcpy(plan.src_mac, c->port_macs[port], 6);
	data = f->data - plan.len;
	if (lb_encap_write(data, f->data + len, &plan))
		return stat(c, LB_STAT_DROP_MALFORMED, len, FWD_DROP); /* cannot happen: parsed */
	f->data = data;
	f->len = len + plan.len;
	stat(c, LB_STAT_TUNNEL_ENCAP, len, FWD_DROP);
	stat(c, be->port == 0 ? LB_STAT_FWD_TX : LB_STAT_FWD_REDIRECT, len, FWD_OUT);
	count(&c->counters->vips[vip->vip_id], len);
	count(&c->counters->backends[backend_id], len);
	*out_port = port;
	return FWD_OUT;
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
		/* No NAT46: an IPv4 VIP's connection goes to an IPv4 backend. */
		if (!be || be->family != LB_FAMILY_V4)
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

/* ---- NAT mode for IPv6 ---------------------------------------------------
 * lb_conn.h's steps again, on the IPv6 table (struct fwd_conn6_table, keys
 * struct lb_flow_key with family 6) and lb_nat6.h's rewrites; the
 * differences are the nat6 spec's: the key is the 40-byte flow key the DSR
 * path builds (flow_key_v6), the flow hash the 40-byte one, the SNAT pool
 * snat_addrs6, IPv6 backends only, and an L4 header beyond
 * LB_NAT6_MAX_L4_OFF (too many extension headers to rewrite behind) passed
 * to the kernel as pass_ext_headers. Out of line like everything IPv6, so the
 * IPv4 paths compile as they did. */

/* NAT mode is "active" (lb_conn.h, the spec's sections 4 and 6; XDP's
 * nat_active): a NAT VIP is configured, or a connection table of either
 * family still holds entries. Only then do an IPv6 frame for no VIP and an
 * ICMPv6 error go through NAT's checks, so that the planes count a frame
 * beyond LB_NAT6_MAX_L4_OFF alike (pass_ext_headers while active). */
static inline bool nat_active(const struct fwd_packet_ctx *c)
{
	return c->tables->has_nat_vip || (c->conns && fwd_conn_count(c->conns)) ||
	       (c->conns6 && fwd_conn6_count(c->conns6));
}

/* An L4 header NAT can reach: at most LB_NAT6_MAX_L4_OFF into the frame. */
static inline bool nat6_reachable(const struct lb_parsed *p)
{
	return p->l4_off <= LB_NAT6_MAX_L4_OFF;
}

/* nat_out for an IPv6 connection's entry. Its own copy: nat_out shared
 * through a common helper compiled into a different calling convention for
 * the IPv4 callers (gcc's IPA-SRA; two to six instructions more a packet). */
static enum fwd_verdict nat6_out(struct fwd_packet_ctx *c, __u8 *frame, __u32 len,
				 const __u8 *dst_mac, __u32 port, const struct lb_conn6 *e,
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

static enum fwd_verdict nat6_to_backend(struct fwd_packet_ctx *c, __u8 *frame, __u32 len,
					const struct lb_parsed *p, const struct lb_flow_key *key,
					const struct fwd_conn6_slot *o, const struct lb_backend *be,
					__u32 *out_port)
{
	if (lb_conn6_translate(frame, frame + len, p, key, &o->c.peer) != LB_NAT_OK)
		return stat(c, LB_STAT_DROP_MALFORMED, len, FWD_DROP); /* cannot happen: parsed */
	return nat6_out(c, frame, len, be->mac, be->port ? be->port : c->in_port, &o->c, out_port);
}

/* Step 2: a packet matching the reply entry r. */
static enum fwd_verdict nat6_reply(struct fwd_packet_ctx *c, __u8 *frame, __u32 len,
				   const struct lb_parsed *p, const struct lb_flow_key *key,
				   const struct fwd_conn6_slot *r, __u8 tcp_flags, __u32 *out_port)
{
	struct fwd_conn6_slot *o = fwd_conn6_orig(c->conns6, (struct fwd_conn6_slot *)r);

	/* Removed by another worker a moment ago: as if not found. */
	if (!o || !fwd_conn6_update(c->conns6, &c->counters->conns, o, LB_CONN_REPLY, p->proto,
				    tcp_flags, c->now_ns))
		return stat(c, LB_STAT_PASS_NOT_VIP, len, FWD_TO_KERNEL);
	stat(c, LB_STAT_CONN_REPLY, len, FWD_DROP);
	if (lb_conn6_translate(frame, frame + len, p, key, &r->c.peer) != LB_NAT_OK)
		return stat(c, LB_STAT_DROP_MALFORMED, len, FWD_DROP); /* cannot happen: parsed */
	return nat6_out(c, frame, len, r->c.client_mac, r->c.client_port, &r->c, out_port);
}

/* Step 1: a TCP/UDP packet to an IPv6 NAT VIP; key is its flow key. */
static enum fwd_verdict nat6_vip(struct fwd_packet_ctx *c, __u8 *frame, __u32 len,
				 const struct lb_parsed *p, const struct lb_flow_key *key,
				 const struct fwd_vip_slot *vip, __u32 *out_port)
{
	const struct fwd_tables *t = c->tables;
	struct fwd_conn6_table *ct = c->conns6;
	struct fwd_conn_figures *fig = &c->counters->conns;
	const struct lb_backend *be;
	struct fwd_conn6_slot *e;
	struct fwd_conn6_req req;
	enum fwd_conn_open_status st;
	__u32 backend_id;
	__u8 tcp_flags;
	__u64 hash;
	bool evicted;

	if (!ct) /* no table (cannot happen: the forwarder always has one) */
		return stat(c, LB_STAT_DROP_CONN_FULL, len, FWD_DROP);
	if (!nat6_reachable(p))
		return stat(c, LB_STAT_PASS_EXT_HEADERS, len, FWD_TO_KERNEL);
	tcp_flags = lb_tcp_flags6(frame, frame + len, p);
	req.orig_sig = fwd_conn6_sig(ct, key);
	e = fwd_conn6_lookup(ct, key, req.orig_sig);
	/* At most twice, as nat_vip. */
	for (__u32 round = 0; round < 2; round++) {
		if (e && e->c.dir == LB_CONN_REPLY) /* a reply to a pool address that is a VIP's */
			return nat6_reply(c, frame, len, p, key, e, tcp_flags, out_port);
		if (e) {
			be = conn_backend(t, e->c.backend_id);
			if (be) {
				fwd_conn6_update(ct, fig, e, LB_CONN_ORIG, p->proto, tcp_flags,
						 c->now_ns);
				stat(c, LB_STAT_CONN_HIT, len, FWD_DROP);
				return nat6_to_backend(c, frame, len, p, key, e, be, out_port);
			}
			if (t->nat.on_backend_down == LB_NAT_DOWN_DROP)
				return stat(c, LB_STAT_DROP_BACKEND_DOWN, len, FWD_DROP);
			stat(c, LB_STAT_CONN_RESCHEDULE, len, FWD_DROP);
			fwd_conn6_close(ct, fig, e); /* both entries; on as a miss */
		}

		/* Miss. */
		req.tmpl.state = lb_conn_open_state(p->proto, tcp_flags);
		if (req.tmpl.state == LB_CONN_NO_STATE)
			return stat(c, LB_STAT_DROP_CONN_INVALID, len, FWD_DROP);
		hash = lb_flow_hash_v6(t->config.hash_key, key);
		backend_id = pick_backend(t, vip->vip_id, hash);
		be = backend_in(t, backend_id, LB_BACKEND_UP);
		/* No NAT64: an IPv6 VIP's connection goes to an IPv6 backend. */
		if (!be || be->family != LB_FAMILY_V6)
			return stat(c, LB_STAT_DROP_NO_BACKEND, len, FWD_DROP);
		req.orig = *key;
		req.backend_addr = be->addr;
		req.backend_port = vip->nat_port ? vip->nat_port : key->dport;
		req.snat = vip->nat_flags & LB_VIP_F_SNAT;
		/* No IPv6 pool: the unspecified address, which fwd_conn6_open
		 * refuses (drop_snat_exhausted). */
		memset(&req.snat_addr, 0, sizeof(req.snat_addr));
		if (req.snat && t->nat.snat_naddrs6 && t->nat.snat_naddrs6 <= LB_MAX_SNAT_ADDRS)
			req.snat_addr =
				t->nat.snat_addrs6[lb_snat_addr_index(hash, t->nat.snat_naddrs6)];
		req.port_min = t->nat.snat_port_min;
		req.port_max = t->nat.snat_port_max;
		req.hash = hash;
		req.now_ns = c->now_ns;
		memset(&req.tmpl.peer, 0, sizeof(req.tmpl.peer));
		req.tmpl.last_seen_ns = 0;
		req.tmpl.backend_id = backend_id;
		req.tmpl.vip_id = (__u8)vip->vip_id;
		req.tmpl.dir = LB_CONN_ORIG;
		req.tmpl.fin_dirs = 0;
		memcpy(req.tmpl.client_mac, frame + 6, 6); /* the Ethernet source: parsed */
		req.tmpl.client_port = (__u8)c->in_port;
		req.tmpl.flags = 0;
		st = fwd_conn6_open(ct, fig, &req, &e, &evicted);
		if (st == FWD_CONN_EXISTS)
			continue;
		if (st == FWD_CONN_NO_REPLY_KEY)
			return stat(c, LB_STAT_DROP_SNAT_EXHAUSTED, len, FWD_DROP);
		if (st != FWD_CONN_OPENED)
			return stat(c, LB_STAT_DROP_CONN_FULL, len, FWD_DROP);
		if (evicted)
			stat(c, LB_STAT_CONN_EVICT, len, FWD_DROP);
		stat(c, LB_STAT_CONN_NEW, len, FWD_DROP);
		return nat6_to_backend(c, frame, len, p, key, e, be, out_port);
	}
	/* Opened by another worker, then gone again: give up on this one. */
	return stat(c, LB_STAT_DROP_CONN_FULL, len, FWD_DROP);
}

/* Step 2's lookup for an IPv6 frame to no VIP, while NAT is active
 * (nat_active): FWD_DROP with *handled false when it is no reply of ours. */
static enum fwd_verdict nat6_not_vip(struct fwd_packet_ctx *c, __u8 *frame, __u32 len,
				     const struct lb_parsed *p, const struct lb_flow_key *key,
				     __u32 *out_port, bool *handled)
{
	const struct fwd_conn6_slot *e;

	*handled = c->conns6 != NULL; /* no IPv6 table (a self-test's context): nothing of ours */
	if (!*handled)
		return FWD_DROP;
	if (!nat6_reachable(p))
		return stat(c, LB_STAT_PASS_EXT_HEADERS, len, FWD_TO_KERNEL);
	e = fwd_conn6_lookup(c->conns6, key, fwd_conn6_sig(c->conns6, key));
	/* An original entry here is one whose VIP is gone. */
	if (e && e->c.dir == LB_CONN_REPLY)
		return nat6_reply(c, frame, len, p, key, e, lb_tcp_flags6(frame, frame + len, p),
				  out_port);
	*handled = false;
	return FWD_DROP;
}

/* Step 3 for ICMPv6: an error (types 1-4) while NAT is active (nat_active), whose quote, reversed, is a connection's key. FWD_DROP with
 * *handled false when the frame is no error of ours to translate (the
 * caller goes on to neighbour discovery, which passes what it does not
 * answer). */
static enum fwd_verdict nat6_icmp(struct fwd_packet_ctx *c, __u8 *frame, __u32 len,
				  const struct lb_parsed *p, __u32 *out_port, bool *handled)
{
	const struct fwd_tables *t = c->tables;
	struct lb_nat6_icmp ic;
	struct lb_flow_key key;
	const struct fwd_conn6_slot *e;
	const __u8 *mac;
	__u8 type;
	__u32 port;

	*handled = false;
	/* The type byte, if the ICMPv6 header begins in the frame: only the
	 * errors are NAT's; a Neighbor Solicitation goes on to ndp(). */
	if (!c->conns6 || p->l4_off >= len)
		return FWD_DROP;
	type = frame[p->l4_off];
	if (type < LB_ICMP6_DEST_UNREACH || type > LB_ICMP6_PARAMPROB)
		return FWD_DROP;
	*handled = true;
	if (!nat6_reachable(p))
		return stat(c, LB_STAT_PASS_EXT_HEADERS, len, FWD_TO_KERNEL);
	if (lb_nat6_icmp_parse(frame, frame + len, p, &ic) != LB_NAT_OK)
		return stat(c, LB_STAT_PASS_NOT_VIP, len, FWD_TO_KERNEL);
	lb_conn6_icmp_key(&key, &ic);
	e = fwd_conn6_lookup(c->conns6, &key, fwd_conn6_sig(c->conns6, &key));
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
	if (lb_conn6_icmp_translate(frame, frame + len, &ic, &e->c.peer) != LB_NAT_OK)
		return stat(c, LB_STAT_DROP_MALFORMED, len, FWD_DROP); /* cannot happen: parsed */
	stat(c, LB_STAT_NAT_ICMP, len, FWD_DROP);
	return nat6_out(c, frame, len, mac, port, &e->c, out_port);
}

/* DSR and tunnel mode, both families: the flow's pinned backend, or one
 * picked on the ring and pinned; then the MACs rewritten (DSR) or, with
 * `tunnel`, the outer headers put in front. Inlined into each caller; the
 * IPv4 DSR caller passes a constant false, so its path has no mode test
 * beyond the one it always had. */
static inline __attribute__((always_inline)) enum fwd_verdict
dsr_flow(struct fwd_packet_ctx *c, struct fwd_frame *f, const struct lb_parsed *p,
	 const struct lb_flow_key *flow, const struct fwd_vip_slot *vip, bool tunnel,
	 __u32 *out_port)
{
	const struct fwd_tables *t = c->tables;
	const struct lb_backend *backend = NULL;
	struct fwd_flow_slot *pinned;
	__u8 *frame = f->data;
	__u32 len = f->len;
	__u32 backend_id = LB_NO_BACKEND, port;
	hash_sig_t sig;

	sig = fwd_flow_sig(c->flows, flow);
	pinned = fwd_flow_lookup(c->flows, flow, sig, c->now_tsc);
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

		backend_id = pick_backend(t, vip->vip_id, lb_flow_hash(t->config.hash_key, flow));
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
		} else if (fwd_flow_pin(c->flows, flow, sig, &fresh, c->now_tsc) == 1) {
			stat(c, LB_STAT_FLOW_EVICT, len, FWD_DROP);
		}
	}

	/* Port 0 means "back out of the port it came in on" (lb_tables.h). */
	port = backend->port ? backend->port : c->in_port;
	if (port >= c->nports)
		return stat(c, LB_STAT_DROP_TX_ERROR, len, FWD_DROP);
	if (tunnel)
		return tunnel_out(c, f, p, vip, backend, backend_id, port, out_port);
	if (lb_rewrite_macs(frame, frame + len, backend->mac, c->port_macs[port]))
		return stat(c, LB_STAT_DROP_MALFORMED, len, FWD_DROP); /* cannot happen: parsed */
	stat(c, backend->port == 0 ? LB_STAT_FWD_TX : LB_STAT_FWD_REDIRECT, len, FWD_OUT);
	count(&c->counters->vips[vip->vip_id], len);
	count(&c->counters->backends[backend_id], len);
	*out_port = port;
	return FWD_OUT;
}

/* An untagged IPv6 frame (fwd_packet read its EtherType, and its Ethernet
 * header is whole): lb_parse_untagged's verdicts as lb.bpf.c treats them, a
 * Neighbor Solicitation for a VIP or IPv6 SNAT pool address answered, TCP/UDP
 * to an IPv6 VIP balanced in DSR, tunnel or NAT mode as IPv4, and, while the
 * IPv6 connection table holds any connection, a backend's reply or an ICMPv6
 * error about a connection translated back (the NAT steps above). */
static __attribute__((noinline)) enum fwd_verdict ipv6_packet(struct fwd_packet_ctx *c,
							      struct fwd_frame *f,
							      __u32 *out_port)
{
	const struct fwd_tables *t = c->tables;
	struct lb_parsed pkt;
	struct lb_flow_key flow;
	struct lb_vip_key vkey;
	const struct fwd_vip_slot *vip;
	__u32 len = f->len;

	switch (lb_parse_untagged(&pkt, f->data, f->data + len)) {
	case LB_PARSE_OK:
		break;
	case LB_PARSE_UNSUPPORTED_L4:
		/* ICMPv6: an error may quote a NAT connection's packet; a
		 * Neighbor Solicitation may be for a VIP or pool address. */
		if (pkt.proto == LB_IPPROTO_ICMPV6) {
			if (nat_active(c)) {
				bool handled;
				enum fwd_verdict v = nat6_icmp(c, f->data, len, &pkt, out_port,
							       &handled);

				if (handled)
					return v;
			}
			return ndp(c, f, &pkt);
		}
		return stat(c, LB_STAT_PASS_NOT_VIP, len, FWD_TO_KERNEL);
	case LB_PARSE_FRAGMENT:
		return stat(c, LB_STAT_PASS_FRAGMENT, len, FWD_TO_KERNEL);
	case LB_PARSE_EXT_TOO_LONG: /* more extension headers than the parse walks */
		return stat(c, LB_STAT_PASS_EXT_HEADERS, len, FWD_TO_KERNEL);
	default: /* LB_PARSE_MALFORMED (NOT_IP cannot be: the EtherType is IPv6's) */
		return stat(c, LB_STAT_DROP_MALFORMED, len, FWD_DROP);
	}
	flow_key_v6(&flow, &pkt);
	vip_key_v6(&vkey, &flow);
	vip = fwd_vip_lookup(t, &vkey);
	if (!vip) {
		/* A backend's reply to an IPv6 NAT connection (step 2). */
		if (nat_active(c)) {
			bool handled;
			enum fwd_verdict v = nat6_not_vip(c, f->data, len, &pkt, &flow, out_port,
							  &handled);

			if (handled)
				return v;
		}
		if (!t->configured)
			return stat(c, LB_STAT_DROP_NO_BACKEND, len, FWD_DROP); /* see fwd_tables.h */
		return stat(c, LB_STAT_PASS_NOT_VIP, len, FWD_TO_KERNEL);
	}
	if (vip->mode == LB_MODE_NAT)
		return nat6_vip(c, f->data, len, &pkt, &flow, vip, out_port);
	return dsr_flow(c, f, &pkt, &flow, vip, vip->mode == LB_MODE_TUNNEL, out_port);
}

/* An IPv4 packet to a tunnel VIP: dsr_flow's tunnel copy, out of line. */
static __attribute__((noinline)) enum fwd_verdict ipv4_tunnel(struct fwd_packet_ctx *c,
							      struct fwd_frame *f,
							      const struct lb_parsed *p,
							      const struct lb_flow_key *flow,
							      const struct fwd_vip_slot *vip,
							      __u32 *out_port)
{
	return dsr_flow(c, f, p, flow, vip, true, out_port);
}

enum fwd_verdict fwd_packet(struct fwd_packet_ctx *c, struct fwd_frame *f, __u32 *out_port)
{
	const struct fwd_tables *t = c->tables;
	__u8 *frame = f->data;
	__u32 len = f->len;
	struct lb_parsed pkt;
	struct lb_flow_key flow;
	const struct fwd_vip_slot *vip;

	stat(c, LB_STAT_RX, len, FWD_DROP);
	/* The same one-pass parse as lb.bpf.c: the data planes balance untagged
	 * IPv4 and IPv6, in lb_parse_untagged. Its IPv4 half is inlined here,
	 * on the instructions it always had; an IPv6 EtherType is NOT_IP to
	 * it, and only then takes the out-of-line IPv6 path (ipv6_packet: the
	 * rest of lb_parse_untagged), so IPv4 pays nothing for IPv6. */
	switch (lb_parse_untagged_ipv4(&pkt, frame, frame + len)) {
	case LB_PARSE_OK:
		break;
	case LB_PARSE_NOT_IP:
		/* NOT_IP means the Ethernet header is whole. */
		if (((const struct rte_ether_hdr *)frame)->ether_type == RTE_BE16(RTE_ETHER_TYPE_IPV6))
			return ipv6_packet(c, f, out_port);
		/* Untagged ARP is ours to answer for VIP addresses (the kernel
		 * holds none in DPDK mode); the rest, a tagged ARP included (its
		 * EtherType is the tag's), goes to the kernel. */
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
	vip = fwd_vip_lookup_v4(t, pkt.dst.v4, pkt.dport, pkt.proto);
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
	/* One test for DSR, as before tunnel mode: the other modes behind it. */
	if (vip->mode != LB_MODE_DSR) {
		if (vip->mode == LB_MODE_TUNNEL)
			return ipv4_tunnel(c, f, &pkt, &flow, vip, out_port);
		return nat_vip(c, frame, len, &pkt, vip, out_port);
	}
	return dsr_flow(c, f, &pkt, &flow, vip, false, out_port);
}

