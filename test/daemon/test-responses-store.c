/* test-responses-store.c - the stored responses of /v1/responses (responses.c) on a clock of
 * the test's own: the TTL, the size bound (oldest dropped first), and either at 0 turning
 * the store off. */
#include <stdlib.h>

#include "harness.h"
#include "coord-int.h"
#include "doors.h"

static int put(struct coord *co, const char *id, int64_t now)
{
    json_t *conv = json_pack("[{s:s, s:s}]", "role", "user", "content", id);
    json_t *resp = json_pack("{s:s}", "id", id);
    int r = responses_store_put(co, id, conv, resp, now);

    json_decref(conv);
    json_decref(resp);
    return r;
}

static bool has(struct coord *co, const char *id, int64_t now)
{
    const json_t *r = responses_store_get(co, id, now);

    return r && !strcmp(json_string_value(json_object_get(r, "id")), id);
}

int main(void)
{
    struct coord *co = calloc(1, sizeof(*co));

    coord_opts_default(&co->o);
    ASSERT_EQ(co->o.responses_store_size, 1024u);
    ASSERT_EQ(co->o.responses_store_ttl_s, 3600u);
    /* the TTL: kept until its second 10 ends, not after */
    co->o.responses_store_ttl_s = 10;
    ASSERT_EQ(put(co, "resp_a", 1000), 0);
    ASSERT_EQ(put(co, "resp_b", 5000), 0);
    ASSERT_TRUE(has(co, "resp_a", 10999));
    ASSERT_TRUE(!has(co, "resp_a", 11000));
    ASSERT_TRUE(has(co, "resp_b", 11000));
    ASSERT_TRUE(!has(co, "resp_b", 15000));
    ASSERT_TRUE(!has(co, "resp_nope", 0));
    /* the size: the oldest goes first */
    co->o.responses_store_size = 2;
    ASSERT_EQ(put(co, "resp_1", 20000), 0);
    ASSERT_EQ(put(co, "resp_2", 20001), 0);
    ASSERT_EQ(put(co, "resp_3", 20002), 0);
    ASSERT_TRUE(!has(co, "resp_1", 20003));
    ASSERT_TRUE(has(co, "resp_2", 20003) && has(co, "resp_3", 20003));
    /* off: nothing is kept (size 0 or TTL 0) */
    co->o.responses_store_size = 0;
    ASSERT_EQ(put(co, "resp_4", 20004), 0);
    co->o.responses_store_size = 2;
    co->o.responses_store_ttl_s = 0;
    ASSERT_EQ(put(co, "resp_5", 20005), 0);
    co->o.responses_store_ttl_s = 10;
    ASSERT_TRUE(!has(co, "resp_4", 20006) && !has(co, "resp_5", 20006));
    ASSERT_TRUE(has(co, "resp_3", 20006));
    responses_store_free(co);
    ASSERT_TRUE(co->responses == NULL);
    free(co);
    return 0;
}
