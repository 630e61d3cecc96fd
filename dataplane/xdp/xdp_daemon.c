/* SPDX-License-Identifier: Apache-2.0
 *
 * xdp_daemon.c - hpclb-xdp: loads lb.bpf.c (embedded skeleton), pins its maps
 * and program, attaches it to the ingress interface, and serves the table
 * protocol (lb_proto.c) on a ZeroMQ REP socket until SIGTERM/SIGINT.
 *
 * The program keeps forwarding with the last tables whatever happens to the
 * control plane: the daemon only answers requests. If a previous daemon died
 * without cleaning up, its pinned maps are reused (when compatible) and their
 * tables adopted, so forwarding does not blink across a restart.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <net/if.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/un.h>
#include <unistd.h>
#include <linux/if_link.h>
#include <linux/magic.h>
#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <zmq.h>

#include "lb.skel.h"
#include "lb_proto.h"
#include "xdp_tables.h"

#define PROG "hpclb-xdp"
#define DEFAULT_SOCKET "ipc:///run/hpclb/dataplane.sock"
#define POLL_MS 200                 /* signal latency bound */
#define SEND_TIMEOUT_MS 1000        /* a stuck peer cannot block the loop */
#define HARD_MAX_MSG (4ll * LB_MAX_MSG_BYTES) /* beyond this zmq drops the peer */
#define MAX_FLOWS_OPT (1u << 28)

enum { LOG_ERR, LOG_WARN, LOG_INFO, LOG_DEBUG };
static int log_level = LOG_INFO;

static void logmsg(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void logmsg(int level, const char *fmt, ...)
{
	static const char *const tag[] = { "error: ", "warning: ", "", "debug: " };
	char line[1024];
	va_list ap;

	if (level > log_level)
		return;
	va_start(ap, fmt);
	vsnprintf(line, sizeof(line), fmt, ap);
	va_end(ap);
	/* One write per line, so lines from concurrent writers do not interleave. */
	fprintf(stderr, PROG ": %s%s\n", tag[level], line);
}

/* While set, libbpf's warnings are kept here instead of logged, so that a
 * failed native attach is reported in one line with the kernel's reason. */
static int libbpf_capture;
static char libbpf_last[256];

static int libbpf_log(enum libbpf_print_level level, const char *fmt, va_list ap)
{
	char line[1024];
	size_t n;
	int ours = level == LIBBPF_WARN ? LOG_WARN : LOG_DEBUG;

	if (ours > log_level && !(libbpf_capture && level == LIBBPF_WARN))
		return 0;
	vsnprintf(line, sizeof(line), fmt, ap);
	n = strlen(line);
	while (n && line[n - 1] == '\n')
		line[--n] = '\0';
	if (libbpf_capture && level == LIBBPF_WARN) {
		const char *msg = strstr(line, "Kernel error message: ");

		snprintf(libbpf_last, sizeof(libbpf_last), "%s",
			 msg ? msg + strlen("Kernel error message: ") : line);
		return 0;
	}
	logmsg(ours, "%s", line); /* libbpf's lines start with "libbpf: " */
	return 0;
}

static volatile sig_atomic_t stop;

static void on_signal(int sig)
{
	(void)sig;
	stop = 1;
}

struct opts {
	const char *iface;
	const char *egress[LB_MAX_PORTS - 1];
	int negress;
	const char *netns;
	const char *socket;
	__u32 ring_size;
	__u32 flow_table_size;
	const char *xdp_mode;
	char pin_dir[PATH_MAX - 64]; /* room for "/<map name>" */
	int no_attach;
};

static void usage(FILE *f)
{
	fprintf(f,
		"usage: " PROG " --iface IF [--egress IF]... [--netns NAME] [--socket ENDPOINT]\n"
		"       [--ring-size PRIME] [--flow-table-size N] [--xdp-mode auto|native|generic]\n"
		"       [--pin-dir DIR] [--no-attach] [--log-level error|warn|info|debug]\n"
		"defaults: --socket " DEFAULT_SOCKET ", --ring-size %u, --flow-table-size %u,\n"
		"          --xdp-mode auto, --pin-dir /sys/fs/bpf/hpclb/<iface>\n",
		LB_RING_SIZE_DEFAULT, LB_MAX_FLOWS);
}

static int is_prime(__u32 n)
{
	if (n < 3 || n % 2 == 0)
		return n == 2;
	for (__u32 d = 3; d <= n / d; d += 2)
		if (n % d == 0)
			return 0;
	return 1;
}

static int parse_u32(const char *s, __u32 *out)
{
	char *end;
	unsigned long long v;

	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno || end == s || *end || s[0] == '-' || v > UINT32_MAX)
		return -1;
	*out = (__u32)v;
	return 0;
}

