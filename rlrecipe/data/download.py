"""`rlrecipe data download` / `rlrecipe data import`: raw file -> checked -> canonical JSONL.

download: fetch the registry entry's file from the hub (or the mirror in HF_ENDPOINT) with
huggingface_hub, at the pinned revision (or the commit recorded in `<dest>/checksums.lock`),
check its sha256 against the registry pin or the lock, convert it, and write
`<dest>/<name>/<kind>.jsonl` plus `<dest>/<name>/source.json` (provenance and counts) atomically.
The raw file stays in huggingface_hub's cache under `<dest>/.cache/huggingface`.

With no network the command fails within seconds (a short TCP connect check runs before
huggingface_hub, which would otherwise retry for ~25 s) and says how to proceed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from rlrecipe.core.atomic_io import atomic_write_text
from rlrecipe.core.errors import UserError
from rlrecipe.data.convert import ConversionReport, convert_file
from rlrecipe.data.io import write_jsonl_atomic
from rlrecipe.data.registry import (
    DATA_DIR,
    KINDS,
    REGISTRY_PATH,
    Entry,
    get_entry,
    load_lock,
    load_registry,
    lock_key,
    lock_path,
    record_lock,
)

DEFAULT_ENDPOINT = "https://huggingface.co"
CONNECT_TIMEOUT_S = 3.0
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass
class DataResult:
    name: str
    kind: str
    out_path: Path
    raw_path: Path
    sha256: str
    report: ConversionReport
    commit: str | None = None
    lock_recorded: Path | None = None
    notes: tuple[str, ...] = ()

    def summary_lines(self) -> list[str]:
        lines = list(self.notes)
        lines.append(f"sha256:    {self.sha256}" + (f" (commit {self.commit})" if self.commit else ""))
        if self.lock_recorded:
            lines.append(f"recorded:  sha256 and commit in {self.lock_recorded} (first download)")
        lines += self.report.summary_lines()
        lines.append(f"wrote:     {self.out_path}")
        return lines


# --- helpers -------------------------------------------------------------------------------------

def hub_endpoint() -> str:
    """The hub to talk to: HF_ENDPOINT if set (a mirror), else huggingface.co; read at call time."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _offline_env() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def _proxy_for(scheme: str, host: str) -> str | None:
    no_proxy = os.environ.get("NO_PROXY") or os.environ.get("no_proxy") or ""
    for item in (x.strip().lstrip(".") for x in no_proxy.split(",")):
        if item == "*" or (item and (host == item or host.endswith("." + item))):
            return None
    for var in (f"{scheme.upper()}_PROXY", f"{scheme}_proxy", "ALL_PROXY", "all_proxy"):
        if os.environ.get(var):
            return os.environ[var]
    return None


