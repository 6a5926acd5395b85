#!/usr/bin/env python3
"""fake-serve - a test double of the two servers bench-serve starts, for test-bench-serve-llama.py
and test-bench-serve-slices.py.

  fake-serve.py serve MODEL_DIR ... --port P ...     stepd serve: GET /ready, GET /v1/models,
                                                    POST /v1/completions (OpenAI stream, one chunk
                                                    of "token_ids" a token, then usage, [DONE])
  fake-serve.py --model F ... --port P ...          llama-server: GET /health, POST /completion
                                                    (one chunk of "tokens" a token, then a chunk
                                                    with "stop": true and "tokens_predicted")

Tokens are made up from the prompt (no model); each takes FAKE_TOKEN_MS milliseconds (default 1).
FAKE_SERVE_LOG: a file to which each start appends {"argv": ...} and each completion request
{"server": "stepd"|"llama", "port": P, "body": ...}, one JSON object a line.  Faults of the llama side, to
check that bench-serve rejects them: FAKE_LLAMA_CHUNK=N streams N tokens a chunk; FAKE_LLAMA_SHORT=1
predicts one token fewer than asked for; FAKE_LLAMA_FLIP=J changes token J (from 0) of each stream.
"""
import http.server
import json
import os
import sys
import threading
import time

LLAMA = sys.argv[1:2] != ["serve"]
LOG = os.environ.get("FAKE_SERVE_LOG")
LOCK = threading.Lock()


def log(obj):
    if LOG:
        with LOCK, open(LOG, "a") as f:
            f.write(json.dumps(obj) + "\n")


def arg(name):
    i = sys.argv.index(name)
    return sys.argv[i + 1]


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def plain(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = True

    def do_GET(self):
        if self.path == ("/health" if LLAMA else "/ready"):
            self.plain(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self.plain(200, {"data": [{"id": "fake"}]})
        else:
            self.plain(404, {"error": {"message": "no " + self.path}})

    def event(self, obj):
        data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != ("/completion" if LLAMA else "/v1/completions"):
            self.plain(404, {"error": {"message": "no " + self.path}})
            return
        log({"server": "llama" if LLAMA else "stepd", "port": self.server.server_address[1], "body": body})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        n = body["n_predict"] if LLAMA else body["max_tokens"]
        if LLAMA and os.environ.get("FAKE_LLAMA_SHORT"):
            n -= 1
        toks = [(sum(body["prompt"]) + 7 * i) % 128896 for i in range(n)]
        flip = int(os.environ.get("FAKE_LLAMA_FLIP", "-1")) if LLAMA else -1
        if 0 <= flip < n:
            toks[flip] += 1
        step = int(os.environ.get("FAKE_LLAMA_CHUNK", "1")) if LLAMA else 1
        for i in range(0, n, step):
            time.sleep(float(os.environ.get("FAKE_TOKEN_MS", "1")) / 1000 * step)
            part = toks[i:i + step]
            if LLAMA:
                self.event({"index": 0, "content": "", "tokens": part, "stop": False, "tokens_predicted": i + len(part)})
            else:
                self.event({"choices": [{"index": 0, "text": "", "token_ids": part,
                                         "finish_reason": "length" if i + step >= n else None}]})
        if LLAMA:
            self.event({"index": 0, "content": "", "tokens": [], "stop": True, "tokens_predicted": n,
                        "stop_type": "limit"})
        else:
            self.event({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}})
            self.event(b"[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        self.close_connection = True


def main():
    log({"argv": sys.argv[1:]})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", int(arg("--port"))), Handler)
    srv.daemon_threads = True
    srv.serve_forever()


if __name__ == "__main__":
    main()