static int valid_ifname(const char *s)
{
	return s[0] && strlen(s) < IFNAMSIZ && !strchr(s, '/');
}

static int parse_args(int argc, char **argv, struct opts *o)
{
	static const struct option lo[] = {
		{ "iface", required_argument, NULL, 'i' },
		{ "egress", required_argument, NULL, 'e' },
		{ "netns", required_argument, NULL, 'n' },
		{ "socket", required_argument, NULL, 's' },
		{ "ring-size", required_argument, NULL, 'r' },
		{ "flow-table-size", required_argument, NULL, 'f' },
		{ "xdp-mode", required_argument, NULL, 'm' },
		{ "pin-dir", required_argument, NULL, 'p' },
		{ "no-attach", no_argument, NULL, 'A' },
		{ "log-level", required_argument, NULL, 'l' },
		{ "help", no_argument, NULL, 'h' },
		{ 0 },
	};
	static const char *const levels[] = { "error", "warn", "info", "debug" };
	int c;

	memset(o, 0, sizeof(*o));
	o->socket = DEFAULT_SOCKET;
	o->ring_size = LB_RING_SIZE_DEFAULT;
	o->flow_table_size = LB_MAX_FLOWS;
	o->xdp_mode = "auto";
	while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
		switch (c) {
		case 'i':
			o->iface = optarg;
			break;
		case 'e':
			if (o->negress == LB_MAX_PORTS - 1) {
				logmsg(LOG_ERR, "at most %d --egress interfaces", LB_MAX_PORTS - 1);
				return -1;
			}
			o->egress[o->negress++] = optarg;
			break;
		case 'n':
			o->netns = optarg;
			break;
		case 's':
			o->socket = optarg;
			break;
		case 'r':
			if (parse_u32(optarg, &o->ring_size) || !is_prime(o->ring_size) ||
			    o->ring_size < 3 || o->ring_size > LB_RING_SIZE_MAX) {
				logmsg(LOG_ERR, "--ring-size must be a prime in 3..%u, got '%s'",
				       LB_RING_SIZE_MAX, optarg);
				return -1;
			}
			break;
		case 'f':
			if (parse_u32(optarg, &o->flow_table_size) || o->flow_table_size < 1 ||
			    o->flow_table_size > MAX_FLOWS_OPT) {
				logmsg(LOG_ERR, "--flow-table-size must be in 1..%u, got '%s'",
				       MAX_FLOWS_OPT, optarg);
				return -1;
			}
			break;
		case 'm':
			if (strcmp(optarg, "auto") && strcmp(optarg, "native") &&
			    strcmp(optarg, "generic")) {
				logmsg(LOG_ERR, "--xdp-mode must be auto, native or generic");
				return -1;
			}
			o->xdp_mode = optarg;
			break;
		case 'p':
			if (snprintf(o->pin_dir, sizeof(o->pin_dir), "%s", optarg) >=
			    (int)sizeof(o->pin_dir)) {
				logmsg(LOG_ERR, "--pin-dir too long");
				return -1;
			}
			break;
		case 'A':
			o->no_attach = 1;
			break;
		case 'l':
			log_level = -1;
			for (int i = 0; i < 4; i++)
				if (!strcmp(optarg, levels[i]))
					log_level = i;
			if (log_level < 0) {
				log_level = LOG_INFO;
				logmsg(LOG_ERR, "--log-level must be error, warn, info or debug");
				return -1;
			}
			break;
		case 'h':
			usage(stdout);
			exit(0);
		default:
			usage(stderr);
			return -1;
		}
	}
	if (optind < argc) {
		logmsg(LOG_ERR, "unexpected argument '%s'", argv[optind]);
		return -1;
	}
	if (!o->iface) {
		logmsg(LOG_ERR, "--iface is required");
		usage(stderr);
		return -1;
	}
	if (!valid_ifname(o->iface)) {
		logmsg(LOG_ERR, "bad interface name '%s'", o->iface);
		return -1;
	}
	for (int i = 0; i < o->negress; i++) {
		if (!valid_ifname(o->egress[i])) {
			logmsg(LOG_ERR, "bad interface name '%s'", o->egress[i]);
			return -1;
		}
	}
	if (o->netns && (!o->netns[0] || strchr(o->netns, '/') || !strcmp(o->netns, ".") ||
			 !strcmp(o->netns, ".."))) {
		logmsg(LOG_ERR, "bad --netns name '%s'", o->netns);
		return -1;
	}
	if (!o->pin_dir[0])
		snprintf(o->pin_dir, sizeof(o->pin_dir), "/sys/fs/bpf/hpclb/%s", o->iface);
	return 0;
}

