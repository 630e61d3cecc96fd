/* SPDX-License-Identifier: Apache-2.0
 *
 * lb_proto.h - the table-protocol server (version 2, see PROTOCOL.md), shared by
 * the XDP daemon and the DPDK forwarder.
 *
 * The server parses one msgpack request, validates the whole message against a
 * shadow copy of the configured tables, and only then applies it through the
 * data plane's ops. It never talks to a socket: the caller hands it a request
 * buffer and gets a reply buffer back, so it can be tested and fuzzed alone.
 *
 * lb_proto_ops.c implements it (the shadow tables, what each op does to them)
 * over lb_proto_codec.c (the wire format and every per-field check).
 */
#ifndef HPCLB_LB_PROTO_H
#define HPCLB_LB_PROTO_H

#include <stdbool.h>
#include <stddef.h>
#include <msgpack.h>

#include "lb_tables.h"

/* A port's own counters (DPDK: rte_eth_stats and xstats). */
struct lb_port_stats {
	__u64 rx_packets, rx_bytes, tx_packets, tx_bytes;
	__u64 rx_missed;   /* dropped by the NIC: no RX descriptor free */
	__u64 rx_errors, tx_errors;
	__u64 rx_nombuf;   /* no mbuf to receive into */
	__u64 rx_crc_errors;
};

#define LB_PORT_STAT_FIELDS 9

/* How a data plane applies changes. Every call returns 0 or a negative errno.
 * The server calls them only with validated arguments (ids in range, VIP known,
 * ring_size slots) and updates its shadow only when they succeed; on failure it
 * tries to restore the previous contents with the same calls. */
struct lb_dataplane_ops {
	int (*set_config)(void *ctx, const struct lb_config *cfg);
	/* vip is whole (pad 0). Mode 1 with an IPv6 key only where info.nat6
	 * (LB_VIP_F_SNAT then only with snat_naddrs6 > 0). Mode 2 only where
	 * info.tunnel, and then with a
	 * tunnel_src (IPv6 for an IPv6 VIP), nat_port 0, gue_port non-zero
	 * exactly with LB_ENCAP_GUE; other modes have tunnel_encap, gue_port
	 * and tunnel_src_bits 0. */
	int (*set_vip)(void *ctx, const struct lb_vip_key *key, const struct lb_vip_entry *vip);
	int (*del_vip)(void *ctx, const struct lb_vip_key *key);
	/* Upsert n backend entries; state LB_BACKEND_UNUSED empties an entry. */
	int (*set_backends)(void *ctx, const __u32 *ids, const struct lb_backend *b, size_t n);
	/* Replace the whole ring of vip_id: exactly ring_size slots. */
	int (*write_ring)(void *ctx, __u32 vip_id, const __u32 *slots);
	/* Change n slots of the ring of vip_id, in order (a repeated slot: last wins). */
	int (*patch_ring)(void *ctx, __u32 vip_id, const struct lb_ring_patch *p, size_t n);
	/* Counters summed over CPUs: global[LB_STAT_MAX], vips[LB_MAX_VIPS],
	 * backends[LB_MAX_BACKENDS]. */
	int (*read_stats)(void *ctx, struct lb_counter *global, struct lb_counter *vips,
			  struct lb_counter *backends);
	/* Optional (NULL: the stats reply has no "ports"): the NIC counters of
	 * port 0..nports-1, as the port's driver reports them. */
	int (*read_port_stats)(void *ctx, __u32 port, struct lb_port_stats *out);
	/* NAT mode (lb_conn.h). Both NULL in a data plane without it: its hello
	 * lacks the "nat" capability and reports conn_table_size 0, and the
	 * server refuses NAT VIPs (set_vip mode 1) and set_nat.
	 *
	 * set_nat replaces the whole NAT configuration with *nat, which the
	 * server has validated (lb_proto_nat_check): snat_naddrs <=
	 * LB_MAX_SNAT_ADDRS distinct unicast addresses (none in 0.0.0.0/8,
	 * 127.0.0.0/8 or 224.0.0.0/3), the entries after them 0; likewise
	 * snat_naddrs6 <= LB_MAX_SNAT_ADDRS distinct unicast IPv6 addresses
	 * (not ::, ::1, ff00::/8, fe80::/10 nor ::ffff:0:0/96), only where
	 * info.nat6 (else snat_naddrs6 is 0),
	 * 1 <= snat_port_min <= snat_port_max, on_backend_down an enum
	 * lb_nat_down, pad 0, every timeout 1..INT32_MAX. The server never
	 * calls it at start: a data plane starts with lb_proto_nat_defaults'
	 * values itself. Existing connections keep their translation (their
	 * entries carry it); the new pool, port range and down policy are for
	 * the connections opened after the call, the timeouts for every
	 * connection from the sweep after it. On failure the server calls it
	 * again with the previous configuration (the rollback). */
	int (*set_nat)(void *ctx, const struct lb_nat_config *nat);
	/* The connection table's figures (the stats reply's "conns"; with
	 * info.nat6, each figure the sum over the IPv4 and the IPv6 table,
	 * capacity included); *out is zeroed by the server first. Optional even with set_nat: NULL, the
	 * stats reply has no "conns". A failure gives an empty "conns" map
	 * rather than failing stats. */
	int (*read_conns)(void *ctx, struct lb_conn_stats *out);
};

