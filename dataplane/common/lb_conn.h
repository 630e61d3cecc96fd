/* SPDX-License-Identifier: Apache-2.0
 *
 * lb_conn.h - the NAT gateway mode's connection rules, written once for both
 * data planes (header-only, compiled like lb_parse.h and lb_nat.h: into the
 * XDP program, where the verifier proves every access, and natively into the
 * DPDK forwarder and the tests). control/hpclb/contract/model.py is their
 * reference; the structs are in lb_tables.h ("NAT mode: the connection
 * table"), the packet rewrites in lb_nat.h.
 *
 * What a NAT data plane does with an untagged IPv4 TCP/UDP frame:
 *   1. to a NAT VIP (vip lookup hit, mode LB_MODE_NAT): look the frame's
 *      5-tuple up in the connection table.
 *      - Hit on an original entry whose backend is up or draining: update the
 *        state (lb_conn_next_state), translate (lb_conn_translate) and send to
 *        the backend. conn_hit.
 *      - Hit whose backend is down: on_backend_down RESCHEDULE deletes both
 *        entries and goes on as a miss (conn_reschedule); DROP drops
 *        (drop_backend_down).
 *      - Miss: lb_conn_open_state says whether the frame may open a
 *        connection (a TCP RST may not: drop_conn_invalid). The backend is
 *        picked from the VIP's ring exactly as in DSR mode (the first up
 *        backend among the probe slots of the flow hash; none: drop_no_backend).
 *        The reply key is (backend, client or SNAT address, backend port,
 *        client port or SNAT port): lb_conn_reply_key; with SNAT the port is
 *        the first of the LB_SNAT_PROBES candidates (lb_snat_candidate) whose
 *        reply key is free. Without SNAT the one reply key must be free too
 *        (the same client address and port through two NAT VIPs to one
 *        backend port would share it, and the second connection would steal
 *        the first one's replies); a reply key equal to the connection's own
 *        original key counts as taken. No free reply key: drop_snat_exhausted.
 *        Checks in this order: RST (drop_conn_invalid), backend
 *        (drop_no_backend), reply key (drop_snat_exhausted), room
 *        (drop_conn_full). Both entries are inserted, the original first; a
 *        table without room for both evicts the oldest embryonic connection
 *        (below) or refuses (drop_conn_full). The opening packet sets the
 *        open state only (no lb_conn_next_state). The client's MAC and port
 *        are those of the opening frame. conn_new (after conn_reschedule
 *        when a down backend's connection was moved).
 *   2. not to a VIP: look the 5-tuple up. A reply entry: update the state in
 *      the original entry (named by the peer key), translate, send to the
 *      client's MAC out of the client's port. conn_reply. An original entry
 *      whose VIP is gone, or no entry: pass to the kernel (pass_not_vip).
 *   3. an ICMP error (lb_nat4_icmp_parse) whose quoted packet, reversed, is a
 *      connection's key: translate the quote back (lb_conn_icmp_translate) and
 *      send it where that entry's peer came from. nat_icmp. Any other ICMP,
 *      a malformed or fragmented one included: pass to the kernel
 *      (pass_not_vip). Neither replies nor ICMP errors look at the backend's
 *      state or the VIP (a connection outlives both until it expires) or
 *      change the connection's state.
 * A packet to the backend leaves by the backend's port (0: the port it came
 * in on) with the backend's MAC, a reply or an error for the client by the
 * client's port to the client's MAC; the source MAC is the egress port's.
 * fwd_tx when the egress port is the ingress port, else fwd_redirect (DSR
 * decides by the backend's port number alone); a backend gone from the
 * tables is drop_tx_error. Per-VIP and per-backend counters count both
 * directions.
 *
 * Full table: the data plane keeps the original keys of connections opened
 * embryonic (SYN_SENT, UDP_UNREPLIED) in creation order, in a FIFO holding as
 * many keys as the table has entries (a push onto a full FIFO drops its
 * oldest key); when an insert finds no room it pops up to
 * LB_CONN_EVICT_TRIES keys from the FIFO's head (popped keys are gone),
 * evicts the first whose original entry is in an embryonic state (SYN_SENT,
 * SYN_RECV, UDP_UNREPLIED; both entries; conn_evict), and retries once.
 * An established connection is never evicted: with nothing embryonic, the new
 * connection is refused (drop_conn_full). Idle timeouts (by state, struct
 * lb_nat_config) are enforced by a sweep outside the fast path; the fast path
 * never looks at time except to stamp last_seen_ns.
 *
 * IPv6: all of the above holds for an untagged IPv6 TCP/UDP frame (and
 * ICMPv6 errors: lb_nat6_icmp_parse), with a table and an embryonic FIFO of
 * its own per family, keyed by struct lb_flow_key (family 6), the IPv6 SNAT
 * pool (snat_addrs6[lb_snat_addr_index(hash, snat_naddrs6)], the 40-byte flow
 * hash), IPv6 backends only (another family: drop_no_backend), and the
 * IPv6 functions at the end of this file (lb_tcp_flags6, lb_conn6_*). A NAT
 * frame whose L4 (or ICMPv6) header starts beyond LB_NAT6_MAX_L4_OFF (at most
 * 256 bytes of extension headers) is passed to the kernel, counted
 * pass_ext_headers, before any lookup.
 *
 * There are no loops here; every packet access is bounded as in lb_nat.h.
 */
