"""`rlrecipe fit --out`: the best layout written as a recipe, its header saying what changed from the
source recipe and why (the plan's figure without the change, or the seconds it would cost)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import yaml

from rlrecipe.checks.colocate import PHASES
from rlrecipe.checks.fit_layout import Fit, Layout
from rlrecipe.checks.fit_search import Search
from rlrecipe.checks.memory import SGLANG_OUTSIDE_POOL_GIB, SGLANG_OUTSIDE_POOL_LOGGED_GIB
from rlrecipe.checks.model_dims import GIB
from rlrecipe.checks.plan import plan
from rlrecipe.recipe.schema import Recipe, apply_overrides, load_recipe, recipe_from_dict

HEADER_WIDTH = 105  # the fitted recipe's header lines


def fitted_fields(layout: Layout, source: Recipe) -> dict[str, object]:
    """Dotted field -> value for the layout (only those that differ from the source are written)."""
    t, r, m = layout.train, layout.rollout, layout.machine
    shared = {"rollout.sglang.weight_sync": layout.push} if layout.colocated else {}
    return shared | {"trainer.nproc": t.ranks // t.nodes, "trainer.nodes": t.nodes, "trainer.zero_stage": t.zero_stage,
            "trainer.offload_optimizer": t.offload_optimizer, "trainer.offload_params": t.offload_params,
            "trainer.max_tokens_per_microbatch": t.microbatch_tokens,
            "trainer.logprob_chunk_tokens": t.chunk_tokens, "trainer.gpu_memory_gib": m.gpu_memory_gib,
            "rollout.sglang.tp_size": r.tp, "rollout.sglang.dp_size": 1, "rollout.sglang.num_servers": r.servers,
            "rollout.sglang.nodes": r.nodes, "rollout.sglang.mem_fraction_static": r.mem_fraction,
            "rollout.sglang.host": "127.0.0.1" if m.nodes == 1 else "0.0.0.0", "rollout.colocate": layout.colocated}


def _get(recipe: Recipe, dotted: str):
    value = recipe
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _set(data: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        data = data.setdefault(p, {})
    data[last] = value


def reasons(search: Search, layout: Layout) -> dict[str, str]:
    """Why each changed field took its value, in one line each."""
    src, t, r = search.recipe, layout.train, layout.rollout
    out: dict[str, str] = {}
    unit = "" if layout.machine.nodes > 1 else " GPUs"
    split = (f"{layout.split}{unit} for training + rollout, the split projected fastest per trained token "
             f"(rollout {r.time.seconds:.0f} s, training {t.time.seconds:.0f} s a step)")
    if layout.colocated:
        changes = sum(t.time.parts.get(k, 0.0) for k in PHASES if k != "train")
        split = (f"every GPU shared by a trainer rank and an SGLang server, taking turns: the layout projected "
                 f"fastest per trained token (rollout {r.time.seconds:.0f} s, training {t.time.seconds:.0f} s a step, "
                 f"{changes:.0f} s of it the phase changes: release, reload, offload, resume, push, verify; "
                 f"{_push_short(search.pushes(r), layout.push, search.allowed)})")
    for key in ("trainer.nproc", "trainer.nodes", "rollout.sglang.num_servers", "rollout.sglang.nodes",
                "rollout.colocate"):
        out[key] = split
    out["trainer.gpu_memory_gib"] = "the GPUs' memory, which `rlrecipe plan` checks both sides against"
    out["rollout.sglang.host"] = ("servers launched by the run on its own node" if layout.machine.nodes == 1
                                  else "servers on other nodes, reached over the network")
    out["rollout.sglang.dp_size"] = "one model copy per server"
    if layout.colocated:
        out["rollout.sglang.weight_sync"] = _push_reason(search.pushes(r), layout.push, search.allowed)

    def train_alt(**change) -> str:
        base = dict(stage=t.zero_stage, opt=t.offload_optimizer, par=t.offload_params, micro=t.microbatch_tokens,
                    chunk=t.chunk_tokens)
        base.update(change)
        o = search.train_option(t.ranks, t.nodes, **base, colocated=layout.colocated,
                                push_s=t.time.parts.get("push", 0.0), tp=r.tp if layout.colocated else None)
        if not search.train_fits(o):
            return (f"{t.peak / GIB:.1f} GiB per GPU; with the source's value training needs {o.peak / GIB:.1f}, "
                    f"over {search.limit / GIB:.1f}")
        return (f"{t.peak / GIB:.1f} GiB per GPU; the source's value fits too ({o.peak / GIB:.1f} GiB) but projects "
                f"{o.time.seconds - t.time.seconds:+.0f} s a step")

    tr = src.trainer
    alts = {"trainer.zero_stage": dict(stage=tr.zero_stage, par=tr.offload_params and tr.zero_stage == 3),
            "trainer.offload_optimizer": dict(opt=tr.offload_optimizer),
            "trainer.offload_params": dict(par=tr.offload_params),
            "trainer.max_tokens_per_microbatch": dict(micro=tr.max_tokens_per_microbatch),
            "trainer.logprob_chunk_tokens": dict(chunk=tr.logprob_chunk_tokens)}
    for key, change in alts.items():
        out[key] = train_alt(**change)
    s = src.rollout.sglang
    for key, (tp, frac) in {"rollout.sglang.tp_size": (s.tp_size, r.mem_fraction),
                            "rollout.sglang.mem_fraction_static": (r.tp, s.mem_fraction_static)}.items():
        alt = (search.rollout_option(r.gpus, r.nodes, tp, frac)
               if tp in search.tp_candidates(r.gpus) and frac in search.fractions(layout.colocated) else None)
        here = f"KV cache of {r.kv_tokens:,} tokens per server"
        # colocated, the push also depends on the servers: the cheapest built one into the alternative's
        dpush = (min(search.pushes(alt)[k] for k in search.allowed) - t.time.parts["push"]
                 if alt is not None and layout.colocated else 0.0)
        out[key] = (f"{here}; the source's value does not fit this machine" if alt is None else
                    f"{here}; the source's value projects {alt.time.seconds + dpush - r.time.seconds:+.0f} s a step")
    return out


PUSH_WAY = {"tensor": "by value", "disk": "over disk", "ipc": "by handle"}


def _others(seconds: dict[str, float], kind: str, allowed: tuple[str, ...], digits: int = 1) -> str:
    return " and ".join(f"{seconds[k]:.{digits}f} s {PUSH_WAY[k]}" for k in allowed if k != kind)


# Under trainer.lora: the adapter alone, which SGLang takes two ways (colocate.LORA_PUSHES)
LORA_HOW = {"tensor": "rank 0 posts the adapter by value (pickled, base64 in the body, once per tensor-parallel "
                      "rank) to each server in turn (/load_lora_adapter_from_tensors); the base weights never move",
            "disk": "rank 0 writes the adapter as a PEFT directory once and the servers load it "
                    "(/load_lora_adapter); the base weights never move"}


def _push_reason(seconds: dict[str, float], kind: str, allowed: tuple[str, ...]) -> str:
    """Why the colocated layout pushes its weights (under LoRA its adapter) as it does: every allowed
    push's seconds."""
    if "ipc" not in allowed:  # under LoRA
        return (f"{LORA_HOW[kind]}: the cheaper of the two, {seconds[kind]:.2f} s a step against "
                f"{_others(seconds, kind, allowed, 2)}")
    how = {"tensor": "rank 0 posts the weights by value (pickled, base64 in the body, once per tensor-parallel "
                     "rank) to each server in turn (/update_weights_from_tensor)",
           "disk": "rank 0 writes an HF export once and the servers load it into their resumed weights "
                   "(/update_weights_from_disk)",
           "ipc": "every rank shares its copy of the weights by CUDA IPC handle, bucket by bucket, rank 0 posts "
                  "the handles to the servers side by side (/update_weights_from_tensor) and copies them into pinned "
                  "host memory to verify (run on an H100 in bench/gpu/ipc_push.py, not end to end with SGLang on "
                  "a GPU)"}
    return f"{how[kind]}: the cheapest built push, {seconds[kind]:.1f} s a step against {_others(seconds, kind, allowed)}"


