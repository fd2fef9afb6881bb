"""Routing replay on a packed tree: a mixture-of-experts model trains on the experts the inference engine chose.

    python examples/moe_router_replay.py

1. a tiny random-weight Qwen3-MoE, built here;
2. an "engine": each call runs the model unpacked and records the experts every MoE layer chose for every token
   (prompt and generated), then perturbs a few of them, as a real engine's batch-dependent numerics flip near-ties;
   so a token seen by two calls (a GRPO group's shared prompt, an agent's turn re-read by its next call) has two
   route sets;
3. writes the calls as pre-tokenized JSONL with their ``routes`` (the agent's first call as vLLM returns them: its last
   token unrouted) and packs them with ``treepack pack``: tokens are shared only where their routes agree too, so the
   tree splits where a shared prefix was routed differently, the micro-batch carries the routes per node, and
   ``PackedDataset`` puts them in ``batch.routes``: every call replays exactly its own routes;
4. one training step packed (tree attention, ``packed_logprobs(routes=...)``, ``packed_loss`` with the router's
   load-balancing loss) and the same step unpacked (each call alone, stock attention, replaying its own routes).

The last line is JSON: the largest differences between the two runs of the per-token logprobs, the load-balancing
loss, the loss and every parameter's gradient (float32 rounding: about 1e-6 or less) and of the weights after an SGD
step, the token and node counts, and the control: how far the packed logprobs are from the unpacked run's when the
routes are not replayed (the router's own top-k), after the step.

Needs torch and transformers (``node scripts/python-env.mjs`` makes a .venv with them) and the built CLI and C core
(``npm install`` builds them).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The installed package (`pip install ./python`) when there is one, else this checkout's sources.
if importlib.util.find_spec("treepack") is None:
    sys.path.insert(0, os.path.join(ROOT, "python"))

import torch  # noqa: E402
import transformers  # noqa: E402
import treepack  # noqa: E402
import treepack.torch as tpt  # noqa: E402  (registers attn_implementation "treepack")

VOCAB = 128
AUX_COEF = 0.01
CONFIG = {"clip_low": 0.2, "clip_high": 0.28, "aggregation": "token-mean"}


def make_model() -> torch.nn.Module:
    """A 2-layer Qwen3-MoE, 8 experts, 2 per token."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight"):  # the init's zeros would make every route a tie
            p.data.normal_(0.0, 0.5)
    return model


def engine_routes(model: torch.nn.Module, tokens: list[int], rng: random.Random, flip: float = 0.02) -> torch.Tensor:
    """int64 [MoE layers, len(tokens), k]: the experts the model picks for the call's tokens, run alone (as an engine
    serves one request), with a fraction ``flip`` of the (layer, token) choices replaced by other experts."""
    with torch.no_grad(), tpt.replay_routes(model) as routing:
        model(torch.tensor([tokens]))
    routes = routing.experts()
    L, T, k = routes.shape
    E = model.config.num_experts
    for layer in range(L):
        for t in range(T):
            if rng.random() < flip:
                others = [e for e in range(E) if e not in routes[layer, t].tolist()]
                routes[layer, t, rng.randrange(k)] = rng.choice(others)
    return routes


def calls(rng: random.Random) -> tuple[list[list[int]], list[list[int]], list[float]]:
    """Token ids, loss masks and rewards of the calls: a GRPO group of 3 answers to one prompt, and a 2-call agent
    episode whose second call re-reads the first call's prompt and answer (plus a tool result, masked)."""
    tok = lambda n: [rng.randrange(2, VOCAB) for _ in range(n)]  # noqa: E731
    seqs, masks, rewards = [], [], []
    prompt = tok(24)
    for _ in range(3):
        answer = tok(rng.randrange(6, 14))
        seqs.append(prompt + answer)
        masks.append([0] * len(prompt) + [1] * len(answer))
        rewards.append(float(rng.random() < 0.5))
    first_prompt, first_answer, tool, second_answer = tok(16), tok(8), tok(5), tok(10)
    seqs.append(first_prompt + first_answer)
    masks.append([0] * 16 + [1] * 8)
    seqs.append(first_prompt + first_answer + tool + second_answer)
    masks.append([0] * 16 + [1] * 8 + [0] * 5 + [1] * 10)
    rewards += [1.0, 1.0]
    return seqs, masks, rewards


def pack(
    seqs: list[list[int]], masks: list[list[int]], advantages: list[float], routes: list[list[Any]], directory: str
) -> tpt.PackedBatch:
    """The calls through ``treepack pack`` (JSONL with ``routes`` [T][MoE layers][k]); the one micro-batch it writes."""
    cli = os.path.join(ROOT, "dist", "src", "cli", "main.js")
    if not os.path.exists(cli):
        sys.exit(f"{cli} not found: run `npm install` (it builds the CLI) first")
    data, out = os.path.join(directory, "calls.jsonl"), os.path.join(directory, "packed")
    with open(data, "w") as f:
        for i, (tokens, mask, adv, r) in enumerate(zip(seqs, masks, advantages, routes)):
            f.write(json.dumps({"id": f"call{i}", "tokens": tokens, "loss_mask": mask, "advantage": adv, "routes": r}) + "\n")
    subprocess.run(["node", cli, "pack", data, "--out", out, "--advantages", "none", "--quiet"], check=True)
    (batch,) = list(tpt.PackedDataset(out))
    return batch