#ifndef HPCLB_LB_CONN_H
#define HPCLB_LB_CONN_H

#include "lb_nat.h"

#define LB_CONN_INLINE static inline __attribute__((always_inline))

/* TCP flag bits (RFC 793, byte 13 of the header). */
#define LB_TCP_FIN 0x01
#define LB_TCP_SYN 0x02
#define LB_TCP_RST 0x04
#define LB_TCP_ACK 0x10

#define LB_CONN_NO_STATE LB_CONN_STATES /* "this packet opens no connection" */

/* The TCP flags of the IPv4 TCP packet *p describes (parse OK), 0 for UDP or
 * a frame that does not hold them. The L4 offset is re-derived from the IHL
 * byte on the very pointer that is checked (as lb_nat4_rewrite does): a
 * pointer built from p->l4_off, which the compiler reloads from the stack,
 * is one the verifier cannot bound. */
LB_CONN_INLINE __u8 lb_tcp_flags(const void *data, const void *data_end, const struct lb_parsed *p)
{
	const __u8 *end = (const __u8 *)data_end;
	const struct lb_ipv4_hdr *iph;
	const __u8 *l4;
	__u32 l3_off = p->l3_off;

	if (p->family != LB_FAMILY_IPV4 || p->proto != LB_IPPROTO_TCP ||
	    l3_off < LB_NAT_MIN_L3_OFF || l3_off > LB_NAT_MAX_L3_OFF)
		return 0;
	iph = (const struct lb_ipv4_hdr *)((const __u8 *)data + l3_off);
	if (LB_PAST_END(iph, sizeof(*iph), end))
		return 0;
	l4 = (const __u8 *)iph + (iph->ver_ihl & 0xf) * 4u;
	if (LB_PAST_END(l4, 14, end))
		return 0;
	return l4[13];
}

LB_CONN_INLINE int lb_conn_embryonic(__u8 state)
{
	return state == LB_CONN_SYN_SENT || state == LB_CONN_SYN_RECV ||
	       state == LB_CONN_UDP_UNREPLIED;
}

/* The state a connection opened by this original-direction packet starts in,
 * or LB_CONN_NO_STATE. TCP: a SYN (without ACK) opens SYN_SENT; an RST opens
 * nothing; any other segment opens ESTABLISHED, so that a connection that
 * outlived the table (a DPDK restart, an eviction) is picked up mid-stream
 * and, the ring being unchanged, reaches the same backend, as in DSR mode.
 * UDP: UDP_UNREPLIED. Only the client's side can open: after a DPDK restart
 * a backend that speaks first (a retransmission of a reply lost while the
 * forwarder was down) finds no connection, its segment passes to the kernel
 * untranslated, and the client answers it with an RST. The XDP plane keeps
 * its table across restarts (pinned maps) and has no such gap. */