def check_reachable(endpoint: str, timeout: float = CONNECT_TIMEOUT_S) -> str | None:
    """None if a TCP connection to the endpoint (or its proxy) opens within `timeout`, else why not."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"HF_ENDPOINT={endpoint!r} is not an http(s) URL"
    host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    proxy = _proxy_for(parts.scheme, host)
    if proxy:
        p = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        if p.hostname:
            host, port = p.hostname, p.port or 8080
    # getaddrinfo has no timeout of its own: run it in a daemon thread and stop waiting.
    result: dict = {}

    def resolve() -> None:
        try:
            result["addrs"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as err:
            result["error"] = err

    thread = threading.Thread(target=resolve, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return f"cannot resolve {host} (DNS timed out after {timeout:.0f} s)"
    if "error" in result:
        return f"cannot resolve {host} ({result['error']})"
    last = None
    for family, socktype, proto, _, addr in result["addrs"]:
        try:
            with socket.socket(family, socktype, proto) as sock:
                sock.settimeout(timeout)
                sock.connect(addr)
            return None
        except OSError as err:
            last = err
    return f"cannot connect to {host}:{port} ({last})"


def _import_hint(name: str, entry: Entry, revision: str) -> str:
    return (f"get {entry.filename} from the {entry.repo_type} repo {entry.repo} (revision {revision}) elsewhere "
            f"and run `rlrecipe data import FILE --as {name}`")


def _how_to_proceed(name: str, entry: Entry, revision: str) -> str:
    return ("set HF_ENDPOINT to a reachable hub mirror (e.g. export HF_ENDPOINT=https://hf-mirror.com) and retry, "
            "or " + _import_hint(name, entry, revision))


def _unreachable(name: str, entry: Entry, revision: str, endpoint: str, why: str) -> UserError:
    return UserError(f"cannot download {name!r}: hub {endpoint} unreachable ({why}); "
                     + _how_to_proceed(name, entry, revision))


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0].rstrip(".") if text else type(err).__name__


_NETWORK_ERROR_NAMES = {"TransportError", "ConnectError", "TimeoutException", "ConnectionError", "Timeout",
                        "OfflineModeIsEnabled"}


def _is_network_error(err: BaseException) -> bool:
    """Connection/timeout errors of httpx2, httpx or requests (whichever huggingface_hub uses)."""
    if isinstance(err, (ConnectionError, TimeoutError)):
        return True
    return any(cls.__name__ in _NETWORK_ERROR_NAMES for cls in type(err).__mro__)


def _commit_from_snapshot_path(path: Path, filename: str) -> str | None:
    parents = path.parents
    depth = len(Path(filename).parts)
    if depth < len(parents) and parents[depth].name == "snapshots":
        return parents[depth - 1].name
    return None


def _check_name(name: str) -> None:
    if not _NAME_RE.match(name):
        raise UserError(f"dataset name {name!r} must be letters, digits, '.', '_' or '-' (it names a folder under data/)")


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _convert_and_write(raw_path: Path, kind: str, name: str, dest: Path, source_label: str,
                       provenance: dict) -> tuple[Path, ConversionReport]:
    result = convert_file(raw_path, kind, name=name, source=source_label)
    report = result.report
    if not result.rows:
        first = "; ".join(report.examples[:3]) or "the file holds no rows"
        raise UserError(f"{source_label}: no usable {kind} rows ({report.rejected} rejected: {first}); "
                        "nothing was written")
    out_dir = Path(dest) / name
    out_path = out_dir / f"{kind}.jsonl"
    write_jsonl_atomic(out_path, result.rows)
    meta = {**provenance, "kind": kind, "written": str(out_path), "rows_read": report.total,
            "rows_kept": report.kept, "rows_converted": report.converted, "rows_rejected": report.rejected,
            "rejected_reasons": dict(report.reasons), "changes": dict(report.changes), "written_at": _utc_now()}
    atomic_write_text(out_dir / "source.json", json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return out_path, report


# --- download ------------------------------------------------------------------------------------

def download(name: str, revision: str | None = None, dest: str | Path = DATA_DIR,
             registry_path: Path = REGISTRY_PATH, connect_timeout: float = CONNECT_TIMEOUT_S) -> DataResult:
    """Fetch, verify and convert a registered dataset; see the module docstring."""
    entry = get_entry(name, registry_path)
    dest = Path(dest)
    rev = revision or entry.revision
    key = lock_key(name, rev)
    locked = load_lock(dest).get(key)
    fetch_rev = (locked or {}).get("commit") or rev
    pinned = entry.sha256 if rev == entry.revision else None
    endpoint = hub_endpoint()
    notes: list[str] = []
    raw = _fetch(name, entry, rev, fetch_rev, endpoint, dest / ".cache" / "huggingface", registry_path,
                 connect_timeout, notes)

    commit = _commit_from_snapshot_path(raw, entry.filename)
    digest = sha256_file(raw)
    label = f"{entry.repo}/{entry.filename}@{commit or fetch_rev}"
    if pinned and digest != pinned:
        raise UserError(f"{label}: sha256 {digest} does not match {pinned} pinned for {name!r} in {registry_path}; "
                        f"refusing the file (nothing under {dest / name} was changed). If the pin is wrong, fix "
                        "the registry entry")
    if locked and locked.get("sha256") and digest != locked["sha256"]:
        raise UserError(f"{label}: sha256 {digest} differs from {locked['sha256']} recorded for {key!r} in "
                        f"{lock_path(dest)} at first download; refusing a silently changed file (nothing under "
                        f"{dest / name} was changed). To accept it, delete that record from the lock file")

    verified = ("registry" if pinned else "lock") if (pinned or (locked or {}).get("sha256")) else None
    provenance = {"name": name, "repo": entry.repo, "repo_type": entry.repo_type, "filename": entry.filename,
                  "revision": rev, "commit": commit, "sha256": digest, "size": raw.stat().st_size,
                  "endpoint": endpoint, "via": "download", "imported": False, "sha256_verified_against": verified}
    out_path, report = _convert_and_write(raw, entry.kind, name, dest, label, provenance)

    recorded = None
    if not locked:
        recorded = record_lock(dest, key, {"repo": entry.repo, "filename": entry.filename, "revision": rev,
                                           "commit": commit, "sha256": digest, "size": raw.stat().st_size,
                                           "recorded_at": _utc_now()})
    return DataResult(name=name, kind=entry.kind, out_path=out_path, raw_path=raw, sha256=digest, report=report,
                      commit=commit, lock_recorded=recorded, notes=tuple(notes))


def _fetch(name: str, entry: Entry, rev: str, fetch_rev: str, endpoint: str, cache_dir: Path, registry_path: Path,
           connect_timeout: float, notes: list[str]) -> Path:
    """The raw file of `entry` at `fetch_rev`: from the hub into `cache_dir`, or the cached copy when
    the hub is unreachable (said in `notes`); every hub failure is a UserError saying what to do."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    why = "HF_HUB_OFFLINE is set" if _offline_env() else check_reachable(endpoint, connect_timeout)
    if why is not None:
        hit = None
        if cache_dir.exists():
            hit = try_to_load_from_cache(entry.repo, entry.filename, cache_dir=cache_dir, revision=fetch_rev,
                                         repo_type=entry.repo_type)
        if not isinstance(hit, str):
            raise _unreachable(name, entry, rev, endpoint, why)
        notes.append(f"note:      hub unreachable ({why}); using the cached file {Path(hit)}")
        return Path(hit)
    try:
        return Path(hf_hub_download(repo_id=entry.repo, filename=entry.filename, repo_type=entry.repo_type,
                                    revision=fetch_rev, cache_dir=cache_dir, endpoint=endpoint, etag_timeout=10))
    except LocalEntryNotFoundError as err:  # the HEAD request failed and nothing is cached
        cause = err.__cause__ or err
        if _is_network_error(cause):
            raise _unreachable(name, entry, rev, endpoint, _first_line(cause)) from None
        raise UserError(f"cannot download {name!r} from {endpoint}: {_first_line(cause)}; "
                        + _how_to_proceed(name, entry, rev)) from None
    except GatedRepoError:
        raise UserError(f"cannot download {name!r}: {entry.repo} is gated; accept its terms on the hub and "
                        "set HF_TOKEN, or " + _import_hint(name, entry, rev)) from None
    except RepositoryNotFoundError:
        raise UserError(f"cannot download {name!r}: {entry.repo_type} repo {entry.repo} not found at {endpoint} "
                        f"(check {registry_path} or HF_ENDPOINT; private repos need HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise UserError(f"cannot download {name!r}: revision {fetch_rev!r} not found in {entry.repo} "
                        f"at {endpoint}") from None
    except EntryNotFoundError:
        raise UserError(f"cannot download {name!r}: {entry.filename} not found in {entry.repo} at revision "
                        f"{fetch_rev!r} ({endpoint})") from None
    except HfHubHTTPError as err:
        raise UserError(f"cannot download {name!r} from {endpoint}: {_first_line(err)}; "
                        + _how_to_proceed(name, entry, rev)) from None
    except Exception as err:  # e.g. the connection dropped mid-download, or the disk is full
        if _is_network_error(err):
            raise _unreachable(name, entry, rev, endpoint, _first_line(err)) from None
        if isinstance(err, OSError):
            raise UserError(f"cannot download {name!r} from {endpoint}: {_first_line(err)}") from None
        raise


