// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/* noop.bpf.c - the do-nothing baselines of hpclb.lab.xdp_cost: a program that
 * only returns a verdict, measured through BPF_PROG_TEST_RUN beside lb_xdp in
 * the same run, so that what the test-run harness itself costs per frame (its
 * loop and timer; in live-frame mode the page pool, the transmit or the
 * kernel's receive path) can be told from what the program costs.
 * Two programs, one per verdict lb_xdp gives on the measured paths:
 * xdp_noop_tx (a flow hit and a new flow leave by XDP_TX) and xdp_noop_pass
 * (a frame for no VIP is the kernel's). Neither reads the frame. */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

SEC("xdp")
int xdp_noop_tx(struct xdp_md *ctx)
{
	(void)ctx;
	return XDP_TX;
}

SEC("xdp")
int xdp_noop_pass(struct xdp_md *ctx)
{
	(void)ctx;
	return XDP_PASS;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
