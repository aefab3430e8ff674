"""Images with pinned PyPI packages: validated specs, keys that leave earlier images' keys alone (unit)."""

from __future__ import annotations

import pytest

from raas.errors import RaasError
from raas.sandbox.images import ImageSpec

pytestmark = pytest.mark.unit


def test_pip_requirements_must_be_pinned_and_need_a_venv() -> None:
    base = ("python3", "python3-venv")
    for bad in ("openai", "openai>=1", "openai==1; rm -rf /", "../x==1", "x==1 y==2"):
        with pytest.raises(RaasError):
            ImageSpec(packages=base, pip=(bad,))
    with pytest.raises(RaasError, match="python3-venv"):
        ImageSpec(packages=("python3",), pip=("openai==3.51.0",))
    spec = ImageSpec(packages=base, pip=("openai==3.51.0", "mini-swe-agent[full]==2.4.6", "openai==3.51.0"))
    assert spec.pip == ("mini-swe-agent[full]==2.4.6", "openai==3.51.0")


def test_keys_change_with_pip_and_stay_put_without() -> None:
    # the test image's key from before images could carry pip packages
    assert (
        ImageSpec(packages=("python3", "python3-ipykernel", "python3-jupyter-client")).key()
        == "6b65bb3f8f09d3cc"
    )
    plain = ImageSpec(packages=("python3", "python3-venv"))
    one = ImageSpec(packages=("python3", "python3-venv"), pip=("openai==3.51.0",))
    other = ImageSpec(packages=("python3", "python3-venv"), pip=("openai==3.50.0",))
    assert len({plain.key(), one.key(), other.key()}) == 3
