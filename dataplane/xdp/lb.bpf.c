// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/*
 * lb.bpf.c - the XDP data plane: TCP/UDP to a VIP in DSR, tunnel or NAT
 * mode, IPv4 and IPv6 (NAT mode's IPv6 paths: xdp_nat6.h).
 *
 * Per packet: parse Ethernet/IP/L4 with every length checked (lb_parse.h's
 * lb_parse_untagged, shared with the DPDK forwarder: untagged IPv4 on its old
 * path, untagged IPv6 beside it, with a bounded walk of the extension
 * headers), look the (daddr, dport, proto) triple up (IPv4: vip4_map, the
 * compact key, through a per-CPU cache of its answers, vip4_lookup; IPv6:
 * vip_map, the contract's key, which holds every VIP),
 * then
 *   1. flow table hit whose backend is up or draining  -> reuse it (affinity:
 *      a weight change or ring patch never moves an established flow; the
 *      flow tables are shared by all CPUs, so this holds whichever CPU a
 *      packet arrives on). IPv4 flows: flow_map (compact key); IPv6 flows:
 *      flow6_map (struct lb_flow_key);
 *   2. otherwise hash the flow (lb_hash.h: IPv4 the 16-byte tuple, IPv6 the
 *      40-byte key) into the VIP's ring and take the first up backend among
 *      LB_RING_PROBES probe slots (a down or draining backend takes no new
 *      flow even before the control plane rewrites the ring), then pin it;
 *   3. DSR: rewrite the destination MAC to the backend's, the source MAC to
 *      the egress port's (lb_rewrite.h); tunnel mode: put the outer headers
 *      of lb_encap.h in front of the IP packet (xdp_encap.h), the same MACs
 *      outside; then XDP_TX (port 0, one-arm) or XDP_REDIRECT through
 *      tx_devmap (two-arm).
 * Everything that is not for a VIP is XDP_PASS, untouched: tagged frames,
 * ICMP and ICMPv6 (NDP: the kernel answers; NAT mode's errors aside), IPv4
 * and IPv6 fragments (a non-first fragment carries no ports, so it cannot be
 * balanced consistently with its head), IPv6 with more extension headers than the parse walks
 * (pass_ext_headers). IP options are skipped using the IHL.
 * control/hpclb/contract/model.py is the reference for all of this.
 *
 * NAT mode (a VIP with mode LB_MODE_NAT): the stateful gateway of
 * lb_conn.h, whose header comment is the specification followed here step by
 * step (the connection table conn_map, two entries per connection; the
 * embryonic FIFO conn_fifo; the settings nat_config_map). IPv6 connections
 * have a table and a FIFO of their own (conn6_map, conn6_fifo), and paths of
 * their own in xdp_nat6.h, the twins of the IPv4 ones here, in a program of
 * their own entered by tail call (nat6_prog says why). Replies come back
 * through the gateway, on whichever port the backend is behind, so the daemon
 * attaches this program to every port; a frame's ingress port is the
 * port_map entry whose ifindex is ctx->ingress_ifindex (port 0 when none is:
 * a BPF_PROG_TEST_RUN without a context runs "on" the loopback device, and
 * the model's frames arrive on port 0). A frame leaves by XDP_TX when its
 * egress port is its ingress port, else through tx_devmap.
 * The IPv4 DSR path costs what it did (perf/packet_cost.py): one more
 * comparison on the VIP's mode, on a value already loaded, and one on the
 * parse's family. Traffic for no VIP costs one connection lookup (in its
 * family's table), and only while nat_active says NAT mode is in use
 * (below). The IPv6 NAT paths add nothing to the IPv4 ones: they branch off
 * where the parse's family already has (balance_v6, and the ICMPv6 test
 * beside ICMP's in the unsupported-protocol case), into their program.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "lb_tables.h"
#include "lb_hash.h"
#include "lb_parse.h"
#include "lb_rewrite.h"
#include "lb_conn.h"
#include "xdp_encap.h"

/* Every VIP of either family under the contract's key: the table the daemon
 * writes and a restarted daemon adopts (xdp_tables.c). The fast path looks
 * IPv6 VIPs up here (IPv4 ones in vip4_map). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct lb_vip_key);
	__type(value, struct lb_vip_entry);
	__uint(max_entries, LB_MAX_VIPS);
} vip_map SEC(".maps");

/* The IPv4 VIPs of vip_map again, under the compact 8-byte key the fast path
 * looks up (lb_tables.h: the kernel hashes and compares whole keys). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct lb_vip_key_v4);
	__type(value, struct lb_vip_entry);
	__uint(max_entries, LB_MAX_VIPS);
} vip4_map SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct lb_backend);
	__uint(max_entries, LB_MAX_BACKENDS);
} backend_map SEC(".maps");

/* vip_id * ring_size + slot -> backend id; resized by the daemon before load. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, __u32);
	__uint(max_entries, LB_MAX_VIPS * LB_RING_SIZE_DEFAULT);
	/* mmapable: the daemon writes whole rings straight into the map (a
	 * million-slot ring fills in 2 s instead of 12 s of update syscalls). */
	__uint(map_flags, BPF_F_MMAPABLE);
} ring_map SEC(".maps");

/* IPv4 flows, under the compact 16-byte key (lb_tables.h).
 * One flow table shared by all CPUs, not one per CPU: a TCP flow's packets do
 * not all arrive on one CPU (the ACK a client sends from the softirq that
 * received the backend's reply, an RSS table change, irqbalance), and a CPU
 * that never saw a flow would re-hash it with the current ring and move it
 * off its backend after a weight change. Lookups are lock-free; only a new
 * flow takes the LRU's lock. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct lb_flow_key_v4);
	__type(value, struct lb_flow_entry);
	__uint(max_entries, LB_MAX_FLOWS);
} flow_map SEC(".maps");

/* IPv6 flows, under the contract's 40-byte struct lb_flow_key (family 6),
 * shared by all CPUs like flow_map. Sized by the daemon with the same
 * --flow-table-size as flow_map: the family mix of a site's flows is not
 * known in advance (a dual-stack site may move its clients from one family
 * to the other), and each table must hold all of a site's flows when they
 * are all of its family; a separate size would be a second knob to get
 * wrong. The price is memory: an LRU map preallocates its entries, 120
 * bytes each here (the kernel's element with its LRU node, the 40-byte key,
 * the 16-byte value: memlock 125830080 bytes for 1048576 entries on kernel
 * 6.18, against flow_map's 96), 120 MiB at the default million, used or not. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct lb_flow_key);
	__type(value, struct lb_flow_entry);
	__uint(max_entries, LB_MAX_FLOWS);
} flow6_map SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct lb_config);
	__uint(max_entries, 1);
} config_map SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct lb_port);
	__uint(max_entries, LB_MAX_PORTS);
} port_map SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_DEVMAP);
	__type(key, __u32);
	__type(value, __u32);
	__uint(max_entries, LB_MAX_PORTS);
} tx_devmap SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct lb_counter);
	__uint(max_entries, LB_STAT_MAX);
} stats_map SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct lb_counter);
	__uint(max_entries, LB_MAX_VIPS);
} vip_stats_map SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct lb_counter);
	__uint(max_entries, LB_MAX_BACKENDS);
} backend_stats_map SEC(".maps");

/* ---- NAT mode's maps (lb_tables.h "NAT mode: the connection table") ---- */

/* The connection table: two entries per connection, each keyed by the
 * 5-tuple its direction carries on the wire. Preallocated (the default for a
 * hash map): an insert into a full table fails at once with -E2BIG instead of
 * allocating, which is the "no room" lb_conn.h evicts on, and the capacity is
 * exactly max_entries. Sized by the daemon before load (--conn-table-size). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct lb_flow_key_v4);
	__type(value, struct lb_conn);
	__uint(max_entries, LB_CONN_TABLE_DEFAULT);
} conn_map SEC(".maps");

/* The original keys of embryonic connections in creation order (lb_conn.h
 * "Full table": "a FIFO of the table's size", conn_map's max_entries, set by
 * the daemon; the model's conn_fifo holds as many, and the conformance suite
 * tells the two readings apart). Keys of connections since gone, established
 * or rescheduled stay in it until taken. A push onto a full FIFO drops its
 * oldest key (BPF_EXIST), as the model's does: the FIFO only names
 * candidates, each checked again when taken. */
struct {
	__uint(type, BPF_MAP_TYPE_QUEUE);
	__type(value, struct lb_flow_key_v4);
	__uint(max_entries, LB_CONN_TABLE_DEFAULT);
} conn_fifo SEC(".maps");

/* The IPv6 connection table: conn_map's twin under the contract's 40-byte
 * struct lb_flow_key (family 6, every pad byte 0), entries struct lb_conn6
 * (lb_tables.h: each family its own table, the same capacity). Sized by the
 * daemon with the same --conn-table-size as conn_map, for flow6_map's
 * reason: the family mix of a site's connections is not known in advance.
 * Preallocated like conn_map, so its memory is spent whether or not IPv6
 * NAT is used (the daemon's figures are in ARCHITECTURE.md). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct lb_flow_key);
	__type(value, struct lb_conn6);
	__uint(max_entries, LB_CONN_TABLE_DEFAULT);
} conn6_map SEC(".maps");

/* conn_fifo's twin for conn6_map: its embryonic connections' original keys. */
struct {
	__uint(type, BPF_MAP_TYPE_QUEUE);
	__type(value, struct lb_flow_key);
	__uint(max_entries, LB_CONN_TABLE_DEFAULT);
} conn6_fifo SEC(".maps");

/* The NAT settings (protocol op set_nat), written by the daemon: both
 * families' SNAT pools (snat_addrs, snat_addrs6). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct lb_nat_config);
	__uint(max_entries, 1);
} nat_config_map SEC(".maps");

/* Non-zero while NAT mode may have connections: a NAT VIP (either family) is
 * configured, or a connection table still holds entries of one that was. The
 * daemon sets it before it writes a NAT VIP and clears it only when neither
 * holds (xdp_conns.c), so a frame for no VIP skips the connection lookup
 * exactly when that lookup could only miss. A global (.bss, written by the daemon through the skeleton's
 * mapping) costs one load, where a map would cost a lookup call. */
volatile __u32 nat_active;

/* ---- the IPv4 VIP cache ----------------------------------------------------
 * A flow hit costs two hash lookups, the VIP's (vip4_map) and the flow's
 * (flow_map); the VIP's, an 8-byte jhash and a bucket walk, is about a fifth
 * of the whole hit path (perf/packet_cost.py, hpclb.lab.xdp_cost). Each CPU
 * keeps the answers it last had from vip4_map, the VIP entry or "no VIP",
 * in a small direct-mapped table of its own (per-CPU: no sharing, no
 * atomics), valid while vip_gen is the value it was stored under.
 *
 * vip_gen (.bss) is written by the daemon only (xdp_tables.c): 0 in a fresh
 * program instance, which disables the cache (never read, never filled),
 * then 1 once the daemon holds the program's tables, and one more after
 * every write of vip4_map, after that write: a CPU that read the old
 * generation may cache what it saw under it, which the new one voids; a
 * CPU that read the new one reads vip4_map after it (x86 keeps loads in
 * order), so it sees the write. A VIP's entry therefore takes effect no
 * later than the generation the daemon bumps right after writing it, as it
 * took effect when written before. The cache map is never pinned (each
 * program instance starts with an empty one; xdp_daemon.c), and nothing but
 * lb_xdp reads it. IPv6 VIPs (vip_map) are not cached: their key is 20
 * bytes and their path is not the one the figures are about. */
#define VIP4_CACHE_SLOTS 64 /* a power of two */

struct vip4_cache_slot {
	__u64 gen;                /* vip_gen the slot was filled under; 0: being filled */
	__u64 key;                /* the struct lb_vip_key_v4 looked up, as one word */
	struct lb_vip_entry vip __attribute__((aligned(8))); /* vip4_map's entry, when present
				  * (8-aligned: copied out as four words) */
	__u32 present;            /* 1: vip holds vip4_map's entry; 0: no such VIP */
	__u32 pad;
	__u64 key_end;            /* key again, written after vip and present */
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct vip4_cache_slot);
	__uint(max_entries, VIP4_CACHE_SLOTS);
} vip4_cache SEC(".maps");

volatile __u64 vip_gen;

static __always_inline void count(struct lb_counter *c, __u64 bytes)
{
	if (c) {
		c->packets += 1;
		c->bytes += bytes;
	}
}

static __always_inline int stat(__u32 which, __u64 bytes, int verdict)
{
	count(bpf_map_lookup_elem(&stats_map, &which), bytes);
	return verdict;
}

static __always_inline int backend_is(const struct lb_backend *b, __u8 state)
{
	return b && b->state == state;
}

/* First up backend among the probe slots of a flow whose hash is hash, or
 * LB_NO_BACKEND; ring_size is cfg->ring_size, already checked to be >= 3. */
static __always_inline __u32 pick_backend_hashed(__u32 ring_size, __u32 vip_id, __u64 hash)
{
	__u32 n;

	for (n = 0; n < LB_RING_PROBES; n++) {
		__u32 idx = vip_id * ring_size + lb_probe_slot(hash, ring_size, n);
		__u32 *id = bpf_map_lookup_elem(&ring_map, &idx);
		__u32 backend_id;

		if (!id)
			return LB_NO_BACKEND;
		backend_id = *id;
		if (backend_id == LB_NO_BACKEND)
			continue;
		if (backend_is(bpf_map_lookup_elem(&backend_map, &backend_id), LB_BACKEND_UP))
			return backend_id;
	}
	return LB_NO_BACKEND;
}

/* First up backend among the probe slots of this flow, or LB_NO_BACKEND.
 * flow is the flow map's key: struct lb_flow_key_v4 when family is
 * LB_FAMILY_V4, struct lb_flow_key otherwise (family is a constant at every
 * call: the other family's hash is not compiled in). */
static __always_inline __u32 pick_backend(const struct lb_config *cfg, __u32 vip_id,
					  const void *flow, __u8 family)
{
	__u32 ring_size = cfg->ring_size;
	__u64 hash;

	if (ring_size < 3)
		return LB_NO_BACKEND;
	/* IPv4: the IPv4 hash of the compact key, the same value lb_flow_hash
	 * gives its struct lb_flow_key; IPv6: the 40-byte key's. */
	if (family == LB_FAMILY_V4)
		hash = lb_flow_hash_v4_key(cfg->hash_key, flow);
	else
		hash = lb_flow_hash_v6(cfg->hash_key, flow);
	return pick_backend_hashed(ring_size, vip_id, hash);
}

/* The backend of a DSR or tunnel flow (steps 1 and 2 at the top of this
 * file), its id in *backend_id; NULL when there is none (drop_no_backend).
 * flows is flow_map (family LB_FAMILY_V4, key a struct lb_flow_key_v4) or
 * flow6_map (struct lb_flow_key); both constants once inlined. */
static __always_inline struct lb_backend *flow_backend(void *flows, const void *flow, __u8 family,
						       const struct lb_vip_entry *vip,
						       __u32 *backend_id, __u64 len)
{
	struct lb_flow_entry *pinned, fresh = {};
	struct lb_backend *backend = NULL;
	struct lb_config *cfg;
	__u32 id, zero = 0;

	pinned = bpf_map_lookup_elem(flows, flow);
	if (pinned) {
		id = pinned->backend;
		backend = bpf_map_lookup_elem(&backend_map, &id);
		if (backend_is(backend, LB_BACKEND_UP) || backend_is(backend, LB_BACKEND_DRAINING)) {
			stat(LB_STAT_FLOW_HIT, len, 0);
			*backend_id = id;
			return backend;
		}
		stat(LB_STAT_FLOW_REPIN, len, 0);
	}
	/* The settings (ring size, hash key) only now: a flow hit, the common
	 * case, never reads them. Slot 0 of a one-entry array always exists, so
	 * the NULL test is for the verifier (and drops, as it always did). */
	cfg = bpf_map_lookup_elem(&config_map, &zero);
	if (!cfg)
		return NULL;
	id = pick_backend(cfg, vip->vip_id, flow, family);
	backend = bpf_map_lookup_elem(&backend_map, &id);
	if (!backend)
		return NULL;
	if (!pinned)
		stat(LB_STAT_FLOW_NEW, len, 0);
	fresh.backend = id;
	fresh.vip_id = vip->vip_id;
	/* The coarse clock (the last tick's time, no clock read): pinned_ns is
	 * diagnostics, and a precise read costs a new flow tens of ns here
	 * (hpclb.lab.xdp_cost); the DPDK plane stamps a burst's time likewise. */
	fresh.pinned_ns = bpf_ktime_get_coarse_ns();
	bpf_map_update_elem(flows, flow, &fresh, BPF_ANY);
	*backend_id = id;
	return backend;
}

/* The flow key from a parse that said LB_PARSE_OK on an untagged IPv4 frame:
 * the one place the key is built. Every byte is written (pad included): the
 * key is hashed and looked up as raw bytes, so nothing in it may be left to
 * what the stack held. */
static __always_inline void flow_key_v4(struct lb_flow_key_v4 *flow, const struct lb_parsed *p)
{
	flow->saddr = p->src.v4;
	flow->daddr = p->dst.v4;
	flow->sport = p->sport;
	flow->dport = p->dport;
	flow->proto = p->proto;
	flow->pad[0] = 0;
	flow->pad[1] = 0;
	flow->pad[2] = 0;
}

/* The last word of a VIP key (port, then two bytes: proto and pad or
 * family) at dst, 4-byte aligned, as one 32-bit store. The VIP lookup comes
 * right after, and the kernel hashes the key a 32-bit word at a time: a word
 * written as three narrower stores still in flight cannot be forwarded to
 * that load, which then waits for them to reach the cache. Little-endian (BPF
 * is host-endian; lb_encap.h refuses a big-endian host): port in the low half. */
static __always_inline void vip_key_word(void *dst, __be16 port, __u8 b2, __u8 b3)
{
	__u32 w = (__u32)port | ((__u32)b2 << 16) | ((__u32)b3 << 24);

	__builtin_memcpy(dst, &w, sizeof(w));
}

/* The VIP key of an IPv4 flow, every byte written as in flow_key_v4 (pad 0). */
static __always_inline void vip_key_v4(struct lb_vip_key_v4 *vkey,
				       const struct lb_flow_key_v4 *flow)
{
	vkey->addr = flow->daddr;
	vip_key_word(&vkey->port, flow->dport, flow->proto, 0);
}

/* The flow key and VIP key of an IPv6 parse that said LB_PARSE_OK, every
 * byte written (pad included) as in flow_key_v4. */
static __always_inline void keys_v6(struct lb_flow_key *flow, struct lb_vip_key *vkey,
				    const struct lb_parsed *p)
{
	flow->saddr = p->src;
	flow->daddr = p->dst;
	flow->sport = p->sport;
	flow->dport = p->dport;
	flow->proto = p->proto;
	flow->family = LB_FAMILY_V6;
	flow->pad[0] = 0;
	flow->pad[1] = 0;
	vkey->addr = p->dst;
	vip_key_word(&vkey->port, p->dport, p->proto, LB_FAMILY_V6);
}

/* 1 and vip4_map's entry for vkey in *out, or 0 when there is none, through
 * this CPU's cache (vip_gen above). The entry is always a copy on the
 * caller's stack (a map value pointer that may be NULL, merged with another,
 * is what the verifier refuses to offset before the NULL test clang moves).
 *
 * Per-CPU data without a lock: a program run that can be preempted (a
 * BPF_PROG_TEST_RUN, generic XDP outside a softirq) may be interrupted on its
 * CPU by another run of this program, which may fill the same slot. So a fill
 * writes gen 0 first, then key, the entry, key_end, and gen last (compiler
 * barriers keep that order; one CPU sees its own stores in order), and a slot
 * counts only when gen is the current generation and key and key_end both
 * name the key looked up: a fill interrupted by another's leaves the two keys
 * different (the later key, the earlier key_end) or is completed over. A hit
 * copies the entry out and checks the slot again after the copy, so that a
 * fill landing meanwhile is seen. */
static __always_inline int vip4_lookup(const struct lb_vip_key_v4 *vkey, struct lb_vip_entry *out)
{
	struct vip4_cache_slot *slot = NULL;
	struct lb_vip_entry *vip;
	__u64 gen = vip_gen, key;
	__u32 idx, present;

	__builtin_memcpy(&key, vkey, sizeof(key));
	if (gen) {
		/* Any fold of the key spreads a site's VIPs; a collision
		 * costs only a lookup. */
		idx = (__u32)(key ^ (key >> 29) ^ (key >> 40)) & (VIP4_CACHE_SLOTS - 1);
		slot = bpf_map_lookup_elem(&vip4_cache, &idx);
	}
	if (slot && slot->gen == gen && slot->key == key && slot->key_end == key) {
		present = slot->present;
		/* Four 8-byte words: slot->vip is 8-aligned, and so is every
		 * caller's copy (lb_xdp's vip_copy). */
		__builtin_memcpy(__builtin_assume_aligned(out, 8),
				 __builtin_assume_aligned(&slot->vip, 8), sizeof(*out));
		asm volatile("" ::: "memory");
		if (slot->gen == gen && slot->key == key && slot->key_end == key)
			return present != 0;
	}
	vip = bpf_map_lookup_elem(&vip4_map, vkey);
	if (vip)
		*out = *vip;
	if (slot) {
		slot->gen = 0;
		asm volatile("" ::: "memory");
		slot->key = key;
		slot->present = vip != NULL;
		if (vip)
			slot->vip = *out;
		asm volatile("" ::: "memory");
		slot->key_end = key;
		asm volatile("" ::: "memory");
		slot->gen = gen;
	}
	return vip != NULL;
}

/* ---- NAT mode (lb_conn.h) ------------------------------------------------ */

/* Errors a map update gives when the table has no room (lb_conn.h: evict);
 * no <errno.h> in a BPF program. */
#define LB_E2BIG 7
#define LB_ENOMEM 12

/* The loopback device's ifindex in every network namespace. */
#define LB_LOOPBACK_IFINDEX 1

/* What the NAT paths return instead of a verdict when the frame is to be
 * translated and sent (XDP verdicts are >= 0). */
#define NAT_FORWARD (-1)

/* Where a translated frame goes and what it counts under. */
struct nat_out {
	__u32 port;       /* egress port index */
	__u32 vip_id;     /* per-VIP counter */
	__u32 backend_id; /* per-backend counter */
	__u8 mac[6];      /* destination MAC */
	__u8 pad[2];
};

/* The port index a frame arrived on: the port_map entry whose ifindex is the
 * frame's, 0 when none is (a test run's loopback device; the top of this
 * file says why). Only NAT mode asks: a connection remembers its client's
 * port, and a frame leaves by XDP_TX only through the port it came in by. */
static __always_inline __u32 ingress_port(const struct xdp_md *ctx)
{
	__u32 ifindex = ctx->ingress_ifindex;
	__u32 i;

	for (i = 0; i < LB_MAX_PORTS; i++) {
		struct lb_port *port = bpf_map_lookup_elem(&port_map, &i);

		if (port && port->ifindex != 0 && port->ifindex == ifindex)
			return i;
	}
	return 0;
}

/* Send a translated frame to out->mac through port out->port, with the
 * source MAC of that port: XDP_TX when it is in_port, the port the frame
 * arrived on, else through tx_devmap (whose slot 0 is the ingress interface,
 * so that a reply arriving on a cluster-side port reaches a client on port
 * 0). Counted as DSR counts: fwd_* (or drop_tx_error), the VIP's and the
 * backend's. */
static __always_inline int nat_send(__u32 in_port, void *data, void *data_end,
				    const struct nat_out *out, __u64 len)
{
	struct lb_port *port;
	__u32 port_idx = out->port, vip_id = out->vip_id, backend_id = out->backend_id;
	long verdict;

	port = bpf_map_lookup_elem(&port_map, &port_idx);
	if (!port || port->ifindex == 0)
		return stat(LB_STAT_DROP_TX_ERROR, len, XDP_DROP);
	if (lb_rewrite_macs(data, data_end, out->mac, port->mac))
		return stat(LB_STAT_DROP_MALFORMED, len, XDP_DROP); /* cannot happen: parsed */
	if (port_idx == in_port) {
		verdict = XDP_TX;
		stat(LB_STAT_FWD_TX, len, 0);
	} else {
		verdict = bpf_redirect_map(&tx_devmap, port_idx, XDP_DROP);
		if (verdict != XDP_REDIRECT)
			return stat(LB_STAT_DROP_TX_ERROR, len, XDP_DROP);
		stat(LB_STAT_FWD_REDIRECT, len, 0);
	}
	count(bpf_map_lookup_elem(&vip_stats_map, &vip_id), len);
	count(bpf_map_lookup_elem(&backend_stats_map, &backend_id), len);
	return (int)verdict;
}

static __always_inline int same_flow(const struct lb_flow_key_v4 *a, const struct lb_flow_key_v4 *b)
{
	return a->saddr == b->saddr && a->daddr == b->daddr && a->sport == b->sport &&
	       a->dport == b->dport && a->proto == b->proto;
}

/* Delete the connection of the entry under key, whose peer is peer (a copy:
 * the entry is gone after the first delete): both entries. The peer's only
 * while it still names key: a reply key another connection has since taken
 * over is that connection's. */
static __always_inline void conn_delete(const struct lb_flow_key_v4 *key,
					const struct lb_flow_key_v4 *peer)
{
	struct lb_conn *pc = bpf_map_lookup_elem(&conn_map, peer);

	bpf_map_delete_elem(&conn_map, key);
	if (pc && same_flow(&pc->peer, key))
		bpf_map_delete_elem(&conn_map, peer);
}

/* lb_conn.h "Full table": take up to LB_CONN_EVICT_TRIES keys from the
 * FIFO's head and evict the first that is still an embryonic connection's
 * original key (both entries). 1 when one was evicted. The keys taken are
 * gone from the FIFO whatever they named. */
static __always_inline int conn_evict_one(void)
{
	struct lb_flow_key_v4 key, peer;
	struct lb_conn *c;
	__u32 i;

	for (i = 0; i < LB_CONN_EVICT_TRIES; i++) {
		if (bpf_map_pop_elem(&conn_fifo, &key))
			return 0; /* empty */
		c = bpf_map_lookup_elem(&conn_map, &key);
		if (!c || c->dir != LB_CONN_ORIG || !lb_conn_embryonic(c->state))
			continue;
		peer = c->peer;
		conn_delete(&key, &peer);
		return 1;
	}
	return 0;
}

/* Insert a new connection: the original entry first, then the reply entry
 * (keyed by orig->peer); both or none. 0, or the failing update's error. */
static __always_inline long conn_insert(const struct lb_flow_key_v4 *key,
					const struct lb_conn *orig, const struct lb_conn *reply)
{
	long err = bpf_map_update_elem(&conn_map, key, orig, BPF_ANY);

	if (err)
		return err;
	err = bpf_map_update_elem(&conn_map, &orig->peer, reply, BPF_ANY);
	if (err)
		bpf_map_delete_elem(&conn_map, key);
	return err;
}

/* A frame matching the reply entry c (lb_conn.h 2.): the state moves in the
 * original entry (named by c's peer), the frame goes to the client's MAC out
 * of the client's port, translated to c->peer reversed (from the VIP). Also
 * taken when the reply's tuple happens to be a NAT VIP's (a SNAT address
 * that is a VIP address): the frame is a reply all the same. */
static __always_inline int nat_reply(const struct lb_conn *c, const struct lb_parsed *p,
				     __u8 tcp_flags, __u64 len, struct nat_out *out,
				     struct lb_flow_key_v4 *peer)
{
	struct lb_conn *o;

	*peer = c->peer;
	out->port = c->client_port;
	out->vip_id = c->vip_id;
	out->backend_id = c->backend_id;
	__builtin_memcpy(out->mac, c->client_mac, LB_ETH_ALEN);
	o = bpf_map_lookup_elem(&conn_map, peer);
	if (o && o->dir == LB_CONN_ORIG) {
		o->state = lb_conn_next_state(o->state, &o->fin_dirs, LB_CONN_REPLY, p->proto,
					      tcp_flags);
		o->last_seen_ns = bpf_ktime_get_ns();
	}
	stat(LB_STAT_CONN_REPLY, len, 0);
	return NAT_FORWARD;
}

/* A TCP/UDP frame for a NAT VIP (lb_conn.h 1.). */
static __always_inline int nat_to_vip(__u32 in_port, void *data, void *data_end,
				      const struct lb_parsed *p, const struct lb_flow_key_v4 *key,
				      const struct lb_vip_entry *vip, __u64 len,
				      struct nat_out *out, struct lb_flow_key_v4 *peer)
{
	const struct lb_eth_hdr *eth = data;
	struct lb_nat_config *nat;
	struct lb_config *cfg;
	struct lb_backend *backend;
	struct lb_conn *c, oc, rc;
	__u32 zero = 0, vip_id = vip->vip_id, backend_id, ring_size;
	__u8 tcp_flags = lb_tcp_flags(data, data_end, p), open, cflags = 0;
	__be16 bport;
	__u64 hash;
	long err;

	cfg = bpf_map_lookup_elem(&config_map, &zero);
	nat = bpf_map_lookup_elem(&nat_config_map, &zero);
	if (!cfg || !nat || vip_id >= LB_MAX_VIPS)
		return stat(LB_STAT_DROP_NO_BACKEND, len, XDP_DROP);

	c = bpf_map_lookup_elem(&conn_map, key);
	if (c && c->dir == LB_CONN_REPLY)
		return nat_reply(c, p, tcp_flags, len, out, peer);
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
		/* Its backend is down (or gone). */
		if (nat->on_backend_down == LB_NAT_DOWN_DROP)
			return stat(LB_STAT_DROP_BACKEND_DOWN, len, XDP_DROP);
		*peer = c->peer;
		conn_delete(key, peer);
		stat(LB_STAT_CONN_RESCHEDULE, len, 0);
	}

	/* A miss: may this frame open a connection, and to which backend. */
	open = lb_conn_open_state(p->proto, tcp_flags);
	if (open == LB_CONN_NO_STATE)
		return stat(LB_STAT_DROP_CONN_INVALID, len, XDP_DROP);
	ring_size = cfg->ring_size;
	if (ring_size < 3)
		return stat(LB_STAT_DROP_NO_BACKEND, len, XDP_DROP);
	hash = lb_flow_hash_v4_key(cfg->hash_key, key);
	backend_id = pick_backend_hashed(ring_size, vip_id, hash);
	backend = bpf_map_lookup_elem(&backend_map, &backend_id);
	/* No NAT64: an IPv6 backend has no IPv4 address to DNAT to. */
	if (!backend || backend->family != LB_FAMILY_V4)
		return stat(LB_STAT_DROP_NO_BACKEND, len, XDP_DROP);

	/* The reply key: what the backend's answer will carry. It must be free
	 * (neither an entry's key nor this connection's own original key): the
	 * backend's replies to two connections sharing it could not be told
	 * apart. With SNAT the first free candidate port is taken; without,
	 * there is one candidate, and a taken one (one client address and port
	 * through two VIPs onto one backend port) refuses the connection as an
	 * exhausted SNAT range does (the model's rule). */
	bport = vip->nat_port ? vip->nat_port : key->dport;
	if (vip->nat_flags & LB_VIP_F_SNAT) {
		__u32 naddrs = nat->snat_naddrs, idx, n;
		__u16 pmin = nat->snat_port_min, pmax = nat->snat_port_max;

		/* The server never lets a SNAT VIP be without a pool, nor a
		 * range be empty; the checks are for the verifier and for a
		 * map written by hand. */
		if (naddrs == 0 || naddrs > LB_MAX_SNAT_ADDRS || pmin == 0 || pmin > pmax)
			return stat(LB_STAT_DROP_SNAT_EXHAUSTED, len, XDP_DROP);
		idx = lb_snat_addr_index(hash, naddrs);
		/* idx < naddrs <= LB_MAX_SNAT_ADDRS, which clang knows and the
		 * verifier (a modulo's result is unbounded to it) does not: hide
		 * the value from clang so that the check stays. */
		asm volatile("" : "+r"(idx));
		if (idx >= LB_MAX_SNAT_ADDRS)
			return stat(LB_STAT_DROP_SNAT_EXHAUSTED, len, XDP_DROP);
		for (n = 0; n < LB_SNAT_PROBES; n++) {
			__be16 sport = lb_htons(lb_snat_candidate(hash, n, pmin, pmax));

			lb_conn_reply_key(peer, backend->addr.v4, bport, nat->snat_addrs[idx],
					  sport, p->proto);
			if (!same_flow(peer, key) && !bpf_map_lookup_elem(&conn_map, peer))
				break;
		}
		if (n == LB_SNAT_PROBES)
			return stat(LB_STAT_DROP_SNAT_EXHAUSTED, len, XDP_DROP);
		cflags = LB_CONN_F_SNAT;
	} else {
		lb_conn_reply_key(peer, backend->addr.v4, bport, key->saddr, key->sport, p->proto);
		if (same_flow(peer, key) || bpf_map_lookup_elem(&conn_map, peer))
			return stat(LB_STAT_DROP_SNAT_EXHAUSTED, len, XDP_DROP);
	}

	/* Both entries: the original names the reply key, the reply the
	 * original key; the client's MAC and port are where replies go. */
	if (LB_PAST_END(eth, sizeof(*eth), data_end))
		return stat(LB_STAT_DROP_MALFORMED, len, XDP_DROP); /* cannot happen: parsed */
	__builtin_memset(&oc, 0, sizeof(oc));
	oc.peer = *peer;
	oc.last_seen_ns = bpf_ktime_get_ns();
	oc.backend_id = backend_id;
	oc.vip_id = (__u8)vip_id;
	oc.dir = LB_CONN_ORIG;
	oc.state = open;
	__builtin_memcpy(oc.client_mac, eth->src, LB_ETH_ALEN);
	oc.client_port = (__u8)in_port;
	oc.flags = cflags;
	rc = oc;
	rc.peer = *key;
	rc.dir = LB_CONN_REPLY;
	err = conn_insert(key, &oc, &rc);
	if (err) {
		/* No room: evict the oldest embryonic connection and retry once;
		 * any other failure refuses at once. */
		if ((err != -LB_E2BIG && err != -LB_ENOMEM) || !conn_evict_one())
			return stat(LB_STAT_DROP_CONN_FULL, len, XDP_DROP);
		stat(LB_STAT_CONN_EVICT, len, 0);
		if (conn_insert(key, &oc, &rc))
			return stat(LB_STAT_DROP_CONN_FULL, len, XDP_DROP);
	}
	if (lb_conn_embryonic(open))
		bpf_map_push_elem(&conn_fifo, key, BPF_EXIST);
	out->port = backend->port ? backend->port : in_port;
	out->vip_id = vip_id;
	out->backend_id = backend_id;
	__builtin_memcpy(out->mac, backend->mac, LB_ETH_ALEN);
	stat(LB_STAT_CONN_NEW, len, 0);
	return NAT_FORWARD;
}

/* A TCP/UDP frame for a NAT VIP (vip set) or, while NAT mode is in use, for
 * no VIP (vip NULL): translated to its entry's peer reversed and sent, or
 * the verdict a path gave. */
static __always_inline int nat_frame(const struct xdp_md *ctx, void *data, void *data_end,
				     const struct lb_parsed *p, const struct lb_flow_key_v4 *key,
				     const struct lb_vip_entry *vip, __u64 len)
{
	struct lb_flow_key_v4 peer;
	struct lb_conn *c = NULL;
	struct nat_out out;
	__u32 in_port;
	int rc;

	/* For no VIP (lb_conn.h 2.): a reply entry, or the kernel's frame (no
	 * entry, or an original entry whose VIP is gone), found before the
	 * ingress port is searched for. */
	if (!vip) {
		c = bpf_map_lookup_elem(&conn_map, key);
		if (!c || c->dir != LB_CONN_REPLY)
			return stat(LB_STAT_PASS_NOT_VIP, len, XDP_PASS);
	}
	in_port = ingress_port(ctx);
	out.pad[0] = 0;
	out.pad[1] = 0;
	if (vip)
		rc = nat_to_vip(in_port, data, data_end, p, key, vip, len, &out, &peer);
	else
		rc = nat_reply(c, p, lb_tcp_flags(data, data_end, p), len, &out, &peer);
	if (rc != NAT_FORWARD)
		return rc;
	if (lb_conn_translate(data, data_end, p, key, &peer) != LB_NAT_OK)
		return stat(LB_STAT_DROP_MALFORMED, len, XDP_DROP); /* cannot happen: parsed */
	return nat_send(in_port, data, data_end, &out, len);
}

/* An ICMP frame while NAT mode is in use (lb_conn.h 3.): an error quoting a
 * packet of a connection goes back where that packet came from, its quote
 * translated back; anything else is the kernel's. */
static __always_inline int nat_icmp(const struct xdp_md *ctx, void *data, void *data_end,
				    const struct lb_parsed *p, __u64 len)
{
	struct lb_flow_key_v4 key, orig;
	struct lb_backend *backend;
	struct lb_nat4_icmp ic;
	struct nat_out out;
	struct lb_conn *c;
	__u32 in_port;

	if (lb_nat4_icmp_parse(data, data_end, p, &ic) != LB_NAT_OK)
		return stat(LB_STAT_PASS_NOT_VIP, len, XDP_PASS);
	lb_conn_icmp_key(&key, &ic);
	c = bpf_map_lookup_elem(&conn_map, &key);
	if (!c)
		return stat(LB_STAT_PASS_NOT_VIP, len, XDP_PASS);
	in_port = ingress_port(ctx);
	/* The quoted packet was sent as c's peer reversed; before translation
	 * it was c's peer, and it came from that side's host. */
	orig = c->peer;
	out.pad[0] = 0;
	out.pad[1] = 0;
	out.vip_id = c->vip_id;
	out.backend_id = c->backend_id;
	if (c->dir == LB_CONN_REPLY) {
		/* About a packet sent to the backend: for the client. */
		out.port = c->client_port;
		__builtin_memcpy(out.mac, c->client_mac, LB_ETH_ALEN);
	} else {
		/* About a reply sent to the client: for the backend, unless it
		 * has left the tables (nowhere to send it). */
		backend = bpf_map_lookup_elem(&backend_map, &out.backend_id);
		if (!backend || backend->state == LB_BACKEND_UNUSED) {
			stat(LB_STAT_NAT_ICMP, len, 0);
			return stat(LB_STAT_DROP_TX_ERROR, len, XDP_DROP);
		}
		out.port = backend->port ? backend->port : in_port;
		__builtin_memcpy(out.mac, backend->mac, LB_ETH_ALEN);
	}
	if (lb_conn_icmp_translate(data, data_end, &ic, &orig) != LB_NAT_OK)
		return stat(LB_STAT_DROP_MALFORMED, len, XDP_DROP); /* cannot happen: parsed */
	stat(LB_STAT_NAT_ICMP, len, 0);
	return nat_send(in_port, data, data_end, &out, len);
}

/* NAT mode's IPv6 paths: the program lb_xdp_nat6 (xdp_nat6.h), entered by
 * tail call through nat6_prog's slot 0, which the daemon fills after the
 * load. A program of its own, not code inlined here: the verifier explores
 * every path of one program within one budget of a million instructions,
 * and the IPv6 rewrites (16-byte addresses in every checksum update) beside
 * the IPv4 and DSR paths exceed it (E2BIG), and within one 512-byte stack
 * (lb_xdp takes 392 of it). A tail call starts afresh on both, costs the
 * IPv4 and DSR paths nothing (they never reach it), and the IPv6 NAT paths
 * a second parse and VIP lookup. */
struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__type(key, __u32);
	__type(value, __u32);
	__uint(max_entries, 1);
} nat6_prog SEC(".maps");

