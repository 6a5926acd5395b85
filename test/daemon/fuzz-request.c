/* fuzz-request.c - libFuzzer target: the public request path before any engine
 * (docs/RELIABILITY.md C10).  The input is a GenerateRequest as it arrives on the wire: it
 * goes through what the coordinator does with a call's bytes - the protobuf unpack, the
 * UTF-8 check of every string (rpc/), request_from_proto(), media_proto_images() (the
 * images' decoders; without a tokenizer they are decoded, then refused) and
 * request_validate() against a served model - and whatever the bytes, each step either accepts or refuses with a
 * message naming the field, and an accepted request keeps the limits validation promises.
 * The committed corpus (corpus/request, written by gen-request-corpus.py) replays in
 * 'unit'; with CC=clang -Dfuzz=true a bounded run is in suite 'fuzz'. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "coord-int.h"
#include "media.h"
#include "rpc-int.h"

static struct coord *coord_for_fuzz(void)
{
    static struct coord co;
    static bool init;

    if (!init) {
        coord_opts_default(&co.o);
        co.o.model_name = "tiny-step";
        co.model.known = true;
        snprintf(co.model.name, sizeof(co.model.name), "tiny-step");
        co.model.vocab_size = 4000;
        co.model.max_model_len = 4096;
        init = true;
    }
    return &co;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct coord *co = coord_for_fuzz();
    ProtobufCMessage *m = protobuf_c_message_unpack(&stepd__v1__generate_request__descriptor, NULL, size, data);
    struct request *in = NULL;
    char path[256] = "", msg[768] = "";
    int r;

    if (!m)
        return 0;
    if (!rpc__msg_strings_valid(m, path, sizeof(path), 0))
        goto out;               /* INVALID_ARGUMENT naming path, before the loop sees it */
    r = request_from_proto((const Stepd__V1__GenerateRequest *)m, &in, msg, sizeof(msg));
    if (r == 0 && (r = media_proto_images((const Stepd__V1__GenerateRequest *)m, NULL, false, NULL, in, msg,
                                          sizeof(msg))) < 0) {
        request_free(in);       /* as grpc-door.c does */
        in = NULL;
    }
    if (r == 0)
        r = request_validate(co, in, msg, sizeof(msg));
    if (r < 0) {
        if (r != -EINVAL && r != -ENOMEM)
            abort();            /* only these two become a status (req.c) */
        if (r == -EINVAL && (!msg[0] || !memchr(msg, '\0', sizeof(msg))))
            abort();            /* a refusal always says which field */
        goto out;
    }
    /* accepted: what the engine and the text pipeline rely on */
    const struct request_sampling *sp = &in->sp;
    if (REQUEST_HAS(sp, RO_TEMPERATURE) && !(isfinite(sp->temperature) && sp->temperature >= 0.0f))
        abort();
    if (REQUEST_HAS(sp, RO_TOP_P) && !(sp->top_p > 0.0f && sp->top_p <= 1.0f))
        abort();
    if (REQUEST_HAS(sp, RO_TOP_K) && sp->top_k < -1)
        abort();
    if (REQUEST_HAS(sp, RO_MAX_TOKENS) && sp->max_tokens > (int64_t)co->o.max_tokens_cap)
        abort();
    if (in->input == REQUEST_INPUT_TOKENS)
        for (size_t i = 0; i < in->n_token_ids; i++)
            if (in->token_ids[i] < 0 || (uint32_t)in->token_ids[i] >= co->model.vocab_size)
                abort();
out:
    request_free(in);
    protobuf_c_message_free_unpacked(m, NULL);
    return 0;
}
