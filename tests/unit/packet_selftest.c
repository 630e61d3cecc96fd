/* SPDX-License-Identifier: Apache-2.0
 *
 * packet_selftest.c - the DPDK forwarder's per-frame decisions
 * (dataplane/dpdk/fwd_packet.c) on the real tables, flow table and counters,
 * where the wire cannot reach: the room around a frame (tunnel mode with too
 * little headroom is drop_encap and leaves the frame as it was; a Neighbor
 * Advertisement longer than the solicitation needs tailroom, shorter leaves
 * the frame shorter), IPv6 flows pinned under their 40-byte keys, and the
 * IPv6 verdicts that go to the kernel; and NAT mode over IPv6 (the IPv6
 * connection table, SNAT from the IPv6 pool, the reply, an ICMPv6 error
 * translated back, Neighbor Solicitations for the pool, the bound on
 * extension headers, IPv6 backends only). The frames are built here byte by
 * byte and the checksums recomputed by this file's own code.
 * Run by tests/unit/test_dpdk_packet.py under a small EAL (--no-huge).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <rte_byteorder.h>
#include <rte_eal.h>
#include <rte_malloc.h>

#include "fwd_packet.h"

#include "selftest.h"

/* fwd_store_init's NAT defaults live in lb_proto_codec.c (msgpack); NAT is
 * not exercised here. */
void lb_proto_nat_defaults(struct lb_nat_config *nat)
{
	memset(nat, 0, sizeof(*nat));
}

#define RING 13
#define ROOM 128

static const __u8 port_mac[1][6] = { { 0x02, 0, 0, 0, 0, 0x01 } };
static const __u8 client_mac[6] = { 0x02, 0xaa, 0, 0, 0, 0x01 };
static const __u8 b4_mac[6] = { 0x02, 0xbb, 0, 0, 0, 0x04 };
static const __u8 b6_mac[6] = { 0x02, 0xbb, 0, 0, 0, 0x06 };
static const __u8 vip6[16] = { 0xfd, 0, [15] = 0x10 };
static const __u8 client6[16] = { 0xfd, 0, 0, 7, [15] = 0x01 };
static const __u8 backend6[16] = { 0xfd, 0, 0, 2, [15] = 0x01 };
static const __u8 tsrc6[16] = { 0xfd, 0, 0, 9 };
static const __u8 snat6[16] = { 0xfd, 0, 0, 0x0a, [15] = 0x01 };
#define VIP4 0x1401a8c6u     /* 198.168.1.20, network order */
#define CLIENT4 0x0107a8c6u  /* 198.168.7.1 */
#define BACKEND4 0x0102a8c6u /* 198.168.2.1 */
#define TSRC4 0x0009a8c6u    /* 198.168.9.0 */

static struct fwd_context ctx;
static struct fwd_flow_table flows;
static struct fwd_conn6_table conns6;
static struct fwd_counters *counters;
static __u8 buf[ROOM + 2048];

static __u64 stat_of(enum lb_stat s)
{
	return counters->global[s].packets;
}

static void put16(__u8 *p, __u16 v)
{
	p[0] = (__u8)(v >> 8);
	p[1] = (__u8)v;
}

/* RFC 1071 over big-endian words, folded; this file's own. */
static __u32 sum16(const __u8 *b, __u32 n, __u32 s)
{
	for (__u32 i = 0; i < n; i += 2)
		s += (__u32)b[i] << 8 | (i + 1 < n ? b[i + 1] : 0);
	return s;
}

static __u16 fold(__u32 s)
{
	while (s >> 16)
		s = (s & 0xffff) + (s >> 16);
	return (__u16)s;
}

/* The ICMPv6 checksum field value for the n-byte message at msg, in the
 * IPv6 packet whose header is at ip6. */
static __u16 icmp6_check_at(const __u8 *ip6, const __u8 *msg, __u32 n)
{
	__u32 s = sum16(ip6 + 8, 32, 0) + n + 58;

	return (__u16)~fold(sum16(msg, n, s));
}

static __u16 icmp6_check(const __u8 *ip6, __u32 n)
{
	return icmp6_check_at(ip6, ip6 + 40, n);
}