LB_CONN_INLINE __u8 lb_conn_open_state(__u8 proto, __u8 tcp_flags)
{
	if (proto == LB_IPPROTO_UDP)
		return LB_CONN_UDP_UNREPLIED;
	if (tcp_flags & LB_TCP_RST)
		return LB_CONN_NO_STATE;
	if ((tcp_flags & (LB_TCP_SYN | LB_TCP_ACK)) == LB_TCP_SYN)
		return LB_CONN_SYN_SENT;
	return LB_CONN_ESTABLISHED;
}

/* The state after a packet in direction dir (enum lb_conn_dir) of a known
 * connection; *fin_dirs collects the sides that sent FIN.
 *   RST either way                              -> CLOSE
 *   SYN_SENT     reply SYN+ACK                  -> SYN_RECV
 *   SYN_RECV     original ACK without SYN       -> ESTABLISHED
 *   ESTABLISHED, SYN_RECV, FIN_WAIT: a FIN      -> FIN_WAIT, TIME_WAIT once both sides sent one
 *   TIME_WAIT, CLOSE: original SYN (a new connection on the same tuple) -> SYN_SENT,
 *                     with the FIN record cleared
 *   UDP_UNREPLIED reply                         -> UDP_REPLIED
 * anything else keeps the state. */
LB_CONN_INLINE __u8 lb_conn_next_state(__u8 state, __u8 *fin_dirs, __u8 dir, __u8 proto,
				       __u8 tcp_flags)
{
	if (proto == LB_IPPROTO_UDP)
		return (state == LB_CONN_UDP_UNREPLIED && dir == LB_CONN_REPLY) ? LB_CONN_UDP_REPLIED
										: state;
	if (tcp_flags & LB_TCP_RST)
		return LB_CONN_CLOSE;
	if ((state == LB_CONN_TIME_WAIT || state == LB_CONN_CLOSE) && dir == LB_CONN_ORIG &&
	    (tcp_flags & (LB_TCP_SYN | LB_TCP_ACK)) == LB_TCP_SYN) {
		*fin_dirs = 0;
		return LB_CONN_SYN_SENT;
	}
	if (state == LB_CONN_SYN_SENT) {
		if (dir == LB_CONN_REPLY &&
		    (tcp_flags & (LB_TCP_SYN | LB_TCP_ACK)) == (LB_TCP_SYN | LB_TCP_ACK))
			return LB_CONN_SYN_RECV;
		return state;
	}
	if (state == LB_CONN_SYN_RECV && dir == LB_CONN_ORIG &&
	    (tcp_flags & (LB_TCP_SYN | LB_TCP_ACK)) == LB_TCP_ACK)
		state = LB_CONN_ESTABLISHED;
	if ((tcp_flags & LB_TCP_FIN) &&
	    (state == LB_CONN_ESTABLISHED || state == LB_CONN_SYN_RECV || state == LB_CONN_FIN_WAIT)) {
		*fin_dirs |= (__u8)(1u << (dir & 1));
		return *fin_dirs == 3 ? LB_CONN_TIME_WAIT : LB_CONN_FIN_WAIT;
	}
	return state;
}

/* The n-th SNAT source port candidate (host order) of a connection whose flow
 * hash is hash: consecutive ports from a point the hash picks, so that a range
 * of at most LB_SNAT_PROBES ports is tried whole. The address is
 * snat_addrs[hash % snat_naddrs] (lb_snat_addr_index): ports are allocated
 * per pool address. */
LB_CONN_INLINE __u16 lb_snat_candidate(__u64 hash, __u32 n, __u16 port_min, __u16 port_max)
{
	__u32 range = (__u32)port_max - port_min + 1;

	return (__u16)(port_min + (__u32)((hash + n) % range));
}

LB_CONN_INLINE __u32 lb_snat_addr_index(__u64 hash, __u32 naddrs)
{
	return naddrs ? (__u32)((hash >> 32) % naddrs) : 0;
}

/* The reply key of a new connection: what the backend's answer carries.
 * client_addr/client_port are the client's, or the SNAT pair. */
LB_CONN_INLINE void lb_conn_reply_key(struct lb_flow_key_v4 *reply, __be32 backend_addr,
				      __be16 backend_port, __be32 client_addr, __be16 client_port,
				      __u8 proto)
{
	reply->saddr = backend_addr;
	reply->daddr = client_addr;
	reply->sport = backend_port;
	reply->dport = client_port;
	reply->proto = proto;
	reply->pad[0] = 0;
	reply->pad[1] = 0;
	reply->pad[2] = 0;
}

