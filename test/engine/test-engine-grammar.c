/* test-engine-grammar.c - structured output in the engine, on the mock forward with the tiny
 * model's vocabulary: every constrained reply (JSON schema, greedy and sampled, K = 0 and
 * K = 3 with MTP drafts that the grammar often forbids) decodes to text the constraint
 * accepts; greedy K = 3 equals K = 0 token for token; an unconstrained request next to it
 * is unchanged by it; a grammar that cannot finish within max_tokens ends LENGTH; a bad
 * schema is refused at submit naming structured_output; an engine without a tokenizer
 * refuses constrained requests.  Skips (77) without llguidance. */
#include <errno.h>
#include <jansson.h>
#include <regex.h>
#include <stdio.h>
#include <string.h>

#include "engine-rig.h"
#include "grammar.h"
#include "tokenizer.h"

#define VOCAB 4096
#define EOS 2

static const char *schema =
    "{\"type\":\"object\",\"properties\":{"
    "\"id\":{\"type\":\"integer\",\"minimum\":1,\"maximum\":99},"
    "\"tag\":{\"enum\":[\"alpha\",\"beta\"]},"
    "\"ok\":{\"type\":\"boolean\"}},"
    "\"required\":[\"id\",\"tag\",\"ok\"],\"additionalProperties\":false}";

static struct tokenizer *tok;

static struct engine *new_engine(struct forward **f, const char *tokjson)
{
    struct mock_config mc;
    struct engine_config ec;

    mock_config_init(&mc);
    mc.vocab_size = VOCAB;
    mc.n_mtp = 3;
    mc.mtp_accuracy = 0.7f;
    ASSERT_OK(mock_forward_new(&mc, f));
    rig_engine_config(&ec, 256, 8, 512, 64, 3);
    ec.eos_ids[ec.n_eos++] = EOS;
    ec.grammar_tokenizer = tokjson;
    return rig_engine_new(*f, &ec);
}

static int submit(struct engine *e, const char *id, const char *kind, const char *text, int k,
                  float temp, int max_tokens, struct rig_out *out, struct err_buf *err)
{
    static const int32_t prompt[] = { 11, 200, 301, 47, 9 };
    struct engine_request q;

    memset(out, 0, sizeof(*out));
    engine_request_init(&q);
    q.id = id;
    q.prompt = prompt;
    q.n_prompt = 5;
    q.max_tokens = max_tokens;
    q.num_speculative_tokens = k;
    q.constraint_kind = kind;
    q.constraint = text;
    if (temp > 0) {
        q.sampling.temperature = temp;
        q.sampling.seed = 1234 + (uint64_t) strlen(id);
    }
    return engine_submit(e, &q, rig_on_out, out, err);
}

static json_t *decode_json(const struct rig_out *o)
{
    char *text = NULL;
    size_t len = 0;
    int n = o->n;
    if (n > 0 && o->toks[n - 1] == EOS)
        n--;
    ASSERT_OK(tok_decode(tok, o->toks, (size_t) n, false, &text, &len));
    json_error_t je;
    json_t *j = json_loads(text, 0, &je);
    if (!j)
        FAIL("not JSON (%d tokens, finish %d): %s", o->n, o->why, text);
    free(text);
    return j;
}

static void check_reply(const struct rig_out *o)
{
    ASSERT_TRUE(o->finished);
    json_t *j = decode_json(o);
    ASSERT_EQ(o->why, ENGINE_FINISH_STOP);
    json_int_t id = json_integer_value(json_object_get(j, "id"));
    ASSERT_TRUE(id >= 1 && id <= 99);
    const char *tag = json_string_value(json_object_get(j, "tag"));
    ASSERT_TRUE(tag && (!strcmp(tag, "alpha") || !strcmp(tag, "beta")));
    ASSERT_TRUE(json_is_boolean(json_object_get(j, "ok")));
    ASSERT_EQ(json_object_size(j), 3);
    json_decref(j);
}

