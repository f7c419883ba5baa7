"""`--quantize gguf` on the embedded default (its shipped Q4_1 file): the blocks served are the
file's, in transformers' row order (q and k un-permuted), and verification stays exact."""

from __future__ import annotations

import pytest
import torch

from specsplit.model import catalog, native
from specsplit.model.modeling import KVSequence, load_model

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def default_dir():
    return catalog.resolve(catalog.DEFAULT)


def _needs_vnni():
    reason = native.unavailable(torch.bfloat16, torch.device("cpu")) or native.lacks_vnni()
    if reason:
        pytest.skip(f"gguf path not tested on this CPU: {reason}")


def test_the_files_blocks_are_the_weights_transformers_dequantized(default_dir):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from specsplit.model.ggufweights import GGUFWeights, dequantize, gguf_path

    weights = GGUFWeights(gguf_path(default_dir), AutoConfig.from_pretrained(default_dir))
    hf = load_file(default_dir / "model.safetensors")
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    seen = set()
    for layer in (0, 17, 29):
        for gguf_name, hf_name in names.items():
            kind, parts = weights.blocks(f"blk.{layer}.{gguf_name}.weight")
            seen.add(kind)
            expected = hf[f"model.layers.{layer}.{hf_name}.weight"].float()
            assert torch.allclose(dequantize(kind, parts), expected, rtol=0, atol=1e-6), (layer, gguf_name)
    kind, parts = weights.blocks("token_embd.weight")  # the tied head
    assert kind == "Q8_0" and torch.allclose(dequantize(kind, parts), hf["model.embed_tokens.weight"].float(),
                                             rtol=0, atol=1e-6)
    assert seen == {"Q4_1"}


def test_gguf_weights_verify_exactly_and_agree_with_the_dequantized_model(default_dir):
    _needs_vnni()
    lm = load_model(default_dir, "bfloat16", quantize="gguf")
    assert lm.kernels == "native gguf"
    prompt = [1, 504, 3303, 314, 260, 1789, 28, 216, 7437, 253, 6591]
    tokens = [4536, 436, 2386, 30, 378, 260, 1789, 282]
    one, many = KVSequence(lm.model), KVSequence(lm.model)
    one.forward(prompt)
    many.forward(prompt)
    singles = torch.stack([one.forward([t])[0] for t in tokens])
    assert torch.equal(singles, torch.cat([many.forward(tokens[:5]), many.forward(tokens[5:])]))
    reference = KVSequence(load_model(default_dir, "float32").model)
    reference.forward(prompt)
    expected = reference.forward(tokens)
    # The weights are the file's exactly; what differs is the int8 activations and bf16 caches.
    assert (singles.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.75
    assert (singles - expected).abs().max() < 0.1 * expected.abs().max()


def test_a_directory_without_its_gguf_file_is_refused_with_the_reason(tmp_path, default_dir):
    _needs_vnni()
    for f in default_dir.iterdir():
        if f.name != "model.gguf":
            (tmp_path / f.name).symlink_to(f)
    with pytest.raises(FileNotFoundError, match="model.gguf"):
        load_model(tmp_path, "bfloat16", quantize="gguf")