def _push_short(seconds: dict[str, float], kind: str, allowed: tuple[str, ...]) -> str:
    if "ipc" not in allowed:  # under LoRA
        return (f"rollout.sglang.weight_sync {kind}: the adapter pushed {PUSH_WAY[kind]} in {seconds[kind]:.2f} s, "
                f"against {_others(seconds, kind, allowed, 2)}")
    return (f"rollout.sglang.weight_sync {kind}: the weights pushed {PUSH_WAY[kind]} in {seconds[kind]:.1f} s, "
            f"against {_others(seconds, kind, allowed)}")


def fitted_recipe(fitted: Fit, layout: Layout, out: Path) -> tuple[str, Recipe]:
    """The fitted recipe's text (a header saying what changed and why, then the source's fields with
    the layout's) and the recipe it loads as."""
    loaded, src = fitted.source, fitted.source.recipe
    search = Search(loaded, fitted.machine)
    # the source as fit saw it, --set included
    data = apply_overrides(yaml.safe_load(Path(loaded.path).read_text()), loaded.overrides)
    name = out.stem.replace("_", "-")
    changes = {"run.name": name} | {k: v for k, v in fitted_fields(layout, src).items() if _get(src, k) != v}
    why = reasons(search, layout) | {"run.name": "this layout's runs apart from the source's"}
    for key, value in changes.items():
        _set(data, key, value)
    recipe = recipe_from_dict(data, str(out))
    header = _header(fitted, layout, out, recipe, changes, why, search.sglang_headroom_gib(layout))
    return header + _dump(data), recipe


