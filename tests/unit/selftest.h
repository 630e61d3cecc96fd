/* SPDX-License-Identifier: Apache-2.0
 *
 * selftest.h - the check macro of the C self-tests the unit suite compiles
 * (flow_selftest.c, parse_selftest.c, proto_selftest.c): a failed check is
 * printed with its place and counted, and the test goes on, so one run shows
 * every failure; main() exits non-zero when `failures` is.
 */
#ifndef HPCLB_SELFTEST_H
#define HPCLB_SELFTEST_H

#include <stdio.h>

static int failures;

#define CHECK(cond, ...)                                            \
	do {                                                        \
		if (!(cond)) {                                      \
			printf("FAIL %s:%d: ", __FILE__, __LINE__); \
			printf(__VA_ARGS__);                        \
			printf("\n");                               \
			failures++;                                 \
		}                                                   \
	} while (0)

#endif /* HPCLB_SELFTEST_H */
