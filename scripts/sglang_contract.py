"""The SGLang contract: what the client sends and reads, checked against SGLang's own released packages.

`make sglang-contract` (needs the package index) downloads the wheels of the two ends of the pin
(`pip download --no-deps`, nothing installed), reads them as source, and writes a small summary to
tests/data/sglang_contract.json: for each version, the routed HTTP endpoints, the fields of the
request dataclasses the client fills, the accepted `sampling_params` keys, the launch flags, and
where each response field the client reads is produced, with the files each was read from. The
test suite checks the client against that summary offline (tests/rollout/test_sglang_contract.py, with
`problems` below), so a field SGLang renames fails a test, not a run.

    python -m scripts.sglang_contract [--versions 0.5.1 0.5.23] [--wheels DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "sglang_contract.json"

HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
SAMPLING = "sglang/srt/sampling/sampling_params.py"
API_TYPES = "sglang/api/v1/api_types.py"  # 0.5.22 on: the schema /generate bodies are checked against
SERVER_ARGS = "sglang/srt/server_args.py"
ARG_FIELDS = "sglang/srt/arg_groups/fields/"  # 0.5.23: launch flags declared as annotated fields

# the request dataclasses whose fields the client fills (io_struct.py)
REQUESTS = ("GenerateReqInput", "UpdateWeightFromDiskReqInput", "InitWeightsUpdateGroupReqInput",
            "UpdateWeightsFromDistributedReqInput", "DestroyWeightsUpdateGroupReqInput", "GetWeightsByNameReqInput",
            "AbortReq", "BeginWeightUpdateReqInput", "EndWeightUpdateReqInput", "CheckWeightsReqInput",
            "UpdateWeightsFromTensorReqInput", "ReleaseMemoryOccupationReqInput", "ResumeMemoryOccupationReqInput")
# The last three were added to the summary without the wheels at hand: 0.5.23's fields were read
# with `_class_fields` from the installed package's io_struct.py (its sha256 matches the wheel's
# RECORD); 0.5.1's summary names them under `requests_unread`, and the check skips only those,
# until `make sglang-contract` reads them from its wheel (which drops the key).

# response fields the client reads, and the files of the package that produce them
RESPONSE_FIELDS = {
    "meta_info.output_token_logprobs": ["sglang/srt/managers/tokenizer_manager.py"],
    "meta_info.finish_reason": ["sglang/srt/managers/tokenizer_manager.py"],
    "meta_info.weight_version": ["sglang/srt/managers/tokenizer_manager.py"],
    "server_info.version": [HTTP_SERVER],
    "server_info.context_length": [SERVER_ARGS, ARG_FIELDS],
    "server_info.max_req_input_len": ["sglang/srt/managers/scheduler.py"],
    "server_info.tp_size": [SERVER_ARGS, ARG_FIELDS],
    "server_info.dp_size": [SERVER_ARGS, ARG_FIELDS],
    "server_info.device": [SERVER_ARGS, ARG_FIELDS],
    "model_info.model_path": [HTTP_SERVER],
    "weights_checker.ranks": [HTTP_SERVER],
    "weights_checker.checksums": [IO_STRUCT, "sglang/srt/utils/weight_checker.py"],
}


# -- reading one wheel -------------------------------------------------------------------------------
def _routes(source: str) -> dict[str, list[str]]:
    """`@app.get("/path")`, `@app.post(...)`, `@app.api_route("/path", methods=[...])` -> {path: methods}."""
    routes: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for dec in node.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                    and isinstance(dec.func.value, ast.Name) and dec.func.value.id == "app"):
                continue
            if not (dec.args and isinstance(dec.args[0], ast.Constant) and isinstance(dec.args[0].value, str)):
                continue  # a path from the environment (an optional route) is not the contract
            kind = dec.func.attr
            if kind == "api_route":
                methods = next((kw.value for kw in dec.keywords if kw.arg == "methods"), None)
                names = [e.value for e in methods.elts] if isinstance(methods, ast.List) else ["GET"]
            elif kind in ("get", "post", "put", "delete"):
                names = [kind.upper()]
            else:
                continue
            routes.setdefault(dec.args[0].value, set()).update(names)
    return {p: sorted(m) for p, m in sorted(routes.items())}


def _class_fields(source: str) -> dict[str, list[str]]:
    """Each class's annotated fields, its bases' in this module included (BaseReq's rid)."""
    classes = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}

    def fields(name: str, seen: frozenset = frozenset()) -> list[str]:
        node = classes.get(name)
        if node is None or name in seen:
            return []
        own = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
        inherited = [f for b in node.bases if isinstance(b, ast.Name) for f in fields(b.id, seen | {name})]
        return sorted(set(own + inherited))

    return {name: fields(name) for name in classes}


