/* SPDX-License-Identifier: Apache-2.0
 *
 * lb_daemon.c - the set-up both data-plane daemons share: see lb_daemon.h.
 * Log lines and exit paths are the ones each daemon had on its own, which the
 * control plane's supervisor and the tests read.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <linux/if_tun.h>
#include <net/if.h>
#include <signal.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
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
	d->alive_iface = NULL;
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
	case 'a':
		if (!lb_daemon_valid_alive_name(arg)) {
			lb_log(LB_LOG_ERR, "--alive-interface must be 1..%d characters of "
			       "[A-Za-z0-9_.-], got '%s'", IFNAMSIZ - 1, arg);
			return -1;
		}
		d->alive_iface = arg;
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

/* ---- the liveness interface ---------------------------------------------- */

/* How long a name still held by another process (EBUSY: a predecessor that
 * is exiting still has its descriptor) is waited for: ALIVE_TRIES x
 * ALIVE_WAIT_NS, 1 s. */
#define ALIVE_TRIES 20
#define ALIVE_WAIT_NS 50000000L

static int alive_fd = -1;
static char alive_name[IFNAMSIZ];

int lb_daemon_valid_alive_name(const char *name)
{
	size_t n = strnlen(name, IFNAMSIZ);

	if (n == 0 || n >= IFNAMSIZ || !strcmp(name, ".") || !strcmp(name, ".."))
		return 0;
	for (size_t i = 0; i < n; i++) {
		char c = name[i];

		if (!((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') ||
		      (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-'))
			return 0;
	}
	return 1;
}

/* The TUN device name attached to a new descriptor, persistence off, or -1
 * with errno set. */
static int alive_open(const char *name)
{
	struct ifreq ifr;
	int fd, err;

	fd = open("/dev/net/tun", O_RDWR | O_CLOEXEC);
	if (fd < 0)
		return -1;
	memset(&ifr, 0, sizeof(ifr));
	ifr.ifr_flags = IFF_TUN | IFF_NO_PI;
	memcpy(ifr.ifr_name, name, strnlen(name, IFNAMSIZ - 1));
	/* A device of that name left persistent (by hand, or by a tool) would
	 * be attached to instead and would outlive us: persistence is turned
	 * off so that our end is its end. */
	if (ioctl(fd, TUNSETIFF, &ifr) < 0 || ioctl(fd, TUNSETPERSIST, 0UL) < 0) {
		err = errno;
		close(fd);
		errno = err;
		return -1;
	}
	return fd;
}

/* IFF_UP on name: BIRD's static device routes need the interface up. */
static int alive_set_up(const char *name)
{
	struct ifreq ifr;
	int s, err = 0;

	s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (s < 0)
		return -1;
	memset(&ifr, 0, sizeof(ifr));
	memcpy(ifr.ifr_name, name, strnlen(name, IFNAMSIZ - 1));
	if (ioctl(s, SIOCGIFFLAGS, &ifr) < 0) {
		err = -1;
	} else if (!(ifr.ifr_flags & IFF_UP)) {
		ifr.ifr_flags |= IFF_UP;
		if (ioctl(s, SIOCSIFFLAGS, &ifr) < 0)
			err = -1;
	}
	if (err) {
		int e = errno;

		close(s);
		errno = e;
		return -1;
	}
	close(s);
	return 0;
}

void lb_daemon_alive_up(const char *name)
{
	struct timespec wait = { 0, ALIVE_WAIT_NS };
	int fd = -1, err = 0;

	if (!name || alive_fd >= 0)
		return;
	for (int tries = 0; tries < ALIVE_TRIES && !lb_daemon_stop; tries++) {
		fd = alive_open(name);
		err = fd < 0 ? errno : 0;
		if (fd >= 0 || err != EBUSY)
			break;
		nanosleep(&wait, NULL);
	}
	if (fd < 0) {
		lb_log(LB_LOG_WARN, "liveness interface %s not created (%s%s): the BGP "
		       "speaker will not announce the VIPs through it", name,
		       strerror(err ? err : EINTR), err == EBUSY ? ": another process holds it" : "");
		return;
	}
	if (alive_set_up(name) < 0) {
		lb_log(LB_LOG_WARN, "liveness interface %s: cannot set it up: %s", name,
		       strerror(errno));
		close(fd);
		return;
	}
	alive_fd = fd;
	snprintf(alive_name, sizeof(alive_name), "%s", name);
	lb_log(LB_LOG_INFO, "liveness interface %s up (removed when this process ends)", name);
}

void lb_daemon_alive_down(void)
{
	if (alive_fd < 0)
		return;
	close(alive_fd);
	alive_fd = -1;
	lb_log(LB_LOG_INFO, "liveness interface %s removed", alive_name);
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
	/* First: the speaker withdraws the VIPs while the daemon still forwards
	 * through its clean-up. */
	lb_daemon_alive_down();
	if (!lb_daemon_stop)
		return -1;
	lb_log(LB_LOG_INFO, "signal received, shutting down");
	return 0;
}

void lb_daemon_ctl_close(struct lb_daemon_ctl *ctl)
{
	lb_daemon_alive_down();
	if (ctl->sock)
		zmq_close(ctl->sock);
	if (ctl->zctx)
		zmq_ctx_term(ctl->zctx);
	ctl->sock = NULL;
	ctl->zctx = NULL;
}
