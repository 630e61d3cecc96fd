/* SPDX-License-Identifier: Apache-2.0
 *
 * lb_log.h - one-line log messages on stderr for the data-plane daemons
 * ("hpclb-xdp: warning: ..."), which systemd's journal or the supervisor
 * collects. One write per line, so concurrent writers do not interleave.
 */
#ifndef HPCLB_LB_LOG_H
#define HPCLB_LB_LOG_H

enum lb_log_level { LB_LOG_ERR, LB_LOG_WARN, LB_LOG_INFO, LB_LOG_DEBUG };

/* prog prefixes every line; it must outlive the process's logging. */
void lb_log_init(const char *prog);
int lb_log_enabled(int level);
/* "error", "warn", "info" or "debug"; returns -1 (and changes nothing) otherwise. */
int lb_log_set_level_name(const char *name);
void lb_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif /* HPCLB_LB_LOG_H */
