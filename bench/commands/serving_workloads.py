"""What `sgl-kvq bench serving` sends and at which KV budgets: the workloads as flags of SGLang's load generator
(`python -m sglang.benchmark.serving`), the agentic workload's trace file, the KV tokens a workload holds at a
concurrency, and the two budget regimes (one where bf16's budget is the bottleneck at the top concurrency, one where it
is not), predicted from the model's shape with the same sizing rule the servers use (sgl_kvq/capacity.py), so no server
is needed to pick them."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

# Chat-template tokens the load generator's chat backend adds: SmolLM2's default system message once, and the role
# markers around every message. An upper bound, so a workload's token estimate never falls short.
TEMPLATE_TOKENS = 40
TEMPLATE_TOKENS_PER_MESSAGE = 8
# The generated-shared-prefix text is random tokens decoded to text and encoded again, which lands a few percent
# above its target length (SmolLM2: 269 tokens for a 256-token system prompt).
RETOKENIZE_SLACK = 1.1


@dataclass(frozen=True)
class Workload:
    name: str
    loadgen_args: tuple[str, ...]  # dataset and backend flags; server, concurrency and output flags are added per run
    conversations: int  # what --max-concurrency limits: requests, or whole multi-turn conversations
    tokens_per_conversation: int  # upper bound on one conversation's context when its last turn ends
    shared_tokens: int = 0  # of those, the prefix every conversation of its group shares (the system prompt)
    groups: int = 1
    turns: int = 1  # requests per conversation, where the load generator's per-request arrays list them turn by turn

    def peak_tokens(self, concurrency: int, shared: bool = False) -> int:
        """KV tokens `concurrency` conversations hold at their ends; shared=True counts each group's prefix once
        (the radix cache's saving), otherwise once per conversation (the bound a pool must hold to never wait)."""
        running = min(concurrency, self.conversations)
        if not shared:
            return running * self.tokens_per_conversation
        return min(running, self.groups) * self.shared_tokens + running * (self.tokens_per_conversation -
                                                                           self.shared_tokens)


def shared_prefix_workload(groups: int, prompts_per_group: int, turns: int, system_len: int, question_len: int,
                           output_len: int) -> Workload:
    """SGLang's generated-shared-prefix dataset, multi-turn: each conversation starts with its group's system prompt
    and asks `turns` questions, each answer appended to the next turn's history (so turns 2+ hit the radix cache).
    Multi-turn needs a chat backend in the load generator."""
    args = ("--backend", "sglang-oai-chat", "--dataset-name", "generated-shared-prefix",
            "--gsp-num-groups", str(groups), "--gsp-prompts-per-group", str(prompts_per_group),
            "--gsp-num-turns", str(turns), "--gsp-system-prompt-len", str(system_len),
            "--gsp-question-len", str(question_len), "--gsp-output-len", str(output_len))
    text = math.ceil(RETOKENIZE_SLACK * (system_len + turns * question_len))
    tokens = text + turns * output_len + TEMPLATE_TOKENS + 2 * turns * TEMPLATE_TOKENS_PER_MESSAGE
    return Workload("shared-prefix-multiturn", args, groups * prompts_per_group, tokens, system_len, groups)


def sharegpt_workload(dataset_path: Path, prompts: int, output_len: int, context_len: int) -> Workload:
    """SGLang's ShareGPT dataset: each conversation's first message as the prompt, a fixed output length, prompts
    longer than context_len - output_len dropped by the load generator itself."""
    args = ("--backend", "sglang", "--dataset-name", "sharegpt", "--dataset-path", str(dataset_path),
            "--num-prompts", str(prompts), "--sharegpt-output-len", str(output_len),
            "--sharegpt-context-len", str(context_len))
    return Workload("sharegpt", args, prompts, context_len)


def write_sharegpt_file(path: Path, records: int) -> Path:
    """The embedded ShareGPT data (bench.data, offline) as the ShareGPT-format JSON the load generator reads
    with --dataset-path; without a path it would download the dataset. The load generator shuffles with its seed and
    filters by length, so `records` only needs to be well above the prompts asked for."""
    from bench import data

    convs = [r for r in data.sharegpt() if len(r.get("conversations", [])) >= 2][:records]
    path.write_text(json.dumps([{"id": r.get("id", str(i)), "conversations": r["conversations"][:2]}
                                for i, r in enumerate(convs)]))
    return path


# The agentic trace: one agent's instructions open every conversation (so they are the prefix all share), and each
# turn's user message is a request (the start of a ShareGPT human message, at most AGENTIC_REQUEST_SHARE of the turn's
# tokens) followed by a document tool's output (essay text) filling the turn to its token count.
AGENTIC_SYSTEM_PROMPT = ("You are a research agent. Each user message holds a request and the output of the document "
                         "tool you called for it. Read the output, then answer the request briefly.")
AGENTIC_REQUEST_SHARE = 0.25
AGENTIC_TOOL_OPEN, AGENTIC_TOOL_CLOSE = "\n\n<tool_output>\n", "\n</tool_output>"
# The essays' first characters are the haystacks and perplexity texts of the evaluations (bench/data.py essay_text):
# the tool outputs start after them.
AGENTIC_ESSAY_SKIP_CHARS = 40_000


def agentic_workload(trace_path: Path, conversations: int, turns: int, turn_tokens: int, output_len: int) -> Workload:
    """SGLang's agentic-trace dataset over the trace write_agentic_trace wrote: `conversations` conversations replayed
    turn by turn, each turn's history the previous turns and the server's real replies (so turns 2+ hit the radix
    cache). The bound counts the system prompt's bytes (no byte-level BPE token is shorter than a byte), the turns'
    tokens with RETOKENIZE_SLACK (a reply re-encoded in the history need not be output_len tokens) and the template's.
    --output-details keeps the per-request arrays the per-turn cached shares are read from."""
    args = ("--backend", "sglang-oai-chat", "--dataset-name", "agentic-trace", "--dataset-path", str(trace_path),
            "--num-prompts", str(conversations), "--sharegpt-output-len", str(output_len),
            "--agentic-max-turns", str(turns), "--output-details")
    system = len(AGENTIC_SYSTEM_PROMPT.encode())
    tokens = (system + math.ceil(RETOKENIZE_SLACK * turns * (turn_tokens + output_len)) + TEMPLATE_TOKENS +
              2 * turns * TEMPLATE_TOKENS_PER_MESSAGE)
    return Workload("agentic", args, conversations, tokens, shared_tokens=system, turns=turns)


def write_agentic_trace(path: Path, tokenizer_dir: Path, conversations: int, turns: int, turn_tokens: int,
                        output_len: int = 32) -> Path:
    """An agentic trace (SGLang's agentic-trace JSON) from the embedded data, offline and deterministic: each
    conversation is the system prompt, then `turns` user messages of about `turn_tokens` tokens (the model's tokenizer)
    that each hold a ShareGPT request and the next chunk of essay text, so a conversation grows by a turn's tokens and a
    reply each turn. Conversations read consecutive essay text, so none shares another's; past the essays' end
    (SmolLM2: ~144k tokens) the text starts over, behind other requests, so still no conversation's prefix is another's
    beyond the system prompt.
    Each turn's prompt_tokens is the history's templated length with output_len-token replies (informational: the load
    generator sends the server's real replies)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tool = _TextStream(tok, _agentic_essay_text())
    requests = _agentic_requests(tok, conversations * turns, max(1, int(AGENTIC_REQUEST_SHARE * turn_tokens)))
    reply = _TextStream(tok, AGENTIC_SYSTEM_PROMPT * (output_len // 8 + 2)).take(output_len)
    trace = []
    for c in range(conversations):
        history, turns_out = [{"role": "system", "content": AGENTIC_SYSTEM_PROMPT}], []
        for t in range(turns):
            head = requests[c * turns + t] + AGENTIC_TOOL_OPEN
            fill = turn_tokens - _count(tok, head) - _count(tok, AGENTIC_TOOL_CLOSE)
            user = {"role": "user", "content": head + tool.take(max(1, fill)) + AGENTIC_TOOL_CLOSE}
            history.append(user)
            turns_out.append({"messages": history[:2] if t == 0 else [user],
                              "prompt_tokens": _chat_tokens(tok, history)})
            history.append({"role": "assistant", "content": reply})
        trace.append(turns_out)
    metadata = {"source": "sgl-kvq bench serving: ShareGPT requests and Paul Graham essays as tool outputs",
                "tokenizer": str(tokenizer_dir), "turns": turns, "turn_tokens": turn_tokens,
                "output_len_assumed": output_len, "essay_text_restarts": tool.restarts,
                "longest_context_tokens": max(c[-1]["prompt_tokens"] for c in trace) + output_len}
    path.write_text(json.dumps({"metadata": metadata, "conversations": trace}))
    return path


def _agentic_essay_text() -> str:
    from bench import data

    return data.essay_text()[AGENTIC_ESSAY_SKIP_CHARS:]


def _agentic_requests(tok, n: int, max_tokens: int) -> list[str]:
    """The first human message of n ShareGPT conversations, each cut to max_tokens at a token boundary."""
    from bench import data

    out = []
    for human in data.sharegpt_conversations(n, min_turns=1, max_turns=1):
        enc = tok(human[0], add_special_tokens=False, return_offsets_mapping=True)
        out.append(human[0] if len(enc.input_ids) <= max_tokens else human[0][:enc.offset_mapping[max_tokens][0]])
    return [r.strip() for r in out]


class _TextStream:
    """A text handed out in consecutive pieces of n tokens, cut at token boundaries; it starts over at its end."""

    def __init__(self, tok, text: str):
        self.text, self.starts = text, [a for a, _ in tok(text, add_special_tokens=False,
                                                          return_offsets_mapping=True).offset_mapping]
        self.pos = self.restarts = 0

    def take(self, n: int) -> str:
        if n >= len(self.starts):
            raise ValueError(f"{n} tokens asked of a text of {len(self.starts)}")
        if self.pos + n >= len(self.starts):
            self.pos, self.restarts = 0, self.restarts + 1
        a, self.pos = self.pos, self.pos + n
        return self.text[self.starts[a]:self.starts[self.pos]].strip()


def _count(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=False).input_ids)


def _chat_tokens(tok, messages: list[dict]) -> int:
    """The messages' tokens as the server's chat template lays them out for the next reply (the contents' tokens where
    the tokenizer has no template)."""
    if not tok.chat_template:
        return sum(_count(tok, m["content"]) for m in messages)
    return _count(tok, tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


@dataclass(frozen=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # the model's dtype name, e.g. "bfloat16"

    @classmethod
    def of(cls, model_dir: Path) -> "ModelShape":
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        heads = cfg["num_attention_heads"]
        return cls(cfg["num_hidden_layers"], cfg.get("num_key_value_heads", heads),
                   cfg.get("head_dim") or cfg["hidden_size"] // heads,
                   cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")

    def dense_bytes_per_token(self) -> int:
        import torch

        element = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return 2 * self.layers * self.kv_heads * self.head_dim * element


def predicted_pool(shape: ModelShape, dtype: str, budget_bytes: int, concurrency: int) -> dict:
    """What a server of `dtype` at `budget_bytes` will hold: its token capacity and the --max-running-requests to
    pass (the top concurrency, or the most the budget allows a kvq dtype: capacity.split_budget refuses more), or
    {"refused": why} where the budget cannot hold one request."""
    import torch

    from sgl_kvq.capacity import (config_pools, largest_fitting_requests, per_request_bytes, per_token_bytes,
                                  split_budget)
    from sgl_kvq.config import KVQConfigError, is_kvq_dtype, parse_kv_cache_dtype
    from bench.launch import baseline_page_size, has_gpu
    from sgl_kvq.pool_shape import PoolShape

    if not is_kvq_dtype(dtype):
        page = baseline_page_size()
        return {"capacity_tokens": budget_bytes // shape.dense_bytes_per_token() // page * page,
                "max_running_requests": concurrency}
    pool = PoolShape(layers=shape.layers, heads=shape.kv_heads, head_dim=shape.head_dim, num_pages=0,
                     cfg=parse_kv_cache_dtype(dtype))
    model_dtype = getattr(torch, shape.dtype)
    pooled = config_pools(pool, model_dtype)
    per_tok = per_token_bytes(pool, model_dtype, host_is_device=not has_gpu(), frames_pooled=pooled)
    per_req = per_request_bytes(pool, model_dtype, frames_pooled=pooled)
    # pooled frames alone (nothing per slot): any value is honoured, admission charges each request's frames
    largest = concurrency if not per_req else largest_fitting_requests(
        budget_bytes, per_req, per_tok, shape.dense_bytes_per_token(), pool.cfg.overlay_share)
    try:
        split = split_budget(budget_bytes, pool, model_dtype, host_is_device=not has_gpu(),
                             requested=max(1, min(concurrency, largest)))
    except KVQConfigError as e:
        return {"refused": str(e)}
    return {"capacity_tokens": split.tokens, "max_running_requests": split.max_running_requests,
            "frame_tokens": split.frame_tokens}


def bottleneck_budget(shape: ModelShape, workloads: list[Workload], concurrency: int, margin: float = 0.1) -> int:
    """The smallest KV budget (plus `margin`) at which kivi2 holds every workload's tokens at `concurrency`, each
    conversation's prefix counted separately, and the fp16 frames of `concurrency` running requests: there kivi2
    never has to wait for memory, while bf16, at 6.4x the bytes per token, holds about a sixth of that and must
    queue or retract."""
    need = max(w.peak_tokens(concurrency) for w in workloads)
    budget = math.ceil(need * shape.dense_bytes_per_token() / 6)  # a first guess below the answer
    while True:
        pool = predicted_pool(shape, "kivi2", budget, concurrency)
        frames = concurrency * pool.get("frame_tokens", 0)
        if pool.get("capacity_tokens", 0) >= need + frames and pool.get("max_running_requests", 0) >= concurrency:
            break
        budget = math.ceil(budget * 1.02)
    return math.ceil(budget * (1 + margin))


def generous_budget(shape: ModelShape, workloads: list[Workload], concurrency: int, headroom: float = 2.0) -> int:
    """A KV budget where bf16 holds `headroom` times every workload's tokens at `concurrency`: memory binds nobody."""
    need = max(w.peak_tokens(concurrency) for w in workloads)
    return math.ceil(headroom * need * shape.dense_bytes_per_token())
