// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/*
 * decap.bpf.c - the backend's side of tunnel mode: strip the outer headers
 * that the appliance put in front of a client's packet (lb_encap.h) and hand
 * the inner packet to the backend's kernel, which holds the VIP on loopback
 * and answers the client directly (DSR).
 *
 * Why an XDP program and not the kernel's tunnel devices: a backend whose
 * kernel has ipip/ip6_tunnel/fou does the same with an ipip or ip6tnl device
 * (or `ip fou add port 6080 gue`), but the kernels hpclb is tested on have
 * none of those modules; this program needs nothing but XDP. It is attached
 * to the backend's interface that faces the appliance (docs/ARCHITECTURE.md,
 * "Tunnel mode", the backends, has the set-up).
 *
 * What is decapsulated (every header's length checked against the frame):
 *   untagged IPv4, not a fragment, proto 4 (IPIP) or 41 (6in4), or proto 17
 *     to the GUE port;
 *   untagged IPv6, next header 4 (4in6) or 41 (6in6), or 17 to the GUE
 *     port, directly after the fixed header (the appliance never writes
 *     extension headers);
 *   GUE is variant 1, "direct IP encapsulation" (what lb_encap.h writes): the
 *     UDP payload starts with the inner IP header, whose version nibble says
 *     the family; the UDP checksum is not checked (the appliance writes 0).
 * The outer destination address is not checked: any tunnel frame that
 * reaches this interface with this host's MAC is decapsulated, like a Linux
 * ipip device with no local address ("any"). What the inner packet is for is
 * the kernel's business after that: a backend does not forward, so an inner
 * packet for an address it does not hold is dropped by its routing.
 * Decapsulating = move the MACs forward over the outer headers,
 * bpf_xdp_adjust_head(+outer), EtherType of the inner family, XDP_PASS; the
 * inner packet's bytes are untouched (no TTL change, as Linux's ipip).
 * Counted in decap_stats: [0] decapsulated, [1] passed (not a tunnel frame:
 * XDP_PASS untouched), [2] malformed (a tunnel frame whose outer or inner
 * headers do not hold together: truncated, wrong inner version for the outer
 * protocol, inner length past the frame; XDP_DROP, as the kernel's tunnel
 * would drop it).
 *
 * Configuration: decap_config[0].gue_port, the GUE UDP port in host order;
 * 0 (the map's initial value) means LB_GUE_PORT_DEFAULT (lb_tables.h), 6080, the
 * port hpclb's tunnel configuration uses unless told otherwise. The loader
 * writes it with `bpftool map update` (the lab: hpclb.lab.tunnel).
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "lb_encap.h" /* the outer headers' constants: what is taken off is what it writes */

enum { DECAP_STAT_DECAP = 0, DECAP_STAT_PASS = 1, DECAP_STAT_MALFORMED = 2, DECAP_STAT_MAX };

struct decap_config {
	__u16 gue_port; /* host order; 0 = LB_GUE_PORT_DEFAULT */
	__u16 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct decap_config);
} decap_config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, DECAP_STAT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} decap_stats SEC(".maps");

static __always_inline int count(__u32 idx, int verdict)
{
	__u64 *c = bpf_map_lookup_elem(&decap_stats, &idx);

	if (c)
		__sync_fetch_and_add(c, 1);
	return verdict;
}

static __always_inline __u16 gue_port(void)
{
	__u32 zero = 0;
	struct decap_config *cfg = bpf_map_lookup_elem(&decap_config, &zero);

	return cfg && cfg->gue_port ? cfg->gue_port : LB_GUE_PORT_DEFAULT;
}

/* The inner packet at `inner` (first byte) is of `version` and fits the frame
 * with its own length: 0, else -1 (malformed). */
static __always_inline int inner_ok(const __u8 *inner, const void *end, __u8 version)
{
	if (LB_PAST_END(inner, 1, end) || (inner[0] >> 4) != version)
		return -1;
	if (version == 4) {
		const struct lb_ipv4_hdr *ip = (const void *)inner;

		if (LB_PAST_END(ip, sizeof(*ip), end) || (ip->ver_ihl & 0xf) < 5)
			return -1;
		if (LB_PAST_END(ip, lb_ntohs(ip->tot_len), end) || lb_ntohs(ip->tot_len) < 20)
			return -1;
	} else {
		const struct lb_ipv6_hdr *ip6 = (const void *)inner;

		if (LB_PAST_END(ip6, sizeof(*ip6), end))
			return -1;
		if (LB_PAST_END(ip6, (__u32)sizeof(*ip6) + lb_ntohs(ip6->payload_len), end))
			return -1;
	}
	return 0;
}

