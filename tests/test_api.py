"""edgespec.api.load(...).generate(...) on exported tiny GPT-2 / Llama / T5 bundles."""
from __future__ import annotations

import dataclasses
import json
import re
import warnings

import numpy as np
import pytest

from edgespec import contract
from edgespec.api import load
from edgespec.errors import BundleError, EdgeSpecWarning, InvalidArgumentError, PromptTooLongError, ProviderError

pytestmark = pytest.mark.slow

PROMPT = "the quick brown fox jumps over"


@pytest.fixture(scope="module")
def engines(tiny_bundle):
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = load(tiny_bundle(arch), threads=1)
        return cache[arch]

    return get


def _first_divergence_report(engine, prompt_ids, spec, plain) -> str:
    """Where greedy speculative and plain greedy differ, and the target's logit gap there."""
    i = next(j for j, (a, b) in enumerate(zip(spec, plain)) if a != b) if spec != plain[: len(spec)] else min(len(spec), len(plain))
    t = engine.target
    if engine.manifest.target.kind == contract.KIND_SEQ2SEQ:
        logits = t.prefill(np.array(prompt_ids))
        if i:
            logits = t.extend(np.array(plain[:i]))[-1]
    else:
        logits = t.prefill(np.array(prompt_ids + plain[:i]))
    logits = logits[:engine.vocab_size]
    a, b = (spec[i], plain[i]) if i < min(len(spec), len(plain)) else (None, None)
    gap = float(logits[b] - logits[a]) if a is not None else float("nan")
    return f"first difference at new-token position {i}: speculative {a}, plain {b}, target logit gap {gap:.3g}"


@pytest.mark.parametrize("arch", ["gpt2", "llama", "t5"])
def test_greedy_speculative_equals_plain_greedy(engines, arch):
    eng = engines(arch)
    for gamma in (1, 3, 5, None):
        spec = eng.generate(PROMPT, max_new_tokens=24, temperature=0, gamma=gamma, seed=0)
        plain = eng.generate(PROMPT, max_new_tokens=24, temperature=0, use_draft=False)
        assert spec.ids == plain.ids, _first_divergence_report(eng, spec.prompt_ids, spec.ids, plain.ids)
        assert spec.finish_reason == plain.finish_reason
        assert set(plain.sources) == {"target"}
        assert len(spec.sources) == len(spec.ids)


@pytest.mark.parametrize("arch", ["gpt2", "t5"])
def test_seeded_sampling_is_deterministic(engines, arch):
    eng = engines(arch)
    a = eng.generate(PROMPT, max_new_tokens=20, temperature=1.0, top_k=20, top_p=0.95, seed=7)
    b = eng.generate(PROMPT, max_new_tokens=20, temperature=1.0, top_k=20, top_p=0.95, seed=7)
    assert a.ids == b.ids and a.sources == b.sources
    others = {tuple(eng.generate(PROMPT, max_new_tokens=20, temperature=1.0, seed=s).ids) for s in range(4)}
    assert len(others) > 1


def test_adaptive_gamma_is_the_default_and_a_seed_fixes_sampled_text(tiny_bundle, engines):
    """No gamma: the adaptive policy (issue 8). Sampled with a seed: the same text from a fresh
    engine and after the engine has learned from other calls (the seeded policy prices calls from
    the bundle and starts afresh); greedy: identical to plain decoding."""
    from edgespec.api import load

    eng = engines("llama")
    greedy = eng.generate(PROMPT, max_new_tokens=30, temperature=0)
    assert eng._policies and greedy.ids == eng.generate(PROMPT, max_new_tokens=30, temperature=0, use_draft=False).ids
    first = eng.generate(PROMPT, max_new_tokens=30, temperature=0.9, seed=4)
    eng.generate(PROMPT, max_new_tokens=30, temperature=0.9)          # unseeded: the measuring policy learns
    assert eng.generate(PROMPT, max_new_tokens=30, temperature=0.9, seed=4).ids == first.ids
    assert load(tiny_bundle("llama"), threads=1).generate(PROMPT, max_new_tokens=30, temperature=0.9,
                                                          seed=4).ids == first.ids


