/* codec.c - protobuf <-> gRPC byte buffers, request string checks, deadlines, status
 * names and clocks (see rpc-int.h). */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/grpc.h>
#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "clock.h"
#include "err.h"
#include "log.h"
#include "rpc-int.h"

/* ------------------------------------------------------------------ helpers */

static const char *const status_names[] = {
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
    "UNAUTHENTICATED",
};

const char *rpc_status_name(int status)
{
    if (status < 0 || (size_t)status >= sizeof(status_names) / sizeof(status_names[0]))
        return "UNKNOWN_STATUS";
    return status_names[status];
}

int64_t rpc_now_us(void)
{
    return clk_now_us();
}

int64_t rpc_now_ms(void)
{
    gpr_timespec t = gpr_now(GPR_CLOCK_MONOTONIC);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

gpr_timespec rpc__deadline_from_ms(int64_t ms)
{
    if (ms <= 0 || ms == INT64_MAX)
        return gpr_inf_future(GPR_CLOCK_MONOTONIC);
    gpr_timespec t;
    t.tv_sec = ms / 1000;
    t.tv_nsec = (int32_t)((ms % 1000) * 1000000);
    t.clock_type = GPR_CLOCK_MONOTONIC;
    return t;
}

int64_t rpc__deadline_to_ms(gpr_timespec t)
{
    if (gpr_time_cmp(t, gpr_inf_future(t.clock_type)) == 0)
        return INT64_MAX;
    t = gpr_convert_clock_type(t, GPR_CLOCK_MONOTONIC);
    if (t.tv_sec > INT64_MAX / 1000 - 1)
        return INT64_MAX;
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

bool rpc_secret_equal(const char *expected, const char *given)
{
    size_t le = strlen(expected), lg = strlen(given);
    volatile unsigned char diff = (unsigned char)(le != lg);
    for (size_t i = 0; i < le; i++) {
        unsigned char g = i < lg ? (unsigned char)given[i] : 0;
        diff |= (unsigned char)expected[i] ^ g;
    }
    return diff == 0;
}

/* Decode a byte buffer into a protobuf-c message (NULL on failure). */
ProtobufCMessage *rpc__bb_decode(grpc_byte_buffer *bb, const ProtobufCMessageDescriptor *desc)
{
    grpc_byte_buffer_reader rd;
    ProtobufCMessage *m;

    /* the usual case (one uncompressed slice): unpack in place, no copy */
    if (bb->type == GRPC_BB_RAW && bb->data.raw.compression == GRPC_COMPRESS_NONE &&
        bb->data.raw.slice_buffer.count == 1) {
        const grpc_slice *s = &bb->data.raw.slice_buffer.slices[0];
        return protobuf_c_message_unpack(desc, NULL, GRPC_SLICE_LENGTH(*s), GRPC_SLICE_START_PTR(*s));
    }
    if (!grpc_byte_buffer_reader_init(&rd, bb))
        return NULL;
    grpc_slice s = grpc_byte_buffer_reader_readall(&rd);
    grpc_byte_buffer_reader_destroy(&rd);
    m = protobuf_c_message_unpack(desc, NULL, GRPC_SLICE_LENGTH(s), GRPC_SLICE_START_PTR(s));
    grpc_slice_unref(s);
    return m;
}

grpc_byte_buffer *rpc__bb_encode(const ProtobufCMessage *msg, size_t *ret_len)
{
    size_t len = protobuf_c_message_get_packed_size(msg);
    grpc_slice s = grpc_slice_malloc(len);
    protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(s));
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    if (ret_len)
        *ret_len = len;
    return bb;
}

/* Strict UTF-8 check (no overlongs, no surrogates, <= U+10FFFF). */
static bool utf8_valid(const unsigned char *s)
{
    while (*s) {
        unsigned c = *s;
        if (c < 0x80) {
            s++;
            continue;
        }
        int n;
        unsigned cp;
        if ((c & 0xE0) == 0xC0) { n = 1; cp = c & 0x1F; }
        else if ((c & 0xF0) == 0xE0) { n = 2; cp = c & 0x0F; }
        else if ((c & 0xF8) == 0xF0) { n = 3; cp = c & 0x07; }
        else return false;
        for (int i = 1; i <= n; i++) {
            if ((s[i] & 0xC0) != 0x80)
                return false;
            cp = (cp << 6) | (s[i] & 0x3F);
        }
        if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) ||
            cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            return false;
        s += n + 1;
    }
    return true;
}

/* Walk every string field of m (recursively); proto3 requires valid UTF-8, which
 * protobuf-c does not check. On failure writes the field path into path. */
bool rpc__msg_strings_valid(const ProtobufCMessage *m, char *path, size_t plen, int depth)
{
    const ProtobufCMessageDescriptor *d = m->descriptor;
    size_t base = strlen(path);

    if (depth > 64)
        return false;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        const char *p = (const char *)m + f->offset;
        if (f->type != PROTOBUF_C_TYPE_STRING && f->type != PROTOBUF_C_TYPE_MESSAGE)
            continue;
        if (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
            uint32_t cse = *(const uint32_t *)((const char *)m + f->quantifier_offset);
            if (cse != f->id)
                continue;
        }
        if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            size_t n = *(const size_t *)((const char *)m + f->quantifier_offset);
            void *const *arr = *(void *const *const *)p;
            for (size_t k = 0; k < n; k++) {
                snprintf(path + base, plen - base, "%s%s[%zu]", base ? "." : "", f->name, k);
                if (f->type == PROTOBUF_C_TYPE_STRING) {
                    if (arr[k] && !utf8_valid(arr[k]))
                        return false;
                } else if (arr[k] && !rpc__msg_strings_valid(arr[k], path, plen, depth + 1)) {
                    return false;
                }
            }
        } else {
            const void *v = *(const void *const *)p;
            if (!v)
                continue;
            snprintf(path + base, plen - base, "%s%s", base ? "." : "", f->name);
            if (f->type == PROTOBUF_C_TYPE_STRING) {
                if (!utf8_valid(v))
                    return false;
            } else if (!rpc__msg_strings_valid(v, path, plen, depth + 1)) {
                return false;
            }
        }
        path[base] = '\0';
    }
    return true;
}