static __u8 *eth(__u8 *f, __u16 type)
{
	memcpy(f, port_mac[0], 6);
	memcpy(f + 6, client_mac, 6);
	put16(f + 12, type);
	return f + 14;
}

/* An IPv4 UDP frame at f, 8 bytes of payload. Returns its length. */
static __u32 udp4(__u8 *f, __u32 daddr, __u16 sport, __u16 dport)
{
	__u8 *ip = eth(f, 0x0800), *udp = ip + 20;

	memset(ip, 0, 36);
	ip[0] = 0x45;
	ip[1] = 0xb8;
	put16(ip + 2, 36);
	ip[8] = 7;
	ip[9] = 17;
	memcpy(ip + 12, &(__u32){ CLIENT4 }, 4);
	memcpy(ip + 16, &daddr, 4);
	put16(ip + 10, (__u16)~fold(sum16(ip, 20, 0)));
	put16(udp, sport);
	put16(udp + 2, dport);
	put16(udp + 4, 16);
	return 14 + 36;
}

/* An IPv6 header at ip: payload plen, next header nh, hop limit hl. */
static void ip6hdr(__u8 *ip, const __u8 *src, const __u8 *dst, __u16 plen, __u8 nh, __u8 hl)
{
	memset(ip, 0, 40);
	ip[0] = 0x60;
	put16(ip + 4, plen);
	ip[6] = nh;
	ip[7] = hl;
	memcpy(ip + 8, src, 16);
	memcpy(ip + 24, dst, 16);
}

static __u32 udp6(__u8 *f, __u16 sport, __u16 dport)
{
	__u8 *ip = eth(f, 0x86DD), *udp = ip + 40;

	ip6hdr(ip, client6, vip6, 16, 17, 9);
	memset(udp, 0, 16);
	put16(udp, sport);
	put16(udp + 2, dport);
	put16(udp + 4, 16);
	return 14 + 56;
}

/* A Neighbor Solicitation for target from src, with optlen bytes of
 * options (a source link-layer option, then 8-byte nonce options). */
static __u32 ns(__u8 *f, const __u8 *src, const __u8 *target, __u32 optlen)
{
	__u8 *ip = eth(f, 0x86DD), *icmp = ip + 40;
	__u32 n = 24 + optlen;

	ip6hdr(ip, src, (const __u8[16]){ 0xff, 0x02, [11] = 1, [12] = 0xff, [15] = 0x10 },
	       (__u16)n, 58, 255);
	memset(icmp, 0, n);
	icmp[0] = 135;
	memcpy(icmp + 8, target, 16);
	for (__u32 off = 24; off + 8 <= n; off += 8) {
		icmp[off] = off == 24 ? 1 : 14; /* SLLA, then nonces (RFC 3971) */
		icmp[off + 1] = 1;
		memcpy(icmp + off + 2, client_mac, 6);
	}
	put16(icmp + 2, icmp6_check(ip, n));
	return 14 + 40 + n;
}

static enum fwd_verdict run(__u8 *frame, __u32 len, __u32 head, __u32 tail,
			    struct fwd_frame *f, __u32 *port)
{
	struct fwd_packet_ctx c = {
		.tables = fwd_tables_current(&ctx.store),
		.flows = &flows,
		.conns6 = conns6.h ? &conns6 : NULL,
		.counters = counters,
		.port_macs = port_mac,
		.nports = 1,
		.now_tsc = 1,
		.now_ns = 1,
	};

	f->data = frame;
	f->len = len;
	f->headroom = head;
	f->tailroom = tail;
	*port = 99;
	return fwd_packet(&c, f, port);
}

