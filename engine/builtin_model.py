"""The built-in model: a tiny random-weight Llama checkpoint in Hugging Face format.

`write_builtin_model(dir)` writes `config.json`, `model.safetensors`, `tokenizer.json` (a
byte-level BPE trained with `tokenizers` on `engine/data/corpus.txt`), `tokenizer_config.json`
(with a ChatML chat template that renders tools) and `generation_config.json`, so halfmoon
runs offline. The weights are random (seeded), so its answers are noise, but every code path
is the real one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.model import CausalLM
from engine.model_config import ModelConfig
from shared.chat_templates import CHATML_WITH_TOOLS
from shared.model_dir import default_model_dir

CORPUS = Path(__file__).parent / "data" / "corpus.txt"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = CHATML_WITH_TOOLS


def ensure_builtin_model(path: Path | None = None) -> Path:
    """The built-in model's directory, written first if it is not there yet. Written into a
    temporary folder and renamed, so processes starting together never see half a model."""
    path = path or default_model_dir()
    if (path / "config.json").exists():
        _refresh_template(path)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=path.parent))
    write_builtin_model(staging)
    try:
        os.rename(staging, path)
    except OSError:  # another process won the race
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _refresh_template(path: Path) -> None:
    """A model written by an older halfmoon gets the current chat template (tools); its
    weights and tokenizer are the same. Replaced atomically, like the model itself."""
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if config.get("chat_template") == CHAT_TEMPLATE:
        return
    config["chat_template"] = CHAT_TEMPLATE
    staging = config_path.with_name(f".{config_path.name}.{os.getpid()}")
    staging.write_text(json.dumps(config, indent=2))
    os.replace(staging, config_path)


def train_tokenizer(vocab_size: int = 1024) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train([str(CORPUS)], trainer)
    return tokenizer


def write_builtin_model(path: Path, *, seed: int = 0, hidden_size: int = 128,
                        num_layers: int = 4, vocab_size: int = 1024,
                        max_position_embeddings: int = 2048) -> Path:
    """Write the checkpoint to `path` (created if needed) and return it; other sizes make
    other, smaller models (tests serving several)."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab_size)
    eos_id = tokenizer.token_to_id("<|im_end|>")
    raw_config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": tokenizer.get_vocab_size(), "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 8 // 3 // 8 * 8, "num_hidden_layers": num_layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": True,
        "bos_token_id": tokenizer.token_to_id("<|endoftext|>"), "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }
    model = CausalLM(ModelConfig.from_dict(raw_config))
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in _hf_state(model).items():
        state[name] = (torch.ones_like(tensor) if name.endswith("norm.weight")
                       else torch.randn(tensor.shape, generator=generator) * 0.05)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(raw_config, indent=2))
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE, "model_max_length": max_position_embeddings,
    }, indent=2))
    (path / "generation_config.json").write_text(json.dumps({
        "bos_token_id": raw_config["bos_token_id"], "eos_token_id": eos_id,
    }, indent=2))
    return path


def _hf_state(model: CausalLM) -> dict[str, torch.Tensor]:
    """Our state dict under Hugging Face names (fused projections split back apart)."""
    config = model.config
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    state = {}
    for name, tensor in model.state_dict().items():
        if "qkv_proj" in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"),
                                   tensor.split([q_size, kv_size, kv_size]), strict=True):
                state[name.replace("qkv_proj", part)] = piece
        elif "gate_up_proj" in name:
            gate, up = tensor.chunk(2)
            state[name.replace("gate_up_proj", "gate_proj")] = gate
            state[name.replace("gate_up_proj", "up_proj")] = up
        else:
            state[name] = tensor
    return state
