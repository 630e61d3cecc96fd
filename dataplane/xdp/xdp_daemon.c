/* SPDX-License-Identifier: Apache-2.0
 *
 * xdp_daemon.c - hpclb-xdp: loads lb.bpf.c (embedded skeleton), pins its maps
 * and program, attaches it to the ingress interface, and serves the table
 * protocol (lb_proto_ops.c) on a ZeroMQ REP socket until SIGTERM/SIGINT; the
 * options, signals and control channel it shares with hpclb-dpdk are
 * lb_daemon.c's.
 *
 * The program keeps forwarding with the last tables whatever happens to the
 * control plane: the daemon only answers requests. If a previous daemon died
 * without cleaning up, its pinned maps are reused (when compatible) and their
 * tables adopted, so forwarding does not blink across a restart: the NAT
 * connection table, its FIFO and the NAT configuration too, so that no
 * connection breaks either (both families' tables, conn_map and conn6_map).
 * Connection tables pinned with another size (--conn-table-size changed) are
 * replaced alone, the other tables adopted. lb_xdp's tail-call slot
 * (nat6_prog) is filled with this load's IPv6 NAT program after every load.
 * Pins of another layout (a daemon of an older table contract: VIP entries
 * of 28 bytes before tunnel mode's fields, no flow6_map before IPv6
 * forwarding, nat_config_map values of 108 bytes and no conn6_map before
 * NAT mode for IPv6) are stale as a whole: removed, and fresh maps made and pinned
 * (the control plane pushes its tables again; the flows are re-hashed).
 *
 * The program is attached to every port (--iface and each --egress): in NAT
 * mode the backends' replies arrive on the port they are behind. Frames for
 * no VIP pass to the kernel, as they would without the program.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <net/if.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/un.h>
#include <unistd.h>
#include <linux/if_link.h>
#include <linux/magic.h>
#include <bpf/bpf.h>
#include <bpf/libbpf.h>

#include "lb.skel.h"
#include "lb_proto.h"
#include "lb_daemon.h"
#include "lb_host.h"
#include "lb_log.h"
#include "xdp_conns.h"
#include "xdp_tables.h"

#define PROG "hpclb-xdp"
#define MAX_FLOWS_OPT (1u << 28)

/* While set, libbpf's warnings are kept here instead of logged, so that a
 * failed native attach is reported in one line with the kernel's reason. */
static int libbpf_capture;
static char libbpf_last[256];

static int libbpf_log(enum libbpf_print_level level, const char *fmt, va_list ap)
{
	char line[1024];
	size_t n;
	int ours = level == LIBBPF_WARN ? LB_LOG_WARN : LB_LOG_DEBUG;

	if (!lb_log_enabled(ours) && !(libbpf_capture && level == LIBBPF_WARN))
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
	lb_log(ours, "%s", line); /* libbpf's lines start with "libbpf: " */
	return 0;
}

struct opts {
	struct lb_daemon_opts common; /* --socket, --ring-size (--log-level) */
	const char *iface;
	const char *egress[LB_MAX_PORTS - 1];
	int negress;
	const char *netns;
	__u32 flow_table_size;
	__u32 conn_table_size; /* NAT connection-table entries (two per connection) */
	const char *xdp_mode;
	char pin_dir[PATH_MAX - 64]; /* room for "/<map name>" */
	int no_attach;
};

static void usage(FILE *f)
{
	fprintf(f,
		"usage: " PROG " --iface IF [--egress IF]... [--netns NAME] [--socket ENDPOINT]\n"
		"       [--ring-size PRIME] [--flow-table-size N] [--conn-table-size N]\n"
		"       [--xdp-mode auto|native|generic] [--pin-dir DIR] [--no-attach]\n"
		"       [--alive-interface NAME] [--log-level error|warn|info|debug]\n"
		"--alive-interface: a TUN device that exists while this process lives (in the\n"
		"          --netns namespace), for the BGP speaker's routes to the VIPs\n"
		"defaults: --socket " LB_DAEMON_DEFAULT_SOCKET ", --ring-size %u, "
		"--flow-table-size %u (entries of each of the IPv4 and IPv6 flow tables),\n"
		"          --conn-table-size %u (entries of each of the IPv4 and IPv6 connection tables;\n"
		"          even, %u..%u), --xdp-mode auto,\n"
		"          --pin-dir /sys/fs/bpf/hpclb/<iface>\n",
		LB_RING_SIZE_DEFAULT, LB_MAX_FLOWS, LB_CONN_TABLE_DEFAULT, LB_CONN_TABLE_MIN,
		LB_CONN_TABLE_MAX);
}

