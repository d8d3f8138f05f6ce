#!/usr/bin/env python3
"""PEFT LoRA fixtures for tests/lora.rs, and the check of our adapters in PEFT.

make OUT: writes a tiny random llama (transformers, safetensors) to OUT/base, a non-zero
LoRA adapter PEFT made on it (init_lora_weights=False, rsLoRA, a rank_pattern and an
alpha_pattern, every projection targeted) to OUT/adapter, and the adapted model's F32 logits for
fixed token ids to OUT/logits.safetensors (`ids` int64 (2, 12), `logits` f32 (2, 12, vocab)),
with PEFT's mean cross-entropy of ids[:, 1:] after ids[:, :-1] (`loss`) and the adapters'
gradients of it (`grad:<PEFT key>`).

check BASE ADAPTER: loads the adapter our code saved (ADAPTER, PEFT's two files, with our
logits in ADAPTER/logits.safetensors, written by the test `lora_saved_adapter_for_peft` when
LORA_PEFT_OUT names a directory) on BASE in PEFT, and prints the rel L2 of PEFT's logits against
ours; exits 1 above 1e-4.

Needs torch, transformers and peft; the fixtures it makes are committed, so CI does not.
"""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


CHATML = (
    "{% for message in messages %}{{'<' + message['role'] + '>' + message['content'] + '|'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}"
)


def ids():
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 96, (2, 12), generator=g)


def make(out: Path):
    from transformers import LlamaConfig, LlamaForCausalLM
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out / "base", safe_serialization=True)
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        use_rslora=True,
        rank_pattern={"model.layers.1.self_attn.q_proj": 2},
        alpha_pattern={"down_proj": 3},
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, lora).eval()
    # init_lora_weights=False leaves B random too; scale both so the update is sizeable.
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.mul_(2.0)
    peft_model.save_pretrained(out / "adapter", safe_serialization=True)
    x = ids()
    with torch.no_grad():
        logits = peft_model(input_ids=x).logits.float().contiguous()
    # PEFT's loss (mean cross-entropy of ids[:, 1:] after ids[:, :-1]) and the adapters'
    # gradients, for the trainer's test.
    peft_model.zero_grad()
    step = peft_model(input_ids=x[:, :-1]).logits.float()
    loss = torch.nn.functional.cross_entropy(step.reshape(-1, step.shape[-1]), x[:, 1:].reshape(-1))
    loss.backward()
    saved = {"ids": x.contiguous(), "logits": logits, "loss": loss.detach().reshape(1)}
    for n, p in peft_model.named_parameters():
        if "lora_" in n:
            saved["grad:" + n.replace(".default", "")] = p.grad.detach().contiguous()
    save_file(saved, str(out / "logits.safetensors"))
    # Keep only what the tests read (config.json, the weights, the tokenizer).
    for p in (out / "base").iterdir():
        if p.name not in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            p.unlink()
    for p in (out / "adapter").iterdir():
        if p.name not in ("adapter_config.json", "adapter_model.safetensors"):
            p.unlink()
    write_tokenizer(out / "base" / "tokenizer.json")
    (out / "base" / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}, indent=2))
    print(json.dumps({"out": str(out), "logits": list(logits.shape)}))


def write_tokenizer(path: Path):
    """A character-level tokenizer of the base's 96 ids: printable ASCII and [UNK] (id 95), for
    running the binaries on the fixture."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, decoders

    vocab = {chr(c): c - 32 for c in range(32, 127)}
    vocab["[UNK]"] = 95
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(path))


def check(base: Path, adapter: Path):
    from transformers import AutoModelForCausalLM
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(model, adapter).eval()
    ours = load_file(str(adapter / "logits.safetensors"))
    with torch.no_grad():
        theirs = peft_model(input_ids=ours["ids"].long()).logits.float()
    rel = ((theirs - ours["logits"]).norm() / ours["logits"].norm()).item()
    print(json.dumps({"peft_roundtrip_rel_l2_ours_in_peft": rel}))
    sys.exit(0 if rel <= 1e-4 else 1)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "make":
        out = Path(sys.argv[2])
        out.mkdir(parents=True, exist_ok=True)
        make(out)
    elif len(sys.argv) == 4 and sys.argv[1] == "check":
        check(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        sys.exit(__doc__)