/* How many bytes of outer IP (+UDP) headers start at l3 for a tunnel frame
 * of this outer protocol, and the inner version: >0 outer length, 0 not a
 * tunnel frame (pass), -1 a malformed tunnel frame (drop). */
static __always_inline int tunnel_len(const __u8 *l3, const void *end, __u32 ip_hlen,
				      __u32 ip_end, __u8 proto, __u8 *version)
{
	const __u8 *payload = l3 + ip_hlen;

	if (proto == LB_IPPROTO_IPIP || proto == LB_IPPROTO_IPV6) {
		*version = proto == LB_IPPROTO_IPIP ? 4 : 6;
		return (int)ip_hlen;
	}
	if (proto == LB_IPPROTO_UDP) {
		const struct lb_l4_ports *udp = (const void *)payload;

		if (LB_PAST_END(payload, LB_UDP_HLEN, end))
			return 0; /* not ours to judge: the kernel drops a short UDP */
		if (lb_ntohs(udp->dport) != gue_port())
			return 0;
		if (ip_end < ip_hlen + LB_UDP_HLEN + 1 || LB_PAST_END(payload, LB_UDP_HLEN + 1, end))
			return -1;
		*version = payload[LB_UDP_HLEN] >> 4;
		if (*version != 4 && *version != 6)
			return -1; /* a GUE variant 0 header, or not GUE at all */
		return (int)(ip_hlen + LB_UDP_HLEN);
	}
	return 0;
}

SEC("xdp")
int xdp_decap(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct lb_eth_hdr *eth = data;
	const __u8 *l3 = (const __u8 *)data + sizeof(*eth);
	__u8 macs[2 * LB_ETH_ALEN];
	__u8 version = 0;
	__u32 ip_end;
	int outer;

	if (LB_PAST_END(eth, sizeof(*eth), end))
		return count(DECAP_STAT_PASS, XDP_PASS);
	if (eth->proto == lb_htons(LB_ETH_P_IP)) {
		const struct lb_ipv4_hdr *ip = (const void *)l3;
		__u32 hlen;

		if (LB_PAST_END(ip, sizeof(*ip), end) || (ip->ver_ihl >> 4) != 4)
			return count(DECAP_STAT_PASS, XDP_PASS);
		hlen = (__u32)(ip->ver_ihl & 0xf) * 4;
		ip_end = lb_ntohs(ip->tot_len);
		/* A fragment is the kernel's to reassemble; no tunnel ever is one
		 * here (the appliance sets DF). */
		if (hlen < 20 || ip_end < hlen || LB_PAST_END(ip, ip_end, end) ||
		    (lb_ntohs(ip->frag_off) & (LB_IP_MF | LB_IP_OFFSET)))
			return count(DECAP_STAT_PASS, XDP_PASS);
		outer = tunnel_len(l3, end, hlen, ip_end, ip->proto, &version);
	} else if (eth->proto == lb_htons(LB_ETH_P_IPV6)) {
		const struct lb_ipv6_hdr *ip6 = (const void *)l3;

		if (LB_PAST_END(ip6, sizeof(*ip6), end) || (l3[0] >> 4) != 6)
			return count(DECAP_STAT_PASS, XDP_PASS);
		ip_end = (__u32)sizeof(*ip6) + lb_ntohs(ip6->payload_len);
		if (LB_PAST_END(ip6, ip_end, end))
			return count(DECAP_STAT_PASS, XDP_PASS);
		outer = tunnel_len(l3, end, sizeof(*ip6), ip_end, ip6->nexthdr, &version);
	} else {
		return count(DECAP_STAT_PASS, XDP_PASS);
	}
	if (outer == 0)
		return count(DECAP_STAT_PASS, XDP_PASS);
	/* outer <= 60 + 8: the verifier needs the bound for the pointer below. */
	if (outer < 0 || outer > 68 || inner_ok(l3 + outer, end, version) < 0)
		return count(DECAP_STAT_MALFORMED, XDP_DROP);

	__builtin_memcpy(macs, eth, sizeof(macs));
	/* The pointers above are invalid after this. */
	if (bpf_xdp_adjust_head(ctx, outer))
		return count(DECAP_STAT_MALFORMED, XDP_DROP);
	data = (void *)(long)ctx->data;
	end = (void *)(long)ctx->data_end;
	eth = data;
	if (LB_PAST_END(eth, sizeof(*eth), end))
		return count(DECAP_STAT_MALFORMED, XDP_DROP);
	__builtin_memcpy(eth, macs, sizeof(macs));
	eth->proto = lb_htons(version == 4 ? LB_ETH_P_IP : LB_ETH_P_IPV6);
	return count(DECAP_STAT_DECAP, XDP_PASS);
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