static int parse_args(int argc, char **argv, struct opts *o)
{
	static const struct option lo[] = {
		{ "iface", required_argument, NULL, 'i' },
		{ "egress", required_argument, NULL, 'e' },
		{ "netns", required_argument, NULL, 'n' },
		LB_DAEMON_OPTION_SOCKET,
		LB_DAEMON_OPTION_RING_SIZE,
		{ "flow-table-size", required_argument, NULL, 'f' },
		{ "conn-table-size", required_argument, NULL, 'C' },
		{ "xdp-mode", required_argument, NULL, 'm' },
		{ "pin-dir", required_argument, NULL, 'p' },
		{ "no-attach", no_argument, NULL, 'A' },
		LB_DAEMON_OPTION_ALIVE_INTERFACE,
		LB_DAEMON_OPTION_LOG_LEVEL,
		{ "help", no_argument, NULL, 'h' },
		{ 0 },
	};
	int c, rc;

	memset(o, 0, sizeof(*o));
	lb_daemon_opts_init(&o->common);
	o->flow_table_size = LB_MAX_FLOWS;
	o->conn_table_size = LB_CONN_TABLE_DEFAULT;
	o->xdp_mode = "auto";
	while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
		switch (c) {
		case 'i':
			o->iface = optarg;
			break;
		case 'e':
			if (o->negress == LB_MAX_PORTS - 1) {
				lb_log(LB_LOG_ERR, "at most %d --egress interfaces", LB_MAX_PORTS - 1);
				return -1;
			}
			o->egress[o->negress++] = optarg;
			break;
		case 'n':
			/* checked after the interfaces, below */
			o->netns = optarg;
			break;
		case 'f':
			if (lb_parse_u32(optarg, &o->flow_table_size) || o->flow_table_size < 1 ||
			    o->flow_table_size > MAX_FLOWS_OPT) {
				lb_log(LB_LOG_ERR, "--flow-table-size must be in 1..%u, got '%s'",
				       MAX_FLOWS_OPT, optarg);
				return -1;
			}
			break;
		case 'C':
			/* Even: a connection is two entries. */
			if (lb_parse_u32(optarg, &o->conn_table_size) ||
			    o->conn_table_size < LB_CONN_TABLE_MIN ||
			    o->conn_table_size > LB_CONN_TABLE_MAX || (o->conn_table_size & 1)) {
				lb_log(LB_LOG_ERR,
				       "--conn-table-size must be even, in %u..%u, got '%s'",
				       LB_CONN_TABLE_MIN, LB_CONN_TABLE_MAX, optarg);
				return -1;
			}
			break;
		case 'm':
			if (strcmp(optarg, "auto") && strcmp(optarg, "native") &&
			    strcmp(optarg, "generic")) {
				lb_log(LB_LOG_ERR, "--xdp-mode must be auto, native or generic");
				return -1;
			}
			o->xdp_mode = optarg;
			break;
		case 'p':
			if (snprintf(o->pin_dir, sizeof(o->pin_dir), "%s", optarg) >=
			    (int)sizeof(o->pin_dir)) {
				lb_log(LB_LOG_ERR, "--pin-dir too long");
				return -1;
			}
			break;
		case 'A':
			o->no_attach = 1;
			break;
		case 'h':
			usage(stdout);
			exit(0);
		default:
			rc = lb_daemon_parse_opt(&o->common, c, optarg);
			if (rc > 0)
				break;
			if (rc == 0)
				usage(stderr);
			return -1;
		}
	}
	if (lb_daemon_check_operands(argc, argv))
		return -1;
	if (!o->iface) {
		lb_log(LB_LOG_ERR, "--iface is required");
		usage(stderr);
		return -1;
	}
	if (!lb_valid_ifname(o->iface)) {
		lb_log(LB_LOG_ERR, "bad interface name '%s'", o->iface);
		return -1;
	}
	for (int i = 0; i < o->negress; i++) {
		if (!lb_valid_ifname(o->egress[i])) {
			lb_log(LB_LOG_ERR, "bad interface name '%s'", o->egress[i]);
			return -1;
		}
	}
	if (o->netns && !lb_valid_netns(o->netns)) {
		lb_log(LB_LOG_ERR, "bad --netns name '%s'", o->netns);
		return -1;
	}
	if (!o->pin_dir[0])
		snprintf(o->pin_dir, sizeof(o->pin_dir), "/sys/fs/bpf/hpclb/%s", o->iface);
	return 0;
}