/* ---- environment ------------------------------------------------------- */

static int enter_netns(const char *name)
{
	char path[PATH_MAX];
	int fd, err = 0;

	snprintf(path, sizeof(path), "/run/netns/%s", name);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		logmsg(LOG_ERR, "cannot open network namespace %s: %s", path, strerror(errno));
		return -1;
	}
	if (setns(fd, CLONE_NEWNET) < 0) {
		logmsg(LOG_ERR, "setns(%s): %s", path, strerror(errno));
		err = -1;
	}
	close(fd);
	if (!err)
		logmsg(LOG_INFO, "entered network namespace %s", name);
	return err;
}

/* ifindex and MAC of an interface of the current network namespace (an
 * ioctl on a socket made here: /sys/class/net still shows the old one). */
static int get_port(const char *ifname, struct lb_proto_port *p)
{
	struct ifreq ifr;
	int fd, err = 0;

	memset(p, 0, sizeof(*p));
	snprintf(p->ifname, sizeof(p->ifname), "%s", ifname);
	p->ifindex = if_nametoindex(ifname);
	if (!p->ifindex) {
		logmsg(LOG_ERR, "interface %s: %s", ifname, strerror(errno));
		return -1;
	}
	fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		logmsg(LOG_ERR, "socket: %s", strerror(errno));
		return -1;
	}
	memset(&ifr, 0, sizeof(ifr));
	snprintf(ifr.ifr_name, sizeof(ifr.ifr_name), "%s", ifname);
	if (ioctl(fd, SIOCGIFHWADDR, &ifr) < 0) {
		logmsg(LOG_ERR, "interface %s: no hardware address: %s", ifname, strerror(errno));
		err = -1;
	} else {
		memcpy(p->mac, ifr.ifr_hwaddr.sa_data, 6);
	}
	close(fd);
	return err;
}

static int mkdir_p(const char *path, mode_t mode)
{
	char buf[PATH_MAX];
	size_t n = strlen(path);

	if (n == 0 || n >= sizeof(buf))
		return -ENAMETOOLONG;
	memcpy(buf, path, n + 1);
	for (size_t i = 1; i <= n; i++) {
		if (buf[i] != '/' && buf[i] != '\0')
			continue;
		buf[i] = '\0';
		if (mkdir(buf, mode) < 0 && errno != EEXIST)
			return -errno;
		buf[i] = i == n ? '\0' : '/';
	}
	return 0;
}

static int ensure_bpffs(void)
{
	struct statfs sf;

	if (statfs("/sys/fs/bpf", &sf) == 0 && sf.f_type == BPF_FS_MAGIC)
		return 0;
	if (mount("bpf", "/sys/fs/bpf", "bpf", 0, "mode=0700") < 0) {
		logmsg(LOG_ERR, "mounting bpffs at /sys/fs/bpf: %s", strerror(errno));
		return -1;
	}
	logmsg(LOG_INFO, "mounted bpffs at /sys/fs/bpf");
	return 0;
}

/* One daemon per pin directory: a second one would adopt the first one's
 * maps and, on exit, unpin them. bpffs holds no plain files, so the lock is
 * /run/hpclb/locks/<pin dir with '/' as '_'>.lock, held (flock) until exit
 * and removed then. Removing a lock file races with a daemon that opened it
 * just before: whoever locks checks that the path still names the file it
 * locked, and starts over if not. */
static int lock_pin_dir(const char *pin_dir, char *path, size_t pathlen)
{
	char name[PATH_MAX];
	int err;

	snprintf(name, sizeof(name), "%s", pin_dir);
	for (char *c = name; *c; c++)
		if (*c == '/')
			*c = '_';
	err = mkdir_p("/run/hpclb/locks", 0700);
	if (err) {
		logmsg(LOG_ERR, "cannot create /run/hpclb/locks: %s", strerror(-err));
		return -1;
	}
	if (snprintf(path, pathlen, "/run/hpclb/locks/%s.lock", name) >= (int)pathlen) {
		logmsg(LOG_ERR, "pin directory name too long");
		return -1;
	}
	for (int tries = 0; tries < 8; tries++) {
		struct stat held, now;
		int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);

		if (fd < 0) {
			logmsg(LOG_ERR, "opening %s: %s", path, strerror(errno));
			return -1;
		}
		if (flock(fd, LOCK_EX | LOCK_NB) < 0) {
			logmsg(LOG_ERR, "another " PROG " serves %s (%s is locked)", pin_dir, path);
			close(fd);
			return -1;
		}
		if (fstat(fd, &held) == 0 && stat(path, &now) == 0 && held.st_ino == now.st_ino &&
		    held.st_dev == now.st_dev)
			return fd;
		close(fd); /* we locked a file its owner just removed */
	}
	logmsg(LOG_ERR, "cannot lock %s", path);
	return -1;
}