/* Static facts reported by hello. */
struct lb_proto_port {
	char ifname[16];
	__u32 ifindex;
	__u8 mac[6];
};

struct lb_proto_info {
	const char *dataplane;   /* "xdp" or "dpdk" */
	const char *attach_mode; /* "native", "generic" or "none" */
	__u32 nports;            /* 1..LB_MAX_PORTS; index 0 = the ingress port */
	struct lb_proto_port ports[LB_MAX_PORTS];
	const char *const *capabilities; /* NULL-terminated */
	__u32 conn_table_size;   /* NAT connection-table entries, of each family's
	                          * table with nat6 (0: no NAT mode;
	                          * hello reports 0 whatever this says when the
	                          * ops have no set_nat) */
	bool tunnel;             /* the fast path does tunnel mode (VIP mode 2,
	                          * lb_encap.h): set_vip accepts mode 2. The data
	                          * plane also lists "tunnel" in capabilities */
	bool nat6;               /* the fast path does NAT mode for IPv6 VIPs
	                          * (an IPv6 connection table, the IPv6 SNAT
	                          * pool): set_vip accepts mode 1 with a 16-byte
	                          * VIP. Meaningful only with set_nat; the data
	                          * plane also lists "nat6" in capabilities */
};

/* The configured tables. A VIP's ring exists while the VIP does. */
struct lb_proto_vip {
	bool used;
	__u8 mode;
	__u8 tunnel_family;       /* of tunnel_src; 0: none given */
	__u16 nat_port;           /* network order, 0 = the VIP's port */
	__u8 nat_flags;           /* LB_VIP_F_* (NAT mode only) */
	struct lb_vip_key key;    /* IPv4: the address's other 12 bytes 0 */
	union lb_addr tunnel_src; /* 0 when tunnel_family is 0 */
	__u8 tunnel_encap;        /* enum lb_encap: tunnel mode only, 0 otherwise */
	__u8 tunnel_src_bits;     /* 0..LB_TUNNEL_SRC_BITS_MAX: tunnel mode only, 0 otherwise */
	__be16 gue_port;          /* network order: tunnel mode with GUE only, 0 otherwise */
};

/* The table entry of VIP vip_id whose shadow is *v (every lb_vip_entry field,
 * pad 0), and back: what a data plane writes to its VIP table and reads from
 * it (XDP: lb_proto_server_restore's input from pinned maps). The key and
 * 'used' are not in the entry; lb_proto_vip_from_entry leaves them alone. */
void lb_proto_vip_entry(const struct lb_proto_vip *v, __u32 vip_id, struct lb_vip_entry *e);
void lb_proto_vip_from_entry(const struct lb_vip_entry *e, struct lb_proto_vip *v);

struct lb_proto_state {
	struct lb_config config;                     /* ring_size fixed at start */
	struct lb_proto_vip vips[LB_MAX_VIPS];       /* indexed by vip_id */
	struct lb_backend backends[LB_MAX_BACKENDS]; /* state UNUSED = empty */
	__u32 *rings[LB_MAX_VIPS];                   /* ring_size slots, NULL if unused */
	struct lb_nat_config nat;                    /* lb_proto_nat_defaults until set_nat */
};