/* ---- environment ------------------------------------------------------- */

static int ensure_bpffs(void)
{
	struct statfs sf;

	if (statfs("/sys/fs/bpf", &sf) == 0 && sf.f_type == BPF_FS_MAGIC)
		return 0;
	if (mount("bpf", "/sys/fs/bpf", "bpf", 0, "mode=0700") < 0) {
		lb_log(LB_LOG_ERR, "mounting bpffs at /sys/fs/bpf: %s", strerror(errno));
		return -1;
	}
	lb_log(LB_LOG_INFO, "mounted bpffs at /sys/fs/bpf");
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
	err = lb_mkdir_p("/run/hpclb/locks", 0700);
	if (err) {
		lb_log(LB_LOG_ERR, "cannot create /run/hpclb/locks: %s", strerror(-err));
		return -1;
	}
	if (snprintf(path, pathlen, "/run/hpclb/locks/%s.lock", name) >= (int)pathlen) {
		lb_log(LB_LOG_ERR, "pin directory name too long");
		return -1;
	}
	for (int tries = 0; tries < 8; tries++) {
		struct stat held, now;
		int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);

		if (fd < 0) {
			lb_log(LB_LOG_ERR, "opening %s: %s", path, strerror(errno));
			return -1;
		}
		if (flock(fd, LOCK_EX | LOCK_NB) < 0) {
			lb_log(LB_LOG_ERR, "another " PROG " serves %s (%s is locked)", pin_dir, path);
			close(fd);
			return -1;
		}
		if (fstat(fd, &held) == 0 && stat(path, &now) == 0 && held.st_ino == now.st_ino &&
		    held.st_dev == now.st_dev)
			return fd;
		close(fd); /* we locked a file its owner just removed */
	}
	lb_log(LB_LOG_ERR, "cannot lock %s", path);
	return -1;
}

/* ---- maps and pins ----------------------------------------------------- */

/* Maps we pin: the program's own, not libbpf's .data/.rodata/.bss, nor
 * vip4_cache (lb.bpf.c): a cache of vip4_map valid under its program
 * instance's vip_gen only, so each instance starts with an empty one. */
static int pinned_kind(const struct bpf_map *m)
{
	return !bpf_map__is_internal(m) && strcmp(bpf_map__name(m), "vip4_cache") != 0;
}

/* The maps --conn-table-size sizes: each family's connection table and its
 * FIFO, which go together (the FIFO names the table's keys). Pinned ones of
 * another size or layout are replaced alone (all four: one size for both
 * families): the other tables are still adopted. A pin set without
 * conn6_map is that of a daemon before NAT mode for IPv6, whose
 * nat_config_map (108-byte values, no IPv6 pool) differs too: stale as a
 * whole (check_pins), never adopted. */
static int conn_kind(const struct bpf_map *m)
{
	const char *n = bpf_map__name(m);

	return !strcmp(n, "conn_map") || !strcmp(n, "conn_fifo") || !strcmp(n, "conn6_map") ||
	       !strcmp(n, "conn6_fifo");
}

/* dir is at most PATH_MAX - 64 (parse_args) and map names are short. */
static void pin_path(char *buf, size_t len, const char *dir, const char *name)
{
	int n = snprintf(buf, len, "%s/%s", dir, name);

	if (n < 0 || (size_t)n >= len)
		buf[0] = '\0';
}