static int setup(void)
{
	struct lb_config cfg = { .ring_size = RING };
	struct lb_backend b[2] = { 0 };
	__u32 ids[2] = { 0, 1 }, ring4[RING], ring6[RING];
	struct {
		__u32 id;
		__u8 family, mode, encap;
		__u16 port;
	} vips[] = {
		{ 1, LB_FAMILY_V4, LB_MODE_TUNNEL, LB_ENCAP_IPIP, 53 },
		{ 2, LB_FAMILY_V6, LB_MODE_TUNNEL, LB_ENCAP_GUE, 53 },
		{ 3, LB_FAMILY_V6, LB_MODE_DSR, 0, 80 },
	};
	/* NAT mode over IPv6: TCP 80 with SNAT to the backends' 8080, TCP 81
	 * whose ring holds the IPv4 backend only (no NAT64: drop_no_backend). */
	struct {
		__u32 id;
		__u16 port;
		__u8 flags;
		__u32 *ring;
	} nat6[] = { { 4, 80, LB_VIP_F_SNAT, ring6 }, { 5, 81, 0, ring4 } };
	struct lb_nat_config nat = { .snat_port_min = 20000, .snat_port_max = 20999,
				     .timeouts_s = LB_CONN_TIMEOUTS_DEFAULT };
	int rc;

	rc = fwd_store_init(&ctx.store, &cfg, 1, SOCKET_ID_ANY);
	if (rc)
		return rc;
	counters = rte_zmalloc("counters", sizeof(*counters), 64);
	ctx.counters = &counters;
	ctx.nworkers = 1;
	if (!counters || fwd_tables_ops.set_config(&ctx, &cfg))
		return -1;
	b[0].addr.v4 = BACKEND4;
	b[0].family = LB_FAMILY_V4;
	memcpy(b[0].mac, b4_mac, 6);
	memcpy(b[1].addr.v6, backend6, 16);
	b[1].family = LB_FAMILY_V6;
	memcpy(b[1].mac, b6_mac, 6);
	if (fwd_tables_ops.set_backends(&ctx, ids, b, 2))
		return -1;
	for (__u32 i = 0; i < RING; i++) {
		ring4[i] = 0;
		ring6[i] = 1;
	}
	for (__u32 i = 0; i < sizeof(vips) / sizeof(vips[0]); i++) {
		struct lb_vip_key k = { .port = rte_cpu_to_be_16(vips[i].port), .proto = 17,
					.family = vips[i].family };
		struct lb_vip_entry e = { .vip_id = vips[i].id, .mode = vips[i].mode };

		if (vips[i].family == LB_FAMILY_V4) {
			k.addr.v4 = VIP4;
		} else {
			memcpy(k.addr.v6, vip6, 16);
		}
		if (vips[i].mode == LB_MODE_TUNNEL) {
			e.tunnel_encap = vips[i].encap;
			e.tunnel_family = vips[i].family;
			if (vips[i].family == LB_FAMILY_V4)
				e.tunnel_src.v4 = TSRC4;
			else
				memcpy(e.tunnel_src.v6, tsrc6, 16);
			if (vips[i].encap == LB_ENCAP_GUE)
				e.gue_port = rte_cpu_to_be_16(6080);
		}
		if (fwd_tables_ops.set_vip(&ctx, &k, &e) ||
		    fwd_tables_ops.write_ring(&ctx, vips[i].id,
					      vips[i].family == LB_FAMILY_V4 ? ring4 : ring6))
			return -1;
	}
	for (__u32 i = 0; i < sizeof(nat6) / sizeof(nat6[0]); i++) {
		struct lb_vip_key k = { .port = rte_cpu_to_be_16(nat6[i].port), .proto = 6,
					.family = LB_FAMILY_V6 };
		struct lb_vip_entry e = { .vip_id = nat6[i].id, .mode = LB_MODE_NAT,
					  .nat_flags = nat6[i].flags,
					  .nat_port = rte_cpu_to_be_16(8080) };

		memcpy(k.addr.v6, vip6, 16);
		if (fwd_tables_ops.set_vip(&ctx, &k, &e) ||
		    fwd_tables_ops.write_ring(&ctx, nat6[i].id, nat6[i].ring))
			return -1;
	}
	memcpy(nat.snat_addrs6[0].v6, snat6, 16);
	nat.snat_naddrs6 = 1;
	if (fwd_tables_ops.set_nat(&ctx, &nat))
		return -1;
	return fwd_flow_init(&flows, "packet_selftest", 1024, 1000000, SOCKET_ID_ANY);
}

