/* batcher.h - admission control for the coordinator: a running cap and a bounded,
 * priority-ordered wait queue.
 *
 * A request either runs at once (a running slot is free), waits (the queue has
 * room) or is refused (BATCH_FULL: answered RESOURCE_EXHAUSTED immediately). When
 * a running request ends, batch_release() promotes the head of the queue (lowest
 * priority value first, FIFO among equals) into the freed slot. Single-threaded
 * (the loop thread); the items are embedded in the caller's request objects.
 */
#pragma once

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

struct batch_item {
    struct batch_item *prev, *next;
    int32_t priority;
    uint64_t seq;
    bool queued;
    bool running;
};

struct batcher {
    unsigned max_running;
    unsigned max_queue;
    unsigned running;
    unsigned queued;
    uint64_t seq;
    struct batch_item *head, *tail;
    _Atomic uint64_t published;     /* running << 32 | queued, for other threads */
};

enum batch_admit {
    BATCH_RUN,
    BATCH_QUEUED,
    BATCH_FULL,
};

void batch_init(struct batcher *b, unsigned max_running, unsigned max_queue);
/* Admit it (priority read from it->priority). */
enum batch_admit batch_admit(struct batcher *b, struct batch_item *it);
/* A running item ended: frees its slot and returns the queued item now promoted to
 * running (the caller dispatches it), or NULL. */
struct batch_item *batch_release(struct batcher *b, struct batch_item *it);
/* Take a queued item out (cancelled while waiting). */
void batch_remove(struct batcher *b, struct batch_item *it);
/* Pop the queue head without a slot (used to fail queued work, e.g. no groups). */
struct batch_item *batch_pop(struct batcher *b);
/* Any thread: the last published (running, queued). */
void batch_published(struct batcher *b, unsigned *ret_running, unsigned *ret_queued);
