/* net.h - small address helpers shared by the coordinator, the worker and the tools. */
#pragma once

#include <stdbool.h>

/* True for unix: / unix-abstract: targets, "localhost", 127.0.0.0/8 and ::1 (with or
 * without a :port; IPv6 in brackets).  Anything else, unparsable ones included, is not. */
bool net_addr_is_loopback(const char *addr);
