"""`rlrecipe rollout-servers`: one node's share of a recipe's SGLang servers, in the foreground.

With `rollout.sglang.nodes` = N, node n (0 .. N-1) starts servers n x S .. (n + 1) x S - 1 of the
recipe, S = num_servers / N: server i on port base_port + i (unique across the nodes, as the
run's own launch numbers them), its tp_size x dp_size GPUs from k x tp x dp on this node (k = i -
n x S). The command lines come from the same builder as the run's launch (`sglang_launch_cmd` or
`rollout.sglang.launch_cmd`, with `--api-key` from SGLANG_API_KEY). Once every server answers
/health_generate, their URLs go to stdout as a YAML list and, with `urls_out`, are merged into
one shared YAML list that every node writes under a file lock; the run attaches to it with
`--set "rollout.urls=$(cat FILE)"`. The command then stays until Ctrl-C or SIGTERM (or until a
server exits more than `rollout.sglang.max_restarts` times: an error naming it and its log; up to
then it is started again, and a run with retry_on_other_servers takes it back), stops its servers
and takes its URLs out of the file again, so the list names servers that are up.
"""

from __future__ import annotations

import shlex
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import yaml
from filelock import FileLock, Timeout

from rlrecipe.core.atomic_io import atomic_write_text
from rlrecipe.core.console import console
from rlrecipe.core.errors import UserError
from rlrecipe.recipe.schema import LoadedRecipe, Recipe
from rlrecipe.recipe.systems import SGLangServer
from rlrecipe.rollout.sglang.api_key import user_key
from rlrecipe.rollout.sglang.health import probe_health, wait_until_healthy
from rlrecipe.rollout.sglang.lora import launch_args
from rlrecipe.rollout.sglang.server import (
    LOG_NAME,
    ServerProcess,
    ServerSpec,
    gpus_per_server,
    model_arg,
    require_sglang,
    server_specs,
    shown_cmd,
    start_servers,
    url_for,
    visible_gpus,
)

URLS_LOCK_TIMEOUT_S = 120.0  # other nodes hold the lock for one read and one rename
ALIVE_POLL_S = 1.0
PROBE_S = 2.0  # a restarted server's health probe, once a poll
ANY_ADDRESS = ("0.0.0.0", "::", "")


@dataclass
class NodePlan:
    """What one node starts: its servers, the URLs the run reaches them at, the GPUs they take."""

    node: int
    nodes: int
    specs: list[ServerSpec]
    urls: list[str]  # as other nodes reach them (the specs' own URLs are this node's, for health)
    gpus: int


def node_share(cfg: SGLangServer, node: int) -> range:
    """The recipe's server indices that node `node` starts."""
    if not 0 <= node < cfg.nodes:
        raise UserError(f"--node {node}: rollout.sglang.nodes is {cfg.nodes}, so --node is one of "
                        f"0..{cfg.nodes - 1} (more rollout nodes: set rollout.sglang.nodes)")
    per_node = cfg.num_servers // cfg.nodes  # the recipe refuses a num_servers that does not split
    return range(node * per_node, (node + 1) * per_node)


def check_node_gpus(cfg: SGLangServer, gpus: int, source: str = "--gpus") -> None:
    """Refuse a node's share that needs more GPUs than the node has, before anything starts."""
    per_node = cfg.num_servers // cfg.nodes
    need = per_node * gpus_per_server(cfg)
    if need > gpus:
        raise UserError(f"rollout.sglang: num_servers {cfg.num_servers} / nodes {cfg.nodes} = {per_node} servers "
                        f"per node x tp_size {cfg.tp_size} x dp_size {cfg.dp_size} = {need} GPUs, but this node "
                        f"has {gpus} ({source}); raise rollout.sglang.nodes or lower num_servers, tp_size or dp_size")


