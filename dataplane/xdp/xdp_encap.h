/* SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
 *
 * xdp_encap.h - tunnel mode's encapsulation in XDP (lb.bpf.c): lb_encap.h's
 * prepare, room made in front of the frame with bpf_xdp_adjust_head, then
 * lb_encap.h's write. Apart from lb.bpf.c because it is the one step that
 * moves the frame: every packet pointer taken before it is dead after it, so
 * it takes the context, not pointers, and gathers all it needs first.
 */
#ifndef HPCLB_XDP_ENCAP_H
#define HPCLB_XDP_ENCAP_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "lb_encap.h"

/* Encapsulate the frame of ctx, parsed into *p (an untagged IPv4 or IPv6
 * TCP/UDP packet), for backend b of the tunnel VIP v, leaving by a port
 * whose MAC is src_mac: on return 0 the frame is
 *   [eth: b->mac, src_mac][outer IP][UDP, GUE only][the IP packet as it came]
 * and ctx's data/data_end span it. -1: not encapsulated (drop_encap, the
 * caller counts and drops): lb_encap_prepare refused the pair (IPv6 inside
 * IPv4, a tunnel source of another family than the backend's), or the
 * driver has no headroom for the outer headers (XDP guarantees 256 bytes
 * in front of a frame, the largest encapsulation takes 48: not on a sane
 * driver). When adjust_head succeeded but the write did not (cannot be:
 * the frame only grew), the frame is left half written, and dropped. */
static __always_inline int xdp_encap(struct xdp_md *ctx, const struct lb_parsed *p,
				     const struct lb_vip_entry *v, const struct lb_backend *b,
				     const __u8 *src_mac)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct lb_encap_plan plan, *e = &plan;

	/* No barrier hides e's alignment from clang any more: lb_tunnel_src
	 * used to patch bytes 2..3 of an address word, whose address clang
	 * formed with an OR on the stack pointer (fp-40 | 2), which the verifier
	 * refuses ("bitwise operator |= on pointer prohibited"); it now stores
	 * whole words. Knowing the alignment, clang copies the plan's fields in
	 * wider loads and stores (lb_xdp is 130 instructions shorter). Should
	 * that error come back, an asm volatile("" : "+r"(e)) here hides it. */
	if (lb_encap_prepare(e, p, v, b, lb_inner_tos(data, data_end, p)))
		return -1;
	if (bpf_xdp_adjust_head(ctx, -(int)e->len))
		return -1;
	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	/* The MACs straight from b and src_mac, map values that the adjust
	 * leaves valid (it invalidates packet pointers only); the plan's MAC
	 * fields stay unused here (lb_encap_write_macs says why). */
	return lb_encap_write_macs(data, data_end, e, b->mac, src_mac);
}

#endif /* HPCLB_XDP_ENCAP_H */
