/* slow-client.c - a Generate client that never reads its stream (docs/RELIABILITY.md A6).
 *
 *   slow-client ADDR MAX_TOKENS SECONDS
 *
 * Opens one stepd.v1.Inference/Generate call with a token-id prompt on raw gRPC core
 * with a small, fixed HTTP/2 window (no BDP probing), never posts RECV_MESSAGE, and
 * waits up to SECONDS for the status. Prints "STATUS <code> <name>: <details>" and
 * exits 0 when a status arrived, 1 on timeout.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/byte_buffer.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <unistd.h>

#include "pb-util.h"
#include "rpc.h"
#include "stepd.pb-c.h"

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: slow-client ADDR MAX_TOKENS SECONDS\n");
        return 2;
    }
    grpc_init();
    grpc_arg args[] = {
        { GRPC_ARG_INTEGER, GRPC_ARG_HTTP2_BDP_PROBE, { .integer = 0 } },
        { GRPC_ARG_INTEGER, GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, { .integer = 16384 } },
    };
    grpc_channel_args ca = { 2, args };
    grpc_channel_credentials *cr = grpc_insecure_credentials_create();
    grpc_channel *ch = grpc_channel_create(argv[1], cr, &ca);
    grpc_channel_credentials_release(cr);
    grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
    gpr_timespec deadline = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                         gpr_time_from_seconds(atoi(argv[3]) + 5, GPR_TIMESPAN));
    grpc_slice method = grpc_slice_from_static_string("/stepd.v1.Inference/Generate");
    grpc_call *call = grpc_channel_create_call(ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq, method, NULL, deadline, NULL);

    Stepd__V1__GenerateRequest req = STEPD__V1__GENERATE_REQUEST__INIT;
    Stepd__V1__TokenIds ti = STEPD__V1__TOKEN_IDS__INIT;
    Stepd__V1__SamplingParams sp = STEPD__V1__SAMPLING_PARAMS__INIT;
    int32_t ids[3] = { 11, 12, 13 };
    ti.n_ids = 3;
    ti.ids = ids;
    PB_SET(&sp, max_tokens, atoll(argv[2]));
    req.request_id = "slow-reader";
    req.input_case = STEPD__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS;
    req.token_ids = &ti;
    req.sampling_params = &sp;
    size_t len = protobuf_c_message_get_packed_size(&req.base);
    grpc_slice s = grpc_slice_malloc(len);
    protobuf_c_message_pack(&req.base, GRPC_SLICE_START_PTR(s));
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);

    grpc_metadata_array init_md, trail_md;
    grpc_metadata_array_init(&init_md);
    grpc_metadata_array_init(&trail_md);
    grpc_status_code status;
    grpc_slice details;
    grpc_op ops[4];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = bb;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &init_md;
    grpc_call_start_batch(call, ops, 4, (void *)1, NULL);
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[0].data.recv_status_on_client.trailing_metadata = &trail_md;
    ops[0].data.recv_status_on_client.status = &status;
    ops[0].data.recv_status_on_client.status_details = &details;
    grpc_call_start_batch(call, ops, 1, (void *)2, NULL);

    gpr_timespec until = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                      gpr_time_from_seconds(atoi(argv[3]), GPR_TIMESPAN));
    int rc = 1;
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(cq, until, NULL);
        if (ev.type == GRPC_QUEUE_TIMEOUT) {
            printf("TIMEOUT no status within %s s\n", argv[3]);
            break;
        }
        if (ev.type == GRPC_OP_COMPLETE && ev.tag == (void *)2) {
            char *d = grpc_slice_to_c_string(details);
            printf("STATUS %d %s: %s\n", (int)status, rpc_status_name((int)status), d);
            gpr_free(d);
            grpc_slice_unref(details);
            rc = 0;
            break;
        }
    }
    fflush(stdout);
    _exit(rc);   /* no orderly teardown needed for a probe */
}
