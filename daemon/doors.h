/* doors.h - the agent-harness doors' routes (openai.c serves them on the API port):
 * OpenAI's Responses API (responses.c) and Anthropic's Messages API (messages.c). */
#pragma once

struct coord;
struct http_req;

/* POST /v1/responses */
void responses_create(struct http_req *hr, void *ud);
/* GET and DELETE /v1/responses/{id} */
void responses_get(struct http_req *hr, void *ud);
/* Drop every stored response (the server's stop). */
void responses_store_free(struct coord *co);

/* POST /v1/messages */
void messages_create(struct http_req *hr, void *ud);
/* POST /v1/messages/count_tokens */
void messages_count_tokens(struct http_req *hr, void *ud);
