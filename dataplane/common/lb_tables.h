/* SPDX-License-Identifier: Apache-2.0
 *
 * lb_tables.h - every structure and size shared by the control plane and the
 * data planes (XDP program, XDP daemon, DPDK forwarder).
 *
 * Sizes live here and nowhere else. Python mirrors these layouts in
 * control/hpclb/contract/tables.py; tests/unit/test_tables_layout.py compiles
 * this header and checks that every size and offset agrees.
 *
 * All multi-byte address and port fields are in network byte order, exactly as
 * they appear in the packet, so the fast path never swaps bytes.
 */
#ifndef HPCLB_LB_TABLES_H
#define HPCLB_LB_TABLES_H

#if defined(__BPF__) || defined(__linux__)
/* Linux userspace too: libbpf and DPDK headers pull in <linux/types.h>, whose
 * __u64 (unsigned long long) conflicts with a uint64_t typedef. */
#include <linux/types.h>
#else
#include <stdint.h>
typedef uint8_t __u8;
typedef uint16_t __u16;
typedef uint32_t __u32;
typedef uint64_t __u64;
#endif

/* ---- sizes ------------------------------------------------------------- */

#define LB_PROTOCOL_VERSION 2

#define LB_MAX_VIPS 64           /* VIP table entries; a VIP's id is its ring id */
#define LB_MAX_BACKENDS 4096     /* backend table entries, ids 0..LB_MAX_BACKENDS-1 */
#define LB_RING_SIZE_DEFAULT 65537 /* Maglev table size, a prime */
#define LB_RING_SIZE_MAX 1048573   /* largest prime ring the data planes accept */
#define LB_MAX_FLOWS 1048576     /* flow-affinity entries, shared by all CPUs */
#define LB_MAX_PORTS 8           /* egress ports: 0 = the ingress port (one-arm) */
#define LB_HASH_KEY_LEN 16       /* SipHash-2-4 key */
#define LB_RING_PROBES 8         /* ring slots tried when a slot's backend is not up */
#define LB_MAX_MSG_BYTES (16u << 20) /* largest table-protocol message accepted */

/* A ring slot that belongs to nobody (every weight 0): packets are dropped. */
#define LB_NO_BACKEND 0xffffffffu

/* ---- addresses --------------------------------------------------------- */

/* An address family, as the tables store it: the IP version number, so that
 * a key's family byte reads the same as the packet's version nibble. */
enum lb_family {
	LB_FAMILY_V4 = 4,
	LB_FAMILY_V6 = 6,
};

/* One IPv4 or IPv6 address, network order. An IPv4 address is in v4 and the
 * other 12 bytes are 0: keys are compared and hashed as raw bytes, so a
 * lookup must never carry garbage there. */
union lb_addr {
	__u32 v4;
	__u32 v6w[4];
	__u8 v6[16];
};

/* ---- VIPs -------------------------------------------------------------- */

struct lb_vip_key {
	union lb_addr addr; /* network order; IPv4 in .v4, the other 12 bytes 0 */
	__u16 port;         /* L4 destination port, network order */
	__u8 proto;         /* IPPROTO_TCP or IPPROTO_UDP */
	__u8 family;        /* enum lb_family */
}; /* 20 bytes, no implicit padding: compared and hashed as raw bytes */

enum lb_vip_mode {
	LB_MODE_DSR = 0,    /* rewrite the destination MAC; the backend answers directly */
	LB_MODE_NAT = 1,    /* stateful NAT gateway: DNAT in, reverse out (lb_conn.h) */
	LB_MODE_TUNNEL = 2, /* DSR through an IPIP or GUE tunnel to an L3-distant backend (lb_encap.h) */
};

/* Tunnel mode's encapsulations (lb_encap.h has the exact headers). */
enum lb_encap {
	LB_ENCAP_IPIP = 0, /* IPv4-in-IPv4 (proto 4), IPv6-in-IPv6 (41), IPv4-in-IPv6 (4) */
	LB_ENCAP_GUE = 1,  /* the same inside UDP (GUE variant 1: no GUE header) */
};

#define LB_GUE_PORT_DEFAULT 6080     /* GUE's outer UDP destination port unless set */
#define LB_TUNNEL_SRC_BITS_MAX 16    /* low bits of the outer source address a flow may set */