def _header(fitted: Fit, layout: Layout, out: Path, recipe: Recipe, changes: dict, why: dict,
            headroom_gib: float) -> str:
    src_path, m, t, r = fitted.source.path, fitted.machine, layout.train, layout.rollout
    src = fitted.source.recipe
    ds = f"DeepSpeed {t.zero}, {t.ranks} ranks"
    servers = f"{r.servers} SGLang server{'s' if r.servers > 1 else ''}, tp {r.tp}"
    where = (f"{t.ranks} GPUs train ({ds}), {r.gpus} serve rollouts ({servers})" if m.nodes == 1 else
             f"{t.nodes} node{'s' if t.nodes > 1 else ''} train ({ds}), {r.nodes} serve rollouts ({servers})")
    if layout.colocated:
        where = (f"{t.ranks} GPU{'s' if t.ranks > 1 else ''}, each shared by a training rank ({ds}, its state "
                 f"offloaded to host memory while SGLang generates) and {servers} (released while the trainer "
                 "trains)")
        if src.trainer.lora.enabled:
            where = (f"{t.ranks} GPU{'s' if t.ranks > 1 else ''}, each shared by a training rank ({ds}, "
                     f"LoRA rank {src.trainer.lora.rank}: its frozen base stays, the adapter's optimizer state is "
                     f"offloaded to host memory while SGLang generates) and {servers} (its weights stay, its "
                     "KV cache released while the trainer trains)")
    sets = "".join(f" --set {s}" for s in fitted.source.overrides)
    host = f" --host-memory {m.host_memory_gib:g}" if m.host_memory_gib is not None else ""
    nodes = f" --nodes {m.nodes}" if m.nodes > 1 else ""
    lines = [f"# {out.stem} — {src_path} laid out on {m.label} GPUs by `rlrecipe fit`; the same training.",
             f"# Reproduces: what {src_path} reproduces (algorithm sha256 {recipe.algorithm_sha256()[:16]}..., "
             "the source's), on other GPUs.",
             f"# Hardware: {m.label} GPUs (times assume H100s): {where}.",
             f"# Command: as the header of {src_path} says, with this file"
             + (f": rlrecipe rl {out}" if m.nodes == 1 else
                f": rlrecipe rollout-servers {out} --node {_ranks(r.nodes)} --urls-out shared/urls.yaml on "
                f"{_each(r.nodes)} rollout node, then {_rank_env(t.nodes)}rlrecipe rl {out} "
                f"--set \"rollout.urls=$(cat shared/urls.yaml)\" on {_each(t.nodes)} training node"),
             f"# Expected: the numbers of {src_path}. Projected {layout.step_s:.0f} s a step, "
             f"{layout.s_per_mtoken:.2f} s per 1M trained tokens, {layout.hours:.0f} h for its {layout.steps} steps "
             "(a projection at H100 rates: docs/gpu.md, \"How fit decides\").",
             f"# Memory: fits with {headroom_gib:.1f} GiB to spare beyond the {SGLANG_OUTSIDE_POOL_GIB:g} GiB SGLang is "
             f"assumed to keep outside its static pool, so it holds while a server keeps at most "
             f"{SGLANG_OUTSIDE_POOL_GIB + headroom_gib:.1f} GiB there; that figure is not measured (the parts published "
             f"logs show come to {SGLANG_OUTSIDE_POOL_LOGGED_GIB:g} GiB at 7-8B, and SGLang's guide reserves 5-8 GB more "
             "for activations: docs/gpu.md, \"SGLang outside its pool\").",
             f"# Generated by: rlrecipe fit {src_path} --gpus {m.gpus}{nodes} --gpu-memory {m.gpu_memory_gib:g}"
             f"{host}{sets} --out {out}",
             "#",
             f"# Changed from {src_path}, and why (nothing else differs; every field here is outside the",
             "# algorithm sha256):"]
    grouped: dict[str, list[str]] = {}
    for key, value in changes.items():
        grouped.setdefault(why.get(key, ""), []).append(f"{key} {_get(fitted.source.recipe, key)} -> {value}")
    for reason, fields in grouped.items():
        lines.append(f"#   {', '.join(fields)}: {reason}")
    wrapped = [textwrap.fill(line, width=HEADER_WIDTH, subsequent_indent="#     " if line.startswith("#   ") else "#   ",
                             break_long_words=False, break_on_hyphens=False) for line in lines]
    return "\n".join(wrapped) + "\n"


