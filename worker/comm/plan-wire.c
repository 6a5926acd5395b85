/* plan-wire.c - the step plan on the wire (rank 0 -> ranks 1..N-1).
 *
 * Layout, little-endian, no padding, no pointers:
 *   header   u32 magic "SPLN" | u16 version (1 or 2) | u16 kind (enum plan_msg) |
 *            u32 body_len | u64 step_id | i32 n_seqs | i32 n_tokens | i32 n_block_ids[2]
 *            (36 bytes); version 2 adds i32 n_img_emb | i32 img_width | u32 img_flags
 *            (48 bytes)
 *   body     n_seqs x 10 i32 (slot, pos0, n_tokens, n_logits, tok_off, n_blocks,
 *            block_off[2], mtp_depth, flags) | n_tokens x i32 token ids |
 *            n_block_ids[0] x i32 | n_block_ids[1] x i32
 *   version 2 only, the image section (issue 40): n_tokens x i32 img_row |
 *            n_seqs x STEP_PLAN_IMG_NEXT i32 img_row_next when img_flags has PLAN_IMG_NEXT |
 *            n_img_emb x img_width f32 img_emb (IEEE-754 binary32, the rows rank 0 splices)
 * A plan without image rows is written as version 1, byte for byte what it was before
 * images; one with image rows as version 2 (n_img_emb >= 1).  A STOP message is the
 * version-1 header alone with every count 0.  The kind of a plan is STEP, or STEP_ARGMAX
 * when plan.argmax is set (the greedy form, issue 38: the layout is STEP's, in either
 * version), or STEP_TOPK when plan.topk is (the sampled form, the same layout); a plan
 * with neither is written as before them.  A receiver that predates STEP_ARGMAX or
 * STEP_TOPK refuses it as an unknown kind (-EPROTO), as it refuses any kind it lacks.
 *
 * The receiver treats the bytes as untrusted (docs/RELIABILITY.md C11): the length must match
 * the counts exactly, every count is bounded, every run lies inside the token array, every
 * table inside its group's block array, every id inside the receiver's own limits, slots
 * are unique, flags carry known bits only (STEP_SEQ_FLAGS_KNOWN; the word was "reserved,
 * 0" before STEP_SEQ_NEW, so older plans read the same).  The image section: the rows'
 * width must be the receiver's (lim->img_width; 0 takes no image rows), their count within
 * lim->max_img_rows, every img_row and img_row_next entry -1 or a row.  Nothing is read
 * before its bounds are known to be inside the buffer.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "err.h"

#define PLAN_MAGIC 0x4e4c5053u  /* "SPLN" */
#define PLAN_VERSION 1       /* a plan without image rows, and STOP */
#define PLAN_VERSION_IMG 2   /* a plan with image rows: the longer header, the image section */
#define HDR_BYTES 36
#define HDR_IMG_BYTES 48
#define SEQ_WORDS 10
#define PLAN_IMG_NEXT 1u     /* img_flags: img_row_next follows img_row */

static void put_u16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static void put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint16_t get_u16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static uint32_t get_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static uint64_t get_u64(const uint8_t *p)
{
    return (uint64_t)get_u32(p) | ((uint64_t)get_u32(p + 4) << 32);
}

static int32_t get_i32(const uint8_t *p)
{
    return (int32_t)get_u32(p);
}

static uint64_t body_bytes(int64_t n_seqs, int64_t n_tokens, int64_t nb0, int64_t nb1)
{
    return 4u * ((uint64_t)n_seqs * SEQ_WORDS + (uint64_t)n_tokens + (uint64_t)nb0 + (uint64_t)nb1);
}

/* The image section's bytes: img_row, img_row_next when next, the rows. */
static uint64_t img_bytes(int64_t n_seqs, int64_t n_tokens, bool next, int64_t n_rows, int64_t width)
{
    return 4u * ((uint64_t)n_tokens + (next ? (uint64_t)n_seqs * STEP_PLAN_IMG_NEXT : 0) +
                 (uint64_t)n_rows * (uint64_t)width);
}