struct lb_vip_entry {
	__u32 vip_id;             /* index of the VIP's ring and counters, < LB_MAX_VIPS */
	__u8 mode;                /* enum lb_vip_mode */
	__u8 tunnel_family;       /* enum lb_family of tunnel_src, 0 when none is set */
	__u16 nat_port;           /* NAT mode's backend port, network order (0 = the VIP's port) */
	union lb_addr tunnel_src; /* tunnel mode's outer source address (0 when none) */
	__u8 nat_flags;           /* LB_VIP_F_*: NAT mode only, 0 otherwise */
	__u8 tunnel_encap;        /* enum lb_encap: tunnel mode only, 0 otherwise */
	__be16 gue_port;          /* GUE's outer UDP destination port, network order (0 unless GUE) */
	__u8 tunnel_src_bits;     /* 0..LB_TUNNEL_SRC_BITS_MAX: low bits of tunnel_src replaced,
	                           * per flow, by lb_tunnel_flow_bits (lb_encap.h), so that a
	                           * backend's RSS spreads the tunnelled flows over its queues */
	__u8 pad[3];              /* always 0 */
}; /* 32 bytes */

/* A NAT VIP whose connections also get a source address from the SNAT pool
 * (struct lb_nat_config), for backends whose default route is not the
 * appliance: their replies come back to a pool address. */
#define LB_VIP_F_SNAT 0x01

/* ---- backends ---------------------------------------------------------- */

enum lb_backend_state {
	LB_BACKEND_UP = 0,       /* takes new flows and keeps old ones */
	LB_BACKEND_DRAINING = 1, /* keeps its flows, takes no new ones */
	LB_BACKEND_DOWN = 2,     /* its flows re-hash at their next packet */
	LB_BACKEND_UNUSED = 3,   /* empty table entry */
};

struct lb_backend {
	union lb_addr addr; /* network order (for NAT/tunnel modes and for reports); IPv4 in .v4 */
	__u8 family;        /* enum lb_family of addr (0 in an UNUSED entry) */
	__u8 mac[6];        /* destination MAC written into forwarded frames */
	__u8 state;         /* enum lb_backend_state */
	__u8 port;          /* egress port: 0 = back out of the ingress port (XDP_TX), else devmap index */
	__u8 pad[3];        /* always 0 */
}; /* 28 bytes */

/* ---- Maglev ring ------------------------------------------------------- *
 * One ring per VIP, ring_size slots of __u32 backend ids (or LB_NO_BACKEND).
 * Slot of a flow: lb_flow_hash(key, flow) % ring_size (lb_hash.h). ring_size is chosen
 * when a data plane starts and reported by the protocol's hello.
 */
struct lb_ring_patch {
	__u32 slot;
	__u32 backend;
};

/* ---- flows ------------------------------------------------------------- */

struct lb_flow_key {
	union lb_addr saddr; /* network order; IPv4 in .v4, the other 12 bytes 0 */
	union lb_addr daddr;
	__u16 sport;         /* network order */
	__u16 dport;
	__u8 proto;
	__u8 family;         /* enum lb_family */
	__u8 pad[2];         /* always 0: the key is a map key, compared as raw bytes */
}; /* 40 bytes. Hashed (lb_hash.h): an IPv4 flow as the 16-byte protocol-1
    * tuple, so that it keeps its ring slot; an IPv6 flow as all 40 bytes. */

struct lb_flow_entry {
	__u32 backend; /* backend id the flow is pinned to */
	__u32 vip_id;
	__u64 pinned_ns; /* when the flow was pinned (diagnostics; recency is the
	                  * LRU's business, so a hit writes nothing) */
};

/* ---- the XDP plane's IPv4 keys --------------------------------------------
 * Not part of the protocol: the contract, the wire and the Python mirror carry
 * the family-aware struct lb_vip_key and struct lb_flow_key. The XDP program
 * keeps its IPv4 entries in maps of their own, keyed by these compact keys
 * (DPDK l3fwd's model: each family side by side), because the kernel hashes
 * (jhash) and compares every byte of a map key on every lookup: an IPv4 key
 * padded to the 20- and 40-byte family-aware layouts cost the per-packet path
 * about a third more (perf/packet_cost.py). xdp_tables.c translates when it
 * writes or reads the maps; IPv6 entries stay in maps keyed by the contract's
 * structs. */

