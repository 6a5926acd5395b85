/* openai.h - the OpenAI-compatible HTTP API of the coordinator (openai.c) and the metrics
 * port, both on http.c.  Loop thread only. */
#pragma once

struct coord;

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
