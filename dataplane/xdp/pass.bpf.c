// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/* pass.bpf.c - XDP_PASS everything. A veth delivers the frames its peer sent
 * with XDP_TX/XDP_REDIRECT only when this end runs an XDP program too: on
 * kernel 6.18, GRO alone queues them but nothing wakes the queue (measured in
 * the lab, see control/hpclb/lab/topology.py). The lab attaches this program to the
 * appliance's peer. */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

SEC("xdp")
int xdp_pass(struct xdp_md *ctx)
{
	(void)ctx;
	return XDP_PASS;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