/* (daddr, dport, proto) of an IPv4 VIP: the table-protocol-1 VIP key. */
struct lb_vip_key_v4 {
	__u32 addr;  /* network order */
	__u16 port;  /* network order */
	__u8 proto;
	__u8 pad;    /* always 0: compared and hashed as raw bytes */
}; /* 8 bytes */

/* An IPv4 flow: exactly the 16-byte tuple lb_flow_hash hashes it over
 * (lb_hash.h), so a new flow hashes its own map key. */
struct lb_flow_key_v4 {
	__u32 saddr; /* network order */
	__u32 daddr;
	__u16 sport; /* network order */
	__u16 dport;
	__u8 proto;
	__u8 pad[3]; /* always 0 */
}; /* 16 bytes */

/* ---- NAT mode: the connection table --------------------------------------
 * Not on the wire (the protocol carries the NAT settings, struct
 * lb_nat_config, and reports the table's figures); shared by both data planes
 * and mirrored by the reference model (contract/model.py). The rules that use
 * these structs are in lb_conn.h.
 *
 * A connection has two entries, one per direction, each keyed by the 5-tuple
 * its packets carry on the wire:
 *   original  client -> VIP            (client, VIP, cport, vport)
 *   reply     backend -> client        (backend, client, bport, cport), or with
 *             SNAT backend -> pool     (backend, snat, bport, sport)
 * Each entry names the other direction's key (peer): a packet matching key K
 * whose entry names peer P leaves as P reversed (source P.daddr:P.dport,
 * destination P.saddr:P.sport), which is the whole translation.
 *
 * Each family has a table of its own, with the same rules and the same
 * capacity (--conn-table-size entries each): IPv4 connections are keyed by
 * the compact struct lb_flow_key_v4 (entries struct lb_conn), IPv6 ones by
 * the contract's struct lb_flow_key with family 6 and every pad byte 0
 * (entries struct lb_conn6). A connection never changes family: NAT mode
 * translates IPv4 to IPv4 and IPv6 to IPv6 (no NAT64), with a SNAT address
 * of the connection's family. */

enum lb_conn_dir {
	LB_CONN_ORIG = 0,  /* the entry of the client's direction */
	LB_CONN_REPLY = 1, /* the entry of the backend's direction */
};

/* Connection states: a subset of the kernel conntrack's (nf_conntrack_proto_tcp),
 * enough for the timeouts. Embryonic: SYN_SENT, SYN_RECV, UDP_UNREPLIED. */
enum lb_conn_state {
	LB_CONN_SYN_SENT = 0,     /* client SYN seen */
	LB_CONN_SYN_RECV,         /* backend SYN+ACK seen */
	LB_CONN_ESTABLISHED,      /* client ACK after the SYN+ACK, or picked up mid-stream */
	LB_CONN_FIN_WAIT,         /* one side sent FIN */
	LB_CONN_TIME_WAIT,        /* both sides sent FIN */
	LB_CONN_CLOSE,            /* RST seen */
	LB_CONN_UDP_UNREPLIED,    /* UDP, no reply yet */
	LB_CONN_UDP_REPLIED,      /* UDP, the backend answered */
	LB_CONN_STATES
};

#define LB_CONN_STATE_NAMES                                                 \
	{ "syn_sent", "syn_recv", "established", "fin_wait", "time_wait",    \
	  "close", "udp_unreplied", "udp_replied" }

/* Default idle timeouts in seconds, the kernel conntrack's (nf_conntrack_tcp_timeout_*,
 * nf_conntrack_udp_timeout{,_stream}), in enum lb_conn_state order. */
#define LB_CONN_TIMEOUTS_DEFAULT { 120, 60, 432000, 120, 120, 10, 30, 120 }

#define LB_CONN_TABLE_DEFAULT 524288 /* entries (two per connection) */
#define LB_CONN_TABLE_MIN 4          /* two connections */
#define LB_CONN_TABLE_MAX 33554432
#define LB_CONN_EVICT_TRIES 4  /* oldest embryonic candidates looked at when full */
#define LB_MAX_SNAT_ADDRS 16
#define LB_SNAT_PROBES 8       /* SNAT ports tried per new connection */

struct lb_conn {
	struct lb_flow_key_v4 peer; /* the other direction's key */
	__u64 last_seen_ns;         /* last packet of either direction (original entry) */
	__u32 backend_id;
	__u8 vip_id;
	__u8 dir;                   /* enum lb_conn_dir of this entry's key */
	__u8 state;                 /* enum lb_conn_state: kept in the original entry */
	__u8 fin_dirs;              /* bit (1 << dir) for each side that sent FIN */
	__u8 client_mac[6];         /* source MAC of the client's first frame: replies go there */
	__u8 client_port;           /* port index the client's frames arrive on: replies leave there */
	__u8 flags;                 /* LB_CONN_F_* */
}; /* 40 bytes */

