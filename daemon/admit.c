/* admit.c - running cap + bounded priority queue. See admit.h. */
#include "admit.h"

#include <stddef.h>
#include <string.h>

#include "err.h"

static void publish(struct admit *b)
{
    atomic_store_explicit(&b->published, (uint64_t)b->running << 32 | b->queued, memory_order_release);
}

void admit_init(struct admit *b, unsigned max_running, unsigned max_queue)
{
    memset(b, 0, sizeof(*b));
    b->max_running = max_running;
    b->max_queue = max_queue;
    atomic_init(&b->published, 0);
}

void admit_published(struct admit *b, unsigned *ret_running, unsigned *ret_queued)
{
    uint64_t v = atomic_load_explicit(&b->published, memory_order_acquire);
    *ret_running = (unsigned)(v >> 32);
    *ret_queued = (unsigned)(v & 0xffffffffu);
}

void admit_list_insert(struct admit_list *l, struct admit_item *it)
{
    struct admit_item *p = l->tail;

    /* scan from the tail: equal priorities (the common case) insert in O(1) */
    while (p && p->priority > it->priority)
        p = p->prev;
    it->prev = p;
    it->next = p ? p->next : l->head;
    if (it->next)
        it->next->prev = it;
    else
        l->tail = it;
    if (p)
        p->next = it;
    else
        l->head = it;
    it->queued = true;
    l->n++;
}

void admit_list_unlink(struct admit_list *l, struct admit_item *it)
{
    BUG_ON(!it->queued);
    if (it->prev)
        it->prev->next = it->next;
    else
        l->head = it->next;
    if (it->next)
        it->next->prev = it->prev;
    else
        l->tail = it->prev;
    it->prev = it->next = NULL;
    it->queued = false;
    l->n--;
}

static void queue_insert(struct admit *b, struct admit_item *it)
{
    admit_list_insert(&b->q, it);
    b->queued = b->q.n;
}

static void queue_unlink(struct admit *b, struct admit_item *it)
{
    admit_list_unlink(&b->q, it);
    b->queued = b->q.n;
}

enum admit_result admit_add(struct admit *b, struct admit_item *it)
{
    it->seq = b->seq++;
    it->queued = it->running = false;
    if (b->running < b->max_running && b->queued == 0) {
        b->running++;
        it->running = true;
        publish(b);
        return ADMIT_RUN;
    }
    if (b->queued < b->max_queue) {
        queue_insert(b, it);
        publish(b);
        return ADMIT_QUEUED;
    }
    return ADMIT_FULL;
}

struct admit_item *admit_release(struct admit *b, struct admit_item *it)
{
    BUG_ON(!it->running);
    it->running = false;
    b->running--;
    if (!b->q.head || b->running >= b->max_running) {
        publish(b);
        return NULL;
    }
    struct admit_item *n = b->q.head;
    queue_unlink(b, n);
    n->running = true;
    b->running++;
    publish(b);
    return n;
}

void admit_remove(struct admit *b, struct admit_item *it)
{
    queue_unlink(b, it);
    publish(b);
}

struct admit_item *admit_pop(struct admit *b)
{
    struct admit_item *n = b->q.head;
    if (n) {
        queue_unlink(b, n);
        publish(b);
    }
    return n;
}
