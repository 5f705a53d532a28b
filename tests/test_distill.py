"""measure_alpha and `edgespec distill` on tiny models."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from edgespec.cli import main  # noqa: E402
from edgespec.distill import distill, measure_alpha, resolve_size  # noqa: E402
from edgespec.errors import CheckpointError, EdgeSpecWarning, InvalidArgumentError, OutputExistsError, TrainingError  # noqa: E402
from edgespec.pair import train_pair  # noqa: E402

_FILES = ["argparse.py", "json/decoder.py", "json/encoder.py", "textwrap.py", "string.py", "bisect.py",
          "heapq.py", "shlex.py", "fnmatch.py", "glob.py", "copy.py", "abc.py"]


class _Fixed(torch.nn.Module):
    """A stand-in causal LM whose logits at every position are a fixed vector."""

    def __init__(self, logits):
        super().__init__()
        self.v = torch.as_tensor(logits, dtype=torch.float32)
        self.head = torch.nn.Linear(1, len(self.v), bias=False)

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.v.expand(*input_ids.shape, len(self.v)).clone())


class _Echo(_Fixed):
    """Logits peaked on the input token itself."""

    def __init__(self, vocab):
        super().__init__(torch.zeros(vocab))

    def forward(self, input_ids):
        from types import SimpleNamespace

        return SimpleNamespace(logits=5.0 * torch.nn.functional.one_hot(input_ids, len(self.v)).float())


def test_measure_alpha_formula():
    p_logits, q_logits = torch.tensor([2.0, 1.0, 0.0, -1.0]), torch.tensor([0.0, 1.5, 0.5, 0.0])
    t, d = _Fixed(p_logits), _Fixed(q_logits)
    ids = torch.zeros(3, 5, dtype=torch.long)
    expected = float(torch.minimum(p_logits.softmax(-1), q_logits.softmax(-1)).sum())
    assert measure_alpha(t, d, ids, 1.0) == pytest.approx(expected, abs=1e-6)
    expected_t2 = float(torch.minimum((p_logits / 2).softmax(-1), (q_logits / 2).softmax(-1)).sum())
    assert measure_alpha(t, d, ids, 2.0) == pytest.approx(expected_t2, abs=1e-6)
    assert measure_alpha(t, d, ids, 0.0) == 0.0  # argmax 0 vs argmax 1
    assert measure_alpha(t, t, ids, 0.0) == 1.0
    assert measure_alpha(t, t, [[1, 2, 3], [4]], 1.0) == pytest.approx(1.0)
    assert measure_alpha(t, d, ids[0], 1.0) == pytest.approx(expected, abs=1e-6)
    with pytest.raises(InvalidArgumentError):
        measure_alpha(t, d, ids, -1.0)
    # start: only positions >= start count. The echo model's argmax is the input token, the fixed
    # draft's is 1, so at T=0 alpha is the share of ones among the counted inputs.
    rows = torch.tensor([[0, 0, 1, 0, 2], [3, 0, 0, 1, 1]])
    assert measure_alpha(_Echo(4), d, rows, 0.0) == pytest.approx(3 / 10)
    assert measure_alpha(_Echo(4), d, rows, 0.0, start=2) == pytest.approx(3 / 6)
    assert measure_alpha(_Echo(4), d, rows, 0.0, start=3) == pytest.approx(2 / 4)
    assert measure_alpha(_Echo(4), d, rows[:1], 0.0, start=3) == 0.0
    with pytest.raises(InvalidArgumentError, match="start"):
        measure_alpha(t, d, ids, 1.0, start=-1)
    with pytest.raises(InvalidArgumentError, match="at least one token"):
        measure_alpha(t, d, ids, 1.0, start=5)
    with pytest.raises(InvalidArgumentError, match="vocabulary"):
        measure_alpha(t, _Fixed(torch.zeros(5)), ids, 1.0)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[Path]:
    from tiny_models import copy_stdlib_files

    return copy_stdlib_files(tmp_path_factory.mktemp("corpus"), _FILES)


@pytest.fixture(scope="module")
def target(corpus, tmp_path_factory) -> Path:
    return train_pair("tiny", corpus, tmp_path_factory.mktemp("p") / "pair", progress=False) / "target"


@pytest.mark.slow
def test_distill_improves_alpha_and_saves_checkpoint(target, corpus, tmp_path):
    from transformers import AutoTokenizer, LlamaForCausalLM

    out = tmp_path / "draft"
    r = distill(target, out, hidden=16, layers=1, heads=1, intermediate=32, corpus=corpus, steps=40, batch_size=8,
                lr=1e-2, eval_windows=8, progress=False)
    assert r["alpha_after"]["T1"] > r["alpha_before"]["T1"] + 0.05
    assert set(r["alpha_after"]) == {"T0", "T1"}
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "distill.json"} <= names
    assert not any(n.endswith((".bin", ".pt")) for n in names)
    assert (out / "tokenizer.json").read_bytes() == (target / "tokenizer.json").read_bytes()
    draft = LlamaForCausalLM.from_pretrained(out, use_safetensors=True)
    assert draft.config.vocab_size == LlamaForCausalLM.from_pretrained(target, use_safetensors=True).config.vocab_size
    assert AutoTokenizer.from_pretrained(out).bos_token == "<|bos|>"
    assert json.loads((out / "distill.json").read_text())["alpha_after"] == r["alpha_after"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left


@pytest.mark.slow
def test_distill_cli_with_baseline(target, corpus, tmp_path, capsys):
    rc = main(["distill", "--target", str(target), "--out", str(tmp_path / "d"), "--hidden", "16", "--layers", "1",
               "--heads", "1", "--intermediate", "32", "--steps", "6", "--batch-size", "4", "--eval-windows", "2",
               "--mode", "tv", "--baseline", "--no-progress", "--generated", "0.5", "--pool-size", "3",
               "--corpus", *map(str, corpus)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "baseline" in out and "alpha" in out and "own continuations" in out
    r = json.loads((tmp_path / "d" / "distill.json").read_text())
    assert "baseline" in r and set(r["alpha_gain_over_baseline"]) == {"T0", "T1"}
    assert r["pool_size"] == 3 and r["generated_fraction"] == 0.5 and r["generated_rows_per_batch"] == 2
    for key in ("alpha_on_target_before", "alpha_on_target_after"):
        assert set(r[key]) == {"T0", "T1"} and all(0 <= v <= 1 for v in r[key].values())


def test_distill_with_a_single_eval_window(target, corpus, tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", EdgeSpecWarning)   # a draft well below the target's size: no warning
        r = distill(target, tmp_path / "d", hidden=16, layers=1, heads=1, intermediate=32, corpus=corpus, steps=1,
                    batch_size=2, eval_windows=1, progress=False)
    assert set(r["alpha_on_target_after"]) == {"T0", "T1"}
    assert r["draft_params"] * 2 < _params(target)


def test_distill_reads_a_tokenizer_json_alone_as_export_does(target, corpus, tmp_path, monkeypatch):
    """Without tokenizer_config.json, AutoTokenizer added its class's default special tokens (323
    "tokens" for a 320-row model) and distill refused a target that export takes; the special ids
    come from the model's config then."""
    from edgespec import corpus as corpus_mod

    bare = tmp_path / "bare"
    shutil.copytree(target, bare)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        (bare / name).unlink()
    seen = {}
    real = corpus_mod.encode_docs

    def spy(backend, docs, *, bos_id, eos_id, **kw):
        seen.update(bos=bos_id, eos=eos_id)
        return real(backend, docs, bos_id=bos_id, eos_id=eos_id, **kw)

    monkeypatch.setattr(corpus_mod, "encode_docs", spy)   # (distill imports it when it runs)
    distill(bare, tmp_path / "d", hidden=16, layers=1, heads=1, intermediate=32, corpus=corpus, steps=1,
            batch_size=2, eval_windows=1, progress=False)
    config = json.loads((target / "config.json").read_text())
    assert seen == {"bos": config["bos_token_id"], "eos": config["eos_token_id"]} and None not in seen.values()