def _init_args(source: str, cls: str) -> list[str]:
    """The keyword arguments of `cls.__init__` (SamplingParams before it became a struct)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    return sorted(a.arg for a in item.args.args + item.args.kwonlyargs if a.arg != "self")
    return []


def _flags(files: dict[str, str]) -> list[str]:
    """Launch flags: `add_argument("--x", ...)` in server_args.py, or (0.5.23) annotated fields in
    arg_groups/fields/*.py, named "--" + name with dashes, plus their aliases."""
    flags: set[str] = set()
    if SERVER_ARGS in files:
        for node in ast.walk(ast.parse(files[SERVER_ARGS])):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
                flags.update(a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--"))
    for path, text in files.items():
        if path.startswith(ARG_FIELDS):
            flags.update("--" + n.replace("_", "-") for n in re.findall(r"^    ([a-z_0-9]+): A\[", text, re.M))
            for group in re.findall(r"aliases=\[([^\]]*)\]", text):
                flags.update(re.findall(r"\"(--[a-z0-9-]+)\"", group))
    return sorted(flags)


def _produced(files: dict[str, str], field: str, where: list[str]) -> list[str]:
    """The files among `where` (paths or folders) that name `field` as a quoted key or a declared field."""
    name = field.rsplit(".", 1)[1]
    pattern = re.compile(rf"[\"']{name}[\"']|^\s+{name}\s*:", re.M)
    return sorted(p for p, text in files.items() if any(p == w or (w.endswith("/") and p.startswith(w))
                                                        for w in where) and pattern.search(text))


def read_wheel(wheel: Path) -> dict:
    """The summary of one SGLang wheel (read as source, nothing imported)."""
    with zipfile.ZipFile(wheel) as z:
        files = {n: z.read(n).decode("utf-8", "replace") for n in z.namelist()
                 if n.endswith(".py") and n.startswith(("sglang/srt/", "sglang/api/", "sglang/version.py"))}
    classes = _class_fields(files[IO_STRUCT])
    if API_TYPES in files:
        sampling, sampling_from = _class_fields(files[API_TYPES])["SamplingParams"], API_TYPES
    else:
        sampling, sampling_from = _init_args(files[SAMPLING], "SamplingParams"), SAMPLING
    flag_files = sorted(p for p in files if p == SERVER_ARGS or p.startswith(ARG_FIELDS))
    return {
        "wheel": wheel.name,
        "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
        "endpoints": _routes(files[HTTP_SERVER]),
        "endpoints_from": HTTP_SERVER,
        "requests": {c: classes[c] for c in REQUESTS if c in classes},
        "requests_from": IO_STRUCT,
        "sampling_params": sampling,
        "sampling_params_from": sampling_from,
        "launch_flags": _flags(files),
        "launch_flags_from": flag_files if len(flag_files) <= 3 else [ARG_FIELDS + "*.py", SERVER_ARGS],
        "response_fields": {f: _produced(files, f, w) for f, w in RESPONSE_FIELDS.items()},
    }


def version_of(wheel: Path) -> str:
    return wheel.name.split("-")[1]


def download(versions: list[str], into: Path) -> list[Path]:
    for v in versions:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"sglang=={v}", "-d",
                        str(into)], check=True)
    return sorted(p for p in into.glob("sglang-*.whl") if version_of(p) in versions)


# -- the client against a summary -------------------------------------------------------------------
def client_contract() -> dict:
    """What the client sends and reads, taken from its own code where it is built there."""
    from rlrecipe.recipe.systems import SGLangServer
    from rlrecipe.rollout.sglang.api import generate_payload, sglang_sampling_params
    from rlrecipe.rollout.sglang.server import sglang_launch_cmd
    from rlrecipe.rollout.sglang.tensor_push import tensor_bodies
    from rlrecipe.rollout.sglang.versions import SAMPLING_KEYS
    from rlrecipe.trajectory.record import SamplingParams

    sp = sglang_sampling_params(SamplingParams(top_k=20), 16, [1])
    cmd = sglang_launch_cmd("m", "127.0.0.1", 30000, 0, SGLangServer(), "bfloat16", seed=0, base_gpu=0,
                            revision="main", memory_saver=True)
    # the last bucket's body carries every field a tensor push sends
    tensor_body = list(tensor_bodies({"w": __import__("torch").zeros(1)}, 1, 1 << 20, 1))[-1]
    return {
        # endpoint -> the Dialect property that says which versions have it (None: every version)
        "endpoints": {"/generate": None, "/abort_request": None, "/update_weights_from_disk": None,
                      "/init_weights_update_group": None, "/update_weights_from_distributed": None,
                      "/destroy_weights_update_group": "destroy_group", "/begin_weight_update": "weight_update_session",
                      "/end_weight_update": "weight_update_session", "/get_weights_by_name": None,
                      "/weights_checker": "weights_checksum", "/health_generate": None,
                      "/update_weights_from_tensor": None, "/release_memory_occupation": None,
                      "/resume_memory_occupation": None, "/flush_cache": None,
                      # the client asks the new name and falls back on the old one after a 404
                      ("/model_info", "/get_model_info"): None, ("/server_info", "/get_server_info"): None},
        "requests": {
            "GenerateReqInput": sorted(generate_payload([1], sp, "r")),
            "UpdateWeightFromDiskReqInput": ["model_path", "weight_version"],
            "InitWeightsUpdateGroupReqInput": ["backend", "group_name", "master_address", "master_port",
                                               "rank_offset", "world_size"],
            "UpdateWeightsFromDistributedReqInput": ["dtypes", "flush_cache", "group_name", "names", "shapes",
                                                     "weight_version"],
            "DestroyWeightsUpdateGroupReqInput": ["group_name"],
            "GetWeightsByNameReqInput": ["name", "truncate_size"],
            "AbortReq": ["abort_all", "rid"],
            "CheckWeightsReqInput": ["action"],
            "UpdateWeightsFromTensorReqInput": sorted(tensor_body),
            "ReleaseMemoryOccupationReqInput": ["tags"],  # rollout/sglang/memory.py
            "ResumeMemoryOccupationReqInput": ["tags"],
        },
        "request_gates": {"BeginWeightUpdateReqInput": "weight_update_session",
                          "EndWeightUpdateReqInput": "weight_update_session",
                          "CheckWeightsReqInput": "weights_checksum",
                          "DestroyWeightsUpdateGroupReqInput": "destroy_group"},
        # sampling_seed: sent where the server's version has it (sglang/call.py)
        "sampling_params": sorted(set(sp) | set(SAMPLING_KEYS) | {"sampling_seed"}),
        "sampling_gated": {"sampling_seed": "sampling_seed"},
        "launch_flags": sorted({a for a in cmd if a.startswith("--")} | {"--api-key"}),  # the key: when set
        "response_fields": sorted(RESPONSE_FIELDS),
        "response_gates": {"weights_checker.ranks": "weights_checksum", "weights_checker.checksums": "weights_checksum",
                           "meta_info.weight_version": None},
    }


def problems(summary: dict, client: dict) -> list[str]:
    """Every endpoint, request field, sampling key, launch flag and response field the client uses
    that a summarised version lacks, and every version rule (rollout/sglang/versions.py, Dialect) the packages
    contradict; [] when the client and the packages agree."""
    from rlrecipe.rollout.sglang.versions import Dialect, parse_version

    out = []
    for version, s in summary["sglang_versions"].items():
        d = Dialect(parse_version(version))
        for path, gate in client["endpoints"].items():
            names = path if isinstance(path, tuple) else (path,)
            routed = any(n in s["endpoints"] for n in names)
            expected = getattr(d, gate) if gate else True
            if routed != expected:
                what = "not routed" if expected else f"routed, but Dialect.{gate} says it is not"
                out.append(f"{version}: endpoint {names[0]} {what} ({s['endpoints_from']})")
        for cls, fields in client["requests"].items():
            gate = client["request_gates"].get(cls)
            if gate and not getattr(d, gate):
                continue
            have = s["requests"].get(cls)
            if have is None and cls in s.get("requests_unread", ()):
                continue  # not read from this version's wheel yet (see REQUESTS)
            if have is None:
                out.append(f"{version}: no request class {cls} ({s['requests_from']})")
                continue
            out += [f"{version}: {cls} has no field {f} ({s['requests_from']})" for f in fields if f not in have]
        for key in client["sampling_params"]:
            gate = client["sampling_gated"].get(key)
            has = key in s["sampling_params"]
            if gate and has != getattr(d, gate):
                out.append(f"{version}: sampling_params.{key} {'exists' if has else 'is missing'}, but "
                           f"Dialect.{gate} says otherwise ({s['sampling_params_from']})")
            elif not gate and not has:
                out.append(f"{version}: sampling_params has no key {key} ({s['sampling_params_from']})")
        out += [f"{version}: no launch flag {f} ({', '.join(s['launch_flags_from'])})"
                for f in client["launch_flags"] if f not in s["launch_flags"]]
        for field in client["response_fields"]:
            gate = client["response_gates"].get(field, None)
            if field in client["response_gates"] and gate is None:
                continue  # read where present (weight_version: the client checks it only when answered)
            if gate and not getattr(d, gate):
                continue
            if not s["response_fields"].get(field):
                out.append(f"{version}: nothing produces {field} (looked in {', '.join(RESPONSE_FIELDS[field])})")
    return out


def main() -> None:
    from rlrecipe.rollout.sglang.versions import LOWEST, NEWEST

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--versions", nargs="+", default=[".".join(map(str, LOWEST)), ".".join(map(str, NEWEST))])
    ap.add_argument("--wheels", type=Path, help="a folder with the wheels already downloaded")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wheels = (sorted(p for p in args.wheels.glob("sglang-*.whl") if version_of(p) in args.versions)
                  if args.wheels else download(args.versions, Path(tmp)))
        missing = set(args.versions) - {version_of(w) for w in wheels}
        if missing:
            sys.exit(f"no wheel for sglang {', '.join(sorted(missing))}")
        summary = {"about": "read by scripts/sglang_contract.py from SGLang's released wheels; "
                            "make sglang-contract rebuilds it",
                   "sglang_versions": {version_of(w): read_wheel(w) for w in wheels}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    found = problems(summary, client_contract())
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}: "
          f"{', '.join(summary['sglang_versions'])}; {len(found)} problem(s) with the client")
    for p in found:
        print("  " + p)
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
