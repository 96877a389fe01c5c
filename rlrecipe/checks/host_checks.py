"""`rlrecipe doctor`'s checks of this machine's storage and memory against a recipe: the disk under
run.dir and rank 0's host memory against the recipe's footprint (host_disk.py, computed once by the
caller), an output directory it can write, and an export directory remote rollout servers can see."""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from rlrecipe.checks.check import FAIL, GB, GIB, OK, SHARED_FS, UNKNOWN, Check
from rlrecipe.recipe.schema import Recipe

if TYPE_CHECKING:
    from rlrecipe.checks.host_disk import Footprint


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


def check_disk(recipe: Recipe, footprint: Footprint) -> Check:
    parts = footprint.disk
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


def check_host_memory(footprint: Footprint) -> Check | None:
    parts = footprint.host
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
