"""The client against SGLang's own packages, offline: tests/data/sglang_contract.json was read from the
released wheels of both ends of the pin by scripts/sglang_contract.py (`make sglang-contract`)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from rlrecipe.rollout.sglang.versions import LOWEST, NEWEST
from scripts.sglang_contract import OUT, client_contract, problems

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def summary() -> dict:
    return json.loads(OUT.read_text())


def test_the_summary_covers_both_ends_of_the_pin_and_says_where_it_was_read(summary):
    ends = {".".join(map(str, LOWEST)), ".".join(map(str, NEWEST))}
    assert set(summary["sglang_versions"]) == ends
    pin = re.search(r'"sglang\[all\]>=([\d.]+),<=([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin and set(pin.groups()) == ends  # the extra installs what was checked
    for version, s in summary["sglang_versions"].items():
        assert s["wheel"].startswith(f"sglang-{version}-") and len(s["sha256"]) == 64
        assert s["endpoints_from"].endswith("http_server.py") and s["requests_from"].endswith("io_struct.py")
        assert "/generate" in s["endpoints"] and "POST" in s["endpoints"]["/generate"]


def test_everything_the_client_sends_and_reads_exists_in_both_ends_of_the_pin(summary):
    assert problems(summary, client_contract()) == []


def test_the_version_rules_are_the_packages(summary):
    """What differs between the ends is what sglang_versions.Dialect says differs."""
    old, new = (summary["sglang_versions"][".".join(map(str, v))] for v in (LOWEST, NEWEST))
    assert "/begin_weight_update" in new["endpoints"] and "/begin_weight_update" not in old["endpoints"]
    assert "/destroy_weights_update_group" not in old["endpoints"]
    assert "sampling_seed" in new["sampling_params"] and "sampling_seed" not in old["sampling_params"]
    assert "/get_model_info" in old["endpoints"] and "/model_info" not in old["endpoints"]


@pytest.mark.parametrize("mutate, named", [
    (lambda s: s["requests"]["GenerateReqInput"].remove("logprob_start_len"), "GenerateReqInput has no field "
                                                                             "logprob_start_len"),
    (lambda s: s["requests"]["UpdateWeightsFromDistributedReqInput"].remove("group_name"), "no field group_name"),
    (lambda s: s["endpoints"].pop("/abort_request"), "endpoint /abort_request not routed"),
    (lambda s: s["sampling_params"].remove("no_stop_trim"), "sampling_params has no key no_stop_trim"),
    (lambda s: s["launch_flags"].remove("--base-gpu-id"), "no launch flag --base-gpu-id"),
    (lambda s: s["response_fields"].update({"meta_info.output_token_logprobs": []}), "output_token_logprobs"),
])
@pytest.mark.parametrize("end", [LOWEST, NEWEST])
def test_a_field_renamed_in_either_end_is_named(summary, mutate, named, end):
    version = ".".join(map(str, end))
    changed = copy.deepcopy(summary)
    mutate(changed["sglang_versions"][version])
    found = problems(changed, client_contract())
    assert len(found) == 1 and found[0].startswith(f"{version}: ") and named in found[0]


def test_a_version_rule_the_packages_contradict_is_named(summary):
    changed = copy.deepcopy(summary)
    old = changed["sglang_versions"][".".join(map(str, LOWEST))]
    old["endpoints"]["/begin_weight_update"] = ["POST"]  # as if the session had been there all along
    old["sampling_params"].append("sampling_seed")
    found = problems(changed, client_contract())
    assert any("endpoint /begin_weight_update routed, but Dialect.weight_update_session" in p for p in found)
    assert any("sampling_params.sampling_seed exists, but Dialect.sampling_seed" in p for p in found)


def test_the_colocated_requests_are_checked_against_0_5_23_and_left_unread_only_for_0_5_1(summary):
    client = client_contract()
    newest = summary["sglang_versions"][".".join(map(str, NEWEST))]
    for cls in ("UpdateWeightsFromTensorReqInput", "ReleaseMemoryOccupationReqInput",
                "ResumeMemoryOccupationReqInput"):
        assert set(client["requests"][cls]) <= set(newest["requests"][cls])
        assert cls not in newest.get("requests_unread", [])
    assert set(client["requests"]["UpdateWeightsFromTensorReqInput"]) >= {
        "serialized_named_tensors", "load_format", "flush_cache", "weight_version"}
    broken = copy.deepcopy(client)
    broken["requests"]["UpdateWeightsFromTensorReqInput"].append("serialized_tensors")
    broken["endpoints"]["/release_memory"] = None
    found = problems(summary, broken)
    assert f"{'.'.join(map(str, NEWEST))}: UpdateWeightsFromTensorReqInput has no field serialized_tensors " \
           f"(sglang/srt/managers/io_struct.py)" in found
    assert any("endpoint /release_memory not routed" in p for p in found)