@pytest.mark.parametrize("arch", ["llama", "t5"])
def test_stream_equals_non_streamed(engines, arch):
    eng = engines(arch)
    full = eng.generate(PROMPT, max_new_tokens=16, temperature=0.8, seed=3)
    stream = eng.generate(PROMPT, max_new_tokens=16, temperature=0.8, seed=3, stream=True)
    with pytest.raises(InvalidArgumentError, match="not finished"):
        stream.result
    chunks = list(stream)
    assert [t for c in chunks for t in c.ids] == full.ids == stream.result.ids
    assert "".join(chunks) == "".join(c.text for c in chunks) == full.text == stream.result.text
    import copy
    import pickle

    from edgespec.api import StreamChunk

    c = chunks[0]
    assert copy.copy(c) == copy.deepcopy(c) == pickle.loads(pickle.dumps(c)) == c and copy.copy(c).ids == c.ids
    assert StreamChunk("a", [1]) != StreamChunk("a", [2]) and StreamChunk("a", [1]) == "a"
    assert StreamChunk("", [7]) and not StreamChunk("", [])    # ids but held-back text: still a chunk
    assert stream.result.sources == full.sources


def test_stream_ending_inside_a_character_flushes_its_tail():
    """Byte-level BPE splits characters across tokens; the stream holds back an incomplete one. If
    generation ends there, the held-back text (U+FFFD, as the full decode has it) must still come
    out, so that "".join(stream) is the text."""
    from edgespec.api import TextStream, _Detokenizer

    class Bytes:  # decodes ids as bytes, like a byte-level tokenizer
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    def blocks():
        yield list("ab".encode())
        yield list("\u00e9".encode())[:1]      # first byte of a 2-byte character, then the end
        return "done"

    stream = TextStream(blocks(), _Detokenizer(Bytes()), finish=lambda value: value)
    chunks = list(stream)
    assert [c.ids for c in chunks] == [[97, 98], [0xC3], []]
    assert "".join(chunks) == Bytes().decode([97, 98, 0xC3]) == "ab\ufffd" and stream.result == "done"


def test_stop_conditions_and_stats(engines):
    eng = engines("gpt2")
    out = eng.generate(PROMPT, max_new_tokens=5, temperature=0)
    assert len(out.ids) == 5 and out.finish_reason == "length"
    longer = eng.generate(PROMPT, max_new_tokens=20, temperature=0)
    stop = longer.ids[6]
    cut = eng.generate(PROMPT, max_new_tokens=20, temperature=0, stop_token_ids=[stop])
    assert cut.finish_reason == "stop" and cut.ids[-1] == stop and stop not in cut.ids[:-1]
    assert cut.ids == longer.ids[: len(cut.ids)]
    for once in (iter([stop]), (i for i in [stop]), map(int, [stop])):   # an iterator was used up by the type check
        assert eng.generate(PROMPT, max_new_tokens=20, temperature=0, stop_token_ids=once).ids == cut.ids
    s = longer.stats.to_dict()
    assert s["emitted"] == len(longer.ids) == 20
    assert s["accepted"] == longer.sources.count("accepted")
    assert s["target_calls"] >= 1 and s["draft_calls"] >= s["accepted"]
    json.dumps(s)  # serialisable
    plain = eng.generate(PROMPT, max_new_tokens=8, temperature=0, use_draft=False).stats.to_dict()
    assert plain["draft_calls"] == 0 and plain["target_calls"] == 8