/* 1 when every map of the object has a compatible pin; 2 when every map but
 * the connection maps (conn_kind) has one, those to be replaced; 0 when none
 * is pinned; -1 when some other pin is missing or differs (stale). */
static int check_pins(struct lb_bpf *skel, const char *dir)
{
	struct bpf_map *m;
	int found = 0, missing = 0, bad = 0, conn_stale = 0;

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
			if (conn_kind(m))
				conn_stale++;
			else
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
			if (conn_kind(m)) {
				lb_log(LB_LOG_INFO,
				       "pinned map %s has %u entries of %u bytes, this daemon "
				       "%u of %u", path, info.max_entries, info.value_size,
				       bpf_map__max_entries(m), bpf_map__value_size(m));
				conn_stale++;
			} else {
				lb_log(LB_LOG_INFO, "pinned map %s does not match this program", path);
				bad++;
			}
		}
		close(fd);
	}
	if (!found)
		return 0;
	if (bad || missing) {
		if (missing)
			lb_log(LB_LOG_INFO, "%d maps missing from %s", missing, dir);
		return -1;
	}
	return conn_stale ? 2 : 1;
}

/* Unpins the connection maps (check_pins gave 2): the next load makes them
 * afresh, with this daemon's size, and pins them. */
static void replace_conn_pins(struct lb_bpf *skel, const char *dir)
{
	struct bpf_map *m;

	bpf_object__for_each_map(m, skel->obj) {
		char path[PATH_MAX];

		if (!pinned_kind(m) || !conn_kind(m))
			continue;
		pin_path(path, sizeof(path), dir, bpf_map__name(m));
		if (unlink(path) < 0 && errno != ENOENT)
			lb_log(LB_LOG_WARN, "unlink %s: %s", path, strerror(errno));
	}
	lb_log(LB_LOG_WARN, "replacing the pinned NAT connection table in %s (another "
	       "--conn-table-size or layout): its connections are lost, the other tables kept",
	       dir);
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
		if (fd < 0 && errno == ENOENT && conn_kind(m))
			continue; /* replaced (check_pins gave 2): made and pinned by the load */
		if (fd < 0)
			return -errno;
		err = bpf_map__reuse_fd(m, fd); /* dups fd */
		close(fd);
		if (err)
			return err;
	}
	return 0;
}

/* Pins the maps of a loaded skeleton: all (fresh start), or only those not
 * pinned yet (reuse: the connection maps check_pins had replaced). */
static int pin_maps(struct lb_bpf *skel, const char *dir, int only_unpinned)
{
	struct bpf_map *m;

	bpf_object__for_each_map(m, skel->obj) {
		char path[PATH_MAX];
		int err;

		if (!pinned_kind(m))
			continue;
		pin_path(path, sizeof(path), dir, bpf_map__name(m));
		if (only_unpinned && access(path, F_OK) == 0)
			continue;
		err = bpf_map__pin(m, path);
		if (err) {
			lb_log(LB_LOG_ERR, "pinning %s: %s", path, strerror(-err));
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
			lb_log(LB_LOG_WARN, "unlink %s: %s", path, strerror(errno));
	}
	pin_path(path, sizeof(path), dir, "lb_xdp");
	if (unlink(path) < 0 && errno != ENOENT)
		lb_log(LB_LOG_WARN, "unlink %s: %s", path, strerror(errno));
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
		lb_log(LB_LOG_ERR, "opening the BPF object: %s", strerror(errno));
		return NULL;
	}
	err = bpf_map__set_max_entries(skel->maps.ring_map, LB_MAX_VIPS * o->common.ring_size);
	if (!err)
		err = bpf_map__set_max_entries(skel->maps.flow_map, o->flow_table_size);
	if (!err) /* one size for both families (lb.bpf.c says why) */
		err = bpf_map__set_max_entries(skel->maps.flow6_map, o->flow_table_size);
	if (!err)
		err = bpf_map__set_max_entries(skel->maps.conn_map, o->conn_table_size);
	if (!err) /* lb_conn.h: "a FIFO of the table's size" */
		err = bpf_map__set_max_entries(skel->maps.conn_fifo, o->conn_table_size);
	if (!err) /* IPv6: its own table and FIFO, the same size (lb_tables.h) */
		err = bpf_map__set_max_entries(skel->maps.conn6_map, o->conn_table_size);
	if (!err)
		err = bpf_map__set_max_entries(skel->maps.conn6_fifo, o->conn_table_size);
	if (err) {
		lb_log(LB_LOG_ERR, "configuring the BPF object: %s", strerror(-err));
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
			lb_log(LB_LOG_INFO, "attached to %s in native mode", iface);
			return 0;
		}
		if (!strcmp(mode, "native")) {
			lb_log(LB_LOG_ERR, "native XDP attach to %s failed: %s%s%s", iface,
			       strerror(-err), libbpf_last[0] ? ": " : "", libbpf_last);
			return err;
		}
		lb_log(LB_LOG_WARN, "native XDP attach to %s failed (%s%s%s), falling back to generic",
		       iface, strerror(-err), libbpf_last[0] ? ": " : "", libbpf_last);
	}
	*flags = XDP_FLAGS_SKB_MODE;
	err = bpf_xdp_attach(ifindex, prog_fd, *flags, NULL);
	if (err)
		lb_log(LB_LOG_ERR, "generic XDP attach to %s failed: %s", iface, strerror(-err));
	else
		lb_log(LB_LOG_INFO, "attached to %s in generic mode", iface);
	return err;
}

