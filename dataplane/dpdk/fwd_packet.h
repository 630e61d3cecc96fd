/* SPDX-License-Identifier: Apache-2.0
 *
 * fwd_packet.h - what the forwarder does with one frame: the same decisions
 * as lb.bpf.c (control/hpclb/contract/model.py is the reference for both),
 * DSR, NAT (lb_conn.h) and tunnel mode (lb_encap.h), IPv4 and IPv6, plus
 * the ARP replies for VIP and SNAT pool addresses and the Neighbor
 * Advertisements for IPv6 VIP addresses that XDP leaves to the kernel.
 *
 * No I/O here: the worker hands a frame in and gets a verdict back, with the
 * frame rewritten in place when it is forwarded or answered. A frame may
 * also change its extent: tunnel mode writes outer headers into the room
 * before it, a Neighbor Advertisement may be longer or shorter than the
 * solicitation it answers. struct fwd_frame says how much room there is and,
 * on return, where the frame now begins and how long it is; the worker moves
 * the mbuf's bounds to match (rte_pktmbuf_prepend/append/trim). Only
 * fwd_packet writes frame bytes, so what it decides is testable without an
 * mbuf.
 */
#ifndef HPCLB_FWD_PACKET_H
#define HPCLB_FWD_PACKET_H

#include "fwd_flow.h"
#include "fwd_tables.h"

enum fwd_verdict {
	FWD_DROP = 0,
	FWD_TO_KERNEL, /* through the port's TAP exception path */
	FWD_OUT,       /* rewritten; send out of *out_port */
	FWD_REPLY,     /* rewritten into an answer; send back out of the ingress port */
};

struct fwd_packet_ctx {
	const struct fwd_tables *tables;
	struct fwd_flow_table *flows;
	struct fwd_conn_table *conns; /* NAT connections (shared by the workers), or NULL */
	struct fwd_conn6_table *conns6; /* IPv6 NAT connections, the same way, or NULL */
	struct fwd_counters *counters;
	const __u8 (*port_macs)[6]; /* source MAC of each port, by port index */
	__u32 nports;
	__u32 in_port;
	__u64 now_tsc;
	__u64 now_ns;
};

/* One frame and the writable room around it. fwd_packet reads data and len,
 * writes nothing outside [data - headroom, data + len + tailroom), and on
 * FWD_OUT or FWD_REPLY leaves data and len describing the frame to send
 * (data moved back by at most headroom, len grown by at most the two rooms). */
struct fwd_frame {
	__u8 *data;
	__u32 len;
	__u32 headroom;
	__u32 tailroom;
};

enum fwd_verdict fwd_packet(struct fwd_packet_ctx *c, struct fwd_frame *f, __u32 *out_port);

#endif /* HPCLB_FWD_PACKET_H */
