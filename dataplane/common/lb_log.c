/* SPDX-License-Identifier: Apache-2.0 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "lb_log.h"

static const char *log_prog = "hpclb";
static int log_level = LB_LOG_INFO;

void lb_log_init(const char *prog)
{
	log_prog = prog;
	setvbuf(stderr, NULL, _IOLBF, 0);
}

int lb_log_enabled(int level)
{
	return level <= log_level;
}

int lb_log_set_level_name(const char *name)
{
	static const char *const names[] = { "error", "warn", "info", "debug" };

	for (int i = 0; i < 4; i++) {
		if (!strcmp(name, names[i])) {
			log_level = i;
			return 0;
		}
	}
	return -1;
}

void lb_log(int level, const char *fmt, ...)
{
	static const char *const tag[] = { "error: ", "warning: ", "", "debug: " };
	char line[1024];
	va_list ap;

	if (level > log_level || level < 0)
		return;
	va_start(ap, fmt);
	vsnprintf(line, sizeof(line), fmt, ap);
	va_end(ap);
	fprintf(stderr, "%s: %s%s\n", log_prog, tag[level], line);
}
