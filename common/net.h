/* net.h - small address helpers shared by the coordinator, the worker and the tools. */
#pragma once

#include <stdbool.h>

/* True for unix: / unix-abstract: targets, "localhost", 127.0.0.0/8 and ::1 (with or
 * without a :port; IPv6 in brackets).  Anything else, unparsable ones included, is not. */
bool net_addr_is_loopback(const char *addr);

/* True when another socket holds the TCP address addr ("host:port", "[v6]:port"; with
 * port >= 0, addr is a host and port its port) so that a listen there would fail with
 * EADDRINUSE.  False for a free one, port 0, unix: targets and unresolvable hosts (the
 * listen itself then says why). */
bool net_port_in_use(const char *addr, int port);
