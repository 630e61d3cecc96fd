// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/* pass.bpf.c - XDP_PASS everything. A veth only delivers frames that its peer
 * sent with XDP_TX/XDP_REDIRECT when this end runs an XDP program too (or has
 * GRO on); the lab attaches this one to the appliance's peer. */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

SEC("xdp")
int xdp_pass(struct xdp_md *ctx)
{
	(void)ctx;
	return XDP_PASS;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
