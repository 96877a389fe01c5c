"""`rlrecipe serve`: a CPU server speaking SGLang's native HTTP API on top of the in-process engine.

It stands in for SGLang where SGLang cannot run: the tests start it as a real process, and users
without a GPU serve with it. The SGLang rollout path (client, server lifecycle, health checks,
partial rollouts, weight sync, the router) then runs unchanged against it:
`rollout.sglang.launch_cmd` set to
`["rlrecipe", "serve", "{model}", "--host", "{host}", "--port", "{port}"]`, or a server started
by hand and attached with `rollout.urls`.

It follows the rules of the newest SGLang the pin allows (0.5.23, reported as /server_info's
`version`), so the client cannot pass against a more lenient imitation: distributed updates run
only inside a weight-update session, unknown `sampling_params` keys are refused with 400, inputs of
max_req_input_len (context - 6) tokens or more and input + new tokens above the context are refused,
and /get_weights_by_name answers only for the architectures SGLang implements it for (400 for
Qwen2, as there). With RLRECIPE_SERVE_SGLANG set to an older version of the pin (e.g. 0.5.1) it
follows that version's rules instead, as docs/gpu.md's version table has them: the tests run the
client against both ends.

Endpoints (request and response shapes as SGLang's): POST /generate (input_ids or text, single
or batch; sampling_params; return_logprob; rid), POST /abort_request, POST
/update_weights_from_disk (flushes the cache, as SGLang's does), POST|GET /flush_cache,
POST /init_weights_update_group + /begin_weight_update + /update_weights_from_distributed +
/end_weight_update + /destroy_weights_update_group (the trainer broadcasts tensors into this
process, see rollout/weights/sync.py), GET /health, GET /health_generate, GET /model_info (and its
old name /get_model_info), GET /server_info (context_length, max_req_input_len, version, device),
GET|POST /get_weights_by_name ({name, truncate_size}: the parameter's first truncate_size rows as
float32 lists, Llama-like models only), GET|POST /weights_checker ({"action": "checksum"}: every
tensor's checksum as SGLang computes it on the CPU), POST /update_weights_from_tensor (tensors
pickled by value, inside the weight-update session: serve/tensors.py), POST|GET
/release_memory_occupation and /resume_memory_occupation (with --enable-memory-saver only, and
stricter than SGLang: serve/memory.py), POST /load_lora_adapter, /load_lora_adapter_from_tensors and
/unload_lora_adapter, and /generate's `lora_path` (with --enable-lora: serve/adapters.py).

Also: stop strings (`sampling_params.stop`: the text is cut before the match unless
no_stop_trim; finish_reason matched is the string) and `n` parallel samples (results prompt by
prompt, rids suffixed _0.._n-1, a list even for one prompt), and `stream` for one prompt (server-
sent events, each with the output so far, as SGLang streams by default). Not supported (HTTP
400): batch streams, prompt log-probs (logprob_start_len >= 0) for a batch or n > 1, min_new_tokens. `ignore_eos`
runs to max_new_tokens.

Limits (beyond SGLang's, which sets none): `sampling_params.n` is at most 256 and one request holds
at most 8,192 samples (prompts x n), else 400; a body over 256 MiB is refused with 413 before it is
read. Integer sampling parameters must be integers (`max_new_tokens: 1e400` is a 400). Each
decoding chunk takes at most one engine batch (`max_batch`) of rows, those that have had the
fewest chunks first, so a request of many samples takes turns with the others. A
/update_weights_from_disk reads and checks every tensor before copying any: one that fails
(a truncated shard, a tensor of the wrong shape) answers 400 and leaves the served weights and
weight_version as they were (SGLang reloads its original weights after a failed load).

Modules: `adapters` (LoRA adapters, applied to the weights per chunk), `memory` (released memory and garbage weights of a colocated server), `tensors` (the
tensor-update body), `protocol` (request parsing and validation, response bodies), `scheduler` (batches
requests onto the in-process engine, applies aborts and weight updates), `weights` (the update
group and session, the weights read back), `routes` (what each endpoint does and answers), `http_server`
(requests read and replies written, /generate and its stream, the server, `serve_forever`).
"""

from rlrecipe.core.threads import threaded_wait_policy

threaded_wait_policy()  # before the server's modules load torch: see rlrecipe/core/threads.py
