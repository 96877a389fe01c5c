"""SGLang server processes on this node: launch commands, the GPU count, start, stop.

`rollout.sglang.num_servers` servers are launched on the node of rank 0 as
`python -m sglang.launch_server` (or `rollout.sglang.launch_cmd`), on ports base_port + i, server
i on GPUs T + i x tp x dp .. T + (i + 1) x tp x dp - 1, where T is the GPUs the trainer's ranks
take on that node when the servers run beside training (0 otherwise); each server runs in its own
process group with its log in `<run_dir>/sglang_server_{i}.log`. A recipe whose servers (and
trainer) need more GPUs than this node shows is refused before anything starts.

With `rollout.sglang.nodes` N > 1 the run launches none: node n starts servers n x S .. (n + 1) x
S - 1 (S = num_servers / N) itself (`rlrecipe rollout-servers`, `sglang/node_servers.py`), server i still
on port base_port + i, its GPUs counted from 0 on its node, and the run attaches to them with
`rollout.urls`. Optionally `sglang-router` runs in front of the servers (`rollout.sglang.router`,
log `<run_dir>/sglang_router.log`) so that generation goes to one URL.

Before the first request, every server (and the router) is awaited on GET /health_generate
(`sglang/health.py`); one that exits or never answers 200 stops the run. A server is stopped with
SIGTERM to its group, then SIGKILL; every one still running is stopped at interpreter exit, and
(Linux, PDEATHSIG) when this process dies hard.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.util
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rlrecipe.core.errors import UserError
from rlrecipe.recipe.systems import SGLangServer, TrainerSection
from rlrecipe.rollout.sglang.api_key import ENV as API_KEY_ENV
from rlrecipe.rollout.sglang.api_key import key_env, redact
from rlrecipe.rollout.sglang.lora import PLACEHOLDER as LORA_PLACEHOLDER
from rlrecipe.rollout.sglang.ownership import foreign_holder, prove_ours, taken_error

LOG_NAME = "sglang_server_{i}.log"
ROUTER_LOG_NAME = "sglang_router.log"


def sglang_launch_cmd(model: str, host: str, port: int, index: int, cfg: SGLangServer, dtype: str,
                      seed: int, base_gpu: int | None = None, revision: str | None = None,
                      memory_saver: bool = False, kv_cache_dtype: str = "auto",
                      lora_args: Sequence[str] = (), key: str | None = None) -> list[str]:
    """`python -m sglang.launch_server ...` for server `index`, its GPUs from `base_gpu` on
    (default index * tp * dp: every server of the recipe on this node); `revision` pins a hub id's
    snapshot, as model.revision pins the trainer's; `memory_saver` (rollout.colocate): the server
    can release its memory while the trainer trains (without the flag SGLang frees nothing);
    `kv_cache_dtype` (rollout.kv_cache_dtype): --kv-cache-dtype unless "auto" or in extra_args already;
    `lora_args`: trainer.lora's flags (sglang/lora.py launch_args); `key`: its fleet's API key."""
    if base_gpu is None:
        base_gpu = index * gpus_per_server(cfg)
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", host,
            "--port", str(port), "--tp-size", str(cfg.tp_size), "--dp-size", str(cfg.dp_size),
            "--mem-fraction-static", str(cfg.mem_fraction_static), "--dtype", dtype,
            "--random-seed", str(seed), "--base-gpu-id", str(base_gpu),
            *(["--revision", revision] if revision else []),
            *(["--api-key", key] if key else []),
            *(["--enable-memory-saver"] if memory_saver and "--enable-memory-saver" not in cfg.extra_args else []),
            *(["--kv-cache-dtype", kv_cache_dtype] if kv_cache_dtype != "auto" and not _has_flag(
                cfg.extra_args, "--kv-cache-dtype") else []),
            *lora_args, *cfg.extra_args]


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def fill_placeholders(template: Sequence[str], **values) -> list[str]:
    """Substitute the known {placeholders} only (other braces, e.g. in a `-c` script, stay)."""
    out = []
    for part in template:
        for key, value in values.items():
            part = part.replace("{" + key + "}", str(value))
        out.append(part)
    return out


def own_cli(cmd: list[str]) -> list[str]:
    """A launch_cmd that starts with `rlrecipe` runs this installation's CLI (`rlrecipe serve`), found
    by this interpreter rather than PATH, which need not hold the environment the run started from."""
    if cmd and cmd[0] == "rlrecipe":
        return [sys.executable, "-m", "rlrecipe.cli.app", *cmd[1:]]
    return cmd


def shown_cmd(cmd: Sequence[str], key: str | None) -> str:
    """The command as logs and --dry-run print it, ready for a shell: the API key's value is not
    written out but read from the environment ("$SGLANG_API_KEY")."""
    return " ".join(f'"${API_KEY_ENV}"' if key and part == key else shlex.quote(part) for part in cmd)


@dataclass(frozen=True)
class ServerSpec:
    """One server to start: its index in the recipe, port, first GPU on its node, URL and command."""

    index: int
    port: int
    base_gpu: int
    url: str
    cmd: list[str]


def url_for(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def server_specs(model: str, cfg: SGLangServer, indices: Sequence[int], *, dtype: str, seed: int,
                 template: Sequence[str] | Callable[[int, int], list[str]] | None = None,
                 gpu_offset: int = 0, revision: str | None = None, memory_saver: bool = False,
                 kv_cache_dtype: str = "auto", lora_args: Sequence[str] = (),
                 key: str | None = None) -> list[ServerSpec]:
    """Servers `indices` of the recipe: server i on port base_port + i, its GPUs from gpu_offset +
    k x tp x dp on, k its place among `indices`; URLs as this node reaches them (host:port).
    `memory_saver` adds --enable-memory-saver to SGLang's own command only: a template must carry it;
    `kv_cache_dtype` adds --kv-cache-dtype to SGLang's command, and fills a template's {kv_cache_dtype};
    `lora_args` (trainer.lora) go to SGLang's command, and stand for a template's argument "{lora_args}";
    `key`, the fleet's API key, goes to SGLang's command (a template's server reads it from its environment)."""
    specs = []
    for k, i in enumerate(indices):
        port = cfg.base_port + i
        base_gpu = gpu_offset + k * gpus_per_server(cfg)
        if template is None:
            cmd = sglang_launch_cmd(model, cfg.host, port, i, cfg, dtype, seed, base_gpu=base_gpu, revision=revision,
                                    memory_saver=memory_saver, kv_cache_dtype=kv_cache_dtype, lora_args=lora_args,
                                    key=key)
        elif callable(template):
            cmd = list(template(i, port))
        else:
            # "{lora_args}" stands for the LoRA flags, zero or more arguments
            spliced = [a for part in template for a in (lora_args if part == LORA_PLACEHOLDER else [part])]
            cmd = own_cli(fill_placeholders(spliced, model=model, host=cfg.host, port=port, index=i, dtype=dtype,
                                            seed=seed, base_gpu_id=base_gpu, revision=revision or "",
                                            kv_cache_dtype=kv_cache_dtype))
        specs.append(ServerSpec(i, port, base_gpu, url_for(cfg.host, port), cmd))
    return specs


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


_LIBC = None


def _pdeathsig_hook():
    """A preexec_fn asking the kernel to SIGTERM the child when this process dies (Linux), or None.

    libc is loaded here, in the parent: the child, forked from a threaded process, only calls it.
    """
    global _LIBC
    if not sys.platform.startswith("linux"):
        return None
    try:
        if _LIBC is None:
            _LIBC = ctypes.CDLL(None, use_errno=True)
        prctl = _LIBC.prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


_LIVE: set[ServerProcess] = set()
_LIVE_LOCK = threading.Lock()


def _stop_all_at_exit() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for server in live:
        server.stop()


atexit.register(_stop_all_at_exit)


@dataclass(eq=False)
class ServerProcess:
    """One launched server: its own process group, its log file, a clean stop."""

    index: int
    url: str
    cmd: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    name: str = ""  # as errors call it; default "SGLang server <index>"
    metrics_url: str | None = None  # its Prometheus exporter, where known (a router launched by default)
    key: str | None = field(default=None, repr=False)  # its fleet's API key (api_key.fleet_key)
    proof: str = "socket_and_key"  # how it proves it is ours: rollout.sglang.ownership_proof
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def label(self) -> str:
        return self.name or f"SGLang server {self.index}"

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            if self.key is not None and self.key in self.cmd:
                # the key on its command line is in its log too (SGLang writes its arguments there)
                os.fchmod(log.fileno(), 0o600)
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} launching: {shown_cmd(self.cmd, self.key)}\n".encode())
            log.flush()
            in_main = threading.current_thread() is threading.main_thread()
            try:
                self.proc = subprocess.Popen(
                    self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env=self.env, start_new_session=True,
                    # SGLang stops its own children when it dies; this stops it when we die hard.
                    # (PDEATHSIG follows the forking *thread*, so only from the main thread.)
                    preexec_fn=_pdeathsig_hook() if in_main else None)
            except OSError as err:
                raise UserError(f"cannot start {self.label} ({self.cmd[0]}): {err}") from None
        with _LIVE_LOCK:
            _LIVE.add(self)

    @property
    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 1) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 8192))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        kept = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("=== ")]
        return " | ".join(kept[-lines:])

    def check_port(self) -> None:
        """Raise when another process holds this server's port (see sglang/ownership.py)."""
        if self.proof != "socket_and_key":
            return  # its socket is not checked: a wrapped launch's is another process's
        holder = foreign_holder(self.url, self.proc.pid) if self.proc is not None else None
        if holder is not None:
            raise taken_error(self.label, self.url, self.proc.pid, holder)

    def prove_ours(self) -> None:
        """Raise unless the server answering at this URL is this process (before anything but its
        health probe is sent to it)."""
        if self.proof != "off":
            prove_ours(self.label, self.url, self.proc.pid, self.key, by_socket=self.proof == "socket_and_key")

    def crash_error(self, what: str = "exited") -> UserError:
        last = redact(self.log_tail(), self.key)
        hint = f"; last log line: {last[:300]!r}" if last else ""
        return UserError(f"{self.label} ({self.url}) {what} with code {self.exit_code}{hint}; "
                         f"full log: {self.log_path}")

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM to the whole process group, then SIGKILL after `timeout` seconds."""
        proc = self.proc
        if proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)  # the group outlives a dead leader: always signal it
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=wait_s)
                if sig == signal.SIGTERM:
                    # children the server left behind in its group
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                break
            except subprocess.TimeoutExpired:
                continue
        with _LIVE_LOCK:
            _LIVE.discard(self)



def model_arg(model_dir: str | Path) -> str:
    """An absolute path when it is a local directory (servers have their own cwd), else as given (hub id)."""
    p = Path(model_dir)
    return str(p.resolve()) if p.exists() else str(model_dir)


def require_sglang() -> None:
    if importlib.util.find_spec("sglang") is None:
        raise UserError("rollout.engine=sglang: SGLang is not installed here (GPU machines: "
                        "`make install-gpu`); attach to running servers with rollout.urls, set "
                        "rollout.sglang.launch_cmd, or use rollout.engine=inprocess")


def launch_servers(model_dir: str | Path, cfg: SGLangServer, *, dtype: str = "bfloat16",
                   run_dir: str | Path | None = None, seed: int = 0,
                   launch_cmd: Sequence[str] | Callable[[int, int], list[str]] | None = None,
                   env: dict[str, str] | None = None, trainer_gpus: int = 0,
                   memory_saver: bool = False, kv_cache_dtype: str = "auto",
                   lora_args: Sequence[str] = (), key: str | None = None) -> list[ServerProcess]:
    """Start `cfg.num_servers` servers on base_port + i (not yet healthy); on failure none is left running.

    `launch_cmd` (or `cfg.launch_cmd`) replaces the SGLang command: a list with placeholders
    {model} {host} {port} {index} {dtype} {seed} {base_gpu_id} {revision} {kv_cache_dtype} (and an argument
    "{lora_args}": trainer.lora's flags), or a callable (index, port) -> argv.
    `trainer_gpus`: GPUs 0 .. trainer_gpus - 1 of this node train (servers launched beside
    training); the servers take the GPUs after them. `key`: the fleet's API key (api_key.fleet_key).
    """
    if cfg.nodes > 1:
        raise UserError(f"rollout.sglang.nodes is {cfg.nodes}: the run launches no servers then; start each "
                        f"node's share with `rlrecipe rollout-servers RECIPE --node N` (N = 0..{cfg.nodes - 1}) "
                        "and attach them with rollout.urls (docs/gpu.md: Rollout at scale)")
    template = launch_cmd if launch_cmd is not None else (cfg.launch_cmd or None)
    if template is None:  # a launch_cmd may not use GPUs at all
        require_sglang()
        check_gpus(cfg, visible_gpus(), trainer_gpus=trainer_gpus)
    specs = server_specs(model_arg(model_dir), cfg, range(cfg.num_servers), dtype=dtype, seed=seed,
                         template=template, gpu_offset=trainer_gpus, memory_saver=memory_saver,
                         kv_cache_dtype=kv_cache_dtype, lora_args=lora_args, key=key)
    return start_servers(specs, cfg, run_dir, env, key)


def start_servers(specs: Sequence[ServerSpec], cfg: SGLangServer, run_dir: str | Path | None,
                  env: dict[str, str] | None = None, key: str | None = None) -> list[ServerProcess]:
    """Start these servers (not yet healthy), logs in `run_dir`, given `key` in their environment;
    on failure none is left running."""
    run_dir = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="rlrecipe-sglang-"))
    servers: list[ServerProcess] = []
    try:
        for spec in specs:
            if not port_free(cfg.host, spec.port):
                raise UserError(f"rollout.sglang.base_port: port {spec.port} on {cfg.host} is already in use "
                                "(another server still running? pick another base_port, or attach to it "
                                "with rollout.urls)")
            server = ServerProcess(spec.index, spec.url, spec.cmd, run_dir / LOG_NAME.format(i=spec.index),
                                   env={**os.environ, **key_env(key), **(env or {})}, key=key,
                                   proof=cfg.ownership_proof)
            servers.append(server)
            server.start()
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


# -- this node's GPUs ------------------------------------------------------------------------------
def gpus_per_server(cfg: SGLangServer) -> int:
    return cfg.tp_size * cfg.dp_size


def gpus_needed(cfg: SGLangServer) -> int:
    """GPUs the launched servers take: num_servers x tp_size x dp_size."""
    return cfg.num_servers * gpus_per_server(cfg)


def trainer_gpus_on_node(trainer: TrainerSection) -> int:
    """GPUs the trainer takes on each of its nodes: one per process, LOCAL_RANK 0 .. nproc - 1
    (train/launch.py sets the device so)."""
    return trainer.nproc


def visible_gpus() -> int:
    """CUDA devices this process sees (CUDA_VISIBLE_DEVICES applied); 0 without CUDA."""
    import torch  # here: the HTTP client itself stays free of torch

    return torch.cuda.device_count()


def check_gpus(cfg: SGLangServer, visible: int, trainer_gpus: int = 0) -> None:
    """Refuse servers that need more GPUs than this node has, before SGLang fails on a missing device.

    `trainer_gpus`: the trainer's GPUs on this node when the servers are launched beside training.
    They count: the servers go on the GPUs after them rather than refused outright, since sharing
    one node between training ranks and servers is a valid layout as long as no GPU does both
    (an overlap would put SGLang's static memory fraction on a GPU the trainer already fills)."""
    need = gpus_needed(cfg)
    if need + trainer_gpus > visible:
        trainer = (f" after the trainer's {trainer_gpus} (trainer.nproc, GPUs 0..{trainer_gpus - 1}) = "
                   f"{need + trainer_gpus}" if trainer_gpus else "")
        raise UserError(f"rollout.sglang: num_servers {cfg.num_servers} x tp_size {cfg.tp_size} x dp_size "
                        f"{cfg.dp_size} = {need} GPUs{trainer}, but this node (rank 0, where the run launches "
                        f"its servers) has {visible}; lower rollout.sglang.num_servers, tp_size or dp_size"
                        f"{', or trainer.nproc' if trainer_gpus else ''}, or spread the servers over "
                        "rollout.sglang.nodes nodes (`rlrecipe rollout-servers`) and attach them with "
                        "rollout.urls (docs/gpu.md: Rollout at scale)")
