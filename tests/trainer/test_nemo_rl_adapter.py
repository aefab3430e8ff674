"""``to_nemo_rl`` next to PyPI's ``nemo-rl``. NeMo RL's own code cannot be installed on these machines (PyPI has
only a 0.0.0 placeholder; the real package installs from a clone of its GitHub repository), so nothing here
runs NeMo RL: see docs/trainers.md, "NeMo RL". What can be checked is that the placeholder — the package
``pip install nemo-rl`` really gives, ``nemo_rl/__init__.py`` and ``package_info.py`` — does not break the
adapter, which looks for ``nemo_rl.distributed.batched_data_dict`` before wrapping in ``BatchedDataDict``."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from raas.trainer.adapters import to_nemo_rl
from raas.trainer.grpo import assemble_batch
from tests.trainer.test_grpo import group, result

pytestmark = pytest.mark.unit


def test_pypis_placeholder_nemo_rl_leaves_the_plain_dict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "nemo_rl"
    package.mkdir()
    (package / "__init__.py").write_text("from nemo_rl.package_info import __version__\n")
    (package / "package_info.py").write_text('__version__ = "0.0.0"\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        assert importlib.import_module("nemo_rl").__version__ == "0.0.0"
        b = assemble_batch(
            [
                group(
                    "g0",
                    [
                        result("a", 1.0, [11, 12], [([21, 22], "0"), ([23], "0")]),
                        result("b", 0.0, [13], [([24], "0")]),
                    ],
                )
            ],
            pad_id=0,
            max_prompt_len=3,
            max_response_len=6,
        )
        data = to_nemo_rl(b)
        assert type(data) is dict
        assert data["uid"] == ["g0", "g0"] and [float(x) for x in data["total_reward"]] == [1.0, 0.0]
    finally:
        for name in [m for m in sys.modules if m == "nemo_rl" or m.startswith("nemo_rl.")]:
            del sys.modules[name]