static void tunnel_room(void)
{
	__u8 *frame = buf + ROOM, copy[64];
	struct fwd_frame f;
	__u32 len, port;
	enum fwd_verdict v;

	/* 19 bytes of headroom for a 20-byte outer header: dropped, counted,
	 * and nothing written, in front or in the frame. */
	len = udp4(frame, VIP4, 40000, 53);
	memcpy(copy, frame, len);
	memset(frame - 19, 0xee, 19);
	v = run(frame, len, 19, 0, &f, &port);
	CHECK(v == FWD_DROP && stat_of(LB_STAT_DROP_ENCAP) == 1, "short headroom: %d", v);
	CHECK(!memcmp(copy, frame, len) && frame[-1] == 0xee && frame[-19] == 0xee,
	      "short headroom: frame changed");
	CHECK(f.data == frame && f.len == len, "short headroom: extent moved");

	/* 20 bytes: exactly enough (the flow was pinned by the drop above). */
	v = run(frame, len, 20, 0, &f, &port);
	CHECK(v == FWD_OUT && port == 0, "IPIP: verdict %d port %u", v, port);
	CHECK(f.data == frame - 20 && f.len == len + 20, "IPIP: extent %td %u", frame - f.data,
	      f.len);
	CHECK(!memcmp(f.data, b4_mac, 6) && !memcmp(f.data + 6, port_mac[0], 6) &&
	      f.data[12] == 0x08 && f.data[13] == 0x00, "IPIP: Ethernet header");
	CHECK(f.data[14] == 0x45 && f.data[15] == 0xb8 && f.data[23] == 4 &&
	      f.data[16] == 0 && f.data[17] == 56 && fold(sum16(f.data + 14, 20, 0)) == 0xffff,
	      "IPIP: outer IPv4 header");
	CHECK(!memcmp(f.data + 34, copy + 14, len - 14), "IPIP: inner packet changed");
	CHECK(stat_of(LB_STAT_TUNNEL_ENCAP) == 1 && stat_of(LB_STAT_FWD_TX) == 1 &&
	      stat_of(LB_STAT_FLOW_NEW) == 1 && stat_of(LB_STAT_FLOW_HIT) == 1,
	      "IPIP: counters");

	/* GUE over IPv6: 48 bytes. */
	len = udp6(frame, 40001, 53);
	memcpy(copy, frame, len);
	v = run(frame, len, 47, 0, &f, &port);
	CHECK(v == FWD_DROP && stat_of(LB_STAT_DROP_ENCAP) == 2, "GUE6 short: %d", v);
	v = run(frame, len, ROOM, 0, &f, &port);
	CHECK(v == FWD_OUT && f.data == frame - 48 && f.len == len + 48, "GUE6: %d", v);
	CHECK(f.data[12] == 0x86 && f.data[13] == 0xdd && f.data[14 + 6] == 17 &&
	      !memcmp(f.data + 14 + 8, tsrc6, 16) && !memcmp(f.data + 14 + 24, backend6, 16),
	      "GUE6: outer IPv6 header");
	CHECK(f.data[54 + 2] == 6080 >> 8 && f.data[54 + 3] == (6080 & 0xff) &&
	      f.data[54 + 6] == 0 && f.data[54 + 7] == 0, "GUE6: UDP header");
	CHECK(!memcmp(f.data + 62, copy + 14, len - 14), "GUE6: inner packet changed");
}

