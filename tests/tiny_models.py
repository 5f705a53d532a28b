"""Tiny Hugging Face checkpoints built from configs (no hub access), shared by the test suite.

Every builder writes a complete local checkpoint folder: ``config.json``, ``model.safetensors``,
``tokenizer.json`` (+ ``tokenizer_config.json`` / ``special_tokens_map.json`` via
PreTrainedTokenizerFast) and, for generative models, ``generation_config.json``. The tokenizer is a
WordLevel tokenizer over a handful of sentences, so all models built here share one vocabulary.
"""
from __future__ import annotations

from pathlib import Path

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a small model drafts tokens and a large model verifies them",
    "speculative decoding is exact when the acceptance test is applied",
    "the cat sat on the mat and the dog sat on the log",
    "edge devices read weights from memory for every token",
    "one two three four five six seven eight nine ten",
    "hello world this is a tiny tokenizer for tests",
]
SPECIALS = ["<pad>", "</s>", "<unk>", "<s>"]  # ids 0..3: pad, eos, unk, bos


def _words() -> list[str]:
    seen: dict[str, None] = {}
    for line in CORPUS:
        for w in line.split():
            seen.setdefault(w, None)
    return list(seen)


def build_tokenizer(folder: str | Path, extra_words: tuple[str, ...] = ()) -> int:
    """Write a WordLevel tokenizer into ``folder``; return its size (specials + words)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for w in [*_words(), *extra_words]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", bos_token="<s>"
    )
    Path(folder).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return len(vocab)


TOKENIZER_SIZE = len(SPECIALS) + len(_words())


def _save(model, folder: Path, extra_words: tuple[str, ...] = ()) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    build_tokenizer(folder, extra_words)
    return folder


def make_gpt2(folder: str | Path, *, n_layer: int = 2, n_embd: int = 32, n_head: int = 2,
              vocab_size: int = 96, n_positions: int = 128, seed: int = 0) -> Path:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                     n_head=n_head, bos_token_id=3, eos_token_id=1, pad_token_id=0)
    return _save(GPT2LMHeadModel(cfg).eval(), Path(folder))


def make_llama(folder: str | Path, *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
               vocab_size: int = 96, max_positions: int = 128, seed: int = 0) -> Path:
    """A Llama with grouped-query attention (``kv_heads < heads``); head size 16, so `edgespec export`
    writes its static-KV graph (export/static_kv.py)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_positions, bos_token_id=3, eos_token_id=1, pad_token_id=0,
                      tie_word_embeddings=False)
    return _save(LlamaForCausalLM(cfg).eval(), Path(folder))


def make_t5(folder: str | Path, *, layers: int = 2, d_model: int = 32, heads: int = 2, d_kv: int = 16,
            vocab_size: int = 96, seed: int = 0) -> Path:
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=vocab_size, d_model=d_model, d_kv=d_kv, d_ff=2 * d_model, num_layers=layers,
                   num_decoder_layers=layers, num_heads=heads, pad_token_id=0, eos_token_id=1,
                   decoder_start_token_id=0, relative_attention_num_buckets=8,
                   relative_attention_max_distance=32)
    return _save(T5ForConditionalGeneration(cfg).eval(), Path(folder))


BUILDERS = {"gpt2": make_gpt2, "llama": make_llama, "t5": make_t5}


def external_data_model(path: str | Path, location: str) -> None:
    """A valid ONNX model whose only initializer lives in external data at ``location``."""
    import onnx
    from onnx import TensorProto, helper

    init = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4])
    init.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", "16")):
        entry = init.external_data.add()
        entry.key, entry.value = k, v
    graph = helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "g", [],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], initializer=[init])
    Path(path).write_bytes(helper.make_model(graph).SerializeToString())
    assert onnx.load(str(path), load_external_data=False).graph.initializer[0].external_data[0].value == location


def make_pair(root: str | Path, arch: str) -> tuple[Path, Path]:
    """A target (2 layers) and a draft (1 layer) of one architecture sharing the tokenizer.

    The draft has a different number of padding embedding rows (vocab 80 vs 96, tokenizer 64-ish) so
    that the shared-vocabulary path is exercised, as with real T5 (32100 tokens, 32128 rows).
    """
    root = Path(root)
    build = BUILDERS[arch]
    target = build(root / f"{arch}-target", seed=1)
    small = {"gpt2": {"n_layer": 1}, "llama": {"layers": 1}, "t5": {"layers": 1}}[arch]
    draft = build(root / f"{arch}-draft", seed=2, vocab_size=80, **small)
    return target, draft


def copy_stdlib_files(dest: str | Path, names) -> list[Path]:
    """Copy standard-library modules (relative paths like "json/decoder.py") into ``dest``: a small,
    real corpus for the training tests."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for name in names:
        dst = Path(dest) / name.replace("/", "_")
        dst.write_bytes((root / name).read_bytes())
        out.append(dst)
    return out
