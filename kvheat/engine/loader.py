"""Loading models and tokenizers: a Hugging Face directory from local disk, or the
built-in tiny defaults (seeded random weights, a tokenizer built in code), so the
engine runs on a fresh machine with no download.

`save_model` writes a model as a real HF directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json) that transformers and vLLM's CPU build load too.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .llama import CausalLM, LlamaForCausalLM
from .model_config import ModelConfig

# ---- tokenizer ------------------------------------------------------------------------------
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|pad|>"]
# The tiny tokenizer's chat format, as a Jinja template (HF's convention) so that other
# engines given the same directory render prompts identically.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Training text of the tiny BPE: short and fixed, so the vocabulary is the same everywhere.
_TINY_CORPUS = """\
The cache keeps the keys and values of every token it has seen, in blocks of sixteen.
A request that shares a prefix with an earlier one reuses those blocks and skips their
compute; a block nobody holds may be evicted when the pool runs out of room. Hot blocks
stay on the device, warm ones move to host memory, cold ones go to disk or a remote store.
You are a helpful assistant. Please answer the question below in one short paragraph.
What is the capital of France? Paris is the capital of France. How many days are in a week?
There are seven days in a week: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and
Sunday. def main(): print("hello, world") return 0 # numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000
Summarise the following conversation. The user asked about the weather; the assistant said
it would rain in the afternoon and be sunny tomorrow morning, with a light wind from the west.
"""


@functools.lru_cache(maxsize=4)
def _tiny_tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_TINY_CORPUS.splitlines(), trainer=trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)])
    return tok.to_str()


class Tokenizer:
    """A `tokenizers` tokenizer plus what an engine needs of tokenizer_config.json.

    Its special tokens and its chat template."""

    def __init__(self, tokenizer_json: str, bos_token: str | None = None,
                 eos_token: str | list[str] | None = None, chat_template: str | None = None,
                 eos_token_ids: Sequence[int] = ()) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_str(tokenizer_json)
        self.bos_token = bos_token
        self.eos_token = eos_token if isinstance(eos_token, str) or eos_token is None \
            else eos_token[0]
        self.chat_template = chat_template
        self.bos_token_id = self._tok.token_to_id(bos_token) if bos_token else None
        ids = list(eos_token_ids)
        if self.eos_token is not None and (i := self._tok.token_to_id(self.eos_token)) is not None \
                and i not in ids:
            ids.insert(0, i)
        self.eos_token_ids = ids
        self.eos_token_id = ids[0] if ids else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, path: str | Path, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """The tokenizer of a Hugging Face model directory."""
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json")
        conf: dict[str, Any] = {}
        if (path / "tokenizer_config.json").is_file():
            conf = json.loads((path / "tokenizer_config.json").read_text())
        template = conf.get("chat_template")
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"),
                            template[0]["template"] if template else None)
        return cls(tj.read_text(), _token_str(conf.get("bos_token")),
                   _token_str(conf.get("eos_token")), template, eos_token_ids)

    @classmethod
    def tiny(cls, vocab_size: int = 1024) -> Tokenizer:
        """The built-in tiny models' tokenizer, of `vocab_size` tokens."""
        return cls(_tiny_tokenizer_json(vocab_size), "<|bos|>", "<|eos|>", TINY_CHAT_TEMPLATE)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of `text`."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of token ids `ids`."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[dict[str, str]],
                    add_generation_prompt: bool = True) -> str:
        """The prompt text of chat `messages`, by the chat template (or a plain format)."""
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError("each chat message needs a 'role' and a 'content'")
        if self.chat_template is None:  # no template in the directory: a plain format
            body = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
            return body + ("<|assistant|>" if add_generation_prompt else "")
        return _jinja_env().from_string(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def apply_chat_template(self, messages: Sequence[dict[str, str]],
                            add_generation_prompt: bool = True) -> list[int]:
        """The token ids of chat `messages`, rendered by the chat template."""
        # The template writes the special tokens itself (as transformers does).
        return self.encode(self.render_chat(messages, add_generation_prompt),
                           add_special_tokens=False)

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json into folder `path`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "tokenizer.json").write_text(self._tok.to_str())
        conf = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": self.bos_token,
                "eos_token": self.eos_token, "pad_token": "<|pad|>" if self._tok.token_to_id(
                    "<|pad|>") is not None else None, "model_max_length": 1 << 20,
                "clean_up_tokenization_spaces": False, "chat_template": self.chat_template}
        (path / "tokenizer_config.json").write_text(json.dumps(conf, indent=2))