/* The NAT configuration a data plane starts with, and the server's until
 * set_nat: no SNAT address, ports 1024..65535, LB_NAT_DOWN_RESCHEDULE, the
 * timeouts of LB_CONN_TIMEOUTS_DEFAULT. */
void lb_proto_nat_defaults(struct lb_nat_config *nat);

/* Whether *nat is a configuration set_nat would accept on a plane with nat6
 * (see set_nat above; both pools checked, IPv4 first). 0, or -EINVAL with
 * err naming the field at fault (errlen > 0): snat_addrs[i] or
 * snat_addrs6[i], the struct's arrays. */
int lb_proto_nat_check(const struct lb_nat_config *nat, char *err, size_t errlen);

/* What one request did, for the caller's log line. Valid until the next call. */
struct lb_proto_outcome {
	const char *op;    /* op name, or "?" when the request had none */
	bool ok;
	bool changed;      /* tables were modified */
	const char *error; /* "" when ok */
};

struct lb_proto_server;

/* Empty tables (no VIP, every backend UNUSED, every ring slot LB_NO_BACKEND)
 * with the given configuration; the caller has put the data plane in the same
 * state. info is copied. Returns NULL on a bad argument or no memory. */
struct lb_proto_server *lb_proto_server_new(const struct lb_dataplane_ops *ops, void *ctx,
					    const struct lb_proto_info *info,
					    const struct lb_config *cfg);
void lb_proto_server_free(struct lb_proto_server *srv);

/* Adopt tables read back from a data plane that outlived its daemon (pinned
 * maps). st->config.ring_size must equal the server's. Everything is checked
 * as a request would be; on error nothing changes and err says why. The rings
 * are copied; st stays the caller's.
 * NAT: with ops->set_nat, st->nat must be filled (what the data plane holds,
 * lb_proto_nat_defaults when it never had a set_nat) and pass
 * lb_proto_nat_check, with snat_naddrs6 0 unless info->nat6; a VIP may be
 * mode LB_MODE_NAT (IPv4; IPv6 too with info->nat6) and carry nat_flags
 * LB_VIP_F_SNAT (NAT VIPs only, and only with a SNAT address of the VIP's
 * family in st->nat). Without ops->set_nat, st->nat is ignored (the server
 * keeps the defaults) and every VIP must be DSR with nat_flags 0.
 * Tunnel: with info->tunnel a VIP may be mode LB_MODE_TUNNEL, with a
 * tunnel_src (IPv6 for an IPv6 VIP), tunnel_encap an enum lb_encap, gue_port
 * non-zero exactly with GUE, tunnel_src_bits <= LB_TUNNEL_SRC_BITS_MAX and
 * nat_port 0; any other VIP has tunnel_encap, gue_port and tunnel_src_bits 0
 * (lb_proto_vip_from_entry fills them from the table entries). */
int lb_proto_server_restore(struct lb_proto_server *srv, const struct lb_proto_state *st,
			    char *err, size_t errlen);

/* Replaces the facts hello reports (e.g. the attach mode, known only after
 * the program is attached). nports must not shrink below a configured
 * backend's port; returns -EINVAL (and changes nothing) if it would. */
int lb_proto_server_set_info(struct lb_proto_server *srv, const struct lb_proto_info *info);

/* Read-only view of the shadow tables. */
const struct lb_proto_state *lb_proto_server_state(const struct lb_proto_server *srv);

/* Handle one request of len bytes. The reply (always a valid msgpack map,
 * also for garbage input) is appended to reply, which the caller has
 * initialised. Returns 0 when the request succeeded, -1 when it was rejected
 * or failed, -ENOMEM when not even an error reply could be built. */
int lb_proto_handle(struct lb_proto_server *srv, const void *req, size_t len,
		    msgpack_sbuffer *reply, struct lb_proto_outcome *out);

/* Appends {"v":2,"ok":false,"error":msg} to reply: for requests the transport
 * rejects before the server sees them (multi-part messages). 0 or -ENOMEM. */
int lb_proto_error_reply(msgpack_sbuffer *reply, const char *msg);

#endif /* HPCLB_LB_PROTO_H */
