/* net.c - see net.h. */
#include "net.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <sys/socket.h>
#include <unistd.h>
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

bool net_port_in_use(const char *addr, int port)
{
    struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE };
    struct addrinfo *res = NULL;
    char host[256], serv[16];
    const char *colon;
    bool used = false;

    if (!addr || strncmp(addr, "unix", 4) == 0)
        return false;
    colon = strrchr(addr, ':');
    if (port >= 0) {
        snprintf(host, sizeof(host), "%s", addr);
        snprintf(serv, sizeof(serv), "%d", port);
    } else {
        if (!colon)
            return false;
        snprintf(host, sizeof(host), "%.*s", (int)(colon - addr), addr);
        snprintf(serv, sizeof(serv), "%s", colon + 1);
    }
    if (host[0] == '[') {                   /* [v6]:port */
        memmove(host, host + 1, strlen(host));
        host[strcspn(host, "]")] = '\0';
    }
    if (strcmp(serv, "0") == 0 || getaddrinfo(host[0] ? host : NULL, serv, &hints, &res) != 0)
        return false;
    for (struct addrinfo *a = res; a && !used; a = a->ai_next) {
        int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol), one = 1;

        if (fd < 0)
            continue;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        used = bind(fd, a->ai_addr, a->ai_addrlen) < 0 && errno == EADDRINUSE;
        close(fd);
    }
    freeaddrinfo(res);
    return used;
}