size_t step_plan_packed_size(const struct step_plan *p)
{
    size_t n = (size_t)body_bytes(p->n_seqs, p->n_tokens, p->n_block_ids[0], p->n_block_ids[1]);

    if (!p->img_row)
        return HDR_BYTES + n;
    return HDR_IMG_BYTES + n + (size_t)img_bytes(p->n_seqs, p->n_tokens, p->img_row_next != NULL,
                                                 p->n_img_emb, p->img_width);
}

/* The image rows a plan within lim may carry: lim->max_img_rows, else a row per token and
 * per MTP fill (the engine's bound: worker/engine/engine.c plan_images). */
static int64_t max_img_rows(const struct step_plan_limits *lim, int64_t s, int64_t t)
{
    return lim->max_img_rows > 0 ? lim->max_img_rows : t + s * STEP_PLAN_IMG_NEXT;
}

size_t step_plan_max_packed_size(const struct step_plan_limits *lim)
{
    int64_t s = lim->max_seqs > 0 ? lim->max_seqs : STEP_PLAN_MAX_SEQS;
    int64_t t = lim->max_tokens > 0 ? lim->max_tokens : STEP_PLAN_MAX_TOKENS;
    int64_t b = lim->max_block_ids > 0 ? lim->max_block_ids : STEP_PLAN_MAX_BLOCK_IDS;
    uint64_t n = HDR_BYTES + body_bytes(s, t, b, b);

    if (lim->img_width > 0)
        n += HDR_IMG_BYTES - HDR_BYTES +
             img_bytes(s, t, true, max_img_rows(lim, s, t), lim->img_width);
    return (size_t)n;
}

static void put_header(uint8_t *o, int version, int kind, uint32_t body_len, uint64_t step_id,
                       int32_t n_seqs, int32_t n_tokens, const int32_t *nb)
{
    put_u32(o, PLAN_MAGIC);
    put_u16(o + 4, (uint16_t)version);
    put_u16(o + 6, (uint16_t)kind);
    put_u32(o + 8, body_len);
    put_u64(o + 12, step_id);
    put_u32(o + 20, (uint32_t)n_seqs);
    put_u32(o + 24, (uint32_t)n_tokens);
    put_u32(o + 28, (uint32_t)nb[0]);
    put_u32(o + 32, (uint32_t)nb[1]);
}

int step_plan_pack(const struct step_plan *p, void *buf, size_t cap)
{
    uint8_t *o = buf;
    uint64_t body;
    size_t need, hdr;
    int32_t i;
    int g;

    if (p->n_seqs < 0 || p->n_seqs > STEP_PLAN_MAX_SEQS || p->n_tokens < 0 ||
        p->n_tokens > STEP_PLAN_MAX_TOKENS)
        return -EINVAL;
    for (g = 0; g < _KV_GROUP_MAX; g++)
        if (p->n_block_ids[g] < 0 || p->n_block_ids[g] > STEP_PLAN_MAX_BLOCK_IDS ||
            (p->n_block_ids[g] && !p->blocks[g]))
            return -EINVAL;
    if ((p->n_seqs && !p->seqs) || (p->n_tokens && !p->tokens))
        return -EINVAL;
    if (p->img_row && (!p->img_emb || p->n_img_emb < 1 || p->n_img_emb > STEP_PLAN_MAX_IMG_ROWS ||
                       p->img_width < 1 || p->img_width > STEP_PLAN_MAX_IMG_WIDTH))
        return -EINVAL;
    if (!p->img_row && (p->img_emb || p->img_row_next))
        return -EINVAL;
    body = body_bytes(p->n_seqs, p->n_tokens, p->n_block_ids[0], p->n_block_ids[1]);
    hdr = HDR_BYTES;
    if (p->img_row) {
        body += img_bytes(p->n_seqs, p->n_tokens, p->img_row_next != NULL, p->n_img_emb,
                          p->img_width);
        hdr = HDR_IMG_BYTES;
    }
    need = hdr + body;
    if (need > cap || need > INT32_MAX)
        return -EMSGSIZE;
    put_header(o, p->img_row ? PLAN_VERSION_IMG : PLAN_VERSION,
               p->argmax ? PLAN_MSG_STEP_ARGMAX : p->topk ? PLAN_MSG_STEP_TOPK : PLAN_MSG_STEP,
               (uint32_t)body,
               p->step_id, p->n_seqs, p->n_tokens, p->n_block_ids);
    if (p->img_row) {
        put_u32(o + 36, (uint32_t)p->n_img_emb);
        put_u32(o + 40, (uint32_t)p->img_width);
        put_u32(o + 44, p->img_row_next ? PLAN_IMG_NEXT : 0);
    }
    o += hdr;
    for (i = 0; i < p->n_seqs; i++) {
        const struct step_seq *s = &p->seqs[i];
        int32_t w[SEQ_WORDS] = { s->slot, s->pos0, s->n_tokens, s->n_logits, s->tok_off,
                                 s->n_blocks, s->block_off[0], s->block_off[1], s->mtp_depth,
                                 s->flags };

        for (int k = 0; k < SEQ_WORDS; k++, o += 4)
            put_u32(o, (uint32_t)w[k]);
    }
    for (i = 0; i < p->n_tokens; i++, o += 4)
        put_u32(o, (uint32_t)p->tokens[i]);
    for (g = 0; g < _KV_GROUP_MAX; g++)
        for (i = 0; i < p->n_block_ids[g]; i++, o += 4)
            put_u32(o, (uint32_t)p->blocks[g][i]);
    if (p->img_row) {
        size_t n_f = (size_t)p->n_img_emb * (size_t)p->img_width;

        for (i = 0; i < p->n_tokens; i++, o += 4)
            put_u32(o, (uint32_t)p->img_row[i]);
        for (i = 0; p->img_row_next && i < p->n_seqs * STEP_PLAN_IMG_NEXT; i++, o += 4)
            put_u32(o, (uint32_t)p->img_row_next[i]);
        for (size_t k = 0; k < n_f; k++, o += 4) {
            uint32_t bits;

            memcpy(&bits, &p->img_emb[k], 4);
            put_u32(o, bits);
        }
    }
    return (int)need;
}