def _dump(data: dict) -> str:
    """Sections in block style, their small mappings and lists in flow style, as the shipped recipes."""
    out = []
    for section, body in data.items():
        if not isinstance(body, dict):
            out.append(yaml.safe_dump({section: body}, sort_keys=False, default_flow_style=None, width=110))
            continue
        out.append(f"{section}:\n")
        for key, value in body.items():
            flow = None if isinstance(value, (dict, list)) else False
            text = yaml.safe_dump({key: value}, sort_keys=False, default_flow_style=flow, width=106,
                                  allow_unicode=True)
            out.append("".join("  " + line + "\n" for line in text.splitlines()))
    return "".join(out)


def _ranks(nodes: int) -> str:
    return "0" if nodes == 1 else f"<0..{nodes - 1}>"


def _each(nodes: int) -> str:
    return "the" if nodes == 1 else "each"


def _rank_env(nodes: int) -> str:
    return "" if nodes == 1 else f"RLRECIPE_NODE_RANK={_ranks(nodes)} "


def write_fitted(fitted: Fit, out: Path) -> Recipe:
    """Write the best layout as a recipe at `out`; check it loads and that the plan says it fits."""
    text, _ = fitted_recipe(fitted, fitted.layouts[0], out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    loaded = load_recipe(out)
    _, _, budgets = plan(loaded)
    wrong = [b.side for b in budgets if not b.fits]
    if wrong:  # the search kept only layouts that fit: this is a bug, not a user mistake
        raise RuntimeError(f"{out}: the fitted layout's plan does not fit ({', '.join(wrong)})")
    return loaded.recipe
