/* openai.h - the OpenAI-compatible HTTP API of the coordinator and the metrics port, both on
 * http.c: the routes (openai-routes.c), the requests' parse (openai-parse.c: names_chat,
 * bad_json, model_known) and the answers (openai-render.c: http_status_of,
 * respond_status).  Loop thread only. */
#pragma once

#include <stdbool.h>
#include <stddef.h>

#include <jansson.h>

struct coord;
struct http_req;

/* Start the API server (--host/--port, unless the port is -1) and the metrics server
 * (--metrics-listen, unless ""); the bound ports go to co->http_port and co->metrics_port.
 * A negative errno with the reason logged. */
int openai_start(struct coord *co);
/* HTTP requests in progress on both servers. */
unsigned openai_active(const struct coord *co);
/* Stop accepting connections (the servers' shutdown). */
void openai_quiesce(struct coord *co);
/* Close both servers (their handles close on the loop). */
void openai_stop(struct coord *co);

/* Pieces the other HTTP doors (door.c, responses.c, messages.c) share with this one. */
/* Chat completions' field names (struct request's names table, [_RN_MAX]). */
extern const char *const names_chat[];
/* The HTTP status of an enum rpc_status. */
unsigned http_status_of(int rpc);
/* Why a body is not JSON, into msg (a NaN or an infinity: the field that holds it). */
void bad_json(const char *body, size_t blen, const json_error_t *je, char *msg, size_t len);
/* Whether name is one of the served model names (--served-model-name, the group's). */
bool model_known(const struct coord *co, const char *name);
/* An OpenAI error answer for an enum rpc_status: 400s name the field their message starts
 * with ("temperature: ..." -> param "temperature"); retry_ms > 0 adds Retry-After. */
int respond_status(struct http_req *hr, int rpc, int retry_ms, const char *msg);
