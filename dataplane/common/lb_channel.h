/* SPDX-License-Identifier: Apache-2.0
 *
 * lb_channel.h - the control channel of a data-plane daemon: the ZeroMQ REP
 * socket the table protocol (PROTOCOL.md) is served on.
 */
#ifndef HPCLB_LB_CHANNEL_H
#define HPCLB_LB_CHANNEL_H

#include <signal.h>

#include "lb_proto.h"

/* A REP socket bound to endpoint. For ipc:// the directory is created, the
 * socket file is made 0600 (the protocol's only guard) and an endpoint some
 * other process still answers on is refused instead of stolen. NULL (logged)
 * on failure. */
void *lb_channel_open(void *zctx, const char *endpoint);

/* Receives one request (all its parts), has srv handle it, sends the reply
 * and logs the outcome. Never blocks on a request that is not there. */
void lb_channel_serve_one(void *sock, struct lb_proto_server *srv);

/* Serves requests until *stop is set (a signal handler sets it: the poll
 * wakes at least every 200 ms to look). 0 when stopped, -1 on a poll error. */
int lb_channel_serve(void *sock, struct lb_proto_server *srv, volatile sig_atomic_t *stop);

#endif /* HPCLB_LB_CHANNEL_H */
