"""SGLang's /generate protocol: requests parsed and validated, responses shaped as SGLang's."""

from __future__ import annotations

import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlrecipe.rollout.sglang.versions import NEWEST, Dialect
from rlrecipe.serve.adapters import AdapterRefused


class Served(Protocol):
    """What of the scheduler a request is checked against: its tokenizer, vocabulary, context and
    rules, and its weights' prompt log-probs."""

    tokenizer: Any
    vocab_size: int
    context_len: int
    rules: Dialect
    weights: Any
    adapters: Any

# SGLang 0.5.23's sampling_params (its api/v1 SamplingParams): any other key is refused with 400, as
# there; those this server does not implement are refused unless they have their neutral value.
SAMPLING_KEYS = ("max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
                 "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
                 "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
                 "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
                 "custom_params", "beam_width", "watermark", "choice")
NOT_IMPLEMENTED = ("stop_regex", "json_schema", "regex", "ebnf", "structural_tag", "logit_bias", "custom_params",
                   "beam_width", "watermark", "choice")


# Parallel samples of one prompt (`sampling_params.n`) and samples of one request in all (prompts x n):
# above these a request is refused with 400 (SGLang sets no limit; here one request must not fill the
# queue of a CPU server for minutes).
MAX_N = 256
MAX_SAMPLES_PER_REQUEST = 8192


class BadRequest(Exception):
    pass


class TooLarge(Exception):
    """A request body over the route's bound: 413, its body left unread."""


def _integer(sp: dict, key: str, default: int) -> int:
    """An integer sampling parameter (an integral float such as 16.0 too); 400 for anything else,
    1e400 (infinity) and NaN included."""
    value = sp.get(key, default)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"sampling_params.{key} must be an integer, not {value!r}")
    return value


@dataclass(eq=False)
class GenRequest:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_ids: frozenset[int]
    return_logprob: bool
    return_text_in_logprobs: bool
    skip_special_tokens: bool
    no_stop_trim: bool
    stop_strs: tuple[str, ...] = ()
    input_logprobs: list = field(default_factory=list)  # input_token_logprobs (logprob_start_len >= 0)
    ignore_eos: bool = False  # throughput tests: run to max_new_tokens (the engine stops at eos; the next chunk goes on)
    lora: str | None = None  # the adapter it names (lora_path; --enable-lora)
    chunks: int = 0  # decoding chunks it has had (the scheduler serves the fewest first)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict | None = None
    abort: bool = False
    arrived: float = field(default_factory=time.time)
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def key(self) -> tuple:
        """Requests decoded together share their sampling and their adapter."""
        return (self.temperature, self.top_p, self.top_k, self.lora)

    def finish_with(self, reason: dict) -> None:
        self.finish = reason
        self.done.set()


def health_probe(kind: str = "HEALTH_CHECK") -> GenRequest:
    """The one-token greedy request SGLang's /health_generate (and warm-up) runs: input_ids [0]."""
    return GenRequest(rid=f"{kind}_{uuid.uuid4().hex}", input_ids=[0], max_new_tokens=1, temperature=0.0, top_p=1.0,
                      top_k=0, stop_ids=frozenset(), return_logprob=False, return_text_in_logprobs=False,
                      skip_special_tokens=True, no_stop_trim=False)


# the SGLang version whose rules `rlrecipe serve` follows by default: the newest in the pin
RULES = Dialect(NEWEST)


class UnknownField(BadRequest):
    """A key SGLang's contract does not know: 400 with {"error": "unknown field ..."}, as SGLang."""


def max_input_len(context_len: int) -> int:
    """SGLang's max_req_input_len without a KV-cache limit: (context - 1) - 5; inputs of this many
    tokens or more are refused."""
    return context_len - 6


class ServerError(Exception):
    """What SGLang answers with HTTP 500: a TypeError from SamplingParams(**keys) before 0.5.22."""