/* Translate the TCP/UDP packet *p describes, whose 5-tuple is key, as the
 * entry naming peer says: it leaves as peer reversed. The destination and the
 * source are each rewritten only when they change (an original packet
 * without SNAT keeps its source). */
LB_CONN_INLINE enum lb_nat_status lb_conn_translate(void *data, const void *data_end,
						    const struct lb_parsed *p,
						    const struct lb_flow_key_v4 *key,
						    const struct lb_flow_key_v4 *peer)
{
	enum lb_nat_status st = LB_NAT_OK;

	if (key->daddr != peer->saddr || key->dport != peer->sport)
		st = lb_nat4_dnat(data, data_end, p, peer->saddr, peer->sport);
	if (st == LB_NAT_OK && (key->saddr != peer->daddr || key->sport != peer->dport))
		st = lb_nat4_snat(data, data_end, p, peer->daddr, peer->dport);
	return st;
}

/* The key to look an ICMP error's quoted packet up under: the quote is a
 * packet the gateway sent, translated, i.e. some entry's peer reversed; so the
 * quote reversed is that peer, the key of the other direction's entry. */
LB_CONN_INLINE void lb_conn_icmp_key(struct lb_flow_key_v4 *key, const struct lb_nat4_icmp *ic)
{
	key->saddr = ic->inner_daddr;
	key->daddr = ic->inner_saddr;
	key->sport = ic->inner_dport;
	key->dport = ic->inner_sport;
	key->proto = ic->inner_proto;
	key->pad[0] = 0;
	key->pad[1] = 0;
	key->pad[2] = 0;
}

/* Translate the ICMP error *ic describes, whose quote reversed is the key of
 * an entry naming orig (the key of the direction the quoted packet was sent
 * in, before translation): the quote becomes that packet again. Each quoted
 * field that changes carries its mirrored outer field along (lb_nat4_icmp_rewrite):
 * a restored quoted destination rewrites the outer source (an error about a
 * DNATed packet then comes from the VIP), a restored quoted source rewrites
 * the outer destination (the error reaches the original sender). */
LB_CONN_INLINE enum lb_nat_status lb_conn_icmp_translate(void *data, const void *data_end,
							 const struct lb_nat4_icmp *ic,
							 const struct lb_flow_key_v4 *orig)
{
	struct lb_nat4_xlat x;
	enum lb_nat_status st = LB_NAT_OK;

	x.pad = 0;
	if (ic->inner_daddr != orig->daddr || ic->inner_dport != orig->dport) {
		x.addr = orig->daddr;
		x.port = orig->dport;
		x.side = LB_NAT_DST;
		st = lb_nat4_icmp_rewrite(data, data_end, ic, &x, orig->daddr);
	}
	if (st == LB_NAT_OK && (ic->inner_saddr != orig->saddr || ic->inner_sport != orig->sport)) {
		x.addr = orig->saddr;
		x.port = orig->sport;
		x.side = LB_NAT_SRC;
		st = lb_nat4_icmp_rewrite(data, data_end, ic, &x, orig->saddr);
	}
	return st;
}

/* ---- IPv6 ------------------------------------------------------------------
 * The same rules for an IPv6 connection (its own table, struct lb_conn6 keyed
 * by struct lb_flow_key with family 6, lb_tables.h); only the key layout and
 * the rewrites (lb_nat6.h) differ. A NAT packet whose L4 header starts beyond
 * LB_NAT6_MAX_L4_OFF is passed to the kernel (pass_ext_headers) by the
 * planes before any lookup: the functions below refuse it too. */

/* The TCP flags of the IPv6 TCP packet *p describes (parse OK), 0 for UDP, a
 * frame that does not hold them or an L4 header beyond LB_NAT6_MAX_L4_OFF.
 * The L4 offset is the parse's (the extension chain cannot be re-derived from
 * one byte), made a bound the verifier sees by lb_nat6_off. lb_tcp_flags
 * stays IPv4's own, so that its path does not grow a branch. */
