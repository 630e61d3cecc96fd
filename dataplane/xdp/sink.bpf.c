// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/* sink.bpf.c - XDP_DROP everything. The benchmark attaches it where forwarded
 * frames land (the appliance's veth peer), so that what happens downstream
 * costs nothing and is the same for every program measured; the veth's own
 * XDP counters (ethtool -S: rx_queue_0_xdp_drops) count the arrivals. */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

SEC("xdp")
int xdp_sink(struct xdp_md *ctx)
{
	(void)ctx;
	return XDP_DROP;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
