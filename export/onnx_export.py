"""PyTorch -> ONNX with KV-cache IO, through optimum-onnx's exporter.

optimum already produces what we need for decoder-only models: one graph whose past may be empty
(prefill) or hold P tokens, taking k >= 1 new tokens and returning logits for all k positions and
present = concat(past, new). For encoder-decoder models its ``decoder_with_past`` graph is traced
with ONE new token and its logits axis is pinned to the literal "1" (huggingface/optimum#1668:
feeding k > 1 tokens fails). ``MultiTokenT5OnnxConfig`` fixes both: the with-past decoder is traced
with several new tokens and its logits/present sequence axes are symbolic, so one call can verify
gamma + 1 tokens.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from pathlib import Path

from edgespec import contract
from edgespec.errors import CheckpointError

from .checkpoint import Checkpoint

TRACE_NEW_TOKENS = 3  # tokens fed to the with-past decoder while tracing (any value > 1 works)


@contextlib.contextmanager
def transformers_progress_bars(enabled: bool):
    """transformers' progress bars (loading a sharded checkpoint) on or off inside the block."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def load_torch_model(ckpt: Checkpoint):
    """Load a checkpoint from safetensors only (``use_safetensors=True``: never unpickle)."""
    return load_torch_model_at(ckpt.path, ckpt.kind == contract.KIND_SEQ2SEQ)


