/* batcher.c - running cap + bounded priority queue. See batcher.h. */
#include "batcher.h"

#include <stddef.h>

#include "err.h"

void batch_init(struct batcher *b, unsigned max_running, unsigned max_queue)
{
    *b = (struct batcher){ .max_running = max_running, .max_queue = max_queue };
}

static void queue_insert(struct batcher *b, struct batch_item *it)
{
    struct batch_item *p = b->tail;

    /* scan from the tail: equal priorities (the common case) insert in O(1) */
    while (p && p->priority > it->priority)
        p = p->prev;
    it->prev = p;
    it->next = p ? p->next : b->head;
    if (it->next)
        it->next->prev = it;
    else
        b->tail = it;
    if (p)
        p->next = it;
    else
        b->head = it;
    it->queued = true;
    b->queued++;
}

static void queue_unlink(struct batcher *b, struct batch_item *it)
{
    BUG_ON(!it->queued);
    if (it->prev)
        it->prev->next = it->next;
    else
        b->head = it->next;
    if (it->next)
        it->next->prev = it->prev;
    else
        b->tail = it->prev;
    it->prev = it->next = NULL;
    it->queued = false;
    b->queued--;
}

enum batch_admit batch_admit(struct batcher *b, struct batch_item *it)
{
    it->seq = b->seq++;
    it->queued = it->running = false;
    if (b->running < b->max_running && b->queued == 0) {
        b->running++;
        it->running = true;
        return BATCH_RUN;
    }
    if (b->queued < b->max_queue) {
        queue_insert(b, it);
        return BATCH_QUEUED;
    }
    return BATCH_FULL;
}

struct batch_item *batch_release(struct batcher *b, struct batch_item *it)
{
    BUG_ON(!it->running);
    it->running = false;
    b->running--;
    if (!b->head || b->running >= b->max_running)
        return NULL;
    struct batch_item *n = b->head;
    queue_unlink(b, n);
    n->running = true;
    b->running++;
    return n;
}

void batch_remove(struct batcher *b, struct batch_item *it)
{
    queue_unlink(b, it);
}

struct batch_item *batch_pop(struct batcher *b)
{
    struct batch_item *n = b->head;
    if (n)
        queue_unlink(b, n);
    return n;
}
