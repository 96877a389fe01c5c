"""`rlrecipe doctor [RECIPE]`: what this machine has against what a recipe needs, before a long job.

Each check gives what the recipe needs, what the machine has and a status: ok, FAIL, or "cannot
check here" (a GPU fact on a machine without one, a hub that cannot be reached). The checks marked
fatal are the ones a stage can already see will stop it (an attention implementation that cannot
load, an output directory it cannot write, a disk too small for its checkpoints, an export
directory its remote servers cannot see): `rlrecipe sft` and `rlrecipe rl` run those at start
(preflight.py) and refuse with one line each, before the run directory is touched.

Sizes come from plan.py and host_disk.py's footprint, computed once for the disk and host memory checks
(the model's dimensions and the recipe's numbers); they are estimates at the worst case (every rollout
at full length), as `rlrecipe plan` prints them.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from packaging.version import Version

from rlrecipe.checks.check import FAIL, GIB, OK, UNKNOWN, Check
from rlrecipe.checks.host_checks import check_disk, check_host_memory, check_shared_export, check_writable
from rlrecipe.checks.host_disk import footprint
from rlrecipe.checks.memory import stage_of
from rlrecipe.recipe.schema import LoadedRecipe, Recipe


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def needs_cuda(recipe: Recipe) -> bool:
    """A recipe whose training or rollouts only run on CUDA GPUs: SGLang's own servers launched by the
    run, or flash-attention."""
    ro = recipe.rollout
    launches_sglang = ro.engine == "sglang" and not ro.urls and not ro.sglang.launch_cmd
    return launches_sglang or recipe.model.attn_implementation == "flash_attention_2"


# -- the checks -----------------------------------------------------------------------------------
def check_torch(recipe: Recipe | None) -> list[Check]:
    import torch

    cuda = torch.version.cuda
    need_cuda = recipe is not None and needs_cuda(recipe)
    rows = [Check("torch", "any" if recipe is None else "2.x", torch.__version__, OK)]
    if cuda is None:
        rows.append(Check("CUDA (torch build)", "a CUDA build" if need_cuda else "none (CPU is enough)",
                          "a CPU-only build", UNKNOWN if need_cuda else OK))
        rows.append(Check("NCCL", "present" if need_cuda else "-", "none (CPU-only torch)",
                          UNKNOWN if need_cuda else OK))
        return rows
    rows.append(Check("CUDA (torch build)", "a CUDA build", cuda, OK))
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        rows.append(Check("NCCL", "present", nccl, OK))
    except Exception as err:  # noqa: BLE001 - reported, not raised
        rows.append(Check("NCCL", "present", f"not loadable ({err})", FAIL if need_cuda else OK))
    return rows


def check_gpus(recipe: Recipe | None, train_gib: float | None) -> Check:
    import torch

    if recipe is None:
        need, per_gpu = "-", 0.0
    else:
        tr, ro = recipe.trainer, recipe.rollout
        gpus = tr.nproc
        launched_here = ro.engine == "sglang" and not ro.urls and ro.sglang.nodes == 1
        if launched_here:
            gpus += ro.sglang.num_servers * ro.sglang.tp_size * ro.sglang.dp_size
        per_gpu = tr.gpu_memory_gib
        need = f"{gpus} GPU(s) on this node of {per_gpu:.0f} GiB"
        if train_gib is not None:
            need += f" (training takes {train_gib:.1f} GiB each, plan)"
    if not torch.cuda.is_available():
        gpu_needed = recipe is not None and needs_cuda(recipe)
        return Check("GPUs", need, "none visible (no CUDA)", UNKNOWN if gpu_needed else OK)
    n = torch.cuda.device_count()
    props = torch.cuda.get_device_properties(0)
    mem = props.total_memory / GIB
    have = f"{n} x {props.name}, {mem:.0f} GiB"
    if recipe is None:
        return Check("GPUs", need, have, OK)
    enough = n >= gpus and mem >= 0.95 * per_gpu
    if train_gib is not None:
        enough = enough and mem >= train_gib
    return Check("GPUs", need, have, OK if enough else FAIL)


def flash_attn_state() -> tuple[bool, str]:
    """Whether flash-attn imports, and what is installed (or why it does not load)."""
    if importlib.util.find_spec("flash_attn") is None:
        return False, "flash-attn not installed"
    try:
        import flash_attn  # noqa: F401 - importing loads its CUDA extension
    except Exception as err:  # noqa: BLE001 - an ABI mismatch raises ImportError or OSError
        return False, f"flash-attn {_version('flash-attn') or '?'} does not load: {type(err).__name__}: {err}"
    return True, f"flash-attn {_version('flash-attn') or '?'}"


def check_attention(recipe: Recipe) -> Check:
    impl = recipe.model.attn_implementation
    if impl != "flash_attention_2":
        # sdpa trains as the per-document varlen_sdpa (train/varlen_attention.py): torch alone
        return Check("attention", f"{impl} (torch only)", "torch " + __import__("torch").__version__, OK, fatal=True)
    loads, have = flash_attn_state()
    return Check("attention", "flash_attention_2: flash-attn built for this torch and CUDA (or --set "
                 "model.attn_implementation=sdpa)", have, OK if loads else FAIL, fatal=True)


def check_sglang(recipe: Recipe) -> list[Check]:
    ro = recipe.rollout
    if ro.engine != "sglang":
        return []
    s = ro.sglang
    rows = []
    own_launch = not ro.urls and not s.launch_cmd and s.nodes == 1  # this node starts sglang.launch_server
    version = _version("sglang")
    if ro.urls or s.nodes > 1:
        need = "sglang >= 0.5 on the rollout nodes (`rlrecipe rollout-servers`)"
        rows.append(Check("SGLang", need, f"sglang {version}" if version else "not installed here", OK if version else UNKNOWN))
    elif s.launch_cmd:
        rows.append(Check("SGLang", "what rollout.sglang.launch_cmd starts", " ".join(s.launch_cmd[:3]), OK))
    else:
        rows.append(Check("SGLang", "sglang >= 0.5 (make install-gpu)", f"sglang {version}" if version else "not installed",
                          OK if version else FAIL, fatal=own_launch))
    if s.router:
        rv = _version("sglang-router")
        launched = not s.router_launch_cmd
        # 0.3 brought the /workers API the client keeps the router's list of servers with
        recent = rv is not None and Version(rv) >= Version("0.3")
        rows.append(Check("sglang-router", "sglang-router >= 0.3" if launched else "rollout.sglang.router_launch_cmd",
                          f"sglang-router {rv}" if rv else "not installed",
                          OK if recent or not launched else FAIL, fatal=launched))
    return rows


def check_deepspeed(recipe: Recipe) -> Check | None:
    if recipe.trainer.engine != "deepspeed":
        return None
    version = _version("deepspeed")
    if version is None:
        return Check("DeepSpeed", "deepspeed (trainer.engine: deepspeed)", "not installed", FAIL, fatal=True)
    # the engine passes torch's AdamW (zero_allow_untested_optimizer): no compiled op is needed
    try:
        from deepspeed.accelerator import get_accelerator

        accel = get_accelerator().device_name()
    except Exception as err:  # noqa: BLE001 - reported
        return Check("DeepSpeed", "deepspeed, no compiled ops (torch AdamW)", f"{version}, does not import: {err}", FAIL)
    need = "deepspeed with the cuda accelerator" if needs_cuda(recipe) else "deepspeed (torch AdamW: no compiled ops)"
    status = UNKNOWN if needs_cuda(recipe) and accel != "cuda" else OK
    return Check("DeepSpeed", need, f"{version}, accelerator {accel}", status)


def check_model_source(loaded: LoadedRecipe, timeout_s: float = 5.0) -> Check:
    recipe = loaded.recipe
    m, run = recipe.model, recipe.run
    if run.init_from:
        from rlrecipe.run.record import resolve_init

        path = Path(resolve_init(run.init_from, run.output_dir))
        ok = (path / "config.json").is_file()
        return Check("model", f"run.init_from {run.init_from}", f"{path} {'present' if ok else 'missing'}",
                     OK if ok else FAIL)
    if m.path is None:
        return Check("model", "built from model.tiny", "-", OK)
    local = Path(m.path)
    if local.exists():
        ok = (local / "config.json").is_file()
        return Check("model", f"local directory {m.path}", "config.json present" if ok else "no config.json",
                     OK if ok else FAIL)
    need = f"{m.path} @ {(m.revision or 'latest')[:12]}, cached or reachable"
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = [try_to_load_from_cache(m.path, f, revision=m.revision)
                  for f in ("config.json", "model.safetensors.index.json", "model.safetensors")]
    except Exception:  # noqa: BLE001 - an odd id: then ask the hub
        cached = [None]
    if isinstance(cached[0], str) and any(isinstance(c, str) for c in cached[1:]):
        return Check("model", need, f"in the hub cache ({Path(cached[0]).parent})", OK)
    try:
        from huggingface_hub import HfApi

        info = HfApi().model_info(m.path, revision=m.revision, timeout=timeout_s)
        return Check("model", need, f"not cached; the hub has it ({info.sha[:12] if info.sha else '?'}): downloaded at start", OK)
    except Exception as err:  # noqa: BLE001 - offline, unknown repo, bad revision
        kind = type(err).__name__
        return Check("model", need, f"not cached, hub not reachable ({kind})", UNKNOWN)


def check_fp16_start(recipe: Recipe) -> Check | None:
    if not (recipe.model.dtype == "float16" and recipe.trainer.engine == "deepspeed"):
        return None
    return Check("fp16 loss scale", "-", "starts at 2^32, halved on each overflow (window 5): the first "
                 "steps may be skipped", OK)


# -- all of them ----------------------------------------------------------------------------------
def _dims(loaded: LoadedRecipe):
    from rlrecipe.checks.model_dims import model_dims
    from rlrecipe.core.errors import UserError

    try:
        return model_dims(loaded)
    except (UserError, OSError, KeyError, ValueError):
        return None


def fatal_checks(loaded: LoadedRecipe, stage: str) -> list[Check]:
    """The checks a training stage runs at start (cheap: no GPU probing, no network)."""
    recipe = loaded.recipe
    rows = [check_attention(recipe), check_writable(recipe)]
    dims = _dims(loaded)
    if dims is not None:
        fp = footprint(recipe, dims)
        rows.append(check_disk(recipe, fp))
        host = check_host_memory(fp) if stage == "rl" else None
        if host is not None:
            rows.append(host)
    if stage == "rl":
        rows += [c for c in (check_shared_export(recipe), *check_sglang(recipe)) if c is not None]
    return rows


def failures(rows: list[Check]) -> list[str]:
    """One line per fatal check that failed."""
    return [c.line for c in rows if c.fatal and c.status == FAIL]


def run_checks(loaded: LoadedRecipe | None, hub_timeout_s: float = 5.0) -> list[Check]:
    """Every check, for `rlrecipe doctor`; without a recipe, what the machine has."""
    if loaded is None:
        rows = check_torch(None) + [check_gpus(None, None)]
        loads, have = flash_attn_state()
        rows.append(Check("flash-attn", "-", have, OK))
        for dist in ("sglang", "sglang-router", "deepspeed"):
            v = _version(dist)
            rows.append(Check(dist, "-", v or "not installed", OK))
        return rows
    recipe = loaded.recipe
    dims = _dims(loaded)
    train_gib = None
    if dims is not None:
        from rlrecipe.checks.plan import plan

        budgets = plan(loaded)[2] if stage_of(recipe) != "eval" else []
        train_gib = next((b.total / GIB for b in budgets if b.side == "train"), None)

    stage = stage_of(recipe)
    rows = check_torch(recipe) + [check_gpus(recipe, train_gib), check_attention(recipe)]
    rows += check_sglang(recipe)
    rows += [c for c in (check_deepspeed(recipe), check_model_source(loaded, hub_timeout_s)) if c is not None]
    if dims is None:
        rows.append(Check("disk for run.dir", "the model's size", "model dimensions unknown", UNKNOWN))
    elif stage != "eval":
        fp = footprint(recipe, dims)
        rows.append(check_disk(recipe, fp))
        host = check_host_memory(fp)
        if host is not None:
            rows.append(host)
    rows.append(check_writable(recipe))
    rows += [c for c in (check_shared_export(recipe), check_fp16_start(recipe)) if c is not None]
    return rows