def server_model(recipe: Recipe) -> tuple[str, str | None]:
    """The model the servers start with and the hub revision that pins it (None for a local
    directory); the run also loads its own exact snapshot into them on attach, but until then
    the tokenizer and config they serve with are the model.revision the trainer reads."""
    if recipe.run.init_from:
        from rlrecipe.run.record import resolve_init  # local: runs pulls in the run machinery

        return model_arg(resolve_init(recipe.run.init_from, recipe.run.output_dir)), None
    if recipe.model.path:
        local = Path(recipe.model.path).is_dir()
        return model_arg(recipe.model.path), None if local else recipe.model.revision
    raise UserError("model: SGLang servers need model.path or run.init_from (model.tiny is built by the run "
                    "itself, which then launches its own servers)")


def advertised_host(bind_host: str) -> str:
    """How other nodes name this one: the bound address, or this machine's name when bound to all."""
    return socket.gethostname() if bind_host in ANY_ADDRESS else bind_host


def plan_node(recipe: Recipe, node: int, *, gpus: int | None, url_host: str | None = None,
              gpus_source: str = "--gpus") -> NodePlan:
    """Node `node`'s servers; `gpus`: the GPUs this node has for them (None: not checked)."""
    if recipe.rollout.engine != "sglang":
        raise UserError(f"rollout.engine is {recipe.rollout.engine}: this recipe samples without SGLang "
                        "servers (set rollout.engine: sglang)")
    cfg = recipe.rollout.sglang
    indices = node_share(cfg, node)
    if gpus is not None:
        check_node_gpus(cfg, gpus, gpus_source)
    model, revision = server_model(recipe)
    specs = server_specs(model, cfg, indices, dtype=recipe.rollout.dtype, seed=recipe.run.seed,
                         template=cfg.launch_cmd or None, revision=revision,
                         memory_saver=recipe.rollout.colocate, kv_cache_dtype=recipe.rollout.kv_cache_dtype,
                         lora_args=launch_args(recipe.trainer.lora), key=user_key())
    host = url_host or advertised_host(cfg.host)
    return NodePlan(node, cfg.nodes, specs, [url_for(host, s.port) for s in specs],
                    len(indices) * gpus_per_server(cfg))


# -- the shared URL list --------------------------------------------------------------------------
URLS_HEADER = ("# rollout.urls, one SGLang server a line in server order, written by `rlrecipe rollout-servers`\n"
               "# attach: rlrecipe rl RECIPE --set \"rollout.urls=$(cat {path})\"\n")


def _port(url: str) -> int:
    try:
        return urlsplit(url).port or -1
    except ValueError:
        return -1


def read_urls(path: Path) -> list[str]:
    if not path.exists():
        return []
    try:
        urls = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: not a YAML list of URLs ({err})") from None
    if urls is None:
        return []
    if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
        raise UserError(f"{path}: not a YAML list of URLs (rlrecipe rollout-servers writes one; start a new file)")
    return urls


def update_urls(path: Path, urls: list[str], *, add: bool) -> list[str]:
    """Put `urls` into (add) or take them out of the list in `path`, under a lock shared by the nodes.

    A server is known by its port (base_port + its index, unique across nodes), so a node that
    restarts under another address replaces its old entries instead of doubling them."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ports = {_port(u) for u in urls}
    try:
        with FileLock(str(path) + ".lock", timeout=URLS_LOCK_TIMEOUT_S):
            kept = [u for u in read_urls(path) if _port(u) not in ports]
            merged = sorted(kept + (list(urls) if add else []), key=lambda u: (_port(u), u))
            atomic_write_text(path, URLS_HEADER.format(path=shlex.quote(str(path)))
                              + "".join(f"- {u}\n" for u in merged))
    except Timeout:
        raise UserError(f"{path}: another process held {path}.lock for {URLS_LOCK_TIMEOUT_S:.0f}s "
                        "(a stuck rollout-servers? remove the lock file if none runs)") from None
    return merged


# -- the command ------------------------------------------------------------------------------------
def print_plan(plan: NodePlan, out: Callable[[str], None]) -> None:
    """--dry-run: each server's command and the URLs, on stdout."""
    first, last = plan.specs[0].index, plan.specs[-1].index
    out(f"# node {plan.node} of {plan.nodes}: servers {first}..{last}, {plan.gpus} GPUs")
    per_server = plan.gpus // len(plan.specs)
    for spec in plan.specs:
        out(f"# server {spec.index}: port {spec.port}, GPUs {spec.base_gpu}..{spec.base_gpu + per_server - 1}")
        out(shown_cmd(spec.cmd, user_key()))
    out("# rollout.urls from this node:")
    for url in plan.urls:
        out(f"- {url}")


