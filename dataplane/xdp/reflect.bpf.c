// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/* reflect.bpf.c - the benchmark ceiling: swap the MACs of every IPv4 frame and
 * send it back out (XDP_TX), doing none of the balancer's lookups. hpclb's own
 * XDP path is measured against this on the same interface, generator and run. */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

SEC("xdp")
int xdp_reflect(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	unsigned char tmp[ETH_ALEN];

	if ((void *)(eth + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP))
		return XDP_PASS;
	__builtin_memcpy(tmp, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, eth->h_source, ETH_ALEN);
	__builtin_memcpy(eth->h_source, tmp, ETH_ALEN);
	return XDP_TX;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