def _params(folder: Path) -> int:
    import math

    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "np") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def test_distill_warns_of_a_draft_as_large_as_its_target(target, corpus, tmp_path):
    """`--size tiny` is larger than the tiny preset's target: a draft that costs nearly a target step
    gains nothing, so distill says so (it still trains what was asked for)."""
    with pytest.warns(EdgeSpecWarning, match=r"of the target's .*make it smaller with --hidden"):
        distill(target, tmp_path / "d", size="tiny", corpus=corpus, steps=1, batch_size=2, eval_windows=1,
                progress=False)
    assert (tmp_path / "d" / "distill.json").is_file()
    # from an --init checkpoint the shape is the checkpoint's, which --hidden cannot change
    with pytest.warns(EdgeSpecWarning, match=r"of the target's .*start from a smaller --init checkpoint") as seen:
        distill(target, tmp_path / "e", init=tmp_path / "d", corpus=corpus, steps=1, batch_size=2, eval_windows=1,
                progress=False)
    assert not any("--hidden" in str(w.message) for w in seen)


def test_continuations_are_the_targets_own_text(target):
    from edgespec.distill import continuations, load_target

    model, _ = load_target(target)
    g = torch.Generator().manual_seed(0)
    prefixes = torch.randint(3, model.config.vocab_size, (8, 4), generator=g)
    out = continuations(model, prefixes, 12, (0.0, 1.0), seed=3, batch_size=2)
    assert out.shape == (8, 12) and torch.equal(out[:, :4], prefixes)

    def argmax_text(rows):
        with torch.no_grad():
            return model(input_ids=rows).logits[:, 3:-1].argmax(-1)         # [n, 8]: what each next token must be

    assert torch.equal(out[0::2, 4:], argmax_text(out[0::2]))              # rows 0, 2, 4, 6: greedy
    assert not torch.equal(out[1::2, 4:], argmax_text(out[1::2]))          # rows 1, 3, 5, 7: sampled at T=1
    # A row's text is its own: the sampled rows span two batches of 2 here, one batch of 32 there
    # (one generator for the whole batch made rows depend on their batch mates).
    assert torch.equal(continuations(model, prefixes, 12, (0.0, 1.0), seed=3, batch_size=32), out)
    other = continuations(model, prefixes, 12, (0.0, 1.0), seed=4)
    assert torch.equal(other[0::2], out[0::2]) and not torch.equal(other[1::2], out[1::2])  # the seed moves samples only
    cold = continuations(model, prefixes, 12, (1e-3,), seed=3)             # sampling at T -> 0 is argmax
    assert torch.equal(cold[:, 4:], argmax_text(cold))
    # The checkpoint's generation_config.json does not apply: the engine decodes without it.
    model.generation_config.repetition_penalty, model.generation_config.no_repeat_ngram_size = 1.3, 2
    assert torch.equal(continuations(model, prefixes, 12, (0.0, 1.0), seed=3), out)


