"""Draft/target vocabulary compatibility.

Speculative decoding compares the draft's and the target's distributions id by id, so the two
tokenizers must map the same text pieces to the same ids. Model vocabularies may still differ in
size: embedding matrices are often padded past the tokenizer (T5: 32100 tokens, 32128 rows). Such
padding rows never correspond to text; generation samples only the tokenizer's ids (``Engine.vocab_size``).
"""
from __future__ import annotations

from pathlib import Path

from edgespec import contract
from edgespec.errors import CheckpointError, TokenizerMismatchError


def load_vocab(folder: Path) -> dict[str, int]:
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(folder / contract.TOKENIZER_FILE))
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise CheckpointError(f"{folder / contract.TOKENIZER_FILE} cannot be read ({exc}); save the tokenizer again") from exc
    return tok.get_vocab(with_added_tokens=True)


def tokenizer_size(vocab: dict[str, int]) -> int:
    return max(vocab.values(), default=-1) + 1


def check_model_covers_tokenizer(vocab: dict[str, int], model_vocab: int | None, role: str,
                                 from_config: bool = False) -> None:
    """``from_config``: ``model_vocab`` is config.json's vocab_size (before the weights are loaded),
    which may be what is wrong."""
    size = tokenizer_size(vocab)
    if model_vocab is not None and size > model_vocab:  # (None: not known yet)
        raise TokenizerMismatchError(
            f"the {role} tokenizer has ids up to {size - 1} but the model has only {model_vocab} embedding rows"
            + (" (its config.json's vocab_size)" if from_config else "")
            + "; use the tokenizer that was trained with this model"
            + (", or correct vocab_size in config.json if the weights have more rows" if from_config else "")
        )


def shared_vocab(target_vocab: dict[str, int], draft_vocab: dict[str, int], target_rows: int | None,
                 draft_rows: int | None, from_config: bool = False) -> dict:
    """Return the compatibility record for the manifest, or raise TokenizerMismatchError
    (``from_config``: the rows are the configs' vocab_size, see check_model_covers_tokenizer)."""
    if target_vocab != draft_vocab:
        t_items, d_items = set(target_vocab.items()), set(draft_vocab.items())
        only_t = sorted(t_items - d_items, key=lambda kv: kv[1])[:5]
        only_d = sorted(d_items - t_items, key=lambda kv: kv[1])[:5]
        examples = "; ".join(f"{who}-only e.g. {ex}" for who, ex in (("target", only_t), ("draft", only_d)) if ex)
        raise TokenizerMismatchError(
            f"draft and target tokenizers differ ({len(t_items ^ d_items)} differing token/id entries; "
            f"{examples}); speculative decoding needs the same "
            "tokenizer: pick a draft from the same model family (or distill one with `edgespec distill`)"
        )
    size = tokenizer_size(target_vocab)
    check_model_covers_tokenizer(target_vocab, target_rows, "target", from_config)
    check_model_covers_tokenizer(draft_vocab, draft_rows, "draft", from_config)
    if target_rows is None or draft_rows is None:  # (before the export, rows not known: the checks only)
        return {"identical_token_to_id_mapping": True, "tokenizer_size": size}
    return {
        "identical_token_to_id_mapping": True,
        "tokenizer_size": size,
        "target_vocab_size": target_rows,
        "draft_vocab_size": draft_rows,
        "padding_rows": {"target": target_rows - size, "draft": draft_rows - size},
        "shared_vocab_size": min(target_rows, draft_rows),
    }
