/* owner.c - who a request belongs to and the secrets that name it: the owner string of a
 * caller (the API key, or its connection) that Abort by id is checked against, and the
 * random hex of server-assigned request ids, abort tokens and session ids. */
#include <stdint.h>
#include <stdio.h>
#include <sys/random.h>
#include <unistd.h>

#include "coord-int.h"

void coord_random_hex(char out[COORD_RANDOM_HEX])
{
    uint8_t b[16];

    if (getrandom(b, sizeof(b), 0) != (ssize_t)sizeof(b)) {
        uint64_t t = (uint64_t)rpc_now_us() ^ ((uint64_t)getpid() << 32);

        for (size_t i = 0; i < sizeof(b); i++, t = t * 6364136223846793005ull + 1442695040888963407ull)
            b[i] = (uint8_t)(t >> 56);
    }
    for (size_t i = 0; i < sizeof(b); i++)
        snprintf(out + 2 * i, 3, "%02x", b[i]);
}

void coord_call_owner(const struct coord *co, const struct rpc_call *call, char *buf, size_t n)
{
    char peer[REQ_OWNER_LEN];

    if (co->o.api_key && co->o.api_key[0]) {
        snprintf(buf, n, "api-key");
        return;
    }
    if (rpc_call_peer(call, peer, sizeof(peer)) < 0)
        snprintf(peer, sizeof(peer), "unknown");
    snprintf(buf, n, "peer:%.*s", (int)(n > 6 ? n - 6 : 0), peer);
}

void req_caller_owner(const struct coord *co, const struct req_caller *c, char *buf, size_t n)
{
    if (co->o.api_key && co->o.api_key[0])
        snprintf(buf, n, "api-key");
    else
        snprintf(buf, n, "peer:%.*s", (int)(n > 6 ? n - 6 : 0), c->peer[0] ? c->peer : "unknown");
}
