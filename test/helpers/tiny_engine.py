"""A small OpenAI-compatible inference engine for the gateway tests, on real parts: a tiny random-weight Qwen3
model (transformers, CPU), Qwen3's tokenizer and chat template (transformers' own rendering), sampling with
torch, and vLLM's extensions: `return_token_ids` (top-level `prompt_token_ids`, per-choice `token_ids`) and
OpenAI `logprobs` (the model's log-softmax at each generated token). Streaming answers in SSE chunks of one
token, as vLLM does.

Sampling is restricted to whole-word tokens (" word": one pre-token that encodes back to itself) and the
end-of-turn token, so the text of a reply re-tokenizes to the ids sampled (a random model would otherwise write
byte soup whose re-tokenization differs, which is a test of its own: `--drift` renders prompts with a stray
space so the gateway's template check must fail). A call whose `tool_choice` names a function answers with a
call of it, the argument text sampled, the JSON frame forced (like guided decoding).

Every generation is appended to `--log` (JSONL: prompt_token_ids, token_ids, logprobs) so a test can compare
what the gateway recorded with what the engine produced.
"""

import argparse
import json
import re
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("--port", type=int, required=True)
ap.add_argument("--tokenizer", required=True)
ap.add_argument("--log", required=True)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--drift", action="store_true")
ap.add_argument("--no-ids", action="store_true", help="answer without token ids and logprobs, as a plain OpenAI server")
args = ap.parse_args()

torch.manual_seed(args.seed)
tok = AutoTokenizer.from_pretrained(args.tokenizer)
cfg = Qwen3Config(
    vocab_size=151936,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
model = Qwen3ForCausalLM(cfg).eval()
EOS = tok.convert_tokens_to_ids("<|im_end|>")
WORD = re.compile(r"^ [a-z]{2,8}$")
allowed = [i for i in range(len(tok)) if WORD.match(tok.decode([i])) and tok.encode(tok.decode([i]), add_special_tokens=False) == [i]]
mask = torch.full((cfg.vocab_size,), float("-inf"))
mask[allowed] = 0.0
lock = threading.Lock()
gen = torch.Generator().manual_seed(args.seed)


def sample_words(ids, n):
    """n sampled word tokens after `ids`: (token ids, logprobs under the full distribution)."""
    out, lps = [], []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids + out]), logits_to_keep=1).logits[0, -1].float()
        lp = torch.log_softmax(logits, -1)
        t = int(torch.multinomial(torch.softmax(logits + mask, -1), 1, generator=gen))
        out.append(t)
        lps.append(float(lp[t]))
    return out, lps


def forced(ids, prefix, forced_ids):
    """logprobs of tokens that were forced after ids + prefix."""
    lps = []
    for k, t in enumerate(forced_ids):
        with torch.no_grad():
            logits = model(torch.tensor([ids + prefix + forced_ids[:k]]), logits_to_keep=1).logits[0, -1].float()
        lps.append(float(torch.log_softmax(logits, -1)[t]))
    return lps


def generate(prompt_ids, max_tokens, tool):
    """Generated ids, logprobs, and the parsed message parts."""
    n = max(1, min(max_tokens, 12) - 1)
    with lock:
        if tool is None:
            words, lps = sample_words(prompt_ids, n)
            lps += forced(prompt_ids, words, [EOS])
            return words + [EOS], lps, tok.decode(words), None
        head = tok.encode('<tool_call>\n{"name": "' + tool + '", "arguments": {"query": "', add_special_tokens=False)
        head_lps = forced(prompt_ids, [], head)
        words, lps = sample_words(prompt_ids + head, n)
        tail = tok.encode('"}}\n</tool_call>', add_special_tokens=False) + [EOS]
        tail_lps = forced(prompt_ids, head + words, tail)
        ids = head + words + tail
        return ids, head_lps + lps + tail_lps, None, {"query": tok.decode(words)}


