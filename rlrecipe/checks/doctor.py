"""`rlrecipe doctor [RECIPE]`: what this machine has against what a recipe needs, before a long job.

Each check gives what the recipe needs, what the machine has and a status: ok, FAIL, or "cannot
check here" (a GPU fact on a machine without one, a hub that cannot be reached). The checks marked
fatal are the ones a stage can already see will stop it (an attention implementation that cannot
load, an output directory it cannot write, a disk too small for its checkpoints, an export
directory its remote servers cannot see): `rlrecipe sft` and `rlrecipe rl` run those at start
(preflight.py) and refuse with one line each, before the run directory is touched.

Sizes come from plan.py (the model's dimensions and the recipe's numbers); they are estimates at
the worst case (every rollout at full length), as `rlrecipe plan` prints them.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import ipaddress
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from rlrecipe.recipe.schema import LoadedRecipe, Recipe

OK, FAIL, UNKNOWN = "ok", "FAIL", "cannot check here"
GB = 1e9
GIB = 2**30
# Filesystems a rollout node elsewhere can see the same files through.
SHARED_FS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "glusterfs", "fuse.glusterfs",
             "wekafs", "panfs", "9p", "cifs", "smb3", "fuse.juicefs", "fuse.s3fs", "fuse.gcsfuse", "virtiofs")


@dataclass
class Check:
    name: str
    need: str
    have: str
    status: str
    fatal: bool = False  # a FAIL here stops `rlrecipe sft` / `rlrecipe rl` at start

    @property
    def line(self) -> str:
        return f"{self.name}: needs {self.need}; this machine has {self.have}"


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
        rows.append(Check("sglang-router", "sglang-router >= 0.2" if launched else "rollout.sglang.router_launch_cmd",
                          f"sglang-router {rv}" if rv else "not installed",
                          OK if rv or not launched else FAIL, fatal=launched))
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


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def check_disk(recipe: Recipe, dims) -> Check:
    from rlrecipe.checks.plan import disk_parts

    parts = disk_parts(recipe, dims)
    run_dir = recipe.run.dir
    base = _existing_parent(run_dir)
    free = shutil.disk_usage(base).free
    own = _dir_bytes(run_dir) if run_dir.is_dir() else 0  # replaced as the run goes: counts as room
    need = sum(parts.values())
    detail = ", ".join(f"{k} {v / GB:,.1f}" for k, v in parts.items())
    have = f"{(free + own) / GB:,.1f} GB free at {base}" + (f" (incl. {own / GB:.1f} GB of this run's)" if own else "")
    return Check("disk for run.dir", f"{need / GB:,.1f} GB ({detail})", have, OK if free + own >= need else FAIL,
                 fatal=True)


def meminfo() -> tuple[float | None, float | None]:
    """Total and available host memory in bytes (None where /proc/meminfo does not say)."""
    out: dict[str, float] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                out[key] = float(rest.split()[0]) * 1024
    except OSError:
        pass
    return out.get("MemTotal"), out.get("MemAvailable")


def check_host_memory(recipe: Recipe, dims) -> Check | None:
    from rlrecipe.checks.plan import rank0_host_parts

    parts = rank0_host_parts(recipe, dims)
    if not parts:
        return None
    need = sum(parts.values())
    total, avail = meminfo()
    detail = ", ".join(f"{k} {v / GIB:.1f}" for k, v in parts.items())
    if total is None:
        return Check("rank-0 host memory", f"{need / GIB:.1f} GiB ({detail})", "unknown", UNKNOWN)
    have = f"{total / GIB:.0f} GiB total, {avail / GIB:.0f} GiB available" if avail else f"{total / GIB:.0f} GiB"
    # fatal only where the whole machine has less: what is available now changes
    return Check("rank-0 host memory", f"{need / GIB:.1f} GiB ({detail})", have,
                 OK if (avail or total) >= need else FAIL, fatal=total < need)


def check_writable(recipe: Recipe) -> Check:
    run_dir = recipe.run.dir
    base = _existing_parent(run_dir)
    try:
        with tempfile.NamedTemporaryFile(dir=base, prefix=".rlrecipe-doctor-"):
            pass
        return Check("output directory", f"{run_dir} writable", f"{base} writable", OK, fatal=True)
    except OSError as err:
        return Check("output directory", f"{run_dir} writable", f"{base}: {err.strerror or err}", FAIL, fatal=True)


def _own_addresses() -> set[str]:
    names = {"localhost", socket.gethostname(), socket.getfqdn()}
    addrs = set()
    for name in names:
        try:
            addrs |= {ai[4][0] for ai in socket.getaddrinfo(name, None)}
        except OSError:
            pass
    return names | addrs


def remote_urls(urls: list[str]) -> list[str]:
    """The URLs whose host is not this machine (loopback, its name, its addresses)."""
    own = None
    out = []
    for url in urls:
        host = urlparse(url if "//" in url else "http://" + url).hostname or ""
        try:
            if ipaddress.ip_address(host).is_loopback:
                continue
        except ValueError:
            pass
        if own is None:
            own = _own_addresses()
        if host not in own:
            out.append(url)
    return out


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem `path` lies on, from /proc/mounts (the longest mount point above it)."""
    path = _existing_parent(path).resolve()
    best, kind = "", None
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) < 3:
                continue
            mount = fields[1].replace("\\040", " ")
            if (str(path) == mount or str(path).startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                best, kind = mount, fields[2]
    except OSError:
        return None
    return kind


def check_shared_export(recipe: Recipe) -> Check | None:
    """weight_sync: disk with servers on other nodes: they load the export from run.dir, which they
    must see at the same path."""
    ro = recipe.rollout
    if ro.engine != "sglang" or ro.sglang.weight_sync != "disk" or not ro.urls:
        return None
    remote = remote_urls(ro.urls)
    if not remote:
        return None
    need = f"run.output_dir an absolute path the {len(remote)} remote server(s) mount (weight_sync: disk)"
    out = Path(recipe.run.output_dir)
    if not out.is_absolute():
        return Check("export seen by servers", need, f"relative run.output_dir {recipe.run.output_dir!r}; or use "
                     "rollout.sglang.weight_sync: distributed", FAIL, fatal=True)
    kind = filesystem_type(out)
    if kind is None:
        return Check("export seen by servers", need, f"{out} (filesystem unknown)", UNKNOWN)
    if kind in SHARED_FS or kind.startswith("fuse"):
        return Check("export seen by servers", need, f"{out} on {kind}", OK)
    return Check("export seen by servers", need, f"{out} on a local {kind} filesystem", FAIL)


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
        rows.append(check_disk(recipe, dims))
        host = check_host_memory(recipe, dims) if stage == "rl" else None
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
        from rlrecipe.checks.plan import plan, stage_of

        budgets = plan(loaded)[2] if stage_of(recipe) != "eval" else []
        train_gib = next((b.total / GIB for b in budgets if b.side == "train"), None)
    from rlrecipe.checks.plan import stage_of

    stage = stage_of(recipe)
    rows = check_torch(recipe) + [check_gpus(recipe, train_gib), check_attention(recipe)]
    rows += check_sglang(recipe)
    rows += [c for c in (check_deepspeed(recipe), check_model_source(loaded, hub_timeout_s)) if c is not None]
    if dims is None:
        rows.append(Check("disk for run.dir", "the model's size", "model dimensions unknown", UNKNOWN))
    elif stage != "eval":
        rows.append(check_disk(recipe, dims))
        host = check_host_memory(recipe, dims)
        if host is not None:
            rows.append(host)
    rows.append(check_writable(recipe))
    rows += [c for c in (check_shared_export(recipe), check_fp16_start(recipe)) if c is not None]
    return rows
