/* SPDX-License-Identifier: Apache-2.0 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <zmq.h>

#include "lb_channel.h"
#include "lb_host.h"
#include "lb_log.h"

#define POLL_MS 200                           /* signal latency bound */
#define SEND_TIMEOUT_MS 1000                  /* a stuck peer cannot block the loop */
#define HARD_MAX_MSG (4ll * LB_MAX_MSG_BYTES) /* beyond this zmq drops the peer */

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

void *lb_channel_open(void *zctx, const char *endpoint)
{
	void *s = zmq_socket(zctx, ZMQ_REP);
	int linger = 0, sndtimeo = SEND_TIMEOUT_MS;
	int64_t maxmsg = HARD_MAX_MSG;
	const char *path = NULL;
	mode_t old_umask;
	int rc;

	if (!s) {
		lb_log(LB_LOG_ERR, "zmq_socket: %s", zmq_strerror(errno));
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
			rc = lb_mkdir_p(dir, 0755);
			if (rc)
				lb_log(LB_LOG_WARN, "mkdir %s: %s", dir, strerror(-rc));
		}
	}
	if (path && path[0] != '@' && ipc_in_use(path)) {
		lb_log(LB_LOG_ERR, "%s is served by another process", endpoint);
		zmq_close(s);
		return NULL;
	}
	/* The socket file is created by bind: a tight umask closes the window
	 * before chmod; file permissions are the protocol's only guard. */
	old_umask = umask(0077);
	rc = zmq_bind(s, endpoint);
	umask(old_umask);
	if (rc < 0) {
		lb_log(LB_LOG_ERR, "binding %s: %s", endpoint, zmq_strerror(errno));
		zmq_close(s);
		return NULL;
	}
	if (path && path[0] != '@' && chmod(path, 0600) < 0)
		lb_log(LB_LOG_WARN, "chmod %s: %s", path, strerror(errno));
	return s;
}

void lb_channel_serve_one(void *sock, struct lb_proto_server *srv)
{
	struct lb_proto_outcome oc;
	msgpack_sbuffer reply;
	zmq_msg_t msg;
	int more, rc;

	zmq_msg_init(&msg);
	if (zmq_msg_recv(&msg, sock, ZMQ_DONTWAIT) < 0) {
		if (errno != EAGAIN && errno != EINTR)
			lb_log(LB_LOG_WARN, "receiving: %s", zmq_strerror(errno));
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
		lb_log(LB_LOG_WARN, "request rejected: multi-part message");
		rc = lb_proto_error_reply(&reply, "multi-part messages are not supported: "
					  "send the request as one part");
	} else {
		rc = lb_proto_handle(srv, zmq_msg_data(&msg), zmq_msg_size(&msg), &reply, &oc);
		if (rc == 0 && oc.changed)
			lb_log(LB_LOG_INFO, "%s: applied", oc.op);
		else if (rc == 0)
			lb_log(LB_LOG_DEBUG, "%s: served", oc.op);
		else
			lb_log(LB_LOG_WARN, "%s: rejected: %s", oc.op, oc.error);
	}
	zmq_msg_close(&msg);
	if (rc == -ENOMEM) {
		/* Not even an error reply: an empty frame keeps REP's turn order. */
		lb_log(LB_LOG_ERR, "out of memory building a reply");
		reply.size = 0;
	}
	/* A REP socket that fails to reply cannot receive again: retry a send
	 * a signal interrupted. */
	for (int tries = 0; tries < 3; tries++) {
		if (zmq_send(sock, reply.data, reply.size, 0) >= 0)
			break;
		if (errno != EINTR) {
			lb_log(LB_LOG_WARN, "sending reply: %s", zmq_strerror(errno));
			break;
		}
	}
	msgpack_sbuffer_destroy(&reply);
}

int lb_channel_serve(void *sock, struct lb_proto_server *srv, volatile sig_atomic_t *stop)
{
	while (!*stop) {
		zmq_pollitem_t item = { .socket = sock, .events = ZMQ_POLLIN };
		int n = zmq_poll(&item, 1, POLL_MS);

		if (n < 0) {
			if (errno == EINTR)
				continue;
			lb_log(LB_LOG_ERR, "zmq_poll: %s", zmq_strerror(errno));
			return -1;
		}
		if (n > 0 && (item.revents & ZMQ_POLLIN))
			lb_channel_serve_one(sock, srv);
	}
	return 0;
}