#define LB_CONN_F_SNAT 0x01 /* the reply key's destination is a pool address */

/* An IPv6 connection's entry: struct lb_conn with the family-aware key. */
struct lb_conn6 {
	struct lb_flow_key peer;    /* the other direction's key (family 6) */
	__u64 last_seen_ns;         /* as in struct lb_conn */
	__u32 backend_id;
	__u8 vip_id;
	__u8 dir;
	__u8 state;
	__u8 fin_dirs;
	__u8 client_mac[6];
	__u8 client_port;
	__u8 flags;
}; /* 64 bytes */

/* What a NAT VIP's backend being down does to its connections. */
enum lb_nat_down {
	LB_NAT_DOWN_RESCHEDULE = 0, /* next packet opens a new connection on an up backend */
	LB_NAT_DOWN_DROP = 1,       /* packets dropped until the backend returns or the entry expires */
};

/* The NAT settings (protocol op set_nat), one per data plane. */
struct lb_nat_config {
	__u32 snat_addrs[LB_MAX_SNAT_ADDRS]; /* IPv4 pool, network order */
	__u32 snat_naddrs;
	__u16 snat_port_min;  /* host order, inclusive; both families' */
	__u16 snat_port_max;
	__u8 on_backend_down; /* enum lb_nat_down */
	__u8 pad[3];
	__u32 timeouts_s[LB_CONN_STATES]; /* idle timeouts by state (the sweepers') */
	union lb_addr snat_addrs6[LB_MAX_SNAT_ADDRS]; /* IPv6 pool, network order */
	__u32 snat_naddrs6;
}; /* 368 bytes */

/* The connection table's figures (protocol op stats, "conns"). */
struct lb_conn_stats {
	__u64 capacity;                  /* entries */
	__u64 entries;                   /* in use (two per connection) */
	__u64 by_state[LB_CONN_STATES];  /* connections */
	__u64 snat_ports_in_use;         /* connections holding a SNAT port */
	__u64 expired;                   /* connections removed by the idle timeouts */
};

/* ---- egress ports ------------------------------------------------------ */

struct lb_port {
	__u32 ifindex;
	__u8 mac[6]; /* source MAC written into frames leaving through this port */
	__u16 pad;
};

/* ---- counters ---------------------------------------------------------- */

struct lb_counter {
	__u64 packets;
	__u64 bytes;
};

/* Global event and drop counters, indexed by this enum. Names must match
 * LB_STAT_NAMES below (the protocol's stats reply uses them). */