int step_plan_pack_stop(void *buf, size_t cap)
{
    static const int32_t nb[2] = { 0, 0 };

    if (cap < HDR_BYTES)
        return -EMSGSIZE;
    put_header(buf, PLAN_VERSION, PLAN_MSG_STOP, 0, 0, 0, 0, nb);
    return HDR_BYTES;
}

void step_plan_buf_init(struct step_plan_buf *b)
{
    memset(b, 0, sizeof(*b));
}

void step_plan_buf_done(struct step_plan_buf *b)
{
    if (!b)
        return;
    free(b->plan.seqs);
    free(b->plan.tokens);
    for (int g = 0; g < _KV_GROUP_MAX; g++)
        free(b->plan.blocks[g]);
    free(b->img_emb);
    free(b->img_row);
    free(b->img_row_next);
    free(b->seen);
    memset(b, 0, sizeof(*b));
}

static int grow(void **p, size_t *cap, size_t n, size_t elem)
{
    void *q;

    if (n <= *cap)
        return 0;
    q = realloc(*p, n * elem);
    if (!q)
        return -ENOMEM;
    *p = q;
    *cap = n;
    return 0;
}

int step_plan_unpack(const void *buf, size_t len, const struct step_plan_limits *lim,
                     struct step_plan_buf *b, int *ret_kind, struct err_buf *e)
{
    const uint8_t *in = buf;
    int32_t n_seqs, n_tokens, nb[_KV_GROUP_MAX], sum = 0, i, n_img = 0, width = 0;
    uint32_t body_len, img_flags = 0;
    uint16_t version, kind;
    size_t hdr = HDR_BYTES;
    uint64_t want;
    int32_t max_mtp = lim->max_mtp_depth > 0 ? lim->max_mtp_depth : STEP_PLAN_MAX_MTP;
    struct step_plan *p = &b->plan;
    int g, r;

