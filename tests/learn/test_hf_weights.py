"""The policy's weights between torch and llama.cpp: the embedded GGUF loads as a float model, and
``export_gguf`` writes it back so that loading the export gives the same tensors (F32 bit for bit, F16 to
half precision), with the template's metadata (tokenizer, chat template) carried over. Bad input (a model
that is not a llama) fails with a typed error and leaves no file behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from raas.errors import RaasError
from raas.llm.models import default_gguf_path
from raas.trainer.hf_weights import export_gguf, load_policy

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def policy() -> Any:
    return load_policy(default_gguf_path())


def test_f32_export_round_trips_every_tensor_exactly(policy: Any, tmp_path: Path) -> None:
    out = export_gguf(policy, tmp_path / "p.gguf", template=default_gguf_path(), tensor_type="f32")
    again = load_policy(out)
    want, got = policy.state_dict(), again.state_dict()
    assert want.keys() == got.keys()
    different = [k for k in want if not torch.equal(want[k], got[k])]
    assert different == []


def test_f16_export_keeps_the_metadata_and_rounds_to_half_precision(policy: Any, tmp_path: Path) -> None:
    template = default_gguf_path()
    out = export_gguf(policy, tmp_path / "p16.gguf", template=template, tensor_type="f16")
    src, new = gguf.GGUFReader(template), gguf.GGUFReader(out)
    for key in (
        "tokenizer.chat_template",
        "tokenizer.ggml.tokens",
        "llama.rope.freq_base",
        "llama.block_count",
    ):
        assert new.fields[key].contents() == src.fields[key].contents(), key
    assert int(new.fields["general.file_type"].contents()) == int(gguf.LlamaFileType.MOSTLY_F16)
    types = {t.name: t.tensor_type for t in new.tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F16
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert "output.weight" not in types  # tied to token_embd, as in the template
    again = load_policy(out)
    for name, want in policy.state_dict().items():
        got = again.state_dict()[name]
        assert torch.allclose(got, want, rtol=2**-10, atol=1e-4), name


def test_a_model_that_is_not_a_llama_is_refused_and_leaves_no_file(tmp_path: Path) -> None:
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32, n_positions=16))
    with pytest.raises(RaasError) as err:
        export_gguf(gpt2, tmp_path / "x.gguf", template=default_gguf_path())
    assert err.value.kind == "bad_request" and "llama" in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_a_missing_gguf_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RaasError) as err:
        load_policy(tmp_path / "nope.gguf")
    assert err.value.kind == "bad_request"