LB_CONN_INLINE __u8 lb_tcp_flags6(const void *data, const void *data_end, const struct lb_parsed *p)
{
	const __u8 *l4;
	__u32 l4_off = lb_nat6_l4_off(p);

	if (p->family != LB_FAMILY_IPV6 || p->proto != LB_IPPROTO_TCP ||
	    l4_off > LB_NAT6_MAX_L4_OFF || l4_off < LB_NAT_MIN_L3_OFF + LB_IPV6_HLEN)
		return 0;
	l4 = (const __u8 *)data + lb_nat6_off(l4_off);
	if (LB_PAST_END(l4, 14, data_end))
		return 0;
	return l4[13];
}

/* The reply key of a new IPv6 connection (lb_conn_reply_key's): every byte
 * written, family 6, pad 0. */
LB_CONN_INLINE void lb_conn6_reply_key(struct lb_flow_key *reply, const union lb_addr *backend_addr,
				       __be16 backend_port, const union lb_addr *client_addr,
				       __be16 client_port, __u8 proto)
{
	__builtin_memcpy(reply->saddr.v6, backend_addr->v6, 16);
	__builtin_memcpy(reply->daddr.v6, client_addr->v6, 16);
	reply->sport = backend_port;
	reply->dport = client_port;
	reply->proto = proto;
	reply->family = LB_FAMILY_IPV6;
	reply->pad[0] = 0;
	reply->pad[1] = 0;
}

/* lb_conn_translate for IPv6: the packet *p describes, whose 5-tuple is key,
 * leaves as peer reversed; the destination first, if it changes, then the
 * source, if it changes. */
LB_CONN_INLINE enum lb_nat_status lb_conn6_translate(void *data, const void *data_end,
						     const struct lb_parsed *p,
						     const struct lb_flow_key *key,
						     const struct lb_flow_key *peer)
{
	int dst = lb_addr6_ne(&key->daddr, &peer->saddr) || key->dport != peer->sport;
	int src = lb_addr6_ne(&key->saddr, &peer->daddr) || key->sport != peer->dport;

	if (!dst && !src)
		return LB_NAT_OK;
	/* One pass for both (lb_nat6_xlat): the bytes of lb_nat6_dnat then
	 * lb_nat6_snat, for half the verifier's work. */
	return lb_nat6_xlat(data, data_end, p, dst ? &peer->saddr : 0, peer->sport,
			    src ? &peer->daddr : 0, peer->dport);
}

/* lb_conn_icmp_key for IPv6: the quote reversed, family 6, pad 0. */
LB_CONN_INLINE void lb_conn6_icmp_key(struct lb_flow_key *key, const struct lb_nat6_icmp *ic)
{
	__builtin_memcpy(key->saddr.v6, ic->inner_daddr.v6, 16);
	__builtin_memcpy(key->daddr.v6, ic->inner_saddr.v6, 16);
	key->sport = ic->inner_dport;
	key->dport = ic->inner_sport;
	key->proto = ic->inner_proto;
	key->family = LB_FAMILY_IPV6;
	key->pad[0] = 0;
	key->pad[1] = 0;
}

/* lb_conn_icmp_translate for IPv6: the quote becomes the packet orig names
 * again; a restored quoted destination carries the outer source along to
 * orig->daddr, then a restored quoted source the outer destination to
 * orig->saddr (lb_nat6_icmp_rewrite). */
LB_CONN_INLINE enum lb_nat_status lb_conn6_icmp_translate(void *data, const void *data_end,
							  const struct lb_nat6_icmp *ic,
							  const struct lb_flow_key *orig)
{
	enum lb_nat_status st = LB_NAT_OK;

	if (lb_addr6_ne(&ic->inner_daddr, &orig->daddr) || ic->inner_dport != orig->dport)
		st = lb_nat6_icmp_rewrite(data, data_end, ic, LB_NAT_DST, &orig->daddr,
					  orig->dport, &orig->daddr);
	if (st == LB_NAT_OK &&
	    (lb_addr6_ne(&ic->inner_saddr, &orig->saddr) || ic->inner_sport != orig->sport))
		st = lb_nat6_icmp_rewrite(data, data_end, ic, LB_NAT_SRC, &orig->saddr,
					  orig->sport, &orig->saddr);
	return st;
}

#endif /* HPCLB_LB_CONN_H */