def test_ids_prompt_and_single_model_bundle(engines, tiny_bundle):
    eng = engines("gpt2")
    ids = eng.encode(PROMPT)
    assert eng.generate(ids, max_new_tokens=6, temperature=0).ids == eng.generate(PROMPT, max_new_tokens=6, temperature=0).ids
    no_draft = load(tiny_bundle("gpt2"), load_draft=False)
    assert not no_draft.has_draft
    with pytest.warns(EdgeSpecWarning, match=r"^draft_providers \(CLI --draft-provider\), draft_threads \(CLI --draft-threads\) "
                                             r"have no effect: load_draft=False \(CLI --no-draft, --draft ngram\) loads no draft model; drop them$"):
        load(tiny_bundle("gpt2"), load_draft=False, draft_threads=2, draft_providers=["cpu"])
    assert set(no_draft.generate(PROMPT, max_new_tokens=4, temperature=0).sources) == {"target"}
    for drafter in ("model", "lookahead", "hybrid"):  # asked for by name: not a silent plain run
        with pytest.raises(InvalidArgumentError, match=f"drafter='{drafter}'.*load_draft=False.*ngram"):
            no_draft.generate(PROMPT, max_new_tokens=4, drafter=drafter)
    with pytest.raises(InvalidArgumentError, match="use_draft=False decodes with the target alone, so drafter='model'"):
        eng.generate(PROMPT, max_new_tokens=4, use_draft=False, drafter="model")
    for kw in ({"drafter": "model"}, {}):  # the default drafts with the model when there is one
        out = eng.generate(PROMPT, max_new_tokens=8, temperature=0, gamma=3, **kw)
        assert out.stats.draft_calls > 0 and out.stats.drafted > 0 and out.sources.count("target") < 8