def test_bad_targets(target, corpus, tmp_path):
    kw = dict(corpus=corpus, steps=1, progress=False)
    with pytest.raises(CheckpointError, match="does not exist"):
        distill(tmp_path / "missing", tmp_path / "o", **kw)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointError, match="afile is a file, not a folder"):  # not "does not exist"
        distill(tmp_path / "afile", tmp_path / "o", **kw)
    no_tok = tmp_path / "no_tok"
    shutil.copytree(target, no_tok)
    (no_tok / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer"):
        distill(no_tok, tmp_path / "o", **kw)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(target / "config.json", pickled)
    shutil.copy(target / "tokenizer.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"not a real pickle; never loaded")
    with pytest.raises(CheckpointError, match="pickle"):
        distill(pickled, tmp_path / "o", **kw)
    seq2seq = tmp_path / "t5"
    shutil.copytree(target, seq2seq)
    cfg = json.loads((seq2seq / "config.json").read_text())
    (seq2seq / "config.json").write_text(json.dumps({**cfg, "model_type": "t5"}))
    with pytest.raises(CheckpointError, match="holds a 't5' model; distill trains drafts for decoder-only targets"):
        distill(seq2seq, tmp_path / "o", **kw)
    cut = tmp_path / "cut"
    shutil.copytree(target, cut)
    (cut / "model.safetensors").write_bytes((target / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        distill(cut, tmp_path / "o", **kw)
    more = tmp_path / "more-layers"  # config.json describes more layers than the weights hold
    shutil.copytree(target, more)
    cfg = json.loads((more / "config.json").read_text())
    (more / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": cfg["num_hidden_layers"] + 1}))
    with pytest.raises(CheckpointError, match="has no weights for model.layers"):
        distill(more, tmp_path / "o", **kw)
    with pytest.raises(CheckpointError, match="has no weights for model.layers"):
        distill(target, tmp_path / "o", init=more, **kw)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    for overwrite in (False, True):  # not a distilled draft: the message says --overwrite would not help either
        with pytest.raises(OutputExistsError, match="is not a distilled draft .*replaces only a distilled draft"):
            distill(target, tmp_path / "taken", overwrite=overwrite, **kw)
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(TrainingError, match="no text"):
        distill(target, tmp_path / "o", corpus=[empty], steps=1, progress=False)
    with pytest.raises(TrainingError, match="does not exist"):
        distill(target, tmp_path / "o", corpus=[tmp_path / "nope.txt"], steps=1, progress=False)
    with pytest.raises(InvalidArgumentError, match="mode"):
        distill(target, tmp_path / "o", mode="js", **kw)
    assert not (tmp_path / "o").exists()


def test_pool_size_without_generated_is_an_error(target, tmp_path, capsys):
    assert main(["distill", "--target", str(target), "--out", str(tmp_path / "d"), "--pool-size", "3"]) == 2
    err = capsys.readouterr().err
    assert "add --generated FRACTION or drop --pool-size" in err and not (tmp_path / "d").exists()
    # a fraction that rounds to no row of the batch did nothing, while the report said it was used
    assert main(["distill", "--target", str(target), "--out", str(tmp_path / "d"), "--generated", "0.02"]) == 2
    err = capsys.readouterr().err
    assert "--generated) 0.02 of a batch of 16 rows is no row; give at least 0.0625" in err and not (tmp_path / "d").exists()


def test_bad_sizes():
    with pytest.raises(InvalidArgumentError, match="divide"):
        resolve_size(None, hidden=30, heads=4)
    with pytest.raises(InvalidArgumentError, match="unknown draft size"):
        resolve_size("gigantic")
    s = resolve_size("tiny", layers=2)
    assert s.layers == 2 and s.hidden == 64
    s = resolve_size(None, hidden=100)
    assert 100 % s.heads == 0 and (100 // s.heads) % 2 == 0


def _tiny_llama(layers: int, seed: int = 0):
    from edgespec.pair import ModelSize, new_llama

    torch.manual_seed(seed)
    m = new_llama(ModelSize(hidden=16, layers=layers, heads=2, intermediate=32).llama_config(50, 32))
    with torch.no_grad():  # trained-looking weights: new_llama zeroes the residual outputs
        for name, p in m.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0, 0.2)
    return m.eval()


def test_grow_layers_keeps_the_drafts_distributions():
    from edgespec.distill import grow_layers

    m = _tiny_llama(2)
    torch.manual_seed(1)
    g = grow_layers(m, 4)
    assert g.config.num_hidden_layers == 4 and len(g.model.layers) == 4
    assert m.config.num_hidden_layers == 2  # the checkpoint is not modified
    x = torch.randint(0, 50, (3, 20))
    with torch.no_grad():
        assert torch.equal(m(input_ids=x).logits, g(input_ids=x).logits)
        # the new layers are real: once their outputs move, the distributions move
        g.model.layers[3].mlp.down_proj.weight.normal_(0, 0.2)
        assert not torch.allclose(m(input_ids=x).logits, g(input_ids=x).logits)


def test_grow_layers_extends_per_layer_settings():
    from transformers import LlamaForCausalLM

    from edgespec.distill import grow_layers

    m = _tiny_llama(2)
    cfg = m.config.__class__.from_dict({**m.config.to_dict(), "layer_types": ["full_attention"] * 2})
    m2 = LlamaForCausalLM(cfg).eval()
    m2.load_state_dict(m.state_dict())
    g = grow_layers(m2, 3)
    assert g.config.layer_types == ["full_attention"] * 3
    x = torch.randint(0, 50, (1, 9))
    with torch.no_grad():
        assert torch.equal(m2(input_ids=x).logits, g(input_ids=x).logits)


def test_init_shape_rules():
    from edgespec.distill import _init_shape

    c = _tiny_llama(2).config
    own = _init_shape(c, None, None, None, None, None)
    assert (own.layers, own.hidden, own.heads, own.intermediate) == (2, 16, 2, 32)
    assert _init_shape(c, None, 5, 16, None, 32).layers == 5
    with pytest.raises(InvalidArgumentError, match="hidden 192 .*checkpoint has 16.*drop --size"):
        _init_shape(c, "large", None, None, None, None)
    with pytest.raises(InvalidArgumentError, match="heads 4"):
        _init_shape(c, None, None, None, 4, None)
    with pytest.raises(InvalidArgumentError, match="fewer than .* 2 layers"):
        _init_shape(c, None, 1, None, None, None)
    with pytest.raises(InvalidArgumentError, match="layers"):
        _init_shape(c, None, 3.0, None, None, None)
    c1 = _tiny_llama(1).config  # a named size asks for its layers too (tiny: 1) unless --layers says otherwise
    with pytest.raises(InvalidArgumentError, match="layers 1 .*checkpoint has 2"):
        _init_shape(c, "tiny", None, 64, 2, 172)
    assert _init_shape(c1.__class__.from_dict({**c1.to_dict(), "hidden_size": 64, "intermediate_size": 172}),
                       "tiny", 3, None, None, None).layers == 3


@pytest.mark.slow
def test_distill_from_init_keeps_its_shape_and_grows(target, corpus, tmp_path):
    from transformers import AutoConfig

    kw = dict(corpus=corpus, steps=2, batch_size=2, eval_windows=4, context=16, progress=False)
    first = distill(target, tmp_path / "a", hidden=16, layers=1, heads=1, intermediate=32, **kw)
    # a new draft has the target's positions, not the training window's (it would stop speculation there)
    assert AutoConfig.from_pretrained(tmp_path / "a").max_position_embeddings == \
        AutoConfig.from_pretrained(target).max_position_embeddings == 32
    assert "init" not in first
    # the report names the checkpoint's shape (it named the default size's before)
    same = distill(target, tmp_path / "b", init=tmp_path / "a", **kw)
    assert same["draft_config"] == first["draft_config"] == {"hidden": 16, "layers": 1, "heads": 1, "intermediate": 32}
    grown = distill(target, tmp_path / "c", init=tmp_path / "a", layers=3, **kw)
    assert grown["draft_config"]["layers"] == 3 and grown["draft_params"] > first["draft_params"]
    assert grown["init"] == str((tmp_path / "a").resolve()) and grown["init_layers"] == 1
    # the grown draft starts exactly where the checkpoint ended
    assert grown["alpha_before"] == first["alpha_after"]
    assert grown["alpha_on_target_before"] == first["alpha_on_target_after"]
    with pytest.raises(InvalidArgumentError, match="only --layers may grow"):
        distill(target, tmp_path / "d", init=tmp_path / "a", size="large", **kw)
    # --init must be a Llama draft: another type's config read as Llama gives a 7 B-parameter model
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(tmp_path / "a", gpt2)
    cfg = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(InvalidArgumentError, match="holds a 'gpt2' model.*Llama draft"):
        distill(target, tmp_path / "e", init=gpt2, **kw)
    # --overwrite never replaces a plain file given as --out
    afile = tmp_path / "afile"
    afile.write_text("hi")
    with pytest.raises(OutputExistsError, match="not a folder"):
        distill(target, afile, overwrite=True, **kw)
    assert afile.read_text() == "hi"
    # distill's own files (sharded weights too) are its output; a distilled draft that holds something else is not
    from edgespec.outputs import DRAFT_FILES, foreign_names

    a = tmp_path / "a"
    assert foreign_names(a, DRAFT_FILES) == []  # everything distill wrote
    (a / "model-00001-of-00002.safetensors").write_bytes(b"")  # the draft saved sharded: still distill's own
    (a / "model.safetensors.index.json").write_text("{}")
    (a / "model-notes.safetensors").write_text("mine")
    (a / "model-00002-of-00002.safetensors").mkdir()  # a folder of a weights file's name is not ours
    assert foreign_names(a, DRAFT_FILES) == ["model-00002-of-00002.safetensors", "model-notes.safetensors"]
    for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json", "model-notes.safetensors"):
        (a / name).unlink()
    (a / "model-00002-of-00002.safetensors").rmdir()
    (tmp_path / "a" / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match=r"also holds what this command did not write \(notes.txt\)"):
        distill(target, tmp_path / "a", overwrite=True, **kw)
    assert (tmp_path / "a" / "notes.txt").read_text() == "mine" and (tmp_path / "a" / "distill.json").exists()


def _interrupt_at(monkeypatch, n: int):
    """Make the n-th optimizer step (counting from now) raise KeyboardInterrupt; returns the real
    optimizer_step and the list each call appends to."""
    import edgespec.pair as pair
    real, calls = pair.optimizer_step, []

    def interrupted(*a):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(pair, "optimizer_step", interrupted)
    return real, calls


def test_an_interrupted_baseline_resumes_too(target, corpus, tmp_path, monkeypatch, capsys):
    """--baseline's corpus-only draft saves its training state as the distilled draft does: stopped in
    it, the rerun neither distils again nor trains the baseline from its start, and reports what an
    uninterrupted run reports (it used to train the baseline again from step 0)."""
    import edgespec.pair as pair

    kw = dict(hidden=16, layers=1, heads=1, intermediate=32, corpus=corpus, steps=6, batch_size=4, eval_windows=2,
              generated=0.5, pool_size=3, checkpoint_every=2, progress=False, baseline=True)
    whole = distill(target, tmp_path / "whole", **kw)
    real, calls = _interrupt_at(monkeypatch, 6 + 3)  # the baseline's third step, after its state of step 2 was saved
    with pytest.raises(KeyboardInterrupt):
        distill(target, tmp_path / "d", **kw)
    base_state = tmp_path / ".d.distill-baseline-state.pt"
    assert base_state.is_file() and "the baseline draft's training so far is saved in" in capsys.readouterr().err
    calls.clear()
    monkeypatch.setattr(pair, "optimizer_step", lambda *a: (calls.append(1), real(*a))[1])
    resumed = distill(target, tmp_path / "d", **{**kw, "progress": True})
    assert len(calls) == 4                                     # the baseline's steps 3-6 only
    assert "resuming the baseline draft's training at step 2/6" in capsys.readouterr().err
    assert resumed["baseline"] == whole["baseline"] and resumed["alpha_after"] == whole["alpha_after"]
    assert not base_state.exists() and not (tmp_path / ".d.distill-state.pt").exists()


def test_an_interrupted_distillation_resumes_where_it_stopped(target, corpus, tmp_path, monkeypatch, capsys):
    """The training state is saved beside --out every --checkpoint-every steps; after an interruption
    the same call resumes from it and ends with the weights an uninterrupted run has (every batch is
    a function of the seed and the step), then deletes it. A state saved with other settings is an
    error that names them, not a silent restart. The last step's state is saved too: stopped after
    training, the rerun does not train again."""
    import edgespec.pair as pair
    from safetensors.numpy import load_file

    kw = dict(hidden=16, layers=1, heads=1, intermediate=32, corpus=corpus, steps=6, batch_size=4, eval_windows=2,
              generated=0.5, pool_size=3, checkpoint_every=2, progress=False)
    distill(target, tmp_path / "whole", **kw)
    real, calls = _interrupt_at(monkeypatch, 5)  # during the fifth step, after the state of step 4 was saved
    with pytest.raises(KeyboardInterrupt):
        distill(target, tmp_path / "d", **kw)
    state = tmp_path / ".d.distill-state.pt"
    assert state.is_file() and not (tmp_path / "d").exists()
    assert "run the same command again to resume" in capsys.readouterr().err
    import torch

    saved = torch.load(state, weights_only=True)
    assert saved["elapsed"] > 0                                  # the interrupted run's 4 steps
    torch.save({**saved, "elapsed": 1000.0}, state)              # large enough to tell apart
    real_save, saves = pair._atomic_torch_save, []
    monkeypatch.setattr(pair, "_atomic_torch_save", lambda d, p: (saves.append(d["elapsed"]), real_save(d, p))[1])
    with pytest.raises(InvalidArgumentError, match=r"other settings \(steps: steps 6 there, 8 now\).*delete that file"):
        distill(target, tmp_path / "d", **{**kw, "steps": 8})
    monkeypatch.setattr(pair, "optimizer_step", real)
    calls.clear()
    monkeypatch.setattr(pair, "optimizer_step", lambda *a: (calls.append(1), real(*a))[1])
    loads, real_load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: (loads.append(a[0]), real_load(*a, **k))[1])
    report = distill(target, tmp_path / "d", **{**kw, "progress": True})
    assert len(calls) == 2 and "resuming the distillation at step 4/6" in capsys.readouterr().err
    # the report's seconds count the interrupted run's training too (they counted the last run only),
    # and so does the state this run saves (for a second interruption)
    assert report["seconds_in_earlier_runs"] == 1000.0 and report["seconds"] > 1000.0
    assert saves and all(s > 1000.0 for s in saves)
    assert loads == [state]                # read once: checked early, then resumed from
    assert not state.exists()
    whole, resumed = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "d" / "model.safetensors")
    assert whole.keys() == resumed.keys() and all((whole[k] == resumed[k]).all() for k in whole)
    # stopped after training (here in the measurements that follow it): the rerun does not train again
    real_validation = pair.validation_loss
    seen = []

    def stop_after_training(model, windows):
        seen.append(1)
        if len(seen) == 2:          # the target's loss, then the trained draft's
            raise KeyboardInterrupt
        return real_validation(model, windows)

    monkeypatch.setattr(pair, "validation_loss", stop_after_training)
    every4 = {**kw, "checkpoint_every": 4}     # saved at step 4, and at the last step, 6
    with pytest.raises(KeyboardInterrupt):
        distill(target, tmp_path / "e", **every4)
    monkeypatch.setattr(pair, "validation_loss", real_validation)
    calls.clear()
    distill(target, tmp_path / "e", **{**every4, "progress": True})
    assert calls == [] and "resuming the distillation at step 6/6" in capsys.readouterr().err
    after = load_file(tmp_path / "e" / "model.safetensors")
    assert all((whole[k] == after[k]).all() for k in whole)


def test_distill_into_the_current_folder(target, corpus, tmp_path, monkeypatch):
    """`--out .` (an empty current folder) has no name to put the temporary folder and the saved
    state beside: it was a ValueError traceback. The path is made absolute first."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert main(["distill", "--target", str(target), "--out", ".", "--hidden", "16", "--layers", "1", "--heads", "1",
                 "--intermediate", "32", "--steps", "1", "--batch-size", "2", "--eval-windows", "1", "--no-progress",
                 "--checkpoint-every", "1", "--corpus", *map(str, corpus)]) == 0
    assert (here / "distill.json").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["here"]
