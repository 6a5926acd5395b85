#!/usr/bin/env python3
"""gen-request-corpus.py [DIR] - the seed corpus of fuzz-request: GenerateRequest messages as
a client sends them (one serialized message per file), valid and invalid, covering every
input kind and every field request_from_proto() and request_validate() look at.  Written
once into test/daemon/corpus/request (committed); run again after the proto changes."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stepd_harness as h  # noqa: E402  (the stubs)
from test_media import png  # noqa: E402

pb = h.pb
SP = pb.SamplingParams
T = lambda *ids: pb.TokenIds(ids=list(ids) or [1, 2, 3])  # noqa: E731
MSG = pb.ChatMessage
TOOL = ('[{"type":"function","function":{"name":"get_weather","description":"the weather",'
        '"parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}]')


def chat(*msgs, **kw):
    return pb.ChatInput(messages=list(msgs) or [MSG(role="user", content="Hi")], **kw)


CASES = {
    "tokens": pb.GenerateRequest(token_ids=T(), sampling_params=SP(max_tokens=8)),
    "tokens-id": pb.GenerateRequest(request_id="client-1", token_ids=T(5, 6, 7), priority=-2),
    "tokens-out-of-vocab": pb.GenerateRequest(token_ids=T(1, 4000, -1)),
    "text": pb.GenerateRequest(text="In the beginning", sampling_params=SP(max_tokens=16, temperature=0.7)),
    "text-empty": pb.GenerateRequest(text=""),
    "text-blank": pb.GenerateRequest(text=" \t\n"),
    "sampling-all": pb.GenerateRequest(token_ids=T(), sampling_params=SP(
        temperature=0.8, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5,
        frequency_penalty=0.3, max_tokens=32, min_tokens=2, seed=7, logprobs=5, ignore_eos=True, n=1,
        skip_special_tokens=False, include_stop_str_in_output=True)),
    "top-k-disabled": pb.GenerateRequest(token_ids=T(), sampling_params=SP(top_k=-1)),
    "top-k-bad": pb.GenerateRequest(token_ids=T(), sampling_params=SP(top_k=-3)),
    "temperature-nan": pb.GenerateRequest(token_ids=T(), sampling_params=SP(temperature=float("nan"))),
    "top-p-zero": pb.GenerateRequest(token_ids=T(), sampling_params=SP(top_p=0.0)),
    "max-tokens-huge": pb.GenerateRequest(token_ids=T(), sampling_params=SP(max_tokens=1 << 30)),
    "n-two": pb.GenerateRequest(token_ids=T(), sampling_params=SP(n=2)),
    "stop-strings": pb.GenerateRequest(text="x", sampling_params=SP(stop=["\n\n", "END"], stop_token_ids=[1, 2])),
    "stop-with-tokens": pb.GenerateRequest(token_ids=T(), sampling_params=SP(stop=["a"])),
    "logit-bias": pb.GenerateRequest(token_ids=T(), sampling_params=SP(logit_bias={5: 1.5, 9: -100.0})),
    "logit-bias-bad": pb.GenerateRequest(token_ids=T(), sampling_params=SP(logit_bias={-5: 1.0})),
    "spec-tokens": pb.GenerateRequest(token_ids=T(), num_speculative_tokens=2),
    "spec-tokens-bad": pb.GenerateRequest(token_ids=T(), num_speculative_tokens=9),
    "model": pb.GenerateRequest(token_ids=T(), model="tiny-step"),
    "model-other": pb.GenerateRequest(token_ids=T(), model="other\n<3>stepd: x"),
    "request-id-bad": pb.GenerateRequest(token_ids=T(), request_id="has space"),
    "cache-salt": pb.GenerateRequest(token_ids=T(), cache_salt="tenant-a"),
    "stream-options": pb.GenerateRequest(token_ids=T(), stream_options=pb.StreamOptions(
        include_token_ids=True, continuous_usage_stats=True)),
    "chat": pb.GenerateRequest(chat=chat(MSG(role="system", content="Be brief."), MSG(role="user", content="Hi"))),
    "chat-effort": pb.GenerateRequest(chat=chat(reasoning_effort="high")),
    "chat-effort-bad": pb.GenerateRequest(chat=chat(reasoning_effort="extreme")),
    "chat-role-bad": pb.GenerateRequest(chat=chat(MSG(role="robot", content="x"))),
    "chat-tools": pb.GenerateRequest(chat=chat(tools_json=TOOL)),
    "chat-tools-not-list": pb.GenerateRequest(chat=chat(tools_json='{"a":1}')),
    "chat-tools-numbers": pb.GenerateRequest(chat=chat(tools_json='[1,2]')),
    "chat-tools-empty-object": pb.GenerateRequest(chat=chat(tools_json='[{}]')),
    "chat-tools-name-number": pb.GenerateRequest(chat=chat(tools_json='[{"type":"function","function":{"name":5}}]')),
    "chat-tool-call": pb.GenerateRequest(chat=chat(
        MSG(role="user", content="weather?"),
        MSG(role="assistant", content="", reasoning_content="look it up",
            tool_calls=[pb.ToolCall(id="c1", type="function", name="get_weather", arguments_json='{"city":"x"}')]),
        MSG(role="tool", content="sunny", tool_call_id="c1"), tools_json=TOOL)),
    "chat-no-generation-prompt": pb.GenerateRequest(chat=chat(add_generation_prompt=False)),
    "chat-template-kwargs": pb.GenerateRequest(chat=chat(chat_template_kwargs_json='{"enable_thinking":false}')),
    "chat-template-kwargs-bad": pb.GenerateRequest(chat=chat(chat_template_kwargs_json='[1')),
    "chat-empty": pb.GenerateRequest(chat=pb.ChatInput()),
    "no-input": pb.GenerateRequest(),
    "images": pb.GenerateRequest(text="Look <im_patch>", images=[pb.ImageInput(data=png(8, 6))]),
    "images-chat": pb.GenerateRequest(chat=chat(MSG(role="user", content="<im_patch><im_patch>")),
                                      images=[pb.ImageInput(data=png(8, 6)), pb.ImageInput(data=png(3, 40))]),
    "images-bad": pb.GenerateRequest(text="<im_patch>", images=[pb.ImageInput(data=png(8, 6)[:40])]),
    "images-wire": pb.GenerateRequest(token_ids=T(), images=[pb.ImageInput(sha256=bytes(32), token_ids=[1])]),
}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                             "corpus", "request")
    os.makedirs(out, exist_ok=True)
    for i, (name, msg) in enumerate(sorted(CASES.items())):
        with open(os.path.join(out, "%02d-%s.pb" % (i, name)), "wb") as f:
            f.write(msg.SerializeToString())
    print("%d messages in %s" % (len(CASES), out))


if __name__ == "__main__":
    main()