static void ipv6_flows(void)
{
	__u8 *frame = buf + ROOM;
	struct fwd_frame f;
	__u64 hit = stat_of(LB_STAT_FLOW_HIT), fresh = stat_of(LB_STAT_FLOW_NEW);
	__u32 len = udp6(frame, 40100, 80), port;
	enum fwd_verdict v;

	/* DSR: the MACs, nothing else; the second frame hits the pin. */
	v = run(frame, len, ROOM, 0, &f, &port);
	CHECK(v == FWD_OUT && f.data == frame && f.len == len && !memcmp(frame, b6_mac, 6),
	      "IPv6 DSR: %d", v);
	len = udp6(frame, 40100, 80);
	v = run(frame, len, ROOM, 0, &f, &port);
	CHECK(v == FWD_OUT && stat_of(LB_STAT_FLOW_NEW) == fresh + 1 &&
	      stat_of(LB_STAT_FLOW_HIT) == hit + 1, "IPv6 DSR: pinned once, hit once");
	/* Another source port: another flow. */
	len = udp6(frame, 40101, 80);
	v = run(frame, len, ROOM, 0, &f, &port);
	CHECK(v == FWD_OUT && stat_of(LB_STAT_FLOW_NEW) == fresh + 2, "IPv6 DSR: a second flow");
	/* No VIP on this port. */
	len = udp6(frame, 40101, 81);
	CHECK(run(frame, len, ROOM, 0, &f, &port) == FWD_TO_KERNEL &&
	      stat_of(LB_STAT_PASS_NOT_VIP) == 1, "IPv6 non-VIP");

	/* Nine destination-options headers: more than lb_parse walks. */
	{
		__u8 *ip = eth(frame, 0x86DD);

		ip6hdr(ip, client6, vip6, 9 * 8 + 8, 60, 64);
		memset(ip + 40, 0, 9 * 8 + 8);
		for (int i = 0; i < 9; i++)
			ip[40 + i * 8] = i < 8 ? 60 : 17;
		CHECK(run(frame, 14 + 40 + 80, ROOM, 0, &f, &port) == FWD_TO_KERNEL &&
		      stat_of(LB_STAT_PASS_EXT_HEADERS) == 1, "IPv6 extension chain");
	}
	/* A first fragment of UDP. */
	{
		__u8 *ip = eth(frame, 0x86DD);

		ip6hdr(ip, client6, vip6, 8 + 16, 44, 64);
		memset(ip + 40, 0, 24);
		ip[40] = 17;
		ip[43] = 1; /* M */
		CHECK(run(frame, 14 + 40 + 24, ROOM, 0, &f, &port) == FWD_TO_KERNEL &&
		      stat_of(LB_STAT_PASS_FRAGMENT) == 1, "IPv6 fragment");
	}
	/* A payload length beyond the frame. */
	len = udp6(frame, 40102, 80);
	CHECK(run(frame, len - 1, ROOM, 0, &f, &port) == FWD_DROP &&
	      stat_of(LB_STAT_DROP_MALFORMED) == 1, "IPv6 truncated");
}

static void ndp_room(void)
{
	__u8 *frame = buf + ROOM, *ip = frame + 14, *icmp = frame + 54;
	struct fwd_frame f;
	__u64 pass = stat_of(LB_STAT_PASS_NOT_VIP);
	__u32 len, port;
	enum fwd_verdict v;

	/* No options: 78 bytes, the answer 86. Without 8 bytes of tailroom it
	 * is not answered short but left to the kernel. */
	len = ns(frame, client6, vip6, 0);
	v = run(frame, len, 0, 7, &f, &port);
	CHECK(v == FWD_TO_KERNEL && stat_of(LB_STAT_PASS_NOT_VIP) == pass + 1 &&
	      icmp[0] == 135, "NS, no tailroom: %d", v);
	v = run(frame, len, 0, 8, &f, &port);
	CHECK(v == FWD_REPLY && f.data == frame && f.len == 86 &&
	      stat_of(LB_STAT_NDP_REPLY) == 1, "NS: %d, len %u", v, f.len);
	CHECK(!memcmp(frame, client_mac, 6) && !memcmp(frame + 6, port_mac[0], 6),
	      "NA: Ethernet header");
	CHECK(ip[0] == 0x60 && ip[4] == 0 && ip[5] == 32 && ip[6] == 58 && ip[7] == 255 &&
	      !memcmp(ip + 8, vip6, 16) && !memcmp(ip + 24, client6, 16), "NA: IPv6 header");
	CHECK(icmp[0] == 136 && icmp[1] == 0 && icmp[4] == 0x60 && !memcmp(icmp + 8, vip6, 16) &&
	      icmp[24] == 2 && icmp[25] == 1 && !memcmp(icmp + 26, port_mac[0], 6),
	      "NA: message");
	CHECK(fold(sum16(ip + 8, 32, 32 + 58) + sum16(icmp, 32, 0)) == 0xffff, "NA: checksum");

	/* Three options (24 bytes): the answer is shorter than the request. */
	len = ns(frame, client6, vip6, 24);
	v = run(frame, len, 0, 0, &f, &port);
	CHECK(v == FWD_REPLY && f.len == 86 && stat_of(LB_STAT_NDP_REPLY) == 2, "NS+opts: %d", v);

	/* An option running past the message: not a solicitation to answer. */
	len = ns(frame, client6, vip6, 8);
	icmp[25] = 2;
	put16(icmp + 2, 0);
	put16(icmp + 2, icmp6_check(ip, 32));
	CHECK(run(frame, len, 0, 64, &f, &port) == FWD_TO_KERNEL, "NS, option too long");
	/* Another target. */
	len = ns(frame, client6, backend6, 8);
	CHECK(run(frame, len, 0, 64, &f, &port) == FWD_TO_KERNEL, "NS, not a VIP");
	/* Behind a hop-by-hop header: the kernel's, which judges those. */
	len = ns(frame, client6, vip6, 0);
	memmove(icmp + 8, icmp, 24);
	ip[6] = 0;
	put16(ip + 4, 8 + 24);
	memset(icmp, 0, 8);
	icmp[0] = 58;
	icmp[2] = 1; /* PadN, 4 bytes */
	icmp[3] = 4;
	put16(icmp + 8 + 2, 0);
	put16(icmp + 8 + 2, icmp6_check_at(ip, icmp + 8, 24));
	CHECK(run(frame, len + 8, 0, 64, &f, &port) == FWD_TO_KERNEL, "NS behind hop-by-hop");
	/* A hop limit below 255: forwarded onto the link, not from it. */
	len = ns(frame, client6, vip6, 8);
	ip[7] = 254;
	CHECK(run(frame, len, 0, 64, &f, &port) == FWD_TO_KERNEL, "NS, hop limit 254");
	/* A wrong checksum. */
	len = ns(frame, client6, vip6, 8);
	icmp[3] ^= 1;
	CHECK(run(frame, len, 0, 64, &f, &port) == FWD_TO_KERNEL, "NS, bad checksum");
	CHECK(stat_of(LB_STAT_NDP_REPLY) == 2, "answered twice: %llu",
	      (unsigned long long)stat_of(LB_STAT_NDP_REPLY));
}

