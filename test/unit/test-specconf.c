/* test-specconf.c - the one --speculative-config parser (common/specconf.c) that `stepd serve`
 * and stepd-worker share: method is required and "mtp"; without num_speculative_tokens K is
 * the checkpoint's MTP layers (at most SPEC_MAX_K); unknown keys and values are refused with
 * the keys stepd takes named; K is range-checked by one function (spec_k_check).  Also the
 * --max-model-len check against the model's positions and the --kv-cache-dtype values
 * (common/config.c, common/cli.c) `stepd serve` checks before it starts any rank. */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "config.h"
#include "harness.h"
#include "specconf.h"

int main(void)
{
    struct spec_config c;
    struct model_config mc;
    struct err_buf e = { "" };
    bool f32 = true;

    ASSERT_OK(spec_config_parse("{\"method\": \"mtp\", \"num_speculative_tokens\": 3}", &c, &e));
    ASSERT_EQ(c.num_speculative_tokens, 3);
    ASSERT_EQ(spec_config_k(&c, 3), 3);
    ASSERT_EQ(spec_config_k(&c, 1), 1);        /* fewer layers in the checkpoint */
    /* vLLM: without num_speculative_tokens, num_nextn_predict_layers */
    ASSERT_OK(spec_config_parse("{\"method\": \"mtp\"}", &c, &e));
    ASSERT_EQ(c.num_speculative_tokens, SPEC_K_MODEL);
    ASSERT_EQ(spec_config_depth(&c, 5), SPEC_MAX_K);
    ASSERT_EQ(spec_config_depth(&c, 1), 1);          /* as deep as the layers go */
    ASSERT_EQ(spec_config_k(&c, 2), 2);
    ASSERT_EQ(spec_config_k(&c, 0), 0);
    ASSERT_OK(spec_config_parse("{\"method\": \"mtp\", \"num_speculative_tokens\": 0}", &c, &e));
    ASSERT_EQ(spec_config_k(&c, 3), 0);
    /* what every rank refused and serve let through */
    ASSERT_ERR(spec_config_parse("{\"num_speculative_tokens\": 2}", &c, &e), -EINVAL);
    ASSERT_CONTAINS(e.msg, "method");
    ASSERT_ERR(spec_config_parse("{\"method\": \"mtp\", \"num_speculative_tokens\": 3, \"bogus\": 1}", &c, &e),
               -EINVAL);
    ASSERT_CONTAINS(e.msg, "unknown key \"bogus\"");
    ASSERT_CONTAINS(e.msg, "draft_policy");
    ASSERT_ERR(spec_config_parse("{\"method\": \"mtp\", \"draft_policy\": \"sometimes\"}", &c, &e), -EINVAL);
    ASSERT_CONTAINS(e.msg, "draft_policy");
    ASSERT_ERR(spec_config_parse("{\"method\": \"ngram\", \"num_speculative_tokens\": 3}", &c, &e), -EINVAL);
    /* vLLM's draft "model": the MTP layers from another directory (--mtp-model) */
    ASSERT_OK(spec_config_parse("{\"method\":\"mtp\",\"model\":\"/draft\",\"num_speculative_tokens\":1}", &c, &e));
    ASSERT_STREQ(c.model, "/draft");
    ASSERT_EQ(c.num_speculative_tokens, 1);
    ASSERT_ERR(spec_config_parse("{\"method\":\"mtp\",\"model\":5}", &c, &e), -EINVAL);
    ASSERT_CONTAINS(e.msg, "model");
    ASSERT_OK(spec_config_parse(NULL, &c, &e));
    ASSERT_STREQ(c.model, "");
    ASSERT_EQ(c.num_speculative_tokens, 0);

    /* K's one range check: the parser, stepd-worker --mtp, the engine's default and a
     * request's own (-1: the default) */
    ASSERT_OK(spec_k_check("--mtp", 0, false, &e));
    ASSERT_OK(spec_k_check("--mtp", SPEC_MAX_K, false, &e));
    ASSERT_ERR(spec_k_check("--mtp", SPEC_MAX_K + 1, false, &e), -EINVAL);
    ASSERT_STREQ(e.msg, "--mtp: 4 is not in 0..3");
    ASSERT_ERR(spec_k_check("--mtp", -1, false, &e), -EINVAL);
    ASSERT_OK(spec_k_check("num_speculative_tokens", -1, true, &e));
    ASSERT_ERR(spec_k_check("num_speculative_tokens", -2, true, &e), -EINVAL);
    ASSERT_ERR(spec_k_check("num_speculative_tokens", 1LL << 40, true, &e), -EINVAL);
    ASSERT_ERR(spec_config_parse("{\"method\": \"mtp\", \"num_speculative_tokens\": 4}", &c, &e), -EINVAL);
    ASSERT_STREQ(e.msg, "--speculative-config: num_speculative_tokens: 4 is not in 0..3");
    ASSERT_ERR(spec_config_parse("{\"method\": \"mtp\", \"num_speculative_tokens\": 1.5}", &c, &e), -EINVAL);
    ASSERT_CONTAINS(e.msg, "must be an integer in 0..3");

    memset(&mc, 0, sizeof(mc));
    mc.max_position_embeddings = 4096;
    ASSERT_OK(model_config_check_len(&mc, 4096, false, &e));
    ASSERT_ERR(model_config_check_len(&mc, 100000, false, &e), -EINVAL);
    ASSERT_CONTAINS(e.msg, "max_position_embeddings 4096");
    ASSERT_CONTAINS(e.msg, "--allow-long-max-model-len");
    ASSERT_OK(model_config_check_len(&mc, 100000, true, &e));

    ASSERT_OK(cli_parse_kv_dtype("--kv-cache-dtype", "auto", &f32, &e));
    ASSERT_TRUE(!f32);
    ASSERT_OK(cli_parse_kv_dtype("--kv-cache-dtype", "fp32", &f32, &e));
    ASSERT_TRUE(f32);
    ASSERT_ERR(cli_parse_kv_dtype("--kv-cache-dtype", "fp8", &f32, &e), -EINVAL);
    ASSERT_CONTAINS(e.msg, "--kv-cache-dtype 'fp8'");
    ASSERT_CONTAINS(e.msg, "fp32");
    printf("specconf: ok\n");
    return 0;
}
