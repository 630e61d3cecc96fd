/* SPDX-License-Identifier: Apache-2.0 */
#include <string.h>
#include <rte_arp.h>
#include <rte_byteorder.h>
#include <rte_ether.h>

#include "fwd_packet.h"
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

/* First up backend among the probe slots of this flow, or LB_NO_BACKEND. */
static __u32 pick_backend(const struct fwd_tables *t, __u32 vip_id, const struct lb_flow_key *k)
{
	const __u32 *ring = t->rings[vip_id];
	__u32 ring_size = t->config.ring_size;
	__u64 hash;

	if (!ring || ring_size < 3)
		return LB_NO_BACKEND;
	hash = lb_flow_hash(t->config.hash_key, k);
	for (__u32 n = 0; n < LB_RING_PROBES; n++) {
		__u32 id = ring[lb_probe_slot(hash, ring_size, n)];

		if (id != LB_NO_BACKEND && backend_in(t, id, LB_BACKEND_UP))
			return id;
	}
	return LB_NO_BACKEND;
}

/* An ARP request for a VIP address becomes its reply, in place. */
static enum fwd_verdict arp(struct fwd_packet_ctx *c, __u8 *frame, __u32 len)
{
	struct rte_ether_hdr *eth = (struct rte_ether_hdr *)frame;
	struct rte_arp_hdr *a = (struct rte_arp_hdr *)(eth + 1);
	const __u8 *mac = c->port_macs[c->in_port];
	__u32 vip;

	if (len < sizeof(*eth) + sizeof(*a) || a->arp_hardware != RTE_BE16(RTE_ARP_HRD_ETHER) ||
	    a->arp_protocol != RTE_BE16(RTE_ETHER_TYPE_IPV4) || a->arp_hlen != 6 ||
	    a->arp_plen != 4 || a->arp_opcode != RTE_BE16(RTE_ARP_OP_REQUEST) ||
	    !fwd_is_vip_addr(c->tables, a->arp_data.arp_tip))
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
		return stat(c, LB_STAT_PASS_NOT_VIP, len, FWD_TO_KERNEL);
	case LB_PARSE_FRAGMENT:
		return stat(c, LB_STAT_PASS_FRAGMENT, len, FWD_TO_KERNEL);
	default: /* LB_PARSE_MALFORMED (LB_PARSE_EXT_TOO_LONG is IPv6's: not here) */
		return stat(c, LB_STAT_DROP_MALFORMED, len, FWD_DROP);
	}
	flow_key_v4(&flow, &pkt);
	vip_key_v4(&vkey, &flow);
	vip = fwd_vip_lookup(t, &vkey);
	if (!vip && !t->configured)
		return stat(c, LB_STAT_DROP_NO_BACKEND, len, FWD_DROP); /* see fwd_tables.h */
	if (!vip)
		return stat(c, LB_STAT_PASS_NOT_VIP, len, FWD_TO_KERNEL);

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

		backend_id = pick_backend(t, vip->vip_id, &flow);
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