    if (len < HDR_BYTES)
        return err_set(e, -EBADMSG, "step plan: %zu bytes, shorter than the %d-byte header", len,
                       HDR_BYTES);
    if (get_u32(in) != PLAN_MAGIC)
        return err_set(e, -EBADMSG, "step plan: bad magic 0x%08x", get_u32(in));
    version = get_u16(in + 4);
    kind = get_u16(in + 6);
    if (version != PLAN_VERSION && version != PLAN_VERSION_IMG)
        return err_set(e, -EPROTO, "step plan: version %u, this worker speaks %d and %d", version,
                       PLAN_VERSION, PLAN_VERSION_IMG);
    if (kind != PLAN_MSG_STEP && kind != PLAN_MSG_STOP && kind != PLAN_MSG_STEP_ARGMAX &&
        kind != PLAN_MSG_STEP_TOPK)
        return err_set(e, -EPROTO, "step plan: unknown message kind %u", kind);
    if (version == PLAN_VERSION_IMG) {
        if (kind == PLAN_MSG_STOP)
            return err_set(e, -EBADMSG, "step plan: a version-%d message of kind %u (only a "
                           "step plan carries image rows)", PLAN_VERSION_IMG, kind);
        hdr = HDR_IMG_BYTES;
        if (len < hdr)
            return err_set(e, -EBADMSG, "step plan: %zu bytes, shorter than the %zu-byte header "
                           "of a plan with image rows", len, hdr);
        n_img = get_i32(in + 36);
        width = get_i32(in + 40);
        img_flags = get_u32(in + 44);
    }
    body_len = get_u32(in + 8);
    if ((uint64_t)body_len != (uint64_t)len - hdr)
        return err_set(e, -EBADMSG, "step plan: body length field %u, message carries %zu", body_len,
                       len - hdr);
    n_seqs = get_i32(in + 20);
    n_tokens = get_i32(in + 24);
    nb[0] = get_i32(in + 28);
    nb[1] = get_i32(in + 32);
    if (kind == PLAN_MSG_STOP) {
        if (n_seqs || n_tokens || nb[0] || nb[1] || len != HDR_BYTES)
            return err_set(e, -EBADMSG, "step plan: STOP message with a body");
        *ret_kind = PLAN_MSG_STOP;
        return 0;
    }
    if (n_seqs < 0 || n_seqs > STEP_PLAN_MAX_SEQS || (lim->max_seqs > 0 && n_seqs > lim->max_seqs))
        return err_set(e, -ERANGE, "step plan: n_seqs %d out of range", n_seqs);
    if (n_tokens < 0 || n_tokens > STEP_PLAN_MAX_TOKENS ||
        (lim->max_tokens > 0 && n_tokens > lim->max_tokens))
        return err_set(e, -ERANGE, "step plan: n_tokens %d out of range", n_tokens);
    for (g = 0; g < _KV_GROUP_MAX; g++)
        if (nb[g] < 0 || nb[g] > STEP_PLAN_MAX_BLOCK_IDS ||
            (lim->max_block_ids > 0 && nb[g] > lim->max_block_ids))
            return err_set(e, -ERANGE, "step plan: n_block_ids[%d] %d out of range", g, nb[g]);
    if (hdr == HDR_IMG_BYTES) {
        int64_t most = max_img_rows(lim, n_seqs, n_tokens);

        if (img_flags & ~PLAN_IMG_NEXT)
            return err_set(e, -EBADMSG, "step plan: unknown image flags 0x%x", (unsigned)img_flags);
        if (lim->img_width <= 0)
            return err_set(e, -EPROTO, "step plan: carries image rows, which this rank does not "
                           "take (no vision config, or --mock)");
        if (width != lim->img_width)
            return err_set(e, -ERANGE, "step plan: image rows of width %d, this rank's hidden "
                           "size is %d", width, lim->img_width);
        if (n_img < 1 || n_img > STEP_PLAN_MAX_IMG_ROWS || n_img > most)
            return err_set(e, -ERANGE, "step plan: %d image rows for %d tokens and %d seqs (1 to "
                           "%lld)", n_img, n_tokens, n_seqs,
                           (long long)(most < STEP_PLAN_MAX_IMG_ROWS ? most : STEP_PLAN_MAX_IMG_ROWS));
    }
    want = body_bytes(n_seqs, n_tokens, nb[0], nb[1]);
    if (hdr == HDR_IMG_BYTES)
        want += img_bytes(n_seqs, n_tokens, img_flags & PLAN_IMG_NEXT, n_img, width);
    if (want != (uint64_t)len - hdr)
        return err_set(e, -EBADMSG, "step plan: counts (%d seqs, %d tokens, %d+%d block ids, %d "
                       "image rows) need %llu body bytes, message carries %zu", n_seqs, n_tokens,
                       nb[0], nb[1], n_img, (unsigned long long)want, len - hdr);