/* ---- NAT mode over IPv6 ------------------------------------------------- */

/* The TCP (or UDP) checksum of the n-byte segment at l4 in the IPv6 packet
 * at ip6 is right: the sum over pseudo-header and segment is 0xffff. */
static bool l4_ok6(const __u8 *ip6, const __u8 *l4, __u32 n, __u8 proto)
{
	__u32 s = sum16(ip6 + 8, 32, 0) + n + proto;

	return fold(sum16(l4, n, s)) == 0xffff;
}

/* A TCP segment (20-byte header, no payload) from src:sport to dst:dport
 * with flags, behind ext bytes of destination options. Returns the frame's
 * length; *l4 is the TCP header. */
static __u32 tcp6(__u8 *f, const __u8 *src, const __u8 *dst, __u16 sport, __u16 dport,
		  __u8 flags, __u32 ext, __u8 **l4)
{
	__u8 *ip = eth(f, 0x86DD), *o = ip + 40, *t = o + ext;

	ip6hdr(ip, src, dst, (__u16)(ext + 20), ext ? 60 : 6, 64);
	if (ext) {
		memset(o, 0, ext);
		o[0] = 6;                     /* next header: TCP */
		o[1] = (__u8)(ext / 8 - 1);   /* length in 8-byte units, the first not counted */
		o[2] = 1;                     /* a PadN option over the rest */
		o[3] = (__u8)(ext - 4);
	}
	memset(t, 0, 20);
	put16(t, sport);
	put16(t + 2, dport);
	put16(t + 4, 0x1234);
	t[12] = 0x50;
	t[13] = flags;
	put16(t + 14, 512);
	put16(t + 16, (__u16)~fold(sum16(t, 20, sum16(ip + 8, 32, 0) + 20 + 6)));
	*l4 = t;
	return 14 + 40 + ext + 20;
}

