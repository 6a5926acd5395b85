/* pb-util.h - small helpers for the protoc-c generated code.
 *
 * protoc-c 1.4 has no proto3 `optional`; the build turns `optional T f` into the
 * synthetic oneof `_f` (see desugar-optional.sh), so presence is the oneof case:
 *     if (PB_HAS(sp, temperature)) use(sp->temperature);
 *     PB_SET(sp, temperature, 0.7f);
 * Case value 0 is "not set"; when set it equals the field number (PB_SET looks it
 * up in the descriptor, so it also works for ordinary oneof members).
 */
#pragma once

#include <stdint.h>
#include <protobuf-c/protobuf-c.h>

#define PB_HAS(msg, field) ((msg)->_##field##_case != 0)
#define PB_SET(msg, field, value) \
    do { (msg)->field = (value); pb_case_set(&(msg)->base, #field); } while (0)

/* Set the oneof case of the named field to that field's number. */
static inline void pb_case_set(ProtobufCMessage *m, const char *field)
{
    const ProtobufCFieldDescriptor *f =
        protobuf_c_message_descriptor_get_field_by_name(m->descriptor, field);
    if (f && (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF))
        *(uint32_t *)((char *)m + f->quantifier_offset) = f->id;
}