    r = grow((void **)&p->seqs, &b->cap_seqs, (size_t)n_seqs, sizeof(*p->seqs));
    if (r == 0)
        r = grow((void **)&p->tokens, &b->cap_tokens, (size_t)n_tokens, sizeof(*p->tokens));
    for (g = 0; g < _KV_GROUP_MAX && r == 0; g++)
        r = grow((void **)&p->blocks[g], &b->cap_blocks[g], (size_t)nb[g], sizeof(int32_t));
    if (r == 0 && lim->max_seqs > 0)
        r = grow((void **)&b->seen, &b->cap_seen, (size_t)lim->max_seqs, 1);
    if (r == 0 && n_img) {
        r = grow((void **)&b->img_row, &b->cap_img_row, (size_t)n_tokens, sizeof(int32_t));
        if (r == 0 && (img_flags & PLAN_IMG_NEXT))
            r = grow((void **)&b->img_row_next, &b->cap_img_row_next,
                     (size_t)n_seqs * STEP_PLAN_IMG_NEXT, sizeof(int32_t));
        if (r == 0)
            r = grow((void **)&b->img_emb, &b->cap_img_emb, (size_t)n_img * (size_t)width,
                     sizeof(float));
    }
    if (r < 0)
        return err_set(e, r, "step plan: out of memory");

    p->step_id = get_u64(in + 12);
    p->argmax = kind == PLAN_MSG_STEP_ARGMAX;
    p->topk = kind == PLAN_MSG_STEP_TOPK;
    p->n_seqs = n_seqs;
    p->n_tokens = n_tokens;
    p->n_block_ids[0] = nb[0];
    p->n_block_ids[1] = nb[1];
    p->img_emb = NULL;
    p->img_row = p->img_row_next = NULL;
    p->n_img_emb = p->img_width = 0;
    in += hdr;
    for (i = 0; i < n_seqs; i++, in += 4 * SEQ_WORDS) {
        struct step_seq *s = &p->seqs[i];

        s->slot = get_i32(in);
        s->pos0 = get_i32(in + 4);
        s->n_tokens = get_i32(in + 8);
        s->n_logits = get_i32(in + 12);
        s->tok_off = get_i32(in + 16);
        s->n_blocks = get_i32(in + 20);
        s->block_off[0] = get_i32(in + 24);
        s->block_off[1] = get_i32(in + 28);
        s->mtp_depth = get_i32(in + 32);
        s->flags = get_i32(in + 36);
        if (s->flags & ~STEP_SEQ_FLAGS_KNOWN)
            return err_set(e, -EBADMSG, "step plan: seq %d: unknown flags 0x%x", i,
                           (unsigned)s->flags);
    }
    for (i = 0; i < n_tokens; i++, in += 4)
        p->tokens[i] = get_i32(in);
    for (g = 0; g < _KV_GROUP_MAX; g++)
        for (i = 0; i < nb[g]; i++, in += 4)
            p->blocks[g][i] = get_i32(in);
    if (n_img) {
        size_t n_f = (size_t)n_img * (size_t)width;

        for (i = 0; i < n_tokens; i++, in += 4) {
            b->img_row[i] = get_i32(in);
            if (b->img_row[i] < -1 || b->img_row[i] >= n_img)
                return err_set(e, -EBADMSG, "step plan: token %d takes image row %d of %d", i,
                               b->img_row[i], n_img);
        }
        for (i = 0; (img_flags & PLAN_IMG_NEXT) && i < n_seqs * STEP_PLAN_IMG_NEXT; i++, in += 4) {
            b->img_row_next[i] = get_i32(in);
            if (b->img_row_next[i] < -1 || b->img_row_next[i] >= n_img)
                return err_set(e, -EBADMSG, "step plan: seq %d: MTP input %d takes image row %d "
                               "of %d", i / STEP_PLAN_IMG_NEXT, i % STEP_PLAN_IMG_NEXT,
                               b->img_row_next[i], n_img);
        }
        for (size_t k = 0; k < n_f; k++, in += 4) {
            uint32_t bits = get_u32(in);

            memcpy(&b->img_emb[k], &bits, 4);
        }
        p->img_emb = b->img_emb;
        p->img_row = b->img_row;
        p->img_row_next = (img_flags & PLAN_IMG_NEXT) ? b->img_row_next : NULL;
        p->n_img_emb = n_img;
        p->img_width = width;
    }