def _token_str(t: Any) -> str | None:
    if isinstance(t, dict):  # {"content": "<s>", ...} in older tokenizer_config.json files
        return t.get("content")
    return t


@functools.lru_cache(maxsize=1)
def _jinja_env() -> Any:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg: str) -> None:
        raise jinja2.TemplateError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False)
    return env


# ---- tiny default configs ---------------------------------------------------------------
def tiny_config(family: str = "llama") -> ModelConfig:
    """The built-in tiny model of a family.

    Small enough for CPU tests and benches, shaped so that vLLM's CPU build accepts it
    (head_dim 64; MLA latent + rope = 576)."""
    if family == "llama":
        return ModelConfig(model_type="llama", vocab_size=1024, hidden_size=256,
                           intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                           rope_theta=10000.0, bos_token_id=0, eos_token_id=1)
    if family == "qwen3":
        return ModelConfig(model_type="qwen3", vocab_size=1024, hidden_size=256,
                           intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                           rope_theta=1000000.0, qk_norm=True, bos_token_id=0, eos_token_id=1)
    if family == "deepseek":
        return ModelConfig(model_type="deepseek_v3", vocab_size=1024, hidden_size=256,
                           intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
                           rope_theta=10000.0, q_lora_rank=128, kv_lora_rank=512,
                           qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
                           n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                           moe_intermediate_size=128, first_k_dense_replace=1,
                           routed_scaling_factor=2.5, norm_topk_prob=True, n_group=2,
                           topk_group=1, bos_token_id=0, eos_token_id=1)
    raise ValueError(f"unknown model family {family!r}; use 'llama', 'qwen3' or 'deepseek'")


def build_model(cfg: ModelConfig) -> CausalLM:
    """An uninitialised model of config `cfg`: DeepSeek for an MLA config, else Llama."""
    if cfg.is_mla:
        from .deepseek import DeepseekForCausalLM

        return DeepseekForCausalLM(cfg)
    return LlamaForCausalLM(cfg)


