/* SPDX-License-Identifier: Apache-2.0
 *
 * fwd_packet.h - what the forwarder does with one frame: the same decisions
 * as lb.bpf.c (control/hpclb/contract/model.py is the reference for both),
 * DSR and NAT mode (lb_conn.h), plus the ARP replies for VIP and SNAT pool
 * addresses that XDP leaves to the kernel.
 *
 * No I/O here: the worker hands a frame in and gets a verdict back, with the
 * frame rewritten in place when it is forwarded or answered.
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
	struct fwd_counters *counters;
	const __u8 (*port_macs)[6]; /* source MAC of each port, by port index */
	__u32 nports;
	__u32 in_port;
	__u64 now_tsc;
	__u64 now_ns;
};

enum fwd_verdict fwd_packet(struct fwd_packet_ctx *c, __u8 *frame, __u32 len, __u32 *out_port);

#endif /* HPCLB_FWD_PACKET_H */