/* Detaches only if our program is still the one attached. */
static void detach(int ifindex, int prog_fd, __u32 flags, const char *iface)
{
	LIBBPF_OPTS(bpf_xdp_attach_opts, ao, .old_prog_fd = prog_fd);
	int err = bpf_xdp_detach(ifindex, flags | XDP_FLAGS_REPLACE, &ao);

	if (err)
		lb_log(LB_LOG_WARN, "detaching from %s: %s", iface, strerror(-err));
	else
		lb_log(LB_LOG_INFO, "detached from %s", iface);
}

/* Which ports the program is attached to, and how. */
struct attachment {
	__u32 n;                     /* ports 0..n-1 attached */
	__u32 flags[LB_MAX_PORTS];   /* XDP_FLAGS_DRV_MODE or XDP_FLAGS_SKB_MODE */
	const char *names[LB_MAX_PORTS];
};

static void detach_all(struct attachment *a, const struct lb_proto_info *info, int prog_fd)
{
	while (a->n > 0) {
		a->n--;
		detach((int)info->ports[a->n].ifindex, prog_fd, a->flags[a->n], a->names[a->n]);
	}
}

/* Attaches to every port, in port order: the ingress port as before, and the
 * egress ports, where NAT mode's replies arrive. On a failure the ports
 * already attached are detached again. */
static int attach_all(struct attachment *a, const struct lb_proto_info *info, int prog_fd,
		      const struct opts *o)
{
	memset(a, 0, sizeof(*a));
	for (__u32 i = 0; i < info->nports; i++) {
		a->names[i] = i ? o->egress[i - 1] : o->iface;
		if (attach((int)info->ports[i].ifindex, prog_fd, a->names[i], o->xdp_mode,
			   &a->flags[i])) {
			detach_all(a, info, prog_fd);
			return -1;
		}
		a->n = i + 1;
	}
	return 0;
}

/* hello's attach_mode: "native" only when every port is. */
static const char *attach_mode_name(const struct attachment *a)
{
	for (__u32 i = 0; i < a->n; i++)
		if (a->flags[i] != XDP_FLAGS_DRV_MODE)
			return "generic";
	return a->n ? "native" : "none";
}

/* ---- main -------------------------------------------------------------- */

static const char *const capabilities[] = { "dsr", "patch_ring", "xdp_tx", "redirect", "nat",
					    "tunnel", "nat6", NULL };

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
		lb_log(LB_LOG_WARN, "pinned tables in %s not adopted (%s)", pin_dir, why);
		lb_proto_server_free(srv);
		return NULL;
	}
	lb_log(LB_LOG_INFO, "adopted the pinned tables in %s", pin_dir);
	return srv;
}