def test_bad_inputs(engines, tiny_bundle):
    eng = engines("gpt2")
    with pytest.raises(InvalidArgumentError, match="empty"):
        eng.generate("")
    with pytest.raises(InvalidArgumentError, match="encodes to no tokens"):  # whitespace is text; this tokenizer drops it
        eng.generate("   ")
    with pytest.raises(InvalidArgumentError, match="can never be generated"):
        eng.generate(PROMPT, stop_token_ids=[eng.vocab_size])
    with pytest.raises(InvalidArgumentError, match=r"the prompt is bytes; pass text \(a str: decode it first"):
        eng.generate(b"the quick")  # said "prompt ids must be a non-empty 1-D sequence of integers"
    from edgespec.api import gamma_bound  # an XLA bundle of verify width 1 has no room for a draft at all
    with pytest.raises(InvalidArgumentError, match=r"verify one token per call \(verify_width=1\): no room for a draft"):
        gamma_bound([1], 1)
    with pytest.raises(InvalidArgumentError, match="so gamma <= 3"):
        gamma_bound([5], 4)
    # numpy scalars are numbers like any other; "auto" is adaptive gamma, as on the command line
    a = eng.generate(PROMPT, max_new_tokens=np.int64(6), temperature=np.float32(0.7), top_k=np.int64(5),
                     top_p=np.float64(0.9), gamma=np.int64(2), seed=np.int64(3), stop_token_ids=[np.int64(eng.vocab_size - 1)])
    b = eng.generate(PROMPT, max_new_tokens=6, temperature=0.7, top_k=5, top_p=0.9, gamma=2, seed=3,
                     stop_token_ids=[eng.vocab_size - 1])
    assert a.ids == b.ids
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for greedy without sampling keywords
        greedy = eng.generate(PROMPT, max_new_tokens=6, temperature=0).ids
    assert eng.generate(PROMPT, max_new_tokens=6, temperature=0, gamma="auto").ids == greedy
    # sampling keywords at temperature 0 do nothing: a warning (Hugging Face's generate warns too)
    with pytest.warns(EdgeSpecWarning, match=r"^top_k \(CLI --top-k\) has no effect at temperature 0.*drop it "):
        assert eng.generate(PROMPT, max_new_tokens=6, temperature=0, top_k=5).ids == greedy
    with pytest.warns(EdgeSpecWarning, match=r"top_k .* and top_p \(CLI --top-p\) have no effect.*drop them"):
        eng.generate(PROMPT, max_new_tokens=2, temperature=0, top_k=5, top_p=0.5)
    with pytest.warns(EdgeSpecWarning, match=r"^lenience \(CLI --lenience\) has no effect at temperature 0"):
        assert eng.generate(PROMPT, max_new_tokens=6, temperature=0, lenience=0.1).ids == greedy   # argmax kept whatever l
    # a numpy scalar is summed with the prompt length as a Python int (int8 overflowed, uint8 wrapped around)
    limit = eng.manifest.target.max_positions
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # numpy's overflow warning included (the check wrapped around and passed)
        for small in (np.uint8(250), np.int8(100)):
            with pytest.raises(PromptTooLongError, match="max_new_tokens"):
                eng.generate([5] * (limit - 10), max_new_tokens=small)
    with pytest.raises(InvalidArgumentError, match="non-empty"):
        eng.generate([])
    # one range, the tokenizer's, with or without the draft (its 80 rows took ids the tokenizer has
    # not, which decode() then refused, and refused 85, which the target's 96 rows and plain decoding took)
    n = eng.vocab_size
    assert n < eng.draft.vocab_size < eng.target.vocab_size
    for use_draft in (True, False):
        for bad in (n, 85, 90):
            with pytest.raises(InvalidArgumentError, match=rf"must be in \[0, {n}\) \(this bundle's tokenizer: engine.encode"):
                eng.generate([4, bad], max_new_tokens=2, use_draft=use_draft)
        out = eng.generate([4, n - 1], max_new_tokens=2, use_draft=use_draft)
        assert eng.decode(out.prompt_ids) == eng.decode([4, n - 1])
    with pytest.raises(InvalidArgumentError, match=rf"\[0, {n}\)"):  # beyond int64: the range, not "integers"
        eng.generate([4, 2**70])
    with pytest.raises(PromptTooLongError, match="characters; its first .* alone are .* tokens, more than the 128"):
        eng.generate("the cat " * 50_000)   # refused from a prefix, before the whole text is tokenized
    with pytest.raises(InvalidArgumentError, match="not valid Unicode"):   # a long text too (it was a TypeError)
        eng.generate("\udcff" + "the cat " * 50_000)
    from collections import deque

    for bools in ([True, 2], deque([True, 2]), np.array([True, 2], dtype=object), np.array([True, False])):
        with pytest.raises(InvalidArgumentError, match="not bools"):  # numpy would make True a 1
            eng.generate(bools)
    for bare, needle in ((None, r"the prompt is None; pass text"), (7, r"token ids \(\[7\] for one token id\)"),
                         (2.5, r"the prompt is 2.5; pass text \(a str\) or a sequence of token ids$"),
                         (True, r"the prompt is True; pass text \(a str\) or a sequence of token ids$")):
        with pytest.raises(InvalidArgumentError, match=needle):
            eng.generate(bare)
    with pytest.raises(PromptTooLongError, match="128"):
        eng.generate([4] * 129, max_new_tokens=1)
    with pytest.raises(PromptTooLongError, match="at most 29"):
        eng.generate([4] * 100, max_new_tokens=40)
    for kwargs in ({"temperature": -1}, {"top_p": 0.0}, {"top_k": -2}, {"gamma": 0}, {"seed": -1},
                   {"max_new_tokens": 0}, {"lenience": 2.0}, {"stop_token_ids": 5},
                   {"use_draft": "no"}, {"stream": "yes"}, {"use_draft": False, "drafter": "ngram"}):
        with pytest.raises(InvalidArgumentError):
            eng.generate(PROMPT, **kwargs)
    # settings that would do nothing are refused, as the CLI refuses them (they were ignored)
    for kwargs, needle in (({"use_draft": False, "gamma": 3}, "use_draft=False decodes with the target alone, so gamma"),
                           ({"use_draft": False, "lenience": 0.5}, "so lenience has no effect")):
        with pytest.raises(InvalidArgumentError, match=needle):
            eng.generate(PROMPT, **kwargs)
    alone = load(tiny_bundle("llama"), load_draft=False)
    with pytest.raises(InvalidArgumentError, match="no draft model .loaded with load_draft=False., so gamma"):
        alone.generate(PROMPT, gamma=3)
    assert alone.generate(PROMPT, max_new_tokens=4, temperature=0, gamma=3, drafter="ngram").ids == \
        alone.generate(PROMPT, max_new_tokens=4, temperature=0).ids
    # None is Python's "none": no stop ids, as the default ()
    assert eng.generate(PROMPT, max_new_tokens=4, temperature=0, stop_token_ids=None).ids == \
        eng.generate(PROMPT, max_new_tokens=4, temperature=0).ids
    ids = eng.generate(PROMPT, max_new_tokens=4, temperature=0).ids
    assert eng.decode(np.asarray(ids)) == eng.decode(ids)           # numpy ids are ids
    for bad in ([10**6], [-1], "abc", [1.5], None):
        with pytest.raises(InvalidArgumentError, match="decode takes a sequence of token ids"):
            eng.decode(bad)
    for bad in (-1, "x", float("nan"), float("inf")):
        with pytest.raises(InvalidArgumentError, match="busy_timeout must be a number of seconds >= 0"):
            eng.busy_timeout = bad
    eng.busy_timeout = np.float32(0.5)
    assert eng.busy_timeout == 0.5
    eng.busy_timeout = None
    # text that is not valid Unicode (a shell's $'\xff' arrives as a lone surrogate)
    with pytest.raises(InvalidArgumentError, match="not valid Unicode text"):
        eng.generate("the \udcff fox")
    with pytest.raises(InvalidArgumentError, match="takes text"):
        eng.encode(b"the fox")