def packed_step(model: torch.nn.Module, batch: tpt.PackedBatch) -> tuple[torch.Tensor, dict]:
    """Per-occurrence logprobs [M] and the metrics of one packed step (gradients left in the parameters)."""
    scores = tpt.packed_logprobs(model, batch, nodes="all")  # replays batch.routes
    loss, metrics = tpt.packed_loss(scores.logprobs, batch, CONFIG, router=scores.router, aux_coef=AUX_COEF)
    loss.backward()
    return tpt.gather_occurrences(scores.logprobs, batch).detach(), metrics


def unpacked_logprobs(model: torch.nn.Module, batch: tpt.PackedBatch, routes: list[torch.Tensor], with_router: bool = False) -> Any:
    """Per-occurrence logprobs [M] (NaN at t = 0), each call alone through the model's own forward replaying its
    own routes; with ``with_router`` also the router outputs of the unpacked batch (calls concatenated)."""
    lps, logits, experts = [], [], []
    for i, r in enumerate(routes):
        a, b = int(batch.seq_offsets[i]), int(batch.seq_offsets[i + 1])
        ids = batch.input_ids[batch.seq_positions[a:b]]
        with tpt.replay_routes(model, r) as routing:
            out = model(ids[None], use_cache=False).logits[0, :-1].float()
        lps.append(torch.cat([out.new_full((1,), float("nan")), out.log_softmax(-1).gather(1, ids[1:, None])[:, 0]]))
        logits.append(routing.logits)
        experts.append(routing.experts())
    if not with_router:
        return torch.cat(lps)
    return torch.cat(lps), tpt.RouterOutputs(tuple(torch.cat(x) for x in zip(*logits)), torch.cat(experts, dim=1), routing.kinds, AUX_COEF)


def unpacked_step(model: torch.nn.Module, batch: tpt.PackedBatch, routes: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """The same step with each call alone through the model's own forward, replaying its own routes; the loss over
    the unpacked batch (every occurrence its own node, in call order)."""
    lp, router = unpacked_logprobs(model, batch, routes, with_router=True)
    loss, metrics = tpt.packed_loss(lp, tpt.naive_batch(batch), CONFIG, router=router)
    loss.backward()
    return lp.detach(), metrics


def main() -> None:
    rng = random.Random(0)
    model = make_model()
    seqs, masks, rewards = calls(rng)
    routes = [engine_routes(model, s, rng) for s in seqs]  # each call routed by the engine anew
    # The agent's first call as vLLM returns it: its last token (never fed back) unrouted; replayed as -1, i.e. the
    # router's own top-k, packed and unpacked alike.
    given = [r.transpose(0, 1).tolist() for r in routes]
    given[3] = given[3][:-1]
    routes[3][:, -1] = -1
    mean = sum(rewards) / len(rewards)
    with tempfile.TemporaryDirectory() as directory:
        batch = pack(seqs, masks, [r - mean for r in rewards], given, directory)
    order = {f"call{i}": r for i, r in enumerate(routes)}
    routes = [order[sid] for sid in batch.meta["sequence_ids"]]  # in the micro-batch's sequence order
    with torch.no_grad():  # on-policy: the old logprobs are the current model's
        batch.old_logprobs = tpt.gather_occurrences(tpt.packed_logprobs(model, batch, nodes="all").logprobs, batch).float()
    trie_nodes = len(treepack.pack_sequences(seqs).input_ids)

    plain = copy.deepcopy(model)
    model.set_attn_implementation("treepack")
    plain.set_attn_implementation("sdpa")
    lp_packed, m_packed = packed_step(model, batch)
    lp_plain, m_plain = unpacked_step(plain, batch, routes)

    t = batch.token_index > 0
    grads = max(float((p.grad - q.grad).abs().max()) for p, q in zip(model.parameters(), plain.parameters()))
    for m in (model, plain):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    weights = max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), plain.parameters()))
    with torch.no_grad():  # the control: the same packed forward without the routes (the router's own top-k)
        batch.routes = None
        lp_own = tpt.gather_occurrences(tpt.packed_logprobs(model.requires_grad_(False), batch, nodes="all").logprobs, batch)
        lp_after = unpacked_logprobs(plain, batch, routes)
    result = {
        "calls": batch.num_sequences,
        "tokens": batch.num_occurrences,
        "nodes_token_trie": trie_nodes,
        "nodes_route_split": batch.num_nodes,
        "aux_loss": m_packed["aux_loss"],
        "max_diff_logprobs": float((lp_packed[t] - lp_plain[t]).abs().max()),
        "max_diff_aux_loss": abs(m_packed["aux_loss"] - m_plain["aux_loss"]),
        "max_diff_loss": abs(m_packed["loss"] - m_plain["loss"]),
        "max_diff_gradients": grads,
        "max_diff_weights_after_step": weights,
        "without_replay_max_diff_logprobs": float((lp_own[t] - lp_after[t]).abs().max()),
    }
    print(
        f"{batch.num_sequences} calls, {batch.num_occurrences} tokens: {trie_nodes} nodes sharing by tokens alone, {batch.num_nodes} "
        "with the tree split where the calls' routes differ"
    )
    print(
        f"packed step with replay: loss {m_packed['loss']:.6f} (aux {m_packed['aux_loss']:.6f}); unpacked: {m_plain['loss']:.6f} "
        f"(aux {m_plain['aux_loss']:.6f})"
    )
    print(f"without replay the packed logprobs would be off by up to {result['without_replay_max_diff_logprobs']:.3g}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