/* Server around empty tables written into fresh maps. */
static struct lb_proto_server *fresh_tables(struct xdp_tables *t, const struct lb_proto_info *info,
					    const struct opts *o)
{
	struct lb_proto_server *srv;
	struct lb_config cfg;
	int err;

	if (lb_daemon_initial_config(&cfg, o->common.ring_size))
		return NULL;
	err = xdp_tables_reset(t, &cfg);
	if (err) {
		lb_log(LB_LOG_ERR, "initialising the maps: %s", strerror(-err));
		return NULL;
	}
	srv = lb_proto_server_new(&xdp_tables_ops, t, info, &cfg);
	if (!srv)
		lb_log(LB_LOG_ERR, "creating the protocol server: out of memory");
	else
		lb_log(LB_LOG_INFO, "maps initialised (ring_size %u, flow tables %u each, connection "
		       "tables %u each)", o->common.ring_size, o->flow_table_size, o->conn_table_size);
	return srv;
}

/* Fills lb_xdp's tail-call slot with the IPv6 NAT program (lb.bpf.c's
 * nat6_prog): after every load, an adopted slot included, which then names
 * this load's program (the one a previous daemon left keeps working until
 * this write: both use the same maps). */
static int link_nat6(struct lb_bpf *skel)
{
	__u32 zero = 0;
	int fd = bpf_program__fd(skel->progs.lb_xdp_nat6);
	int err = bpf_map_update_elem(bpf_map__fd(skel->maps.nat6_prog), &zero, &fd, BPF_ANY);

	if (err)
		lb_log(LB_LOG_ERR, "filling nat6_prog: %s", strerror(-err));
	return err;
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
			lb_log(LB_LOG_WARN, "reusing the pins in %s: %s", o->pin_dir, strerror(-err));
			goto fail;
		}
	}
	err = lb_bpf__load(skel);
	if (err) {
		lb_log(LB_LOG_ERR, "loading the BPF program: %s", strerror(-err));
		goto fail;
	}
	if (link_nat6(skel))
		goto fail;
	if (pin_maps(skel, o->pin_dir, reuse))
		goto fail;
	err = xdp_tables_open(t, skel, o->common.ring_size);
	if (err) {
		lb_log(LB_LOG_ERR, "opening the maps: %s", strerror(-err));
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
	if (reuse == 2) {
		replace_conn_pins(probe, o->pin_dir);
		reuse = 1;
	}
	if (reuse == 1 && load_once(o, info, 1, skelp, t, srvp) == 0) {
		lb_bpf__destroy(probe);
		*adopted = 1;
		return 0;
	}
	if (reuse != 0)
		lb_log(LB_LOG_INFO, "removing stale pins in %s", o->pin_dir);
	remove_pins(probe, o->pin_dir);
	lb_bpf__destroy(probe);
	*adopted = 0;
	return load_once(o, info, 0, skelp, t, srvp);
}

