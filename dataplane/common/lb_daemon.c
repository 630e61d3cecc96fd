/* SPDX-License-Identifier: Apache-2.0
 *
 * lb_daemon.c - the set-up both data-plane daemons share: see lb_daemon.h.
 * Log lines and exit paths are the ones each daemon had on its own, which the
 * control plane's supervisor and the tests read.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <string.h>
#include <sys/random.h>
#include <zmq.h>

#include "lb_channel.h"
#include "lb_daemon.h"
#include "lb_host.h"
#include "lb_log.h"

volatile sig_atomic_t lb_daemon_stop;

void lb_daemon_opts_init(struct lb_daemon_opts *d)
{
	d->socket = LB_DAEMON_DEFAULT_SOCKET;
	d->ring_size = LB_RING_SIZE_DEFAULT;
}

int lb_daemon_parse_opt(struct lb_daemon_opts *d, int c, const char *arg)
{
	switch (c) {
	case 's':
		d->socket = arg;
		return 1;
	case 'r':
		if (lb_parse_u32(arg, &d->ring_size) || !lb_valid_ring_size(d->ring_size)) {
			lb_log(LB_LOG_ERR, "--ring-size must be a prime in 3..%u, got '%s'",
			       LB_RING_SIZE_MAX, arg);
			return -1;
		}
		return 1;
	case 'l':
		if (lb_log_set_level_name(arg)) {
			lb_log(LB_LOG_ERR, "--log-level must be error, warn, info or debug");
			return -1;
		}
		return 1;
	}
	return 0;
}

int lb_daemon_check_operands(int argc, char **argv)
{
	if (optind < argc) {
		lb_log(LB_LOG_ERR, "unexpected argument '%s'", argv[optind]);
		return -1;
	}
	return 0;
}

static void on_signal(int sig)
{
	(void)sig;
	lb_daemon_stop = 1;
}

void lb_daemon_signals(void)
{
	struct sigaction sa;

	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_signal; /* no SA_RESTART: zmq_poll returns EINTR */
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	/* A write to a pipe or socket whose reader is gone fails with EPIPE
	 * instead of killing the daemon. */
	signal(SIGPIPE, SIG_IGN);
	/* A hang-up of a terminal or session the daemon was started from must not
	 * kill it without cleaning up: only SIGTERM/SIGINT stop it. */
	signal(SIGHUP, SIG_IGN);
	/* SIGUSR2 is `hpclb run`'s hand-over (an upgrade of the control plane);
	 * `systemctl kill -s USR2 hpclb` without --kill-whom=main sends it to the
	 * data plane too, which must keep forwarding for the successor. */
	signal(SIGUSR2, SIG_IGN);
}

int lb_daemon_initial_config(struct lb_config *cfg, __u32 ring_size)
{
	memset(cfg, 0, sizeof(*cfg));
	cfg->ring_size = ring_size;
	/* An outsider must not be able to aim flows at one backend before the
	 * control plane sets its key. */
	if (getrandom(cfg->hash_key, sizeof(cfg->hash_key), 0) != (ssize_t)sizeof(cfg->hash_key)) {
		lb_log(LB_LOG_ERR, "getrandom: %s", strerror(errno));
		return -1;
	}
	return 0;
}

int lb_daemon_ctl_open(struct lb_daemon_ctl *ctl, const char *endpoint)
{
	ctl->zctx = zmq_ctx_new();
	ctl->sock = ctl->zctx ? lb_channel_open(ctl->zctx, endpoint) : NULL;
	return ctl->sock ? 0 : -1;
}

int lb_daemon_ctl_serve(struct lb_daemon_ctl *ctl, struct lb_proto_server *srv)
{
	lb_log(LB_LOG_INFO, "ready");
	lb_channel_serve(ctl->sock, srv, &lb_daemon_stop);
	if (!lb_daemon_stop)
		return -1;
	lb_log(LB_LOG_INFO, "signal received, shutting down");
	return 0;
}

void lb_daemon_ctl_close(struct lb_daemon_ctl *ctl)
{
	if (ctl->sock)
		zmq_close(ctl->sock);
	if (ctl->zctx)
		zmq_ctx_term(ctl->zctx);
	ctl->sock = NULL;
	ctl->zctx = NULL;
}