def log(entry):
    with lock, open(args.log, "a") as f:
        f.write(json.dumps(entry) + "\n")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def send_json(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            return self.send_json(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})
        self.send_json(404, {"error": {"message": "not found"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        chat = self.path == "/v1/chat/completions"
        if not chat and self.path != "/v1/completions":
            return self.send_json(404, {"error": {"message": "not found"}})
        tool = None
        if chat:
            tc = body.get("tool_choice")
            if isinstance(tc, dict):
                tool = tc["function"]["name"]
            # As vLLM does: a tool-calling assistant turn's null content is rendered as empty text.
            messages = [{**m, "content": m.get("content") or ""} for m in body["messages"]]
            text = tok.apply_chat_template(messages, tools=body.get("tools"), add_generation_prompt=True, tokenize=False)
            if args.drift:
                text = text.replace("<|im_start|>user\n", "<|im_start|>user\n ", 1)
        else:
            text = body["prompt"]
        prompt_ids = tok.encode(text, add_special_tokens=False)
        ids, lps, content, call_args = generate(prompt_ids, int(body.get("max_tokens") or 8), tool)
        log({"prompt_token_ids": prompt_ids, "token_ids": ids, "logprobs": lps})
        want_ids = body.get("return_token_ids") and not args.no_ids
        # chat: logprobs true; completions: an int, where 0 still means the sampled token's logprob (vLLM)
        want_lp = body.get("logprobs") is not None and body.get("logprobs") is not False and not args.no_ids
        rid = "cmpl-" + uuid.uuid4().hex
        calls = None
        if call_args is not None:
            calls = [
                {"id": "call_" + uuid.uuid4().hex[:8], "type": "function", "function": {"name": tool, "arguments": json.dumps(call_args)}}
            ]
        finish = "tool_calls" if calls else "stop"
        if not body.get("stream"):
            choice = {"index": 0, "finish_reason": finish}
            if chat:
                choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls or []}
                if want_lp:
                    choice["logprobs"] = {
                        "content": [{"token": tok.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []} for t, lp in zip(ids, lps)]
                    }
            else:
                choice["text"] = tok.decode(ids[:-1])
                if want_lp:
                    choice["logprobs"] = {
                        "tokens": [tok.decode([t]) for t in ids],
                        "token_logprobs": lps,
                        "top_logprobs": None,
                        "text_offset": [],
                    }
            if want_ids:
                choice["token_ids"] = ids
                if not chat:
                    choice["prompt_token_ids"] = prompt_ids
            out = {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": "tiny",
                "choices": [choice],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids), "total_tokens": len(prompt_ids) + len(ids)},
            }
            if want_ids and chat:
                out["prompt_token_ids"] = prompt_ids
            return self.send_json(200, out)
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()

        def event(obj):
            data = ("data: " + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n\n").encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        obj = "chat.completion.chunk" if chat else "text_completion"
        for k, (t, lp) in enumerate(zip(ids, lps)):
            last = k == len(ids) - 1
            choice = {"index": 0, "finish_reason": finish if last else None}
            if chat:
                delta = {}
                if k == 0:
                    delta["role"] = "assistant"
                if calls is None and not last:
                    delta["content"] = tok.decode([t])
                if calls is not None and last:
                    delta["tool_calls"] = [{"index": 0, **calls[0]}]
                choice["delta"] = delta
                if want_lp:
                    choice["logprobs"] = {"content": [{"token": tok.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}]}
            else:
                choice["text"] = "" if last else tok.decode([t])
                if want_lp:
                    choice["logprobs"] = {"tokens": [tok.decode([t])], "token_logprobs": [lp], "top_logprobs": None, "text_offset": []}
            if want_ids:
                choice["token_ids"] = [t]
            chunk = {"id": rid, "object": obj, "created": int(time.time()), "model": "tiny", "choices": [choice]}
            if k == 0 and want_ids:
                if chat:
                    chunk["prompt_token_ids"] = prompt_ids
                else:
                    choice["prompt_token_ids"] = prompt_ids
            event(chunk)
        event("[DONE]")
        self.wfile.write(b"0\r\n\r\n")


srv = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
print(json.dumps({"ready": True, "port": args.port, "allowed": len(allowed)}), flush=True)
srv.serve_forever()