    /* semantic checks */
    if (lim->max_seqs > 0)
        memset(b->seen, 0, (size_t)lim->max_seqs);
    for (i = 0; i < n_seqs; i++) {
        const struct step_seq *s = &p->seqs[i];
        int64_t end = (int64_t)s->pos0 + s->n_tokens;

        if (s->slot < 0 || (lim->max_seqs > 0 && s->slot >= lim->max_seqs))
            return err_set(e, -ERANGE, "step plan: seq %d: slot %d out of range", i, s->slot);
        if (lim->max_seqs > 0) {
            if (b->seen[s->slot])
                return err_set(e, -EBADMSG, "step plan: seq %d: slot %d appears twice", i, s->slot);
            b->seen[s->slot] = 1;
        }
        if (s->n_tokens < 1 || s->pos0 < 0)
            return err_set(e, -EBADMSG, "step plan: seq %d: pos0 %d, n_tokens %d", i, s->pos0,
                           s->n_tokens);
        if (lim->max_positions > 0 && end > lim->max_positions)
            return err_set(e, -ERANGE, "step plan: seq %d: positions up to %lld exceed %d", i,
                           (long long)end, lim->max_positions);
        if (s->n_logits < 0 || s->n_logits > s->n_tokens)
            return err_set(e, -EBADMSG, "step plan: seq %d: n_logits %d of %d tokens", i,
                           s->n_logits, s->n_tokens);
        if (s->tok_off < 0 || (int64_t)s->tok_off + s->n_tokens > n_tokens)
            return err_set(e, -EBADMSG, "step plan: seq %d: tokens [%d, +%d) outside %d", i,
                           s->tok_off, s->n_tokens, n_tokens);
        sum += s->n_tokens;     /* no overflow: each run fits in n_tokens <= 2^24 */
        if (sum > n_tokens)
            return err_set(e, -EBADMSG, "step plan: runs hold more than %d tokens", n_tokens);
        if (s->n_blocks < 0 ||
            (lim->block_size > 0 && (int64_t)s->n_blocks * lim->block_size < end))
            return err_set(e, -EBADMSG, "step plan: seq %d: %d blocks do not cover %lld positions",
                           i, s->n_blocks, (long long)end);
        for (g = 0; g < _KV_GROUP_MAX; g++)
            if (s->block_off[g] < 0 || (int64_t)s->block_off[g] + s->n_blocks > nb[g])
                return err_set(e, -EBADMSG, "step plan: seq %d: group %d table [%d, +%d) outside %d",
                               i, g, s->block_off[g], s->n_blocks, nb[g]);
        if (s->mtp_depth < 0 || s->mtp_depth > max_mtp)
            return err_set(e, -ERANGE, "step plan: seq %d: mtp_depth %d out of range", i,
                           s->mtp_depth);
    }
    if (sum != n_tokens)
        return err_set(e, -EBADMSG, "step plan: runs hold %d tokens, plan says %d", sum, n_tokens);
    if (lim->vocab_size > 0)
        for (i = 0; i < n_tokens; i++)
            if (p->tokens[i] < 0 || p->tokens[i] >= lim->vocab_size)
                return err_set(e, -ERANGE, "step plan: token %d: id %d outside vocabulary of %d", i,
                               p->tokens[i], lim->vocab_size);
    for (g = 0; g < _KV_GROUP_MAX; g++)
        for (i = 0; i < nb[g]; i++) {
            int32_t id = p->blocks[g][i];

            if (id < -1 || (id == -1 && g == KV_GROUP_FULL) ||
                (lim->max_blocks[g] > 0 && id >= lim->max_blocks[g]))
                return err_set(e, -ERANGE, "step plan: group %d block table entry %d: id %d out "
                               "of range", g, i, id);
        }
    *ret_kind = PLAN_MSG_STEP;
    return 0;
}