def test_load_errors(tmp_path, bundle_copy, tiny_bundle):
    with pytest.raises(BundleError, match="does not exist"):
        load(tmp_path / "nope")
    for bad in (None, 5, b"bundle", ""):
        with pytest.raises(InvalidArgumentError, match="load takes the bundle's folder"):
            load(bad)
    with pytest.raises(ProviderError, match="available"):
        load(tiny_bundle("gpt2"), providers=["cuda"])
    with pytest.raises(ProviderError, match="available"):
        load(tiny_bundle("gpt2"), draft_providers=["coreml"])
    # flags of the wrong type, and settings that do nothing with this runtime, are refused, not ignored
    good = tiny_bundle("gpt2")
    for kwargs, needle in (({"load_draft": "no"}, "load_draft must be True or False"),
                           ({"spinning": "no"}, "spinning must be True or False (or None"),
                           ({"draft_spinning": 1}, "draft_spinning must be True or False"),
                           ({"threads": None}, "threads (CLI --threads) must be an integer from 0 to 4096 (0 = ONNX "
                                               "Runtime's default; this process may use"),
                           ({"threads": -1}, "threads (CLI --threads) must be an integer from 0 to 4096"),
                           ({"draft_threads": 1.5}, "draft_threads (CLI --draft-threads) must be an integer from 0 to "
                                                    "4096 (0 = ONNX Runtime's default; None: as the target;"),
                           ({"providers": None}, "providers must be provider names in order"),
                           ({"providers": 5}, "providers must be provider names"),
                           ({"draft_providers": 5}, "draft_providers must be provider names"),
                           ({"runtime": "tvm"}, "runtime must be 'onnx' or 'xla'"),
                           ({"platform": "cpu"}, "platform= picks the XLA device"),
                           ({"runtime": "xla", "threads": 1}, "threads configures ONNX Runtime and does nothing"),
                           ({"runtime": "xla", "spinning": False, "huge_pages": False},
                            "spinning, huge_pages configure ONNX Runtime")):
        with pytest.raises(InvalidArgumentError, match=re.escape(needle)):
            load(good, **kwargs)
    assert load(good, threads=np.int64(1), draft_threads=np.int32(1)).generate([5, 9], max_new_tokens=2).ids
    b = bundle_copy()
    f = b / "target" / contract.DECODER_FILE
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(BundleError, match="truncated"):
        load(b)