/* ---- maps and pins ----------------------------------------------------- */

/* Maps we pin: the program's own, not libbpf's .data/.rodata/.bss. */
static int pinned_kind(const struct bpf_map *m)
{
	return !bpf_map__is_internal(m);
}

/* dir is at most PATH_MAX - 64 (parse_args) and map names are short. */
static void pin_path(char *buf, size_t len, const char *dir, const char *name)
{
	int n = snprintf(buf, len, "%s/%s", dir, name);

	if (n < 0 || (size_t)n >= len)
		buf[0] = '\0';
}

/* 1 when every map of the object has a compatible pin, 0 when none is
 * pinned, -1 when some pin is missing or differs (stale). */
static int check_pins(struct lb_bpf *skel, const char *dir)
{
	struct bpf_map *m;
	int found = 0, missing = 0, bad = 0;

	bpf_object__for_each_map(m, skel->obj) {
		struct bpf_map_info info;
		__u32 len = sizeof(info);
		char path[PATH_MAX];
		int fd;

		if (!pinned_kind(m))
			continue;
		pin_path(path, sizeof(path), dir, bpf_map__name(m));
		fd = bpf_obj_get(path);
		if (fd < 0) {
			missing++;
			continue;
		}
		found++;
		memset(&info, 0, sizeof(info));
		if (bpf_obj_get_info_by_fd(fd, &info, &len) == 0 &&
		    (info.type == BPF_MAP_TYPE_DEVMAP || info.type == BPF_MAP_TYPE_DEVMAP_HASH))
			/* the kernel adds this flag to devmaps with 4-byte values */
			info.map_flags &= ~(__u32)BPF_F_RDONLY_PROG;
		if (info.type != bpf_map__type(m) || info.key_size != bpf_map__key_size(m) ||
		    info.value_size != bpf_map__value_size(m) ||
		    info.max_entries != bpf_map__max_entries(m) ||
		    info.map_flags != bpf_map__map_flags(m)) {
			logmsg(LOG_INFO, "pinned map %s does not match this program", path);
			bad++;
		}
		close(fd);
	}
	if (!found)
		return 0;
	if (bad || missing) {
		if (missing)
			logmsg(LOG_INFO, "%d maps missing from %s", missing, dir);
		return -1;
	}
	return 1;
}

/* Makes the skeleton use the pinned maps (checked by check_pins). */
static int reuse_pins(struct lb_bpf *skel, const char *dir)
{
	struct bpf_map *m;

	bpf_object__for_each_map(m, skel->obj) {
		char path[PATH_MAX];
		int fd, err;

		if (!pinned_kind(m))
			continue;
		pin_path(path, sizeof(path), dir, bpf_map__name(m));
		fd = bpf_obj_get(path);
		if (fd < 0)
			return -errno;
		err = bpf_map__reuse_fd(m, fd); /* dups fd */
		close(fd);
		if (err)
			return err;
	}
	return 0;
}

/* Pins the maps of a loaded skeleton (fresh start). */
static int pin_maps(struct lb_bpf *skel, const char *dir)
{
	struct bpf_map *m;

	bpf_object__for_each_map(m, skel->obj) {
		char path[PATH_MAX];
		int err;

		if (!pinned_kind(m))
			continue;
		pin_path(path, sizeof(path), dir, bpf_map__name(m));
		err = bpf_map__pin(m, path);
		if (err) {
			logmsg(LOG_ERR, "pinning %s: %s", path, strerror(-err));
			return err;
		}
	}
	return 0;
}

static void remove_pins(struct lb_bpf *skel, const char *dir)
{
	char path[PATH_MAX];
	struct bpf_map *m;

	bpf_object__for_each_map(m, skel->obj) {
		if (!pinned_kind(m))
			continue;
		pin_path(path, sizeof(path), dir, bpf_map__name(m));
		if (unlink(path) < 0 && errno != ENOENT)
			logmsg(LOG_WARN, "unlink %s: %s", path, strerror(errno));
	}
	pin_path(path, sizeof(path), dir, "lb_xdp");
	if (unlink(path) < 0 && errno != ENOENT)
		logmsg(LOG_WARN, "unlink %s: %s", path, strerror(errno));
}

