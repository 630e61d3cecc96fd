/* SPDX-License-Identifier: Apache-2.0 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <net/if.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "lb_host.h"
#include "lb_log.h"

int lb_parse_u32(const char *s, __u32 *out)
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

int lb_is_prime(__u32 n)
{
	if (n < 3 || n % 2 == 0)
		return n == 2;
	for (__u32 d = 3; d <= n / d; d += 2)
		if (n % d == 0)
			return 0;
	return 1;
}

int lb_valid_ring_size(__u32 n)
{
	return n >= 3 && n <= LB_RING_SIZE_MAX && lb_is_prime(n);
}

int lb_valid_ifname(const char *s)
{
	return s[0] && strlen(s) < IFNAMSIZ && !strchr(s, '/');
}

int lb_valid_netns(const char *s)
{
	return s[0] && !strchr(s, '/') && strcmp(s, ".") && strcmp(s, "..");
}

int lb_enter_netns(const char *name)
{
	char path[PATH_MAX];
	int fd, err = 0;

	snprintf(path, sizeof(path), "/run/netns/%s", name);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		lb_log(LB_LOG_ERR, "cannot open network namespace %s: %s", path, strerror(errno));
		return -1;
	}
	if (setns(fd, CLONE_NEWNET) < 0) {
		lb_log(LB_LOG_ERR, "setns(%s): %s", path, strerror(errno));
		err = -1;
	}
	close(fd);
	if (!err)
		lb_log(LB_LOG_INFO, "entered network namespace %s", name);
	return err;
}

/* An ioctl on a socket made here: /sys/class/net still shows the namespace
 * the process started in. */
int lb_get_port(const char *ifname, struct lb_proto_port *p)
{
	struct ifreq ifr;
	int fd, err = 0;

	memset(p, 0, sizeof(*p));
	snprintf(p->ifname, sizeof(p->ifname), "%s", ifname);
	p->ifindex = if_nametoindex(ifname);
	if (!p->ifindex) {
		lb_log(LB_LOG_ERR, "interface %s: %s", ifname, strerror(errno));
		return -1;
	}
	fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		lb_log(LB_LOG_ERR, "socket: %s", strerror(errno));
		return -1;
	}
	memset(&ifr, 0, sizeof(ifr));
	snprintf(ifr.ifr_name, sizeof(ifr.ifr_name), "%s", ifname);
	if (ioctl(fd, SIOCGIFHWADDR, &ifr) < 0) {
		lb_log(LB_LOG_ERR, "interface %s: no hardware address: %s", ifname,
		       strerror(errno));
		err = -1;
	} else {
		memcpy(p->mac, ifr.ifr_hwaddr.sa_data, 6);
	}
	close(fd);
	return err;
}

int lb_mkdir_p(const char *path, mode_t mode)
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
