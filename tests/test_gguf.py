"""GGUF files of float matrices (F32, F16, BF16: what llama.cpp's converter writes before quantizing) decode
as transformers loads them, and a tensor type the tiles do not read is refused by name."""
import gguf
import numpy as np
import pytest
import torch
from gguf_files import llama, transformers_model, write

import megakernel as mk
from megakernel.serving import from_pretrained
from megakernel.models.gguf import FLOATS, FORMATS

pytestmark = pytest.mark.usefixtures("torch_backend")
IDS, NEW_TOKENS = torch.tensor([[11, 7, 50, 3]]), 4


def _decode(path):
    model = from_pretrained(path, max_seq_len=16, workers=1)
    try:
        return model.generate(IDS, NEW_TOKENS), model.logits[0].clone()  # the logits the last token was chosen from
    finally:
        model.close()


@pytest.mark.parametrize("kind,world", [("F32", 1), ("F16", 1), ("BF16", 1), ("Q8_0", 1), ("F16", 2)])
def test_a_gguf_file_of_float_matrices_decodes_as_transformers_loads_it(tmp_path, kind, world):
    """A random Llama whose attention is far from uniform (a q/k row order that is not transformers' changes
    its logits by more than their size), its matrices in each float type and in Q8_0, q and k in llama.cpp's
    rotary order: the greedy tokens and last logits of transformers' GGUF loading, at one rank and (heads
    split) at two."""
    path = tmp_path / "model.gguf"
    write(path, llama(seed=len(kind) + world), kind)
    reference = transformers_model(path)
    with torch.no_grad():
        expected = reference.generate(IDS, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        expected_logits = reference(expected[:, :-1]).logits[0, -1]
    for rank, (tokens, logits) in enumerate(mk.launch(lambda: _decode(path), world_size=world, virtual=True,
                                                      timeout=300)):
        error = (logits - expected_logits).abs().max().item()
        assert error <= 1e-4 * expected_logits.abs().max().item(), f"rank {rank}: logits off by {error}"
        assert torch.equal(tokens, expected), f"rank {rank}: {tokens.tolist()} vs {expected.tolist()}"


def test_every_other_tensor_type_is_refused_by_name(tmp_path):
    """Each GGML type the tiles do not read (other block formats, integers, F64), a matrix of it in an
    otherwise F16 file: a GraphError naming the tensor and its type, not a model of other numbers."""
    model = llama()
    others = [t for t in gguf.GGMLQuantizationType if t.name not in FORMATS and t.name not in FLOATS]
    assert len(others) > 20
    for kind in others:
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        path = tmp_path / f"{kind.name}.gguf"
        rows = np.zeros((256, 256 // block * block_bytes), dtype=np.uint8)
        write(path, model, "F16", kinds={"blk.0.ffn_up.weight": kind.name}, raw={"blk.0.ffn_up.weight": rows})
        with pytest.raises(mk.GraphError, match=rf"{path}: tensor blk\.0\.ffn_up\.weight is {kind.name}; supported: "
                                                rf"Q8_0, .*, F32, F16, BF16"):
            from_pretrained(path, max_seq_len=16, workers=1)