def check_finite_weights(path: Path) -> None:
    """Refuse a checkpoint folder whose safetensors hold NaN or infinite weights, one tensor in
    memory at a time (a bundle's draft is checked so before the target's export starts). Only
    ``*.weight`` tensors: a saved buffer may hold -inf by design (a mask), and the load's own check
    (parameters only) covers the rest."""
    from safetensors import safe_open

    def tensors():
        for f in sorted(Path(path).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                for name in h.keys():
                    if name.endswith("weight"):
                        yield name, h.get_tensor(name)

    _refuse_non_finite(path, tensors())


def _refuse_non_finite(path: Path, named_tensors) -> None:
    import torch

    bad = [(name, int((~torch.isfinite(w)).sum())) for name, w in named_tensors
           if w.is_floating_point() and not bool(torch.isfinite(w).all())]
    if bad:
        shown = ", ".join(f"{name} ({n} values)" for name, n in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise CheckpointError(f"the checkpoint in {str(path)!r} holds NaN or infinite weights: {shown}; any model made "
                              "from it gives NaN logits: use a checkpoint saved before the training diverged, or one "
                              "whose weights are all finite")


def load_torch_model_at(path: Path, seq2seq: bool):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from transformers.utils import logging as hf_logging

    cls = AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its "weights not initialized / not used" warnings: refused below instead
    try:
        model, info = cls.from_pretrained(str(path), use_safetensors=True, local_files_only=True, dtype=torch.float32,
                                          output_loading_info=True)
    except (RuntimeError, ValueError, OSError, KeyError, TypeError, AttributeError) as exc:  # e.g. a config value of the wrong type
        text = " ".join(str(exc).split())  # torch's message spans lines (one per tensor): one line here
        mismatch = "size mismatch" in text or "shape" in text  # config.json describes other weights
        advice = ("check that config.json belongs to these weights, or save the checkpoint again" if mismatch
                  else "check the values in config.json (one has the wrong type or is missing), or save the checkpoint "
                  "again" if isinstance(exc, (TypeError, AttributeError))
                  else "save the checkpoint again with save_pretrained(..., safe_serialization=True)")
        raise CheckpointError(f"cannot load the model in {str(path)!r} ({text[:300]}); {advice}") from exc
    finally:
        hf_logging.set_verbosity(verbosity)
    # transformers fills parameters the files lack with random values and drops tensors the model
    # has no place for, with a warning only; the validation would then compare ONNX against the
    # same wrong model and pass. (Tied weights and buffers it knows to skip are not listed.)
    _refuse_headless(path, model.config, sorted(info.get("missing_keys") or ()), sorted(info.get("unexpected_keys") or ()))
    for key, what in (("missing_keys", "has no weights for"), ("unexpected_keys", "has weights the model has no place for:")):
        names = sorted(info.get(key) or ())
        if names:
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            raise CheckpointError(
                f"the checkpoint in {str(path)!r} {what} {shown}; its config.json does not describe these weights "
                "(e.g. num_hidden_layers): check that config.json belongs to them, or save the checkpoint again with "
                "save_pretrained(..., safe_serialization=True)")
    # A NaN or inf weight (a diverged training run saves them) makes NaN logits in PyTorch and ONNX
    # alike: the validation then blamed the graph ("try --graph optimum") instead of the weights.
    _refuse_non_finite(path, model.named_parameters())
    return model.eval()


# the architectures whose checkpoints hold a head that predicts tokens
_LM_HEAD_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def _refuse_headless(path: Path, config, missing: list[str], unexpected: list[str]) -> None:
    """A checkpoint without its language-model head (lm_head) was refused with the general advice
    that config.json does not describe the weights (a trial's find): say what is missing instead."""
    head = [n for n in missing if n.split(".")[0] == "lm_head"]
    if not head:
        return
    archs = [a for a in (getattr(config, "architectures", None) or []) if isinstance(a, str)]
    if archs and not any(a.endswith(_LM_HEAD_SUFFIXES) for a in archs):
        extra = f" (its {', '.join(unexpected[:2])} belong{'s' if len(unexpected) == 1 else ''} to a head of another task)" if unexpected else ""
        raise CheckpointError(
            f"{str(path)!r} holds a {archs[0]} checkpoint (config.json \"architectures\"), which has no language-model "
            f"head{extra}: edgespec generates tokens, so export the model's causal-LM checkpoint (architectures "
            f"such as {archs[0].split('For')[0].removesuffix('Model') or 'Llama'}ForCausalLM; T5: T5ForConditionalGeneration)")
    if head == missing and not unexpected and getattr(config, "tie_word_embeddings", None) is False:
        raise CheckpointError(
            f"the checkpoint in {str(path)!r} has no weights for {head[0]} and its config.json says tie_word_embeddings "
            "false (an output layer of its own): if the model shares its input embeddings with its output layer, set "
            "\"tie_word_embeddings\": true in config.json; otherwise the checkpoint lacks its output layer: save it again "
            "with save_pretrained(..., safe_serialization=True)")


def _multi_token_t5_config_class():
    from optimum.exporters.onnx.model_configs import T5OnnxConfig

    class MultiTokenT5OnnxConfig(T5OnnxConfig):
        def overwrite_shape_and_generate_input(self, dummy_input_gen, input_name, framework, input_shapes):
            if self.use_past_in_inputs and input_name == "decoder_input_ids":
                saved = dummy_input_gen.sequence_length
                dummy_input_gen.sequence_length = TRACE_NEW_TOKENS
                try:
                    return dummy_input_gen.generate(
                        input_name, framework=framework, int_dtype=self.int_dtype, float_dtype=self.float_dtype
                    )
                finally:
                    dummy_input_gen.sequence_length = saved
            return super().overwrite_shape_and_generate_input(dummy_input_gen, input_name, framework, input_shapes)

        @property
        def outputs(self):
            outputs = super().outputs
            if self.use_past_in_inputs and contract.LOGITS in outputs:
                # optimum pins this axis to "1" for the with-past decoder; it is the number of new tokens.
                outputs[contract.LOGITS] = {0: "batch_size", 1: "decoder_sequence_length"}
            return outputs

    return MultiTokenT5OnnxConfig


def _seq2seq_custom_configs(model) -> dict:
    cls = _multi_token_t5_config_class()
    base = cls(model.config, task="text2text-generation", use_past=True, use_past_in_inputs=False)
    return {
        "encoder_model": base.with_behavior("encoder"),
        "decoder_model": base.with_behavior("decoder", use_past=True, use_past_in_inputs=False),
        "decoder_with_past_model": base.with_behavior("decoder", use_past=True, use_past_in_inputs=True),
    }


def export_graphs(model, ckpt: Checkpoint, out_dir: Path, opset: int | None) -> int:
    """Write the ONNX graph(s) of ``model`` (and its config/tokenizer files) into ``out_dir``; return the opset."""
    from optimum.exporters.onnx import onnx_export_from_model
    from optimum.exporters.onnx.base import OnnxConfig  # noqa: F401  (import check: optimum-onnx present)
    from optimum.exporters.tasks import TasksManager

    if ckpt.kind == contract.KIND_SEQ2SEQ:
        task, custom = "text2text-generation-with-past", _seq2seq_custom_configs(model)
    else:
        task, custom = "text-generation-with-past", None
    ctor = TasksManager.get_exporter_config_constructor(exporter="onnx", model=model, task=task, library_name="transformers")
    used_opset = opset or ctor(model.config, task=task).DEFAULT_ONNX_OPSET
    with warnings.catch_warnings():
        # torch.jit tracer warnings about Python control flow are expected: the graphs are
        # validated numerically against PyTorch right after export.
        warnings.simplefilter("ignore")
        quiet = [logging.getLogger(n) for n in ("optimum", "transformers")]
        levels = [lg.level for lg in quiet]
        for lg in quiet:
            lg.setLevel(logging.ERROR)
        try:
            onnx_export_from_model(
                model=model,
                output=out_dir,
                task=task,
                opset=used_opset,
                do_validation=False,  # edgespec validates itself, and fails (optimum only warns)
                no_post_process=True,  # keep decoder / decoder_with_past separate (no If-merged graph)
                custom_onnx_configs=custom,
                device="cpu",
            )
        finally:
            for lg, lv in zip(quiet, levels):
                lg.setLevel(lv)
    for name in contract.GRAPH_FILES[ckpt.kind].values():
        if not (out_dir / name).is_file():
            raise RuntimeError(f"optimum did not write {name} in {out_dir}")  # bug, not user error
    return used_opset