def init_random_weights(model: nn.Module, seed: int = 0) -> None:
    """Draw seeded weights with O(1) activations.

    Embeddings N(0, 1), each matrix N(0, 1/fan_in), biases N(0, 0.02), norms near one,
    router bias near zero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.ndim >= 2:
                std = 1.0 if "embed_tokens" in name else 1.0 / math.sqrt(p.shape[-1])
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.01 * torch.randn(b.shape, generator=gen))


# ---- HF directories ---------------------------------------------------------------------
_QUANTIZED = re.compile(r"(weight_scale_inv|\.qweight|\.scales|\.qzeros|weight_scale)$")


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors file")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def _remap_weights(cfg: ModelConfig, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names -> this engine's names: drops the MTP layers and rotary buffers,
    splits transformers-5's fused expert tensors into per-expert matrices."""
    out: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if _QUANTIZED.search(name):
            raise ValueError(f"quantized checkpoints are not supported ({name})")
        if name.endswith("rotary_emb.inv_freq"):
            continue
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m and int(m.group(1)) >= cfg.num_hidden_layers:
            continue  # DeepSeek-V3's multi-token-prediction layers
        fused = re.match(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
        if fused:
            prefix, kind = fused.groups()
            for e in range(t.shape[0]):
                if kind == "gate_up_proj":
                    gate, up = t[e].chunk(2, dim=0)
                    out[f"{prefix}.{e}.gate_proj.weight"] = gate
                    out[f"{prefix}.{e}.up_proj.weight"] = up
                else:
                    out[f"{prefix}.{e}.down_proj.weight"] = t[e]
            continue
        out[name] = t
    return out


def load_weights(model: CausalLM, weights: dict[str, torch.Tensor]) -> None:
    """Copy checkpoint tensors into the model by name; every parameter must be given.

    Everything is checked before anything is copied."""
    cfg: ModelConfig = model.config
    weights = _remap_weights(cfg, weights)
    tied = cfg.tie_word_embeddings
    if tied:  # some tied checkpoints store the head anyway; the embedding is what counts
        weights.pop("lm_head.weight", None)
    params: dict[str, torch.Tensor] = dict(model.named_parameters())
    params.update({n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    missing = [n for n in params if n not in weights and not (tied and n == "lm_head.weight")]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")
    unexpected = [n for n in weights if n not in params]
    if unexpected:
        raise ValueError(f"checkpoint has {len(unexpected)} unknown tensors, e.g. {unexpected[:5]}")
    for n, t in weights.items():
        if tuple(params[n].shape) != tuple(t.shape):
            raise ValueError(f"{n}: checkpoint shape {tuple(t.shape)} != model "
                             f"{tuple(params[n].shape)}")
    with torch.no_grad():
        for n, t in weights.items():
            params[n].copy_(t)


def _empty_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> CausalLM:
    """The model with uninitialised storage in `dtype` on `device`, built on the meta
    device first so that no random initialisation runs and no fp32 copy is made.
    Routers stay fp32: routing decisions flip on rounding (transformers does the same)."""
    with torch.device("meta"):
        model = build_model(cfg)
    model = model.to(dtype=dtype)
    for name, mod in model.named_modules():
        if name.endswith("mlp.gate"):
            mod.float()
    model = model.to_empty(device=device)
    model.tie_weights()
    return model.requires_grad_(False).eval()  # inference only: no autograd bookkeeping


def _eos_ids(path: Path, cfg: ModelConfig) -> list[int]:
    """End-of-sequence ids: config.json's, then generation_config.json's (chat models
    often list their end-of-turn tokens only there)."""
    ids = list(cfg.eos_token_ids)
    gen = path / "generation_config.json"
    if gen.is_file():
        e = json.loads(gen.read_text()).get("eos_token_id")
        for i in [e] if isinstance(e, int) else e or []:
            if i not in ids:
                ids.append(i)
    return ids


def load_model(path: str | Path | None = None, family: str = "llama",
               dtype: torch.dtype = torch.float32, seed: int = 0,
               device: torch.device | str = "cpu") -> tuple[CausalLM, Tokenizer, ModelConfig]:
    """A model, its tokenizer and its config.

    `path=None`: the built-in tiny model of `family` with weights drawn from `seed`;
    otherwise a local Hugging Face directory."""
    if path is None:
        cfg = tiny_config(family)
        seeded = _empty_model(cfg, torch.float32, "cpu")  # every tensor is drawn below
        init_random_weights(seeded, seed)
        weights = dict(seeded.state_dict())
        tok = Tokenizer.tiny(cfg.vocab_size)
    else:
        p = Path(path)
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p} has no config.json (a local Hugging Face model "
                                    "directory is needed; nothing is downloaded)")
        cfg = ModelConfig.from_hf_dict(json.loads((p / "config.json").read_text()))
        weights = _read_safetensors(p)
        tok = Tokenizer.from_dir(p, _eos_ids(p, cfg))
    model = _empty_model(cfg, dtype, device)
    load_weights(model, weights)
    return model, tok, cfg


def save_model(model: CausalLM, tok: Tokenizer, path: str | Path) -> None:
    """Write the model and its tokenizer as a Hugging Face directory at `path`."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    sd = {n: t.detach().contiguous().cpu() for n, t in model.state_dict().items()
          if not n.endswith("inv_freq")}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
         "do_sample": False}, indent=2))
    tok.save(path)


def save_tiny_model(path: str | Path, family: str = "llama", seed: int = 0) -> Path:
    """Write the built-in tiny model of `family` (weights drawn from `seed`) to `path`.

    The folder is a Hugging Face model directory, which `load_model`, `kvheat serve`,
    transformers and vLLM's CPU build all load; returns `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model, tok, _ = load_model(None, family, seed=seed)
    save_model(model, tok, path)
    return path