int main(int argc, char **argv)
{
	static struct xdp_tables tables;
	static struct xdp_conns conns;
	struct lb_proto_server *srv = NULL;
	struct lb_proto_info info;
	struct lb_bpf *skel = NULL;
	struct lb_daemon_ctl ctl = { 0 };
	struct attachment att = { 0 };
	char prog_pin[PATH_MAX], lock_path[PATH_MAX];
	int adopted = 0, ret = 1, prog_fd = -1, lock_fd, err;
	struct opts o;

	lb_log_init(PROG);
	if (parse_args(argc, argv, &o))
		return 2;
	/* Before anything else: interfaces, sockets and devmap entries all
	 * belong to the namespace we are in when we create them. */
	if (o.netns && lb_enter_netns(o.netns))
		return 1;
	libbpf_set_print(libbpf_log);
	lb_daemon_signals(); /* only SIGTERM/SIGINT stop it, detaching */

	memset(&info, 0, sizeof(info));
	info.dataplane = "xdp";
	info.attach_mode = "none";
	info.capabilities = capabilities;
	info.tunnel = true; /* lb.bpf.c encapsulates (xdp_encap.h) */
	info.nat6 = true;   /* lb_xdp_nat6 (xdp_nat6.h): conn6_map, the IPv6 pool */
	info.conn_table_size = o.conn_table_size;
	info.nports = 1 + (__u32)o.negress;
	if (lb_get_port(o.iface, &info.ports[0]))
		return 1;
	for (int i = 0; i < o.negress; i++)
		if (lb_get_port(o.egress[i], &info.ports[i + 1]))
			return 1;
	if (ensure_bpffs())
		return 1;
	err = lb_mkdir_p(o.pin_dir, 0700);
	if (err) {
		lb_log(LB_LOG_ERR, "cannot create %s: %s", o.pin_dir, strerror(-err));
		return 1;
	}
	lock_fd = lock_pin_dir(o.pin_dir, lock_path, sizeof(lock_path));
	if (lock_fd < 0)
		return 1;
	if (load(&o, &info, &skel, &tables, &srv, &adopted))
		goto out;
	/* The sweeper, with the timeouts of the NAT configuration in force
	 * (adopted, or the defaults fresh tables start with). */
	err = xdp_conns_init(&conns, tables.conn_fd, tables.conn6_fd, tables.vip_fd,
			     &skel->bss->nat_active, lb_proto_server_state(srv)->nat.timeouts_s);
	if (err) {
		lb_log(LB_LOG_ERR, "opening the NAT connection table: %s", strerror(-err));
		goto out;
	}
	tables.conns = &conns;
	/* This program instance's nat_active starts clear; adopted tables may
	 * hold NAT VIPs and connections. */
	xdp_conns_refresh_active(&conns);
	err = xdp_conns_start(&conns);
	if (err) {
		lb_log(LB_LOG_ERR, "starting the NAT connection sweeper: %s", strerror(-err));
		goto out;
	}
	err = xdp_tables_set_ports(&tables, info.ports, info.nports);
	if (err) {
		lb_log(LB_LOG_ERR, "writing port_map/tx_devmap: %s", strerror(-err));
		goto out;
	}
	prog_fd = bpf_program__fd(skel->progs.lb_xdp);
	pin_path(prog_pin, sizeof(prog_pin), o.pin_dir, "lb_xdp");
	unlink(prog_pin);
	if (bpf_program__pin(skel->progs.lb_xdp, prog_pin)) {
		lb_log(LB_LOG_ERR, "pinning the program at %s: %s", prog_pin, strerror(errno));
		goto out;
	}
	lb_log(LB_LOG_INFO, "program and maps pinned in %s", o.pin_dir);
	/* Bind before attaching: a daemon that cannot serve must not take the
	 * interface from one that does. Requests wait until the loop polls. */
	if (lb_daemon_ctl_open(&ctl, o.common.socket))
		goto out;
	if (!o.no_attach) {
		if (attach_all(&att, &info, prog_fd, &o))
			goto out;
		info.attach_mode = attach_mode_name(&att);
		lb_proto_server_set_info(srv, &info);
	}
	/* Attached and about to serve: the speaker may announce through it. */
	lb_daemon_alive_up(o.common.alive_iface);
	lb_log(LB_LOG_INFO, "serving %s", o.common.socket);
	if (lb_daemon_ctl_serve(&ctl, srv) == 0)
		ret = 0;
out:
	lb_daemon_ctl_close(&ctl);
	detach_all(&att, &info, prog_fd);
	if (skel && ret && adopted)
		lb_log(LB_LOG_WARN, "keeping the adopted pins in %s for the next start", o.pin_dir);
	if (skel && (ret == 0 || !adopted)) {
		remove_pins(skel, o.pin_dir);
		if (rmdir(o.pin_dir) < 0 && errno != ENOENT)
			lb_log(LB_LOG_WARN, "rmdir %s: %s", o.pin_dir, strerror(errno));
		else
			lb_log(LB_LOG_INFO, "unpinned %s", o.pin_dir);
	}
	xdp_conns_fini(&conns); /* before the maps it walks go */
	tables.conns = NULL;
	lb_proto_server_free(srv);
	xdp_tables_close(&tables);
	lb_bpf__destroy(skel);
	unlink(lock_path); /* still locked: see lock_pin_dir */
	close(lock_fd);
	return ret;
}