/* Into lb_xdp_nat6; when the slot is empty (cannot happen once the daemon
 * has started) the frame is the kernel's, as before NAT mode had IPv6. */
static __always_inline int nat6_enter(struct xdp_md *ctx, __u64 len)
{
	bpf_tail_call(ctx, &nat6_prog, 0);
	return stat(LB_STAT_PASS_NOT_VIP, len, XDP_PASS);
}

/* Step 3 at the top of this file: send the frame of a DSR or tunnel flow
 * to backend (id backend_id) of vip, counted under fwd_* (or a drop) and the
 * VIP's and backend's counters; len is the frame's length as it came (the
 * bytes counted, encapsulated or not, as rx counts them). */
static __always_inline int forward(struct xdp_md *ctx, void *data, void *data_end,
				   const struct lb_parsed *p, struct lb_vip_entry *vip,
				   const struct lb_backend *backend, __u32 backend_id, __u64 len)
{
	struct lb_port *port;
	__u32 port_idx = backend->port;
	long verdict;

	port = bpf_map_lookup_elem(&port_map, &port_idx);
	if (!port || port->ifindex == 0)
		return stat(LB_STAT_DROP_TX_ERROR, len, XDP_DROP);
	/* Port 0: back out of the port the frame came in on (XDP_TX), with that
	 * port's MAC. A DSR VIP's frames come in on port 0 (one compare); the
	 * program being attached to every port for NAT mode, one may come in on
	 * another, which the search finds. ifindex 1, the loopback device a
	 * test run without a context runs on, is port 0 without the search, so
	 * that such runs (perf/packet_cost.py) time the path traffic takes. */
	if (port_idx == 0 && port->ifindex != ctx->ingress_ifindex &&
	    ctx->ingress_ifindex != LB_LOOPBACK_IFINDEX) {
		__u32 in_port = ingress_port(ctx);

		port = bpf_map_lookup_elem(&port_map, &in_port);
		if (!port)
			return stat(LB_STAT_DROP_TX_ERROR, len, XDP_DROP);
	}
	if (vip->mode == LB_MODE_TUNNEL) {
		/* data and data_end die here (the frame moves): nothing below
		 * reads them. */
		if (xdp_encap(ctx, p, vip, backend, port->mac))
			return stat(LB_STAT_DROP_ENCAP, len, XDP_DROP);
		stat(LB_STAT_TUNNEL_ENCAP, len, 0);
	} else if (lb_rewrite_macs(data, data_end, backend->mac, port->mac)) {
		return stat(LB_STAT_DROP_MALFORMED, len, XDP_DROP); /* cannot happen: parsed */
	}
	if (port_idx == 0) {
		verdict = XDP_TX;
		stat(LB_STAT_FWD_TX, len, 0);
	} else {
		/* An empty devmap slot (the egress NIC went away) drops: count it
		 * as such, not as forwarded. */
		verdict = bpf_redirect_map(&tx_devmap, port_idx, XDP_DROP);
		if (verdict != XDP_REDIRECT)
			return stat(LB_STAT_DROP_TX_ERROR, len, XDP_DROP);
		stat(LB_STAT_FWD_REDIRECT, len, 0);
	}
	/* vip_id straight from the map value: a key may be any readable
	 * memory, and a copy on the stack would cost a store. */
	count(bpf_map_lookup_elem(&vip_stats_map, &vip->vip_id), len);
	count(bpf_map_lookup_elem(&backend_stats_map, &backend_id), len);
	return verdict;
}

