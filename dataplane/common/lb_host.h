/* SPDX-License-Identifier: Apache-2.0
 *
 * lb_host.h - host facts and argument checks both data-plane daemons need:
 * numbers and names from the command line, the network namespace they serve,
 * and the interfaces they forward on.
 */
#ifndef HPCLB_LB_HOST_H
#define HPCLB_LB_HOST_H

#include <sys/types.h>

#include "lb_proto.h"

/* A decimal __u32 with nothing around it; 0 or -1. */
int lb_parse_u32(const char *s, __u32 *out);
int lb_is_prime(__u32 n);
/* A ring size both data planes accept: a prime in 3..LB_RING_SIZE_MAX. */
int lb_valid_ring_size(__u32 n);
int lb_valid_ifname(const char *s);
/* A name under /run/netns: no slash, not "." or "..". */
int lb_valid_netns(const char *s);
/* setns() into /run/netns/NAME; logs and returns -1 on failure. */
int lb_enter_netns(const char *name);
/* ifindex and MAC of an interface of the current network namespace. */
int lb_get_port(const char *ifname, struct lb_proto_port *p);
/* mkdir -p; 0 or a negative errno. */
int lb_mkdir_p(const char *path, mode_t mode);

#endif /* HPCLB_LB_HOST_H */
