"""Prompt-lookup drafting through the public API and the CLI (no second model)."""
from __future__ import annotations

import json

import pytest

from edgespec.api import load
from edgespec.cli import main
from edgespec.errors import InvalidArgumentError

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("arch", ["llama", "t5"])
def test_ngram_drafter_greedy_identity(tiny_bundle, arch):
    eng = load(tiny_bundle(arch))
    prompt = [5, 9, 4, 5, 9, 4, 5, 9, 4, 5]   # repetitive: lookups find continuations
    plain = eng.generate(prompt, max_new_tokens=24, temperature=0.0, use_draft=False)
    ng = eng.generate(prompt, max_new_tokens=24, temperature=0.0, drafter="ngram", gamma=4)
    assert ng.ids == plain.ids
    assert ng.stats.target_calls <= plain.stats.target_calls
    assert set(ng.sources) <= {"target", "accepted", "recovered", "bonus"}
    with pytest.raises(InvalidArgumentError, match="drafter"):
        eng.generate(prompt, drafter="bigram")


def test_generate_cli_ngram(tiny_bundle, capsys):
    assert main(["generate", str(tiny_bundle("gpt2")), "--prompt", "the cat the cat the cat", "--draft", "ngram",
                 "--temperature", "0", "--max-new-tokens", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["ids"]) == 12 or out["finish_reason"] != "length"
    assert out["speculative"] is True and out["stats"]["rounds"] > 0  # no draft model, still speculative


@pytest.mark.parametrize("arch", ["llama", "gpt2", "t5"])
def test_hybrid_drafter_greedy_identity_and_seeds(tiny_bundle, arch):
    """The draft model with prompt-lookup tokens: greedy output equals plain decoding's while the
    engine's hybrid drafter learns over calls, and with lookup tokens forced wherever one differs;
    a seeded sampled run is reproducible (it learns afresh each call); it needs a draft model."""
    import numpy as np

    eng = load(tiny_bundle(arch))
    prompt = [5, 9, 4, 7, 5, 9, 4, 7, 5, 9, 4, 7, 5, 9]
    plain = eng.generate(prompt, max_new_tokens=40, temperature=0.0, use_draft=False)
    for gamma in (3, None, 3, None):
        out = eng.generate(prompt, max_new_tokens=40, temperature=0.0, drafter="hybrid", gamma=gamma)
        assert out.ids == plain.ids, gamma
    # lookup taking every position it can: replaced tokens, still the plain output
    before = eng._hybrid.replaced
    shape = (eng._hybrid.max_ngram + 1, 10)
    eng._hybrid._stats = {k: (np.stack([np.full(shape, 1e9), np.zeros(shape)]), np.full(shape, 1e9))
                          for k in eng._hybrid._stats}
    out = eng.generate(prompt, max_new_tokens=40, temperature=0.0, drafter="hybrid", gamma=3)
    assert out.ids == plain.ids
    if arch != "gpt2":   # the tiny GPT-2's output and lookups repeat what its draft proposes anyway
        assert eng._hybrid.replaced > before
    a = eng.generate(prompt, max_new_tokens=24, temperature=1.0, seed=3, drafter="hybrid", gamma=3)
    b = eng.generate(prompt, max_new_tokens=24, temperature=1.0, seed=3, drafter="hybrid", gamma=3)
    assert a.ids == b.ids
    plain_only = load(tiny_bundle(arch), load_draft=False)
    with pytest.raises(InvalidArgumentError, match="drafter='hybrid' drafts with the bundle's draft model"):
        plain_only.generate(prompt, drafter="hybrid")