def test_adaptive_policy_persists_across_calls(tiny_bundle):
    """gamma=None: the engine keeps one learning policy per sampling setting, so a later call starts
    from what earlier calls measured (and greedy output stays the target's)."""
    eng = load(tiny_bundle("llama"), threads=1)
    plain = eng.generate([5, 9, 13], max_new_tokens=20, temperature=0, use_draft=False).ids
    rounds, seen = 0, []
    for _ in range(2):
        out = eng.generate([5, 9, 13], max_new_tokens=20, temperature=0, gamma=None)
        assert out.ids == plain
        rounds += out.stats.rounds
        greedy = next(p for k, p in eng._policies.items() if k[0].greedy)
        seen.append(greedy._rounds + len(greedy._pending))  # the drafted rounds it has learned from or holds
    assert seen == [seen[0], rounds] and seen[0] > 0  # the second call added to the first call's rounds
    eng.generate([5, 9, 13], max_new_tokens=20, temperature=1.0, gamma=None)
    assert len(eng._policies) == 2  # one for greedy, one for T=1
    eng.generate([5, 9, 13], max_new_tokens=20, temperature=1.0, gamma=None, seed=0)
    assert len(eng._policies) == 2  # a seeded sampled call uses a fresh policy of its own


def test_public_names_and_thread_oversubscription(tiny_bundle):
    """What an application handles is importable from edgespec itself, and more intra-op threads
    than usable cores (a trial: 500 on 2 cores, 450x slower) is warned about."""
    import os
    import warnings

    import edgespec

    cores = len(os.sched_getaffinity(0))
    with pytest.warns(edgespec.EdgeSpecWarning, match=f"threads={cores + 1} .CLI --threads. on a machine") as seen:
        eng = edgespec.load(tiny_bundle("llama"), threads=cores + 1)
    assert "spin-waiting (the default)" in str(seen[0].message) and "spinning=False, CLI --no-spin" in str(seen[0].message)
    with pytest.warns(edgespec.EdgeSpecWarning) as seen:
        edgespec.load(tiny_bundle("llama"), threads=cores + 1, spinning=False)
    assert "spin" not in str(seen[0].message)
    from edgespec.runtimes.onnx_backend import MAX_THREADS
    for kw in ({"threads": 2**40}, {"draft_threads": MAX_THREADS + 1}):  # ORT's binding took a TypeError
        with pytest.raises(edgespec.InvalidArgumentError, match=f"from 0 to {MAX_THREADS}"):
            edgespec.load(tiny_bundle("llama"), **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error", edgespec.EdgeSpecWarning)
        edgespec.load(tiny_bundle("llama"), threads=cores, draft_threads=1)
    with pytest.warns(edgespec.EdgeSpecWarning) as seen:  # draft_threads=None (as the target's) is not warned twice
        edgespec.load(tiny_bundle("llama"), threads=cores + 1, draft_threads=None)
    assert len(seen) == 1
    assert seen[0].filename == __file__  # the warning names the caller's line, not edgespec's
    assert isinstance(eng, edgespec.Engine)
    out = eng.generate(PROMPT, max_new_tokens=3, temperature=0)
    assert isinstance(out, edgespec.GenerationOutput)
    stream = eng.generate(PROMPT, max_new_tokens=3, temperature=0, stream=True)
    assert isinstance(stream, edgespec.TextStream) and all(isinstance(c, edgespec.StreamChunk) for c in stream)
    with pytest.raises(edgespec.PromptTooLongError) as err:
        eng.generate([4] * 500, max_new_tokens=1)
    assert err.value.knob == "prompt" and issubclass(edgespec.PromptTooLongError, edgespec.InvalidArgumentError)
    for name in ("BundleError", "ProviderError", "InvalidArgumentError"):
        assert issubclass(getattr(edgespec, name), edgespec.EdgeSpecError) and name in edgespec.__all__


# (the tests below pin what a mutation audit's surviving mutants changed: each fails on its mutant)
@pytest.fixture(scope="module")
def eng(engines):
    return engines("gpt2")


def test_top_k_and_top_p_reach_the_sampler(eng):
    greedy = eng.generate(PROMPT, max_new_tokens=16, temperature=0).ids
    for seed in range(3):
        for kw in ({"top_k": 1}, {"top_p": 1e-9}):
            for gamma in (3, None):
                out = eng.generate(PROMPT, max_new_tokens=16, temperature=1.0, seed=seed, gamma=gamma, **kw)
                assert out.ids == greedy, (seed, kw, gamma)


def test_every_stop_id_stops(eng):
    longer = eng.generate(PROMPT, max_new_tokens=20, temperature=0)
    stop = longer.ids[6]
    unused = next(i for i in range(eng.vocab_size) if i not in longer.ids)
    cut = eng.generate(PROMPT, max_new_tokens=20, temperature=0, stop_token_ids=[unused, stop])
    assert cut.finish_reason == "stop" and cut.ids == longer.ids[:longer.ids.index(stop) + 1]


def test_stop_ids_stop_a_stream(eng):
    longer = eng.generate(PROMPT, max_new_tokens=20, temperature=0)
    stop = longer.ids[6]
    full = eng.generate(PROMPT, max_new_tokens=20, temperature=0, stop_token_ids=[stop])
    stream = eng.generate(PROMPT, max_new_tokens=20, temperature=0, stop_token_ids=[stop], stream=True)
    assert [t for c in stream for t in c.ids] == full.ids and stream.result.finish_reason == "stop"


def test_the_bundles_eos_ids_end_generation(tiny_bundle):
    e = load(tiny_bundle("gpt2"), threads=1)
    longer = e.generate(PROMPT, max_new_tokens=20, temperature=0)
    eos = longer.ids[6]
    m = e.manifest
    e.manifest = dataclasses.replace(m, models={**m.models, "target": dataclasses.replace(m.target, eos_token_ids=[eos])})
    out = e.generate(PROMPT, max_new_tokens=20, temperature=0)
    assert out.finish_reason == "eos" and out.ids == longer.ids[:longer.ids.index(eos) + 1]


def test_seeded_hybrid_run_ignores_what_the_engine_learned(tiny_bundle):
    prompt = [5, 9, 4, 7, 5, 9, 4, 7, 5, 9, 4, 7, 5, 9]
    first = load(tiny_bundle("llama")).generate(prompt, max_new_tokens=24, temperature=1.0, seed=3, drafter="hybrid",
                                                gamma=3).ids
    e = load(tiny_bundle("llama"))
    e.generate(prompt, max_new_tokens=40, temperature=1.0, drafter="hybrid", gamma=3)   # unseeded: the engine's hybrid learns
    shape = (e._hybrid.max_ngram + 1, 10)
    e._hybrid._stats = {k: (np.stack([np.full(shape, 1e9), np.zeros(shape)]), np.full(shape, 1e9))
                        for k in e._hybrid._stats}                                     # ... to look up everywhere
    assert e.generate(prompt, max_new_tokens=24, temperature=1.0, seed=3, drafter="hybrid", gamma=3).ids == first


def test_no_greedy_warning_when_sampling(eng):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eng.generate(PROMPT, max_new_tokens=4, temperature=0.7, top_k=5, top_p=0.9, seed=0)


def test_decode_refuses_the_id_past_the_tokenizer(eng):
    size = eng.manifest.target.tokenizer_size
    eng.decode([size - 1])
    with pytest.raises(InvalidArgumentError, match="decode takes"):
        eng.decode([size])


def test_the_oldest_policy_is_evicted(eng):
    from edgespec import api
    eng._policies.clear()
    for i in range(api._MAX_POLICIES):
        eng._policies[("dummy", i)] = object()
    eng.generate(PROMPT, max_new_tokens=4, temperature=0.5)
    assert ("dummy", 0) not in eng._policies and ("dummy", api._MAX_POLICIES - 1) in eng._policies
    assert len(eng._policies) == api._MAX_POLICIES
    eng._policies.clear()  # (the dummies go: the engine is the module's)
