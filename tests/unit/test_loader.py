import json

import pytest
import torch

from services.engine.builtin_model import builtin_model
from services.engine.loader import ModelLoadError, load_model
from services.engine.model_config import UnsupportedModelError
from services.fakes.hf_checkpoints import save_tiny_llama, save_tiny_qwen2


def test_builtin_model_is_deterministic_and_small():
    a, b = builtin_model(), builtin_model()
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    n = sum(p.numel() for p in a.parameters())
    assert 1_000_000 < n < 10_000_000
    assert a.config.num_key_value_heads < a.config.num_attention_heads  # GQA


def test_missing_config_names_the_file(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path))


def test_missing_folder():
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model("/nonexistent/model/folder")


def test_unsupported_architecture_is_named(tmp_path):
    save_tiny_llama(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["MixtralForCausalLM"], "mixtral"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="MixtralForCausalLM"):
        load_model(str(tmp_path))


def test_missing_shard_is_named(tmp_path):
    save_tiny_qwen2(tmp_path, max_shard_size="100KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=shard.name):
        load_model(str(tmp_path))


def test_no_weights(tmp_path):
    save_tiny_llama(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(str(tmp_path))


def test_generation_config_and_tied_embeddings(tmp_path):
    save_tiny_qwen2(tmp_path)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [5, 6], "temperature": 0.7, "top_p": 0.8, "top_k": 20})
    )
    loaded = load_model(str(tmp_path))
    assert loaded.generation_defaults["temperature"] == 0.7
    assert loaded.generation_defaults["top_k"] == 20
    assert set(loaded.config.eos_token_ids) == {5, 6}
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight


def test_cuda_device_refused_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="CUDA is not available"):
        load_model(None, device="cuda:0")


def test_random_builtin_model_speaks_printable_ascii():
    from services.common.sampling_params import SamplingParams
    from services.common.tokenizer import load_tokenizer
    from services.engine.kv_pool import KVPool
    from services.engine.local_generate import generate

    loaded, tok = load_model("builtin-random"), load_tokenizer("builtin-random")
    ids = tok.encode_chat([{"role": "user", "content": "Hello!"}])
    outs = generate(
        loaded.model, KVPool(loaded.config, 64, 16), [ids] * 3,
        [SamplingParams(temperature=t, seed=1, max_tokens=40) for t in (0.0, 0.7, 1.0)],
    )
    text = "".join(tok.decode(o) for o in outs)
    printable = sum(c.isprintable() or c == "\n" for c in text)
    assert printable / len(text) > 0.95, text
