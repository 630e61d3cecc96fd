// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/*
 * lb.bpf.c - the XDP data plane: IPv4 TCP/UDP to a VIP in DSR mode.
 *
 * Per packet: parse Ethernet/IPv4/L4 with every length checked (the IPv4
 * total length too: it covers the header and fits in the frame; lb_parse.h,
 * shared with the DPDK forwarder), look the (daddr, dport, proto) triple up
 * in vip4_map (the compact IPv4 key; vip_map holds every VIP by the contract's
 * key), then
 *   1. flow_map hit whose backend is up or draining   -> reuse it (affinity:
 *      a weight change or ring patch never moves an established flow; the
 *      flow table is shared by all CPUs, so this holds whichever CPU a
 *      packet arrives on);
 *   2. otherwise hash the 5-tuple (lb_hash.h) into the VIP's ring and take the
 *      first up backend among LB_RING_PROBES probe slots (a down or draining
 *      backend takes no new flow even before the control plane rewrites the
 *      ring), then pin the flow;
 *   3. rewrite the destination MAC to the backend's, the source MAC to the
 *      egress port's (lb_rewrite.h), and XDP_TX (port 0, one-arm) or
 *      XDP_REDIRECT through tx_devmap (two-arm).
 * Everything that is not for a VIP is XDP_PASS, untouched: tagged and IPv6
 * frames too, for now (lb_untagged_ipv4_only), even one to an IPv6 VIP: the
 * tables carry IPv6 VIPs and backends since protocol 2, the fast path does
 * not forward IPv6 yet. Fragments pass to the kernel
 * (a non-first fragment carries no ports, so it cannot be balanced
 * consistently with its head). IP options are skipped using the IHL.
 * control/hpclb/contract/model.py is the reference for all of this.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "lb_tables.h"
#include "lb_hash.h"
#include "lb_parse.h"
#include "lb_rewrite.h"

/* Every VIP of either family under the contract's key: the table the daemon
 * writes and a restarted daemon adopts (xdp_tables.c). The fast path does not
 * read it today (IPv6 frames pass); IPv6 forwarding will look up here. */
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

/* IPv4 flows, under the compact 16-byte key (lb_tables.h); IPv6 flows will
 * get a flow map of their own, keyed by struct lb_flow_key, with IPv6
 * forwarding (an LRU map preallocates all its entries, so an unused one would
 * cost its memory for nothing).
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

/* First up backend among the probe slots of this flow, or LB_NO_BACKEND. */
static __always_inline __u32 pick_backend(const struct lb_config *cfg, __u32 vip_id,
					  const struct lb_flow_key_v4 *flow)
{
	__u32 ring_size = cfg->ring_size;
	__u64 hash;
	__u32 n;

	if (ring_size < 3)
		return LB_NO_BACKEND;
	/* An IPv4 flow (lb_untagged_ipv4_only): the IPv4 hash of its compact
	 * key, the same value lb_flow_hash gives its struct lb_flow_key. */
	hash = lb_flow_hash_v4_key(cfg->hash_key, flow);
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

/* The VIP key of an IPv4 flow, every byte written as in flow_key_v4. */
static __always_inline void vip_key_v4(struct lb_vip_key_v4 *vkey,
				       const struct lb_flow_key_v4 *flow)
{
	vkey->addr = flow->daddr;
	vkey->port = flow->dport;
	vkey->proto = flow->proto;
	vkey->pad = 0;
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
	struct lb_flow_entry *pinned, fresh = {};
	struct lb_vip_entry *vip;
	struct lb_backend *backend = NULL;
	struct lb_config *cfg;
	struct lb_port *port;
	__u32 zero = 0, backend_id = LB_NO_BACKEND, port_idx;
	long verdict;

	stat(LB_STAT_RX, len, 0);
	switch (lb_parse_untagged_ipv4(&pkt, data, data_end)) {
	case LB_PARSE_OK:
		break;
	case LB_PARSE_NOT_IP:
		return stat(LB_STAT_PASS_NOT_IPV4, len, XDP_PASS);
	case LB_PARSE_UNSUPPORTED_L4:
		return stat(LB_STAT_PASS_NOT_VIP, len, XDP_PASS);
	case LB_PARSE_FRAGMENT:
		return stat(LB_STAT_PASS_FRAGMENT, len, XDP_PASS);
	default: /* LB_PARSE_MALFORMED (LB_PARSE_EXT_TOO_LONG is IPv6's: not here) */
		return stat(LB_STAT_DROP_MALFORMED, len, XDP_DROP);
	}
	flow_key_v4(&flow, &pkt);
	vip_key_v4(&vkey, &flow);
	vip = bpf_map_lookup_elem(&vip4_map, &vkey);
	if (!vip)
		return stat(LB_STAT_PASS_NOT_VIP, len, XDP_PASS);
	cfg = bpf_map_lookup_elem(&config_map, &zero);
	if (!cfg || vip->vip_id >= LB_MAX_VIPS)
		return stat(LB_STAT_DROP_NO_BACKEND, len, XDP_DROP);

	pinned = bpf_map_lookup_elem(&flow_map, &flow);
	if (pinned) {
		backend_id = pinned->backend;
		backend = bpf_map_lookup_elem(&backend_map, &backend_id);
		if (backend_is(backend, LB_BACKEND_UP) || backend_is(backend, LB_BACKEND_DRAINING)) {
			stat(LB_STAT_FLOW_HIT, len, 0);
		} else {
			stat(LB_STAT_FLOW_REPIN, len, 0);
			backend = NULL;
		}
	}
	if (!backend) {
		backend_id = pick_backend(cfg, vip->vip_id, &flow);
		backend = bpf_map_lookup_elem(&backend_map, &backend_id);
		if (!backend)
			return stat(LB_STAT_DROP_NO_BACKEND, len, XDP_DROP);
		if (!pinned)
			stat(LB_STAT_FLOW_NEW, len, 0);
		fresh.backend = backend_id;
		fresh.vip_id = vip->vip_id;
		fresh.pinned_ns = bpf_ktime_get_ns();
		bpf_map_update_elem(&flow_map, &flow, &fresh, BPF_ANY);
	}

	port_idx = backend->port;
	port = bpf_map_lookup_elem(&port_map, &port_idx);
	if (!port || port->ifindex == 0)
		return stat(LB_STAT_DROP_TX_ERROR, len, XDP_DROP);
	if (lb_rewrite_macs(data, data_end, backend->mac, port->mac))
		return stat(LB_STAT_DROP_MALFORMED, len, XDP_DROP); /* cannot happen: parsed */
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
	count(bpf_map_lookup_elem(&vip_stats_map, &vip->vip_id), len);
	count(bpf_map_lookup_elem(&backend_stats_map, &backend_id), len);
	return verdict;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