def parse_sampling(sp: dict | None, context_len: int, n_input: int, rules: Dialect = RULES) -> dict:
    sp = dict(sp or {})
    known = [k for k in SAMPLING_KEYS if k != "sampling_seed" or rules.sampling_seed]
    unknown = sorted(set(sp) - set(known))
    if unknown and rules.version is not None and rules.version < (0, 5, 22):
        raise ServerError(f"SamplingParams.__init__() got an unexpected keyword argument '{unknown[0]}'")
    if unknown:
        raise UnknownField(f"unknown field `{unknown[0]}`, expected one of " + ", ".join(f"`{k}`" for k in known))
    for k in NOT_IMPLEMENTED:
        if sp.get(k) not in (None, {}, []):
            raise BadRequest(f"sampling_params.{k} is not supported by rlrecipe serve")
    stop = sp.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and all(isinstance(x, str) and x for x in stop)):
        raise BadRequest("sampling_params.stop must be a string or a list of non-empty strings")
    if sp.get("min_new_tokens"):
        raise BadRequest("sampling_params.min_new_tokens is not supported by rlrecipe serve")
    n = sp.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise BadRequest(f"sampling_params.n must be an integer from 1 to {MAX_N}")
    for k, neutral in (("min_p", 0.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0),
                       ("repetition_penalty", 1.0)):
        if sp.get(k, neutral) != neutral:
            raise BadRequest(f"sampling_params.{k} is not supported by rlrecipe serve")
    temperature = float(sp.get("temperature", 1.0))
    top_p = float(sp.get("top_p", 1.0))
    top_k = _integer(sp, "top_k", -1)
    if not 0 <= temperature < math.inf or not 0 < top_p <= 1 or (top_k < 1 and top_k != -1):  # NaN fails too
        raise BadRequest(f"bad sampling_params: temperature={temperature} top_p={top_p} top_k={top_k} "
                         "(top_k must be -1 (off) or >= 1)")
    max_new = _integer(sp, "max_new_tokens", 128)
    if max_new < 0:
        raise BadRequest("sampling_params.max_new_tokens must be >= 0")
    # as SGLang 0.5.23 without --allow-auto-truncate: a request that cannot fit is refused, not shortened
    if n_input >= max_input_len(context_len):
        raise BadRequest(f"Input length ({n_input} tokens) exceeds the maximum allowed length "
                         f"({max_input_len(context_len)} tokens).")
    if n_input + max_new > context_len or (n_input + max_new == context_len and not rules.full_context):
        raise BadRequest(f"Requested token count exceeds the model's maximum context length of {context_len} "
                         f"tokens: {n_input} input + {max_new} new.")
    # exactly at the context it is accepted, one token short (SGLang's max_req_len is context - 1)
    max_new = min(max_new, context_len - 1 - n_input)
    return {"max_new_tokens": max_new, "temperature": temperature, "top_p": top_p,
            "top_k": 0 if top_k == -1 else top_k, "stop_ids": frozenset(int(t) for t in sp.get("stop_token_ids") or []),
            "skip_special_tokens": bool(sp.get("skip_special_tokens", True)),
            "no_stop_trim": bool(sp.get("no_stop_trim", False)), "stop_strs": tuple(stop), "n": n,
            "ignore_eos": bool(sp.get("ignore_eos", False))}



def _as_list(value, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"{name}: {len(value)} entries for a batch of {n}")
        return value
    return [value] * n


def _prompts(body: dict, sched: Served) -> tuple[list, bool]:
    """The prompts of a /generate body as token-id lists (not yet checked), and whether it was a batch."""
    ids, text = body.get("input_ids"), body.get("text")
    if (ids is None) == (text is None):
        raise BadRequest("give exactly one of input_ids or text")
    if ids is not None:
        if not isinstance(ids, list):
            raise BadRequest("input_ids must be a list of integers or a list of such lists")
        batch = bool(ids) and isinstance(ids[0], list)
        return (ids if batch else [ids]), batch
    batch = isinstance(text, list)
    if not all(isinstance(s, str) for s in (text if batch else [text])):
        raise BadRequest("text must be a string or a list of strings")
    return [sched.tokenizer.encode(s) for s in (text if batch else [text])], batch


def _rids(rid, n: int, batch: bool) -> list:
    if isinstance(rid, list):
        return _as_list(rid, n, "rid")
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    return [str(rid)] if not batch else [f"{rid}_{i}" for i in range(n)]


def _adapters(body: dict, n: int, sched: Served) -> list:
    """Each prompt's lora_path, every adapter named resolved first (as SGLang does before it runs)."""
    loras = _as_list(body.get("lora_path"), n, "lora_path")
    for name in dict.fromkeys(loras):
        if name is not None and not isinstance(name, str):
            raise BadRequest("lora_path must be a string, or a list of them (one per prompt)")
        try:
            sched.adapters.check(name)
        except AdapterRefused as err:
            raise BadRequest(str(err)) from None
    return loras