/* Opens the skeleton sized by the options. Pins are handled by hand
 * (reuse_pins, pin_maps) rather than with libbpf's pin_path: libbpf 1.1
 * refuses to reuse a devmap because the kernel adds BPF_F_RDONLY_PROG to its
 * flags, and asking for that flag at creation is EINVAL. */
static struct lb_bpf *open_skel(const struct opts *o)
{
	struct lb_bpf *skel = lb_bpf__open();
	int err;

	if (!skel) {
		logmsg(LOG_ERR, "opening the BPF object: %s", strerror(errno));
		return NULL;
	}
	err = bpf_map__set_max_entries(skel->maps.ring_map, LB_MAX_VIPS * o->ring_size);
	if (!err)
		err = bpf_map__set_max_entries(skel->maps.flow_map, o->flow_table_size);
	if (err) {
		logmsg(LOG_ERR, "configuring the BPF object: %s", strerror(-err));
		lb_bpf__destroy(skel);
		return NULL;
	}
	return skel;
}

/* ---- XDP attach -------------------------------------------------------- */

static int attach(int ifindex, int prog_fd, const char *iface, const char *mode, __u32 *flags)
{
	int err;

	if (strcmp(mode, "generic")) {
		*flags = XDP_FLAGS_DRV_MODE;
		libbpf_last[0] = '\0';
		libbpf_capture = 1;
		err = bpf_xdp_attach(ifindex, prog_fd, *flags, NULL);
		libbpf_capture = 0;
		if (!err) {
			logmsg(LOG_INFO, "attached to %s in native mode", iface);
			return 0;
		}
		if (!strcmp(mode, "native")) {
			logmsg(LOG_ERR, "native XDP attach to %s failed: %s%s%s", iface,
			       strerror(-err), libbpf_last[0] ? ": " : "", libbpf_last);
			return err;
		}
		logmsg(LOG_WARN, "native XDP attach to %s failed (%s%s%s), falling back to generic",
		       iface, strerror(-err), libbpf_last[0] ? ": " : "", libbpf_last);
	}
	*flags = XDP_FLAGS_SKB_MODE;
	err = bpf_xdp_attach(ifindex, prog_fd, *flags, NULL);
	if (err)
		logmsg(LOG_ERR, "generic XDP attach to %s failed: %s", iface, strerror(-err));
	else
		logmsg(LOG_INFO, "attached to %s in generic mode", iface);
	return err;
}

/* Detaches only if our program is still the one attached. */
static void detach(int ifindex, int prog_fd, __u32 flags, const char *iface)
{
	LIBBPF_OPTS(bpf_xdp_attach_opts, ao, .old_prog_fd = prog_fd);
	int err = bpf_xdp_detach(ifindex, flags | XDP_FLAGS_REPLACE, &ao);

	if (err)
		logmsg(LOG_WARN, "detaching from %s: %s", iface, strerror(-err));
	else
		logmsg(LOG_INFO, "detached from %s", iface);
}

/* ---- control socket ---------------------------------------------------- */

/* zmq's ipc bind silently replaces an existing socket file, which would steal
 * the endpoint of a running daemon: refuse when something answers there. */
static int ipc_in_use(const char *path)
{
	struct sockaddr_un sun;
	int fd, in_use;

	if (strlen(path) >= sizeof(sun.sun_path))
		return 0; /* zmq_bind will report it */
	memset(&sun, 0, sizeof(sun));
	sun.sun_family = AF_UNIX;
	memcpy(sun.sun_path, path, strlen(path));
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return 0;
	in_use = connect(fd, (struct sockaddr *)&sun, sizeof(sun)) == 0;
	close(fd);
	return in_use;
}