/* An IPv6 TCP/UDP packet (the parse said LB_PARSE_OK): balanced like IPv4 in
 * DSR and tunnel modes, its flow in flow6_map; to an IPv6 NAT VIP, or for no
 * VIP while NAT mode is in use, NAT mode's IPv6 path (xdp_nat6.h). */
static __always_inline int balance_v6(struct xdp_md *ctx, void *data, void *data_end,
				      const struct lb_parsed *p, __u64 len)
{
	struct lb_flow_key flow;
	struct lb_vip_key vkey;
	struct lb_vip_entry *vip;
	struct lb_backend *backend;
	__u32 backend_id = LB_NO_BACKEND;

	keys_v6(&flow, &vkey, p);
	vip = bpf_map_lookup_elem(&vip_map, &vkey);
	if (!vip && !nat_active)
		return stat(LB_STAT_PASS_NOT_VIP, len, XDP_PASS);
	if (!vip || vip->mode == LB_MODE_NAT)
		return nat6_enter(ctx, len);
	if (vip->vip_id >= LB_MAX_VIPS)
		return stat(LB_STAT_DROP_NO_BACKEND, len, XDP_DROP);
	backend = flow_backend(&flow6_map, &flow, LB_FAMILY_V6, vip, &backend_id, len);
	if (!backend)
		return stat(LB_STAT_DROP_NO_BACKEND, len, XDP_DROP);
	return forward(ctx, data, data_end, p, vip, backend, backend_id, len);
}