static void nat6_paths(void)
{
	__u8 *frame = buf + ROOM, *t, *ip = frame + 14, sent[128];
	struct lb_conn_stats cs;
	struct lb_nat_config nat;
	struct fwd_frame f;
	__u32 len, port, sent_len;
	__u64 before;
	__u16 sport;
	int rc;

	rc = fwd_conn6_init(&conns6, "packet_conns6", 64, 1, NULL, SOCKET_ID_ANY);
	CHECK(rc == 0, "IPv6 connection table: %d", rc);
	if (rc)
		return;
	ctx.conns6 = &conns6;

	/* A SYN to the IPv6 NAT VIP: to the IPv6 backend's 8080, from a pool
	 * pair, the TCP checksum right. */
	len = tcp6(frame, client6, vip6, 40000, 80, 0x02, 0, &t);
	CHECK(run(frame, len, 0, 0, &f, &port) == FWD_OUT && port == 0, "IPv6 SYN: not sent");
	CHECK(!memcmp(frame, b6_mac, 6) && !memcmp(frame + 6, port_mac[0], 6), "SYN: MACs");
	sport = (__u16)(t[0] << 8 | t[1]);
	CHECK(!memcmp(ip + 8, snat6, 16) && !memcmp(ip + 24, backend6, 16) && sport >= 20000 &&
	      sport <= 20999 && t[2] == 8080 >> 8 && t[3] == (8080 & 0xff),
	      "SYN: translated to pool port %u", sport);
	CHECK(l4_ok6(ip, t, 20, 6), "SYN: TCP checksum");
	CHECK(stat_of(LB_STAT_CONN_NEW) == 1 && fwd_conn6_count(&conns6) == 2, "SYN: conn_new");
	sent_len = len - 14;
	memcpy(sent, ip, sent_len);

	/* The backend's SYN+ACK to the pool pair: back from the VIP to the
	 * client's MAC. */
	len = tcp6(frame, backend6, snat6, 8080, sport, 0x12, 0, &t);
	memcpy(frame + 6, b6_mac, 6);
	CHECK(run(frame, len, 0, 0, &f, &port) == FWD_OUT, "IPv6 SYN+ACK: not sent");
	CHECK(!memcmp(frame, client_mac, 6) && !memcmp(ip + 8, vip6, 16) &&
	      !memcmp(ip + 24, client6, 16) && t[0] == 0 && t[1] == 80 &&
	      t[2] == 40000 >> 8 && t[3] == (40000 & 0xff), "SYN+ACK: translated back");
	CHECK(l4_ok6(ip, t, 20, 6), "SYN+ACK: TCP checksum");
	CHECK(stat_of(LB_STAT_CONN_REPLY) == 1, "conn_reply");

	/* The backend resolves the pool address: answered like a VIP's. */
	len = ns(frame, backend6, snat6, 8);
	CHECK(run(frame, len, 0, 64, &f, &port) == FWD_REPLY && !memcmp(ip + 8, snat6, 16),
	      "NS for the IPv6 pool address");
	CHECK(stat_of(LB_STAT_NDP_REPLY) == 3, "ndp_reply %llu",
	      (unsigned long long)stat_of(LB_STAT_NDP_REPLY));

	/* The backend's port unreachable about the SYN it got: the quote
	 * restored (client -> VIP), the error from the VIP to the client. */
	{
		__u8 *icmp = ip + 40;
		__u32 n = 8 + sent_len;

		eth(frame, 0x86DD);
		ip6hdr(ip, backend6, snat6, (__u16)n, 58, 64);
		memset(icmp, 0, 8);
		icmp[0] = 1;
		icmp[1] = 4;
		memcpy(icmp + 8, sent, sent_len);
		put16(icmp + 2, icmp6_check(ip, n));
		len = 14 + 40 + n;
		CHECK(run(frame, len, 0, 0, &f, &port) == FWD_OUT, "ICMPv6 error: not sent");
		CHECK(!memcmp(frame, client_mac, 6) && !memcmp(ip + 8, vip6, 16) &&
		      !memcmp(ip + 24, client6, 16), "ICMPv6 error: outer addresses");
		CHECK(!memcmp(icmp + 8 + 8, client6, 16) && !memcmp(icmp + 8 + 24, vip6, 16) &&
		      icmp[48] == 40000 >> 8 && icmp[49] == (40000 & 0xff) && icmp[50] == 0 &&
		      icmp[51] == 80, "ICMPv6 error: the quote restored");
		CHECK(fold(sum16(icmp, n, sum16(ip + 8, 32, 0) + n + 58)) == 0xffff,
		      "ICMPv6 error: checksum");
		CHECK(l4_ok6(icmp + 8, icmp + 48, 20, 6), "ICMPv6 error: quoted TCP checksum");
		CHECK(stat_of(LB_STAT_NAT_ICMP) == 1, "nat_icmp");
		/* The same error again, now quoting nothing of ours (the quote
		 * is the client's packet): to the kernel. */
		CHECK(run(frame, len, 0, 0, &f, &port) == FWD_TO_KERNEL &&
		      stat_of(LB_STAT_NAT_ICMP) == 1, "an error about no connection");
	}

	/* Extension headers: 8 bytes are translated behind; 264 are beyond
	 * LB_NAT6_MAX_L4_OFF and pass to the kernel, untouched. */
	len = tcp6(frame, client6, vip6, 40001, 80, 0x02, 8, &t);
	CHECK(run(frame, len, 0, 0, &f, &port) == FWD_OUT && !memcmp(ip + 24, backend6, 16) &&
	      l4_ok6(ip, t, 20, 6), "SYN behind 8 bytes of options");
	len = tcp6(frame, client6, vip6, 40002, 80, 0x02, 264, &t);
	memcpy(sent, frame, 128);
	before = stat_of(LB_STAT_PASS_EXT_HEADERS);
	CHECK(run(frame, len, 0, 0, &f, &port) == FWD_TO_KERNEL &&
	      stat_of(LB_STAT_PASS_EXT_HEADERS) == before + 1 && !memcmp(sent, frame, 128),
	      "SYN behind 264 bytes of options");
	/* A reply of no VIP behind as many: the same bound (spec 4 b). */
	len = tcp6(frame, backend6, snat6, 8080, sport, 0x10, 264, &t);
	CHECK(run(frame, len, 0, 0, &f, &port) == FWD_TO_KERNEL &&
	      stat_of(LB_STAT_PASS_EXT_HEADERS) == before + 2, "a reply behind 264 bytes");

	/* An IPv6 NAT VIP whose ring names the IPv4 backend: no NAT64. */
	len = tcp6(frame, client6, vip6, 40003, 81, 0x02, 0, &t);
	CHECK(run(frame, len, 0, 0, &f, &port) == FWD_DROP &&
	      stat_of(LB_STAT_DROP_NO_BACKEND) == 1, "IPv4 backend for an IPv6 NAT VIP: %llu",
	      (unsigned long long)stat_of(LB_STAT_DROP_NO_BACKEND));

	/* No IPv6 pool while the VIP wants SNAT: drop_snat_exhausted. */
	nat = fwd_tables_current(&ctx.store)->nat;
	nat.snat_naddrs6 = 0;
	CHECK(fwd_tables_ops.set_nat(&ctx, &nat) == 0, "set_nat");
	len = tcp6(frame, client6, vip6, 40004, 80, 0x02, 0, &t);
	CHECK(run(frame, len, 0, 0, &f, &port) == FWD_DROP &&
	      stat_of(LB_STAT_DROP_SNAT_EXHAUSTED) == 1, "no IPv6 pool");

	/* The figures: both tables (IPv4's absent here: the IPv6 one alone). */
	CHECK(fwd_tables_ops.read_conns(&ctx, &cs) == 0 && cs.capacity == 64 && cs.entries == 4 &&
	      cs.snat_ports_in_use == 2 && cs.by_state[LB_CONN_SYN_SENT] == 1 &&
	      cs.by_state[LB_CONN_SYN_RECV] == 1,
	      "figures: capacity %llu entries %llu snat %llu", (unsigned long long)cs.capacity,
	      (unsigned long long)cs.entries, (unsigned long long)cs.snat_ports_in_use);
}

int main(int argc, char **argv)
{
	int rc;

	if (rte_eal_init(argc, argv) < 0) {
		printf("EAL init failed\n");
		return 2;
	}
	rc = setup();
	CHECK(rc == 0, "setup: %d", rc);
	if (rc == 0) {
		tunnel_room();
		ipv6_flows();
		ndp_room();
		nat6_paths(); /* last: the IPv6 table is not empty after it */
	}
	if (failures) {
		printf("packet_selftest: %d failures\n", failures);
		return 1;
	}
	printf("packet_selftest: ok\n");
	return 0;
}
