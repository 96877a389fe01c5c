"""SGLang's native HTTP API as the SGLang engine speaks it: what a request carries, what an answer means.

The API subset used (SGLang 0.4/0.5 `sglang/srt/entrypoints/http_server.py`,
`sglang/srt/managers/io_struct.py`, `tokenizer_manager.py`):

- `POST /generate` {input_ids, sampling_params, return_logprob, logprob_start_len, rid} ->
  {text, output_ids, meta_info: {id, finish_reason: {type: stop|length|abort, ...},
  output_token_logprobs: [[logprob, token_id, text|null], ...], ...}}. The token ids and their
  log-probs are read from `output_token_logprobs` (one entry per sampled token); SGLang's
  log-prob is that of the temperature-scaled distribution before top-p/top-k, as in
  `InProcessEngine` (greedy: the raw distribution).
- `POST /abort_request` {rid} or {abort_all}: a running request returns at once with what it
  has, with finish_reason abort. SGLang matches rids by prefix (so rids are fixed-length uuids)
  and, in recent versions, acts on the first abort of a rid only; an abort that lands before the
  scheduler holds the request is lost.
- `POST /update_weights_from_disk` {model_path, weight_version} -> {success, message}; the
  server flushes its prefix cache itself. Responses then carry `meta_info.weight_version`.
- `GET /health_generate` (start-up), `GET /model_info` (old name `/get_model_info`: which model an
  attached server has), `GET /server_info` (`context_length`). SGLang refuses (HTTP 400) a
  request whose input + max_new_tokens exceeds the context.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlrecipe.core.errors import UserError
from rlrecipe.trajectory.record import SamplingParams, Status, Trajectory

# Our stand-in for a -inf log-prob, which SGLang's JSON carries as null.
NEG_INF_LOGP = -999999999.0


def sglang_sampling_params(params: SamplingParams, max_new_tokens: int, stop_token_ids: Sequence[int]) -> dict:
    """Our SamplingParams as SGLang's `sampling_params` (temperature 0 = greedy, top_k -1 = off); only
    keys of versions.SAMPLING_KEYS (from 0.5.22 SGLang refuses others with HTTP 400)."""
    greedy = params.greedy or params.temperature == 0
    sp = {"max_new_tokens": int(max_new_tokens),
          "temperature": 0.0 if greedy else float(params.temperature),
          "top_p": float(params.top_p),
          "top_k": int(params.top_k) if params.top_k > 0 else -1,
          "ignore_eos": False,
          "skip_special_tokens": False,
          "no_stop_trim": True}
    if stop_token_ids:
        sp["stop_token_ids"] = [int(t) for t in stop_token_ids]
    return sp


def generate_payload(input_ids: list[int], sampling_params: dict, rid: str) -> dict:
    """A /generate body for one sequence, with the log-prob of every sampled token and no stream."""
    return {"input_ids": input_ids, "sampling_params": sampling_params,
            "return_logprob": True, "logprob_start_len": -1, "rid": rid, "stream": False}


def apply_output(t: Trajectory, out: dict, params: SamplingParams, version: int) -> None:
    """Append a /generate answer's tokens (labelled `version`) to `t` and set its status."""
    meta = out.get("meta_info") or {}
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    lps = meta.get("output_token_logprobs")
    if lps is None:
        if kind != "abort" and out.get("output_ids"):
            raise UserError(f"SGLang /generate returned no meta_info.output_token_logprobs (rid {meta.get('id')}); "
                            "the server must support return_logprob")
        lps = []
    for entry in lps:
        logp, token = entry[0], entry[1]
        t.append(int(token), NEG_INF_LOGP if logp is None else float(logp), version)
    if kind == "stop":
        t.status = Status.FINISHED
    elif kind == "length":
        t.status = Status.TRUNCATED
        if len(t.response_ids) < params.max_new_tokens:  # the server's context length ended it
            t.meta["truncated_by_server"] = True
    else:  # abort (ours, or the server's) or nothing: partial, resumable
        t.status = Status.RUNNING
        if len(t.response_ids) >= params.max_new_tokens:
            t.status = Status.TRUNCATED


def context_length(server_info: dict) -> int | None:
    """The context length a /server_info answer states; None where it does not say."""
    ctx = server_info.get("context_length")
    if not isinstance(ctx, int) and isinstance(server_info.get("max_req_input_len"), int):
        ctx = server_info["max_req_input_len"] + 1
    return ctx if isinstance(ctx, int) and ctx > 0 else None
