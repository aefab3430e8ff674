"""Record handling a user meets before any sandbox starts: relative ``image`` paths resolve against the
dataset file's directory (registry names stay names), and an empty ``test_patch`` is a valid record."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from raas.errors import RaasError
from raas.tasks.datasets import load_file, resolve_image_path
from raas.tasks.swe.instance import parse_task

pytestmark = pytest.mark.unit

DATA = Path(__file__).parent / "data"


def astropy() -> dict[str, Any]:
    rows = [json.loads(line) for line in (DATA / "swebench_records.jsonl").read_text().splitlines()]
    return next(r for r in rows if r["instance_id"] == "astropy__astropy-12907")


def write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_relative_image_paths_resolve_against_the_dataset_directory(tmp_path: Path) -> None:
    data_dir = tmp_path / "set"
    (data_dir / "images").mkdir(parents=True)
    (data_dir / "images" / "foo.sif").write_bytes(b"SIF")
    (data_dir / "rootfs" / "testbed").mkdir(parents=True)
    (tmp_path / "shared.sif").write_bytes(b"SIF")
    rows = [
        {**astropy(), "image": "images/foo.sif"},
        {**astropy(), "image": "./rootfs"},
        {**astropy(), "image": "../shared.sif"},
        {**astropy(), "image": "docker-archive:images/foo.sif"},
        {**astropy(), "image": "docker://docker.io/swebench/sweb.eval.x86_64.astropy_1776_astropy-12907"},
        {**astropy(), "image": "python:3.11"},
        {**astropy(), "image": "swebench/foo:latest"},
        {**astropy(), "image": str(tmp_path / "shared.sif")},
    ]
    got = [r["image"] for r in load_file(write(data_dir / "swe.jsonl", rows))]
    assert got == [
        str(data_dir / "images" / "foo.sif"),
        str(data_dir / "rootfs"),
        str(tmp_path / "shared.sif"),
        f"docker-archive:{data_dir / 'images' / 'foo.sif'}",
        rows[4]["image"],
        "python:3.11",
        "swebench/foo:latest",
        str(tmp_path / "shared.sif"),
    ]
    # The same file named relative to another working directory gives the same paths.
    assert load_file(Path(os.path.relpath(data_dir / "swe.jsonl")))[0]["image"] == got[0]


def test_a_dot_path_that_does_not_exist_is_a_clear_error(tmp_path: Path) -> None:
    path = write(tmp_path / "swe.jsonl", [astropy(), {**astropy(), "image": "./images/missing.sif"}])
    with pytest.raises(RaasError) as err:
        load_file(path)
    assert err.value.kind == "bad_request"
    assert "row 1" in err.value.message and "images/missing.sif" in err.value.message
    assert str(tmp_path / "images" / "missing.sif") in err.value.message


def test_resolve_image_path_rule(tmp_path: Path) -> None:
    (tmp_path / "img").mkdir()
    assert resolve_image_path("img", tmp_path) == str(tmp_path / "img")
    assert resolve_image_path("nothing-here", tmp_path) == "nothing-here"
    assert resolve_image_path("oras://host/x:1", tmp_path) == "oras://host/x:1"
    assert resolve_image_path("/abs/x.sif", tmp_path) == "/abs/x.sif"
    with pytest.raises(RaasError):
        resolve_image_path("../nothing-here.sif", tmp_path)


@pytest.mark.parametrize("empty", ["", "   \n", None])
def test_an_empty_test_patch_is_allowed(empty: str | None) -> None:
    task = parse_task({**astropy(), "test_patch": empty})
    assert task.test_patch == "" and task.protected_files == []
    assert task.grading_record()["test_patch"] == ""
    assert task.test_cmd  # SWE-bench's command for the repo, over the whole suite (no test directives)


def test_a_non_diff_test_patch_is_still_refused() -> None:
    with pytest.raises(RaasError) as err:
        parse_task({**astropy(), "test_patch": "just text"})
    assert "field test_patch" in err.value.message