static void *open_socket(void *zctx, const char *endpoint)
{
	void *s = zmq_socket(zctx, ZMQ_REP);
	int linger = 0, sndtimeo = SEND_TIMEOUT_MS;
	int64_t maxmsg = HARD_MAX_MSG;
	const char *path = NULL;
	mode_t old_umask;
	int rc;

	if (!s) {
		logmsg(LOG_ERR, "zmq_socket: %s", zmq_strerror(errno));
		return NULL;
	}
	zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(linger));
	zmq_setsockopt(s, ZMQ_SNDTIMEO, &sndtimeo, sizeof(sndtimeo));
	/* Up to LB_MAX_MSG_BYTES a request is served; above it, up to the hard
	 * cap, it gets an error reply; above that zmq drops the connection. */
	zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
	if (!strncmp(endpoint, "ipc://", 6)) {
		char dir[PATH_MAX];
		char *slash;

		path = endpoint + 6;
		snprintf(dir, sizeof(dir), "%s", path);
		slash = strrchr(dir, '/');
		if (slash && slash != dir) {
			*slash = '\0';
			rc = mkdir_p(dir, 0755);
			if (rc)
				logmsg(LOG_WARN, "mkdir %s: %s", dir, strerror(-rc));
		}
	}
	if (path && path[0] != '@' && ipc_in_use(path)) {
		logmsg(LOG_ERR, "%s is served by another process", endpoint);
		zmq_close(s);
		return NULL;
	}
	/* The socket file is created by bind: a tight umask closes the window
	 * before chmod; file permissions are the protocol's only guard. */
	old_umask = umask(0077);
	rc = zmq_bind(s, endpoint);
	umask(old_umask);
	if (rc < 0) {
		logmsg(LOG_ERR, "binding %s: %s", endpoint, zmq_strerror(errno));
		zmq_close(s);
		return NULL;
	}
	if (path && chmod(path, 0600) < 0)
		logmsg(LOG_WARN, "chmod %s: %s", path, strerror(errno));
	return s;
}

static void send_reply(void *sock, const msgpack_sbuffer *sb)
{
	if (zmq_send(sock, sb->data, sb->size, 0) < 0)
		logmsg(LOG_WARN, "sending reply: %s", zmq_strerror(errno));
}

/* Receives one request (all its parts) and answers it. */
static void serve_one(void *sock, struct lb_proto_server *srv)
{
	struct lb_proto_outcome oc;
	msgpack_sbuffer reply;
	zmq_msg_t msg;
	int more, rc;

	zmq_msg_init(&msg);
	if (zmq_msg_recv(&msg, sock, ZMQ_DONTWAIT) < 0) {
		if (errno != EAGAIN && errno != EINTR)
			logmsg(LOG_WARN, "receiving: %s", zmq_strerror(errno));
		zmq_msg_close(&msg);
		return;
	}
	msgpack_sbuffer_init(&reply);
	more = zmq_msg_more(&msg);
	if (more) {
		/* REP must read every part before it may reply (else zmq_send fails
		 * with EFSM and the socket wedges). ZeroMQ delivers a multi-part
		 * message whole, so this loop only walks parts already received. */
		while (more) {
			zmq_msg_close(&msg);
			zmq_msg_init(&msg);
			if (zmq_msg_recv(&msg, sock, 0) < 0)
				break;
			more = zmq_msg_more(&msg);
		}
		logmsg(LOG_WARN, "request rejected: multi-part message");
		rc = lb_proto_error_reply(&reply, "multi-part messages are not supported: "
					  "send the request as one part");
	} else {
		rc = lb_proto_handle(srv, zmq_msg_data(&msg), zmq_msg_size(&msg), &reply, &oc);
		if (rc == 0 && oc.changed)
			logmsg(LOG_INFO, "%s: applied", oc.op);
		else if (rc == 0)
			logmsg(LOG_DEBUG, "%s: served", oc.op);
		else
			logmsg(LOG_WARN, "%s: rejected: %s", oc.op, oc.error);
	}
	zmq_msg_close(&msg);
	if (rc == -ENOMEM) {
		/* Not even an error reply: an empty frame keeps REP's turn order. */
		logmsg(LOG_ERR, "out of memory building a reply");
		reply.size = 0;
	}
	send_reply(sock, &reply);
	msgpack_sbuffer_destroy(&reply);
}

/* ---- main -------------------------------------------------------------- */

static const char *const capabilities[] = { "dsr", "patch_ring", "xdp_tx", "redirect", NULL };

/* Server around the tables of pinned maps that outlived a previous daemon. */
static struct lb_proto_server *adopt_tables(struct xdp_tables *t, const struct lb_proto_info *info,
					    const char *pin_dir)
{
	struct lb_proto_server *srv = NULL;
	struct lb_proto_state *st = calloc(1, sizeof(*st));
	char why[256] = "out of memory";
	int err = -ENOMEM;

	if (st) {
		err = xdp_tables_read_state(t, st);
		if (err) {
			snprintf(why, sizeof(why), "reading them back: %s", strerror(-err));
		} else {
			srv = lb_proto_server_new(&xdp_tables_ops, t, info, &st->config);
			err = srv ? lb_proto_server_restore(srv, st, why, sizeof(why)) : -ENOMEM;
			xdp_tables_free_state(st);
		}
		free(st);
	}
	if (err) {
		logmsg(LOG_WARN, "pinned tables in %s not adopted (%s)", pin_dir, why);
		lb_proto_server_free(srv);
		return NULL;
	}
	logmsg(LOG_INFO, "adopted the pinned tables in %s", pin_dir);
	return srv;
}