int main(int argc, char **argv)
{
    char tokjson[4096];
    struct err_buf err;
    struct forward *f;
    struct rig_out out[8];

    ASSERT_TRUE(argc == 2);
    if (grammar_lib_open(&err) < 0) {
        fprintf(stderr, "skip: %s\n", err.msg);
        return TEST_SKIP;
    }
    snprintf(tokjson, sizeof(tokjson), "%s/tokenizer.json", argv[1]);
    ASSERT_OK(tok_load(tokjson, &tok, &err));
    struct engine *e = new_engine(&f, tokjson);

    /* greedy K = 0 and K = 3, sampled K = 0 and K = 3, and a free request alongside */
    ASSERT_OK(submit(e, "g0", "json_schema", schema, 0, 0, 200, &out[0], &err));
    ASSERT_OK(submit(e, "g3", "json_schema", schema, 3, 0, 200, &out[1], &err));
    ASSERT_OK(submit(e, "s0", "json_schema", schema, 0, 1.0f, 200, &out[2], &err));
    ASSERT_OK(submit(e, "s3x", "json_schema", schema, 3, 1.0f, 200, &out[3], &err));
    ASSERT_OK(submit(e, "free", NULL, NULL, 3, 0, 40, &out[4], &err));
    ASSERT_OK(engine_run_until_idle(e));
    for (int i = 0; i < 4; i++)
        check_reply(&out[i]);
    rig_same(&out[0], &out[1], "greedy K=3 vs K=0 under the schema");
    /* the drafts were checked: some were forbidden (rejected), some accepted */
    ASSERT_TRUE(out[1].mtp.n_draft_tokens > out[1].mtp.n_accepted);
    ASSERT_TRUE(out[1].mtp.n_accepted > 0);

    /* the free request is the same alone */
    struct rig_out alone;
    ASSERT_OK(submit(e, "free2", NULL, NULL, 3, 0, 40, &alone, &err));
    ASSERT_OK(engine_run_until_idle(e));
    rig_same(&out[4], &alone, "free request next to constrained ones");

    /* more sampled replies, K = 3 (drafts rejected and rolled back) */
    for (int i = 0; i < 6; i++) {
        char id[16];
        snprintf(id, sizeof(id), "s%d%s", i, "xxxxx" + i % 5);
        ASSERT_OK(submit(e, id, "json_schema", schema, 3, 1.5f, 200, &out[i], &err));
    }
    ASSERT_OK(engine_run_until_idle(e));
    for (int i = 0; i < 6; i++)
        check_reply(&out[i]);

    /* cannot finish in 4 tokens: LENGTH, a prefix of a valid reply */
    ASSERT_OK(submit(e, "short", "regex", "a{40}", 3, 0, 4, &out[0], &err));
    ASSERT_OK(engine_run_until_idle(e));
    ASSERT_EQ(out[0].why, ENGINE_FINISH_LENGTH);
    ASSERT_EQ(out[0].n, 4);

    /* regex replies match */
    for (int i = 0; i < 4; i++) {
        char id[16];
        snprintf(id, sizeof(id), "rx%d", i);
        ASSERT_OK(submit(e, id, "regex", "(cat|dog)-[0-9]{2}", i % 2 ? 3 : 0, 1.0f, 50, &out[i], &err));
    }
    ASSERT_OK(engine_run_until_idle(e));
    for (int i = 0; i < 4; i++) {
        char *text = NULL;
        size_t len;
        regex_t rx;
        ASSERT_EQ(out[i].why, ENGINE_FINISH_STOP);
        ASSERT_OK(tok_decode(tok, out[i].toks, (size_t) out[i].n - 1, false, &text, &len));
        ASSERT_EQ(regcomp(&rx, "^(cat|dog)-[0-9]{2}$", REG_EXTENDED | REG_NOSUB), 0);
        if (regexec(&rx, text, 0, NULL, 0))
            FAIL("\"%s\" does not match", text);
        regfree(&rx);
        free(text);
    }

    /* refused at submit: a bad schema names the field */
    ASSERT_ERR(submit(e, "bad", "json_schema", "{\"type\": 5}", 0, 0, 10, &out[0], &err), -EINVAL);
    ASSERT_CONTAINS(err.msg, "structured_output.json_schema");
    rig_engine_close(e, NULL);
    f->ops->free(f);

    /* no tokenizer: refused */
    e = new_engine(&f, NULL);
    ASSERT_ERR(submit(e, "x", "regex", "a", 0, 0, 10, &out[0], &err), -EINVAL);
    ASSERT_CONTAINS(err.msg, "structured_output");
    rig_engine_close(e, NULL);
    f->ops->free(f);
    tok_free(tok);
    printf("ok\n");
    return 0;
}