enum lb_stat {
	LB_STAT_RX = 0,            /* every packet seen */
	LB_STAT_FWD_TX,            /* forwarded back out of the ingress port */
	LB_STAT_FWD_REDIRECT,      /* forwarded through another port */
	LB_STAT_PASS_NOT_IPV4,     /* neither untagged IPv4 nor untagged IPv6 (ARP, NDP's
	                            * Ethernet neighbours, tagged frames): to the kernel */
	LB_STAT_PASS_NOT_VIP,      /* IP but no VIP for (addr, port, proto) */
	LB_STAT_PASS_FRAGMENT,     /* IPv4 or IPv6 fragment: handed to the kernel */
	LB_STAT_DROP_MALFORMED,    /* truncated Ethernet/IP/L4 header, bad IHL or version, IP
	                            * length below the header or beyond the frame, an IPv6
	                            * extension header past the packet */
	LB_STAT_DROP_NO_BACKEND,   /* ring empty or no up backend within LB_RING_PROBES */
	LB_STAT_DROP_TX_ERROR,     /* bad port or redirect failure (DPDK: also frames a full
	                            * TX queue refused, already counted as fwd_*) */
	LB_STAT_FLOW_HIT,          /* packet matched a pinned flow */
	LB_STAT_FLOW_NEW,          /* flow hashed into the ring */
	LB_STAT_FLOW_REPIN,        /* pinned flow whose backend was down: re-hashed */
	LB_STAT_ARP_REPLY,         /* ARP request for a VIP answered (DPDK; XDP leaves ARP to the kernel) */
	LB_STAT_FLOW_EVICT,        /* live flow evicted from a full affinity table (DPDK; XDP's LRU evicts silently) */
	/* NAT mode (lb_conn.h). A NAT packet is counted once under fwd_* (or a
	 * drop_*) like any other, and also under one of these. */
	LB_STAT_CONN_NEW,          /* connection created (original direction, to a NAT VIP) */
	LB_STAT_CONN_HIT,          /* original-direction packet of a known connection */
	LB_STAT_CONN_REPLY,        /* reply of a known connection, translated back */
	LB_STAT_CONN_EVICT,        /* embryonic connection evicted to make room (oldest first) */
	LB_STAT_CONN_RESCHEDULE,   /* connection of a down backend moved to a new one */
	LB_STAT_NAT_ICMP,          /* ICMP error quoting a connection's packet, translated */
	LB_STAT_DROP_CONN_FULL,    /* new connection refused: table full, nothing embryonic to evict */
	LB_STAT_DROP_SNAT_EXHAUSTED, /* new connection refused: no free SNAT port among the probes */
	LB_STAT_DROP_BACKEND_DOWN, /* packet of a connection whose backend is down (on_backend_down drop) */
	LB_STAT_DROP_CONN_INVALID, /* TCP RST matching no connection: opens none */
	/* IPv6 and tunnel mode. */
	LB_STAT_NDP_REPLY,         /* Neighbor Solicitation for a VIP answered (DPDK; XDP leaves NDP to
	                            * the kernel) */
	LB_STAT_PASS_EXT_HEADERS,  /* IPv6 with more than LB_IPV6_MAX_EXT_HDRS extension headers:
	                            * to the kernel, unparsed */
	LB_STAT_TUNNEL_ENCAP,      /* frame encapsulated (tunnel mode; also counted under fwd_*) */
	LB_STAT_DROP_ENCAP,        /* tunnel mode: no encapsulation for this pair (IPv6 inside IPv4,
	                            * or the backend's family is not the tunnel source's), or no
	                            * room to prepend the outer headers */
	LB_STAT_MAX
};

#define LB_STAT_NAMES                                                       \
	{ "rx", "fwd_tx", "fwd_redirect", "pass_not_ipv4", "pass_not_vip",   \
	  "pass_fragment", "drop_malformed", "drop_no_backend",              \
	  "drop_tx_error", "flow_hit", "flow_new", "flow_repin",         \
	  "arp_reply", "flow_evict", "conn_new", "conn_hit", "conn_reply",   \
	  "conn_evict", "conn_reschedule", "nat_icmp", "drop_conn_full",     \
	  "drop_snat_exhausted", "drop_backend_down", "drop_conn_invalid",   \
	  "ndp_reply", "pass_ext_headers", "tunnel_encap", "drop_encap" }

/* ---- global configuration (one entry) ---------------------------------- */

struct lb_config {
	__u8 hash_key[LB_HASH_KEY_LEN];
	__u32 ring_size;
	__u32 flags; /* reserved, 0 */
};

/* The layouts the protocol, the maps and the Python mirror agree on. */
_Static_assert(sizeof(union lb_addr) == 16, "union lb_addr is 16 bytes");
_Static_assert(sizeof(struct lb_vip_key) == 20, "struct lb_vip_key is 20 bytes");
_Static_assert(sizeof(struct lb_vip_entry) == 32, "struct lb_vip_entry is 32 bytes");
_Static_assert(sizeof(struct lb_backend) == 28, "struct lb_backend is 28 bytes");
_Static_assert(sizeof(struct lb_flow_key) == 40, "struct lb_flow_key is 40 bytes");
/* The XDP plane's compact IPv4 keys (not on the wire). */
_Static_assert(sizeof(struct lb_vip_key_v4) == 8, "struct lb_vip_key_v4 is 8 bytes");
_Static_assert(sizeof(struct lb_flow_key_v4) == 16, "struct lb_flow_key_v4 is 16 bytes");
/* The connection table (not on the wire; mirrored by the model). */
_Static_assert(sizeof(struct lb_conn) == 40, "struct lb_conn is 40 bytes");
_Static_assert(sizeof(struct lb_nat_config) == 368, "struct lb_nat_config is 368 bytes");
_Static_assert(sizeof(struct lb_conn6) == 64, "struct lb_conn6 is 64 bytes");

#endif /* HPCLB_LB_TABLES_H */