/* Server around empty tables written into fresh maps. */
static struct lb_proto_server *fresh_tables(struct xdp_tables *t, const struct lb_proto_info *info,
					    const struct opts *o)
{
	struct lb_proto_server *srv;
	struct lb_config cfg;
	int err;

	memset(&cfg, 0, sizeof(cfg));
	cfg.ring_size = o->ring_size;
	/* A random flow-hash key until the control plane sets one: an outsider
	 * must not be able to aim flows at one backend. */
	if (getrandom(cfg.hash_key, sizeof(cfg.hash_key), 0) != (ssize_t)sizeof(cfg.hash_key)) {
		logmsg(LOG_ERR, "getrandom: %s", strerror(errno));
		return NULL;
	}
	err = xdp_tables_reset(t, &cfg);
	if (err) {
		logmsg(LOG_ERR, "initialising the maps: %s", strerror(-err));
		return NULL;
	}
	srv = lb_proto_server_new(&xdp_tables_ops, t, info, &cfg);
	if (!srv)
		logmsg(LOG_ERR, "creating the protocol server: out of memory");
	else
		logmsg(LOG_INFO, "maps initialised (ring_size %u, flow table %u)", o->ring_size,
		       o->flow_table_size);
	return srv;
}

/* One start: reuse the pins (reuse != 0) or make and pin fresh maps. */
static int load_once(const struct opts *o, const struct lb_proto_info *info, int reuse,
		     struct lb_bpf **skelp, struct xdp_tables *t, struct lb_proto_server **srvp)
{
	struct lb_bpf *skel = open_skel(o);
	struct lb_proto_server *srv = NULL;
	int err;

	if (!skel)
		return -1;
	if (reuse) {
		err = reuse_pins(skel, o->pin_dir);
		if (err) {
			logmsg(LOG_WARN, "reusing the pins in %s: %s", o->pin_dir, strerror(-err));
			goto fail;
		}
	}
	err = lb_bpf__load(skel);
	if (err) {
		logmsg(LOG_ERR, "loading the BPF program: %s", strerror(-err));
		goto fail;
	}
	if (!reuse && pin_maps(skel, o->pin_dir))
		goto fail;
	err = xdp_tables_open(t, skel, o->ring_size);
	if (err) {
		logmsg(LOG_ERR, "opening the maps: %s", strerror(-err));
		goto fail;
	}
	srv = reuse ? adopt_tables(t, info, o->pin_dir) : fresh_tables(t, info, o);
	if (!srv)
		goto fail;
	*skelp = skel;
	*srvp = srv;
	return 0;
fail:
	lb_proto_server_free(srv);
	xdp_tables_close(t);
	if (!reuse)
		remove_pins(skel, o->pin_dir); /* ours, possibly half made */
	lb_bpf__destroy(skel);
	return -1;
}

/* Loads the program and makes the server: adopts the pinned tables when
 * they are compatible and sane, else removes the pins and starts from
 * empty tables. */
static int load(const struct opts *o, const struct lb_proto_info *info, struct lb_bpf **skelp,
		struct xdp_tables *t, struct lb_proto_server **srvp, int *adopted)
{
	struct lb_bpf *probe = open_skel(o); /* for the map names and sizes */
	int reuse;

	if (!probe)
		return -1;
	reuse = check_pins(probe, o->pin_dir);
	if (reuse == 1 && load_once(o, info, 1, skelp, t, srvp) == 0) {
		lb_bpf__destroy(probe);
		*adopted = 1;
		return 0;
	}
	if (reuse != 0)
		logmsg(LOG_INFO, "removing stale pins in %s", o->pin_dir);
	remove_pins(probe, o->pin_dir);
	lb_bpf__destroy(probe);
	*adopted = 0;
	return load_once(o, info, 0, skelp, t, srvp);
}

