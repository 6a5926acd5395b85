/* net.c - see net.h. */
#include "net.h"

#include <arpa/inet.h>
#include <string.h>

bool net_addr_is_loopback(const char *addr)
{
    char host[256];
    const char *p;
    size_t n;

    if (strncmp(addr, "unix:", 5) == 0 || strncmp(addr, "unix-abstract:", 14) == 0)
        return true;
    if (addr[0] == '[') {
        p = strchr(addr, ']');
        if (!p)
            return false;
        n = (size_t)(p - addr - 1);
        if (n >= sizeof(host))
            return false;
        memcpy(host, addr + 1, n);
    } else {
        p = strrchr(addr, ':');
        n = p ? (size_t)(p - addr) : strlen(addr);
        if (n >= sizeof(host))
            return false;
        memcpy(host, addr, n);
    }
    host[n] = '\0';
    if (strcmp(host, "localhost") == 0)
        return true;
    struct in_addr a4;
    struct in6_addr a6;
    if (inet_pton(AF_INET, host, &a4) == 1)
        return (ntohl(a4.s_addr) >> 24) == 127;
    if (inet_pton(AF_INET6, host, &a6) == 1)
        return memcmp(&a6, &in6addr_loopback, sizeof(a6)) == 0;
    return false;
}
