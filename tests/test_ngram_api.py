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