def _note(text: str) -> None:
    """A line for the operator, on stderr (stdout carries the URLs), never wrapped."""
    console.print(text, highlight=False, soft_wrap=True)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM ends the command as Ctrl-C does: servers stopped, URLs removed


def stop_all(servers: list[ServerProcess]) -> None:
    if servers:
        with ThreadPoolExecutor(max_workers=len(servers)) as pool:
            list(pool.map(lambda s: s.stop(), servers))


def _keep_alive(servers: list[ServerProcess], max_restarts: int) -> None:
    """Until interrupted: a server that exits is started again, `max_restarts` times each; one more
    exit raises its crash error. A restarted server proves it is ours once it answers, and its port
    taken by another process meanwhile raises (the URL listed would reach that process)."""
    restarts_left = {s.index: max_restarts for s in servers}
    unproven: set[int] = set()  # restarted, not yet shown to be ours
    while True:
        for s in servers:
            if s.index in unproven:
                s.check_port()
                if s.alive() and probe_health(s.url, PROBE_S) is None:
                    s.prove_ours()
                    unproven.discard(s.index)
            if not s.alive():
                if not restarts_left[s.index]:
                    raise s.crash_error()
                restarts_left[s.index] -= 1
                _note(f"{s.crash_error()}; starting it again ({restarts_left[s.index]} restarts left); a run "
                      "with retry_on_other_servers takes it back once it answers")
                s.stop()  # what its process group left behind
                s.start()
                unproven.add(s.index)
        time.sleep(ALIVE_POLL_S)


def run_node(loaded: LoadedRecipe, node: int, *, gpus: int | None = None, url_host: str | None = None,
             urls_out: Path | None = None, log_dir: Path | None = None, dry_run: bool = False,
             out: Callable[[str], None] = print) -> NodePlan:
    """Plan node `node`'s servers; unless `dry_run`, start them, report them, serve until stopped."""
    cfg = loaded.recipe.rollout.sglang
    template = cfg.launch_cmd or None
    source = "--gpus"
    if gpus is None and not dry_run and template is None:  # a launch_cmd may not use GPUs at all
        require_sglang()
        gpus, source = visible_gpus(), "GPUs visible here"
    plan = plan_node(loaded.recipe, node, gpus=gpus, url_host=url_host, gpus_source=source)
    if dry_run:
        print_plan(plan, out)
        if gpus is None:
            _note("GPUs not checked: pass --gpus to check this node's share against them")
        return plan
    log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix=f"rlrecipe-rollout-node{node}-"))
    first, last = plan.specs[0].index, plan.specs[-1].index
    _note(f"node {node} of {plan.nodes}: starting servers {first}..{last} ({plan.gpus} GPUs), logs "
          f"{log_dir / LOG_NAME.format(i='<i>')}")
    in_main = threading.current_thread() is threading.main_thread()  # signals reach the main thread only
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
    servers: list[ServerProcess] = []
    listed = False
    try:
        if in_main:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, _raise_interrupt)
        servers = start_servers(plan.specs, cfg, log_dir, key=user_key())  # the user's: the runs attaching need it
        wait_until_healthy([(s.url, s) for s in servers], cfg.startup_timeout_s)
        for url in plan.urls:
            out(f"- {url}")
        if urls_out is not None:
            listed = True
            merged = update_urls(urls_out, plan.urls, add=True)
            _note(f"{urls_out}: {len(merged)} of {cfg.num_servers} servers listed")
        _note(f"node {node}: {len(servers)} servers up; Ctrl-C or SIGTERM stops them")
        _keep_alive(servers, cfg.max_restarts)
    except KeyboardInterrupt:
        _note(f"node {node}: stopping {len(servers)} servers")
    finally:
        for sig in handlers:  # a second signal must not cut the stop short (each stop is bounded)
            signal.signal(sig, signal.SIG_IGN)
        try:
            stop_all(servers)
            if listed:
                update_urls(urls_out, plan.urls, add=False)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    return plan