SEC("xdp")
int lb_xdp(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u64 len = (__u64)(data_end - data);
	struct lb_parsed pkt;
	struct lb_vip_key_v4 vkey;
	struct lb_flow_key_v4 flow;
	struct lb_vip_entry *vip, vip_copy __attribute__((aligned(8)));
	struct lb_backend *backend;
	__u32 backend_id = LB_NO_BACKEND;

	stat(LB_STAT_RX, len, 0);
	switch (lb_parse_untagged(&pkt, data, data_end)) {
	case LB_PARSE_OK:
		break;
	case LB_PARSE_NOT_IP:
		return stat(LB_STAT_PASS_NOT_IPV4, len, XDP_PASS);
	case LB_PARSE_UNSUPPORTED_L4:
		/* ICMP and ICMPv6 errors about NAT connections are NAT mode's,
		 * while it is in use; the rest, NDP included, the kernel's. */
		if (nat_active && pkt.proto == LB_IPPROTO_ICMP && pkt.family == LB_FAMILY_V4)
			return nat_icmp(ctx, data, data_end, &pkt, len);
		if (nat_active && pkt.proto == LB_IPPROTO_ICMPV6 && pkt.family == LB_FAMILY_V6)
			return nat6_enter(ctx, len);
		return stat(LB_STAT_PASS_NOT_VIP, len, XDP_PASS);
	case LB_PARSE_FRAGMENT:
		return stat(LB_STAT_PASS_FRAGMENT, len, XDP_PASS);
	case LB_PARSE_EXT_TOO_LONG:
		return stat(LB_STAT_PASS_EXT_HEADERS, len, XDP_PASS);
	default: /* LB_PARSE_MALFORMED */
		return stat(LB_STAT_DROP_MALFORMED, len, XDP_DROP);
	}
	if (pkt.family == LB_FAMILY_V6)
		return balance_v6(ctx, data, data_end, &pkt, len);
	flow_key_v4(&flow, &pkt);
	vip_key_v4(&vkey, &flow);
	vip = vip4_lookup(&vkey, &vip_copy) ? &vip_copy : NULL;
	if (!vip && !nat_active)
		return stat(LB_STAT_PASS_NOT_VIP, len, XDP_PASS);
	if (!vip || vip->mode == LB_MODE_NAT)
		return nat_frame(ctx, data, data_end, &pkt, &flow, vip, len);
	if (vip->vip_id >= LB_MAX_VIPS)
		return stat(LB_STAT_DROP_NO_BACKEND, len, XDP_DROP);
	backend = flow_backend(&flow_map, &flow, LB_FAMILY_V4, vip, &backend_id, len);
	if (!backend)
		return stat(LB_STAT_DROP_NO_BACKEND, len, XDP_DROP);
	return forward(ctx, data, data_end, &pkt, vip, backend, backend_id, len);
}

/* NAT mode's IPv6 program (the tail call above). */
#include "xdp_nat6.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";
