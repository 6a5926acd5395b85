/* admit.h - admission control for the coordinator: a running cap and a bounded,
 * priority-ordered wait queue.
 *
 * A request either runs at once (a running slot is free), waits (the queue has
 * room) or is refused (ADMIT_FULL: answered RESOURCE_EXHAUSTED immediately). When
 * a running request ends, admit_release() promotes the head of the queue (lowest
 * priority value first, FIFO among equals) into the freed slot. Single-threaded
 * (the loop thread); the items are embedded in the caller's request objects.
 */
#pragma once

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

struct admit_item {
    struct admit_item *prev, *next;
    int32_t priority;
    uint64_t seq;
    bool queued;                    /* on a list (admit_list) */
    bool running;
};

/* Items in priority order (lower value first, FIFO among equals): the admission queue, and
 * any other wait of the same kind (the coordinator's requests held for a group with room). */
struct admit_list {
    struct admit_item *head, *tail;
    unsigned n;
};

void admit_list_insert(struct admit_list *l, struct admit_item *it);
void admit_list_unlink(struct admit_list *l, struct admit_item *it);

struct admit {
    unsigned max_running;
    unsigned max_queue;
    unsigned running;
    unsigned queued;                /* q.n */
    uint64_t seq;
    struct admit_list q;
    _Atomic uint64_t published;     /* running << 32 | queued, for other threads */
};

enum admit_result {
    ADMIT_RUN,
    ADMIT_QUEUED,
    ADMIT_FULL,
};

void admit_init(struct admit *b, unsigned max_running, unsigned max_queue);
/* Admit it (priority read from it->priority). */
enum admit_result admit_add(struct admit *b, struct admit_item *it);
/* A running item ended: frees its slot and returns the queued item now promoted to
 * running (the caller dispatches it), or NULL. */
struct admit_item *admit_release(struct admit *b, struct admit_item *it);
/* Take a queued item out (cancelled while waiting). */
void admit_remove(struct admit *b, struct admit_item *it);
/* Pop the queue head without a slot (used to fail queued work, e.g. no groups). */
struct admit_item *admit_pop(struct admit *b);
/* Any thread: the last published (running, queued). */
void admit_published(struct admit *b, unsigned *ret_running, unsigned *ret_queued);
