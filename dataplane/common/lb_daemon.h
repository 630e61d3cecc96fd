/* SPDX-License-Identifier: Apache-2.0
 *
 * lb_daemon.h - what the two data-plane daemons, hpclb-xdp and hpclb-dpdk, do
 * alike around their own work: the command-line options both parse the same
 * way, the signals that stop them, the configuration their empty tables start
 * with, and the control channel's life (open, serve until a signal, close).
 *
 * Only what both do identically is here. What one daemon alone has (DPDK's
 * EAL arguments and lcores, XDP's attach and pins), and the options whose
 * bounds or checks differ between them (--flow-table-size, --netns, --help's
 * text), stay in xdp_daemon.c and fwd_main.c.
 */
#ifndef HPCLB_LB_DAEMON_H
#define HPCLB_LB_DAEMON_H

#include <getopt.h>
#include <signal.h>

#include "lb_proto.h"

#define LB_DAEMON_DEFAULT_SOCKET "ipc:///run/hpclb/dataplane.sock"

/* ---- command line -------------------------------------------------------- */

/* getopt_long entries of the shared options, for each daemon's own option
 * table (where each keeps its place: getopt lists an ambiguous abbreviation's
 * candidates in table order). Their values are what lb_daemon_parse_opt
 * recognises. */
#define LB_DAEMON_OPTION_SOCKET { "socket", required_argument, NULL, 's' }
#define LB_DAEMON_OPTION_RING_SIZE { "ring-size", required_argument, NULL, 'r' }
#define LB_DAEMON_OPTION_LOG_LEVEL { "log-level", required_argument, NULL, 'l' }
#define LB_DAEMON_OPTION_ALIVE_INTERFACE { "alive-interface", required_argument, NULL, 'a' }

struct lb_daemon_opts {
	const char *socket; /* --socket: the control channel's ZeroMQ endpoint */
	__u32 ring_size;    /* --ring-size: slots of every VIP's ring, fixed at start */
	const char *alive_iface; /* --alive-interface: NULL when none (lb_daemon_alive_up) */
};

/* The defaults: LB_DAEMON_DEFAULT_SOCKET, LB_RING_SIZE_DEFAULT, no
 * liveness interface. */
void lb_daemon_opts_init(struct lb_daemon_opts *d);

/* One getopt_long result c with its optarg. 1: a shared option, taken; 0: not
 * a shared option (the daemon's own, or '?'); -1: a shared option with a bad
 * value (logged). --log-level takes effect at once (lb_log). */
int lb_daemon_parse_opt(struct lb_daemon_opts *d, int c, const char *arg);

/* After getopt_long: the daemons take no operands. 0, or -1 (logged). */
int lb_daemon_check_operands(int argc, char **argv);

/* ---- the liveness interface ---------------------------------------------- */

/* --alive-interface NAME: a TUN device that exists exactly as long as the
 * daemon lives. The BGP speaker (BIRD, in the same network namespace)
 * announces each VIP as a route through it, valid only while the interface
 * exists and is up: when the daemon dies, even by SIGKILL with `hpclb run`
 * dead too, the kernel closes the descriptor, deletes the interface and
 * BIRD, told over netlink, withdraws the VIPs at once.
 *
 * A name the kernel would take: 1..15 characters of [A-Za-z0-9_.-], not "."
 * or "..". 1 or 0. */
int lb_daemon_valid_alive_name(const char *name);

/* Creates the non-persistent TUN device name (NULL: nothing), sets it up and
 * keeps its descriptor until lb_daemon_alive_down or the process's end.
 * Called once the daemon forwards and is about to serve. A failure (no
 * /dev/net/tun, no CAP_NET_ADMIN, the name held by a predecessor that does
 * not exit within a second) is logged as a warning and ignored: the
 * coupling is lost, never the traffic. Call it from the namespace BIRD runs
 * in (after --netns). */
void lb_daemon_alive_up(const char *name);

/* Closes the descriptor, which deletes the interface (idempotent). A daemon
 * that stops removes it first, before detaching or stopping its ports. */
void lb_daemon_alive_down(void);

/* ---- signals ------------------------------------------------------------- */

/* Set by SIGTERM or SIGINT: the daemon stops, cleaning up (DPDK's workers
 * watch it too). The daemon may set it itself to stop its workers. */
extern volatile sig_atomic_t lb_daemon_stop;

/* SIGTERM and SIGINT set lb_daemon_stop (without SA_RESTART, so that a
 * blocking zmq_poll returns EINTR at once); SIGPIPE and SIGHUP are ignored. */
void lb_daemon_signals(void);

/* ---- tables -------------------------------------------------------------- */

/* The configuration empty tables start with: ring_size slots and a random
 * flow-hash key until the control plane sets one. 0, or -1 (logged). */
int lb_daemon_initial_config(struct lb_config *cfg, __u32 ring_size);

/* ---- the control channel ------------------------------------------------- */

/* A ZeroMQ context and the REP socket the table protocol is served on. Zero
 * it before the first path that may reach lb_daemon_ctl_close. */
struct lb_daemon_ctl {
	void *zctx;
	void *sock;
};

/* Binds endpoint (lb_channel_open: directory, mode 0600, an endpoint in use
 * refused). 0, or -1 (a failed bind is logged); close it either way. Requests
 * wait in the socket until lb_daemon_ctl_serve. */
int lb_daemon_ctl_open(struct lb_daemon_ctl *ctl, const char *endpoint);

/* Logs "ready" (the line supervisors and tests wait for), then serves srv
 * until lb_daemon_stop is set; then takes the liveness interface down
 * (lb_daemon_alive_down) before the daemon's own clean-up. 0 when a signal
 * stopped it (logged), -1 when
 * serving failed (the daemon exits with an error). */
int lb_daemon_ctl_serve(struct lb_daemon_ctl *ctl, struct lb_proto_server *srv);

/* Closes what lb_daemon_ctl_open made, if anything; ctl is zeroed. Takes the
 * liveness interface down too (a start that failed after it was up). */
void lb_daemon_ctl_close(struct lb_daemon_ctl *ctl);

#endif /* HPCLB_LB_DAEMON_H */