def _checked_ids(seq, vocab_size: int) -> list[int]:
    if not isinstance(seq, list) or not seq or not all(isinstance(t, int) and not isinstance(t, bool) for t in seq):
        raise BadRequest("input_ids must be non-empty lists of integers")
    if not all(0 <= t < vocab_size for t in seq):
        bad = next(t for t in seq if not 0 <= t < vocab_size)
        raise BadRequest(f"input_ids: token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
    return seq


def _prompt_logprobs(seq: list[int], prompt_from: int, n: int, lora, sched: Served) -> list:
    """SGLang's input_token_logprobs: from logprob_start_len on, the first token's null; from the raw
    logits, whatever the temperature (only the sampled tokens' are tempered)."""
    if n != 1:
        raise BadRequest("logprob_start_len >= 0 takes n = 1 in rlrecipe serve")
    lps = [None, *sched.weights.prompt_logprobs(list(seq), lora)]
    return [[lps[k], seq[k], None] for k in range(prompt_from, len(seq))]


def build_requests(body: dict, sched: Served) -> tuple[list[GenRequest], bool]:
    """A /generate body as requests, and whether it was a batch (list in, list out)."""
    inputs, batch = _prompts(body, sched)
    n = len(inputs)
    if n == 0:
        raise BadRequest("empty batch")
    rids = _rids(body.get("rid"), n, batch)
    sps = _as_list(body.get("sampling_params"), n, "sampling_params")
    want_lp = _as_list(body.get("return_logprob", False), n, "return_logprob")
    loras = _adapters(body, n, sched)
    starts = _as_list(body.get("logprob_start_len", -1), n, "logprob_start_len")
    out = []
    for i, seq in enumerate(inputs):
        seq = _checked_ids(seq, sched.vocab_size)
        prompt_from = starts[i] if starts[i] is not None and starts[i] >= 0 and want_lp[i] else None
        if prompt_from is not None and (batch or prompt_from >= len(seq)):
            raise BadRequest("logprob_start_len >= 0 (prompt log-probs): one prompt per request, and less than "
                             "its length, in rlrecipe serve")
        sp = parse_sampling(sps[i], sched.context_len, len(seq), sched.rules)
        prompt_lps = [] if prompt_from is None else _prompt_logprobs(seq, prompt_from, sp["n"], loras[i], sched)
        for j in range(sp["n"]):  # parallel samples come back prompt by prompt, as in SGLang
            rid_j = str(rids[i]) if sp["n"] == 1 else f"{rids[i]}_{j}"
            out.append(GenRequest(rid=rid_j, input_ids=list(seq), max_new_tokens=sp["max_new_tokens"],
                                  temperature=sp["temperature"], top_p=sp["top_p"], top_k=sp["top_k"],
                                  stop_ids=sp["stop_ids"], return_logprob=bool(want_lp[i]),
                                  return_text_in_logprobs=bool(body.get("return_text_in_logprobs", False)),
                                  skip_special_tokens=sp["skip_special_tokens"], no_stop_trim=sp["no_stop_trim"],
                                  stop_strs=sp["stop_strs"], ignore_eos=sp["ignore_eos"], lora=loras[i] or None,
                                  input_logprobs=prompt_lps))
        if len(out) > MAX_SAMPLES_PER_REQUEST:
            raise BadRequest(f"more than {MAX_SAMPLES_PER_REQUEST} samples (prompts x n) in one request; "
                             "split it")
    return out, batch or len(out) > 1



def response_body(r: GenRequest, tokenizer, weight_version: str) -> dict:
    """The response so far: final once `r.done` is set, else a streaming snapshot (no finish reason)."""
    finish = r.finish if r.done.is_set() else None
    n = min(len(r.output_ids), len(r.logprobs))  # the scheduler appends ids first, log-probs second
    ids, logprobs = r.output_ids[:n], r.logprobs[:n]
    shown = ids
    matched = (finish or {}).get("matched") if (finish or {}).get("type") == "stop" else None
    if isinstance(matched, int) and not r.no_stop_trim and ids:
        shown = ids[:-1]
    meta = {"id": r.rid, "finish_reason": finish, "prompt_tokens": len(r.input_ids),
            "completion_tokens": len(ids), "cached_tokens": 0, "weight_version": weight_version,
            "e2e_latency": time.time() - r.arrived}
    if r.return_logprob:
        texts = ([tokenizer.decode([t]) for t in ids] if r.return_text_in_logprobs else [None] * len(ids))
        meta["output_token_logprobs"] = [[lp, t, s] for lp, t, s in zip(logprobs, ids, texts, strict=True)]
        meta["input_token_logprobs"] = r.input_logprobs
    text = tokenizer.decode(shown, skip_special_tokens=r.skip_special_tokens)
    if isinstance(matched, str) and not r.no_stop_trim:
        text = text[:text.find(matched)] if matched in text else text
    return {"text": text, "output_ids": list(ids), "meta_info": meta}
