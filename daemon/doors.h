/* doors.h - the agent-harness doors' routes (openai-routes.c serves them on the API port):
 * OpenAI's Responses API (responses.c) and Anthropic's Messages API (messages.c). */
#pragma once

#include <stdint.h>

#include <jansson.h>

struct coord;
struct http_req;

/* POST /v1/responses */
void responses_create(struct http_req *hr, void *ud);
/* GET and DELETE /v1/responses/{id} */
void responses_get(struct http_req *hr, void *ud);
/* The stored responses at time now_ms (rpc_now_ms(); a test's own clock): keep one (nothing
 * when the store is off; 0 or -ENOMEM), the response object of id (NULL: not stored, or
 * expired). */
int responses_store_put(struct coord *co, const char *id, json_t *conv, json_t *response, int64_t now_ms);
const json_t *responses_store_get(struct coord *co, const char *id, int64_t now_ms);
/* Drop every stored response (the server's stop). */
void responses_store_free(struct coord *co);

/* POST /v1/messages */
void messages_create(struct http_req *hr, void *ud);
/* POST /v1/messages/count_tokens */
void messages_count_tokens(struct http_req *hr, void *ud);
/* Anthropic's error body for status and msg (http_route.error_body of the /v1/messages paths). */
char *messages_error_body(unsigned status, const char *param, const char *msg);