int main(int argc, char **argv)
{
	static struct xdp_tables tables;
	struct lb_proto_server *srv = NULL;
	struct lb_proto_info info;
	struct lb_bpf *skel = NULL;
	struct sigaction sa;
	void *zctx = NULL, *sock = NULL;
	char prog_pin[PATH_MAX], lock_path[PATH_MAX];
	__u32 xdp_flags = 0;
	int attached = 0, adopted = 0, ret = 1, prog_fd = -1, lock_fd, err;
	struct opts o;

	setvbuf(stderr, NULL, _IOLBF, 0);
	if (parse_args(argc, argv, &o))
		return 2;
	/* Before anything else: interfaces, sockets and devmap entries all
	 * belong to the namespace we are in when we create them. */
	if (o.netns && enter_netns(o.netns))
		return 1;
	libbpf_set_print(libbpf_log);

	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_signal; /* no SA_RESTART: zmq_poll returns EINTR */
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	signal(SIGPIPE, SIG_IGN);
	/* A hang-up of a terminal or session the daemon was started from must not
	 * kill it without detaching: only SIGTERM/SIGINT stop it. */
	signal(SIGHUP, SIG_IGN);

	memset(&info, 0, sizeof(info));
	info.dataplane = "xdp";
	info.attach_mode = "none";
	info.capabilities = capabilities;
	info.nports = 1 + (__u32)o.negress;
	if (get_port(o.iface, &info.ports[0]))
		return 1;
	for (int i = 0; i < o.negress; i++)
		if (get_port(o.egress[i], &info.ports[i + 1]))
			return 1;
	if (ensure_bpffs())
		return 1;
	err = mkdir_p(o.pin_dir, 0700);
	if (err) {
		logmsg(LOG_ERR, "cannot create %s: %s", o.pin_dir, strerror(-err));
		return 1;
	}
	lock_fd = lock_pin_dir(o.pin_dir, lock_path, sizeof(lock_path));
	if (lock_fd < 0)
		return 1;
	if (load(&o, &info, &skel, &tables, &srv, &adopted))
		goto out;
	err = xdp_tables_set_ports(&tables, info.ports, info.nports);
	if (err) {
		logmsg(LOG_ERR, "writing port_map/tx_devmap: %s", strerror(-err));
		goto out;
	}
	prog_fd = bpf_program__fd(skel->progs.lb_xdp);
	pin_path(prog_pin, sizeof(prog_pin), o.pin_dir, "lb_xdp");
	unlink(prog_pin);
	if (bpf_program__pin(skel->progs.lb_xdp, prog_pin)) {
		logmsg(LOG_ERR, "pinning the program at %s: %s", prog_pin, strerror(errno));
		goto out;
	}
	logmsg(LOG_INFO, "program and maps pinned in %s", o.pin_dir);
	/* Bind before attaching: a daemon that cannot serve must not take the
	 * interface from one that does. Requests wait until the loop polls. */
	zctx = zmq_ctx_new();
	sock = zctx ? open_socket(zctx, o.socket) : NULL;
	if (!sock)
		goto out;
	if (!o.no_attach) {
		if (attach((int)info.ports[0].ifindex, prog_fd, o.iface, o.xdp_mode, &xdp_flags))
			goto out;
		attached = 1;
		info.attach_mode = xdp_flags == XDP_FLAGS_DRV_MODE ? "native" : "generic";
		lb_proto_server_set_info(srv, &info);
	}
	logmsg(LOG_INFO, "serving %s", o.socket);
	logmsg(LOG_INFO, "ready");

	while (!stop) {
		zmq_pollitem_t item = { .socket = sock, .events = ZMQ_POLLIN };
		int n = zmq_poll(&item, 1, POLL_MS);

		if (n < 0) {
			if (errno == EINTR)
				continue;
			logmsg(LOG_ERR, "zmq_poll: %s", zmq_strerror(errno));
			break;
		}
		if (n > 0 && (item.revents & ZMQ_POLLIN))
			serve_one(sock, srv);
	}
	if (stop) {
		logmsg(LOG_INFO, "signal received, shutting down");
		ret = 0;
	}
out:
	if (sock)
		zmq_close(sock);
	if (zctx)
		zmq_ctx_term(zctx);
	if (attached)
		detach((int)info.ports[0].ifindex, prog_fd, xdp_flags, o.iface);
	if (skel && ret && adopted)
		logmsg(LOG_WARN, "keeping the adopted pins in %s for the next start", o.pin_dir);
	if (skel && (ret == 0 || !adopted)) {
		remove_pins(skel, o.pin_dir);
		if (rmdir(o.pin_dir) < 0 && errno != ENOENT)
			logmsg(LOG_WARN, "rmdir %s: %s", o.pin_dir, strerror(errno));
		else
			logmsg(LOG_INFO, "unpinned %s", o.pin_dir);
	}
	lb_proto_server_free(srv);
	xdp_tables_close(&tables);
	lb_bpf__destroy(skel);
	unlink(lock_path); /* still locked: see lock_pin_dir */
	close(lock_fd);
	return ret;
}