# --- import --------------------------------------------------------------------------------------

def import_file(file: str | Path, name: str, kind: str | None = None, dest: str | Path = DATA_DIR,
                registry_path: Path = REGISTRY_PATH) -> DataResult:
    """Convert a local raw file (JSONL, JSON or Parquet) to `<dest>/<name>/<kind>.jsonl`.

    For a registered name the kind defaults to the registry's, and the file must match the sha256
    pinned in the registry or recorded in the lock when one is known. source.json marks the data
    imported, with the file's path and sha256; it never claims the registry's hub repo or revision.
    """
    file = Path(file)
    _check_name(name)
    if not file.exists():
        raise UserError(f"{file}: file not found")
    if file.is_dir():
        raise UserError(f"{file}: is a directory, expected a .jsonl, .json or .parquet file")
    dest = Path(dest)
    entry = get_entry(name, registry_path) if name in load_registry(registry_path) else None
    if kind is not None and kind not in KINDS:
        raise UserError(f"--kind {kind!r}: expected one of {', '.join(KINDS)}")
    if entry is not None:
        if kind is not None and kind != entry.kind:
            raise UserError(f"{name!r} is registered in {registry_path} as kind {entry.kind!r}, not {kind!r}; "
                            "drop --kind or import under another name with --as")
        kind = entry.kind
    elif kind is None:
        raise UserError(f"{name!r} is not in {registry_path}: pass --kind rl|sft|eval")

    digest = sha256_file(file)
    verified = None
    if entry is not None:
        expected, where, verified = entry.sha256, f"pinned in {registry_path}", "registry"
        if not expected:
            record = load_lock(dest).get(lock_key(name, entry.revision)) or {}
            expected, where, verified = record.get("sha256"), f"recorded in {lock_path(dest)}", "lock"
        if expected and digest != expected:
            raise UserError(f"{file}: sha256 {digest} does not match {expected} {where} for {name!r}; refusing it "
                            f"(nothing under {dest / name} was changed). If this is intentionally a different file, "
                            f"import it under another name: --as {name}-local --kind {kind}")
        if not expected:
            verified = None

    # An import records only what is known of it: its path and digest. Only a download, which
    # fetched the file from the hub itself, names a hub repo and revision; a matching pinned
    # sha256 is the one link an import has to the hub file, and it is recorded as such.
    provenance = {"name": name, "via": "import", "imported": True, "source_path": str(file.resolve()),
                  "sha256": digest, "size": file.stat().st_size, "sha256_verified_against": verified}
    out_path, report = _convert_and_write(file, kind, name, dest, str(file), provenance)
    return DataResult(name=name, kind=kind, out_path=out_path, raw_path=file, sha256=digest, report=report)
